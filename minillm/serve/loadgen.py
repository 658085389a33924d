"""A load generator for any OpenAI-compatible server, measured from the client (chapter 08).

What a user feels is measured where the user is: the client stamps every streamed chunk. The
definitions are those of vLLM's serving benchmark (`vllm bench serve`), so numbers compare:

    TTFT   request sent -> first chunk with text
    ITL    gaps between consecutive chunks with text, pooled over all requests
    TPOT   per request: (E2E - TTFT) / (output tokens - 1); None for a one-token output (no gap:
           left out of the TPOT statistics, meets any TPOT SLO; see minillm.metrics)
    E2E    request sent -> last chunk
    request / output / total token throughput: completed requests and tokens / run duration
    goodput: completed requests per second that meet EVERY given SLO (ttft, tpot, e2e_latency)

`minillm.metrics.summarize(results, duration, ttft_slo=...)` aggregates a run: the same function,
with the same key names, that summarizes the engine's own RequestMetrics.

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

from ..metrics import time_per_output_token


@dataclass
class LoadRequest:
    prompt: object                 # text or token ids
    prompt_len: int                # tokens, as the workload meant it
    max_tokens: int


@dataclass
class RequestResult:
    """One request as the client saw it; the names are RequestMetrics' (the engine's view), so
    minillm.metrics.summarize reads either."""
    prompt_len: int                           # tokens, as the workload meant it
    send_time: float = 0.0                    # seconds since the run started
    ttft: Optional[float] = None
    itl: list = field(default_factory=list)
    e2e_latency: Optional[float] = None       # request sent -> last chunk
    num_output_tokens: int = 0                # the server's usage.completion_tokens
    num_prompt_tokens: Optional[int] = None   # the server's usage.prompt_tokens (else prompt_len)
    finished: bool = False                    # completed with text (vLLM's `success`)
    error: Optional[str] = None
    status: Optional[int] = None
    sample_index = 0                          # the client sends n=1: one sample per request
    queueing_time = None                      # the server's queue is invisible to the client

    def __post_init__(self):
        if self.num_prompt_tokens is None:
            self.num_prompt_tokens = self.prompt_len

    @property
    def tpot(self) -> Optional[float]:
        span = None if self.e2e_latency is None or self.ttft is None else \
            self.e2e_latency - self.ttft
        return time_per_output_token(span, self.num_output_tokens)


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
                res.num_output_tokens = chunk.usage.completion_tokens
                res.num_prompt_tokens = chunk.usage.prompt_tokens
            for c in chunk.choices:
                text = c.delta.content if endpoint == "chat" else c.text
                if text:
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2e_latency = last - start
        res.finished = res.ttft is not None
        if not res.finished:
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


__all__ = ["LoadRequest", "RequestResult", "arrival_gaps", "run_load"]
