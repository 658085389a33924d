"""A load generator for any OpenAI-compatible server, measured from the client (chapter 08).

What a user feels is measured where the user is: the client stamps every streamed chunk. The
definitions are those of vLLM's serving benchmark (`vllm bench serve`), so numbers compare:

    TTFT   request sent -> first chunk with text
    ITL    gaps between consecutive chunks with text, pooled over all requests
    TPOT   per request: (E2E - TTFT) / (output tokens - 1); 0 for a one-token output
    E2E    request sent -> last chunk
    request / output / total token throughput: completed requests and tokens / run duration
    goodput: completed requests per second that meet EVERY given SLO (ttft, tpot, e2el)

Output tokens are the server's `usage.completion_tokens` (asked for with stream_options), not a
chunk count: a server may pack several tokens into one chunk.

Arrivals: gaps drawn from a gamma distribution with shape `burstiness` and mean 1 / rate (vLLM's
choice). burstiness 1 is a Poisson process; below 1 the same mean rate comes in bursts, above 1
it is more regular. rate=inf sends everything at once; `max_concurrency` caps requests in
flight (a closed loop of that many users) on top of either.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np


@dataclass
class LoadRequest:
    prompt: object                 # text or token ids
    prompt_len: int                # tokens, as the workload meant it
    max_tokens: int


@dataclass
class RequestResult:
    prompt_len: int
    send_time: float = 0.0         # seconds since the run started
    ttft: Optional[float] = None
    itl: list = field(default_factory=list)
    e2e: Optional[float] = None
    output_tokens: int = 0
    prompt_tokens: Optional[int] = None       # the server's count
    success: bool = False
    error: Optional[str] = None
    status: Optional[int] = None

    @property
    def tpot(self) -> float:
        if self.output_tokens > 1 and self.e2e is not None and self.ttft is not None:
            return (self.e2e - self.ttft) / (self.output_tokens - 1)
        return 0.0


def arrival_gaps(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """n inter-arrival gaps in seconds: gamma(shape=burstiness, scale=1/(rate*burstiness)),
    mean 1/rate. rate=inf: all zero."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 (inf: all at once), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0 (1 = Poisson), got {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


async def _one(client, model: str, req: LoadRequest, endpoint: str, extra: dict,
               t0: float) -> RequestResult:
    res = RequestResult(req.prompt_len)
    start = time.perf_counter()
    res.send_time = start - t0
    last = start
    try:
        kw = dict(model=model, max_tokens=req.max_tokens, stream=True, temperature=0,
                  stream_options={"include_usage": True}, extra_body=extra or None)
        if endpoint == "chat":
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": req.prompt}], **kw)
        else:
            stream = await client.completions.create(prompt=req.prompt, **kw)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                res.output_tokens = chunk.usage.completion_tokens
                res.prompt_tokens = chunk.usage.prompt_tokens
            for c in chunk.choices:
                text = c.delta.content if endpoint == "chat" else c.text
                if text:
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e = last - start
        res.success = res.ttft is not None
        if not res.success:
            res.error = "no text came back"
    except Exception as e:                     # a failed request is counted, never fatal
        res.error = f"{type(e).__name__}: {e}"
        res.status = getattr(e, "status_code", None)
    return res


async def run_load(base_url: str, requests: Sequence[LoadRequest], rate: float = math.inf,
                   burstiness: float = 1.0, max_concurrency: Optional[int] = None,
                   model: Optional[str] = None, endpoint: str = "completions",
                   ignore_eos: bool = True, seed: int = 0, timeout: float = 600.0):
    """Send `requests` with the given arrival process; returns (results, duration_s)."""
    import httpx
    import openai

    if endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
    gaps = arrival_gaps(len(requests), rate, burstiness, seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none",
                                  max_retries=0, timeout=timeout,
                                  http_client=httpx.AsyncClient(limits=limits,
                                                                timeout=timeout)) as client:
        if model is None:
            model = (await client.models.list()).data[0].id
        extra = {"ignore_eos": True} if ignore_eos else {}
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        t0 = time.perf_counter()

        async def limited(req):
            if sem is None:
                return await _one(client, model, req, endpoint, extra, t0)
            async with sem:
                return await _one(client, model, req, endpoint, extra, t0)

        tasks = []
        for req, gap in zip(requests, gaps):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return list(results), duration


def _stats(values, percentiles) -> dict:
    vals = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if vals.size == 0:
        out = {"mean": None}
        out.update({f"p{p:g}": None for p in percentiles})
        return out
    out = {"mean": float(vals.mean())}
    out.update({f"p{p:g}": float(np.percentile(vals, p)) for p in percentiles})
    return out


def summarize_results(results: Sequence[RequestResult], duration: float,
                      slos: Optional[dict] = None, percentiles=(50, 90, 99)) -> dict:
    """vLLM's aggregate metrics (seconds). slos: {"ttft": s, "tpot": s, "e2el": s}, any subset;
    a request is good when it completed and meets every one."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    slos = dict(slos or {})
    unknown = set(slos) - {"ttft", "tpot", "e2el"}
    if unknown:
        raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; use ttft, tpot, e2el")
    ok = [r for r in results if r.success]
    n_in = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    good = 0
    for r in ok:
        value = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2e}
        good += all(value[k] <= v for k, v in slos.items())
    out = {"num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
           "duration_s": duration, "total_input_tokens": n_in, "total_output_tokens": n_out,
           "request_throughput": len(ok) / duration,
           "output_throughput": n_out / duration,
           "total_token_throughput": (n_in + n_out) / duration,
           "slos": slos, "request_goodput": good / duration if slos else None,
           # Little's law: mean requests in the system = arrival rate x mean time in it
           "mean_concurrency": sum(r.e2e for r in ok) / duration}
    for name, vals in (("ttft", [r.ttft for r in ok]), ("tpot", [r.tpot for r in ok]),
                       ("itl", [x for r in ok for x in r.itl]), ("e2el", [r.e2e for r in ok])):
        for k, v in _stats(vals, percentiles).items():
            out[f"{name}_{k}"] = v
    return out


__all__ = ["LoadRequest", "RequestResult", "arrival_gaps", "run_load", "summarize_results"]
