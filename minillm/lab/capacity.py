"""Capacity arithmetic for a serving deployment (chapter 08 and the interview drill).

    littles_law_concurrency(rate, latency)  requests in the system = arrival rate x time in it
    littles_law_latency(concurrency, rate)  the inverse: time in the system = requests / rate
    cost_per_million_tokens(price, tok/s)   dollars per 1e6 tokens at a measured throughput
    slo_miss_fractions(metrics, ...)        the share of requests over each latency objective
    max_concurrency_for_tpot(cost, ...)     the most requests in flight whose mean step meets a
                                            TPOT objective (a StepCost and the mean lengths)
    step_peak_bytes(model, num_tokens)      memory one forward pass of num_tokens needs on top of
                                            what is already allocated, measured in a child process

The last one answers "what grows with load" in an engine with a preallocated KV pool: the pool
is allocated once (its bytes never change), so under more load the scheduler preempts or queues
instead of allocating KV. What does grow is the step's own working memory (activations of the
batched tokens, logits), and that is what runs out when a real server dies of OOM under load.
"""
from __future__ import annotations

import os


def littles_law_concurrency(rate: float, mean_latency: float) -> float:
    """L = lambda x W: mean requests in flight at `rate` req/s with `mean_latency` s each."""
    if rate < 0 or mean_latency < 0:
        raise ValueError(f"rate and latency must be >= 0, got {rate}, {mean_latency}")
    return rate * mean_latency


def littles_law_latency(concurrency: float, rate: float) -> float:
    """W = L / lambda: mean seconds a request spends in a system holding `concurrency` requests
    on average while `rate` req/s pass through it (e.g. a full engine of max_num_seqs slots)."""
    if concurrency < 0:
        raise ValueError(f"concurrency must be >= 0, got {concurrency}")
    if rate <= 0:
        raise ValueError(f"arrival rate must be positive, got {rate}")
    return concurrency / rate


def cost_per_million_tokens(price_per_hour: float, tokens_per_s: float, num_gpus: int = 1) -> float:
    """Dollars per 1e6 tokens for `num_gpus` machines at `price_per_hour` each producing
    `tokens_per_s` in total: hourly price / tokens per hour x 1e6."""
    if price_per_hour < 0 or tokens_per_s <= 0 or num_gpus < 1:
        raise ValueError(f"need price >= 0, throughput > 0 and num_gpus >= 1, got "
                         f"{price_per_hour}, {tokens_per_s}, {num_gpus}")
    return price_per_hour * num_gpus / (tokens_per_s * 3600.0) * 1e6


def slo_miss_fractions(metrics, ttft_slo: float, tpot_slo: float) -> dict:
    """{"ttft": share of requests whose TTFT > ttft_slo, "tpot": share whose TPOT > tpot_slo}.
    A one-token request has no TPOT (None) and never misses it, as in vLLM's benchmark."""
    ms = list(metrics)
    if not ms:
        raise ValueError("slo_miss_fractions needs at least one request's metrics")
    late = {"ttft": sum(m.ttft is not None and m.ttft > ttft_slo for m in ms),
            "tpot": sum(m.tpot is not None and m.tpot > tpot_slo for m in ms)}
    return {k: v / len(ms) for k, v in late.items()}


def max_concurrency_for_tpot(cost, tpot_slo: float, prompt_len: float, output_len: float) -> int:
    """The most requests in flight (running or waiting) whose mean step meets `tpot_slo`.

    Over its life a request adds prompt_len + output_len - 1 tokens to the batch in output_len
    steps (one prefill, then one token per step), and one sequence to every step. With N in
    flight the mean step costs fixed + N x (per_seq + per_token x tokens per step of one
    request); the answer is the largest N for which that stays within the objective (0: none)."""
    if tpot_slo <= 0 or prompt_len < 1 or output_len < 1:
        raise ValueError(f"need tpot_slo > 0, prompt_len >= 1, output_len >= 1, got "
                         f"{tpot_slo}, {prompt_len}, {output_len}")
    per_request = cost.per_seq + cost.per_token * (prompt_len + output_len - 1) / output_len
    if per_request <= 0:
        raise ValueError("the cost model charges nothing per request: any concurrency fits")
    return max(0, int((tpot_slo - cost.fixed) // per_request))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def step_peak_bytes(model, num_tokens: int, last_only: bool = True) -> int:
    """Peak extra resident memory of one forward pass over `num_tokens` tokens (one sequence,
    no KV cache), measured in a forked child: its peak RSS minus its RSS just before the pass.
    CPU and Linux only (it reads /proc); returns bytes. last_only=True computes logits for the
    last position only, as a serving engine does; False materialises [T, vocab] logits."""
    import resource

    import torch

    if model.device.type != "cpu" or not os.path.exists("/proc/self/statm"):
        raise ValueError("step_peak_bytes measures CPU memory on Linux; on a GPU read "
                         "torch.cuda.max_memory_allocated around the forward instead")
    if int(num_tokens) != num_tokens or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive integer, got {num_tokens}")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                           # child
        code = 1
        try:
            os.close(r)
            torch.set_num_threads(1)                       # OpenMP pools do not survive fork
            from ..model import prepack
            prepack(model)                                 # packed weights are not the step's
            ids = torch.zeros(1, int(num_tokens), dtype=torch.long)
            before = _rss_bytes()
            with torch.inference_mode():
                model(ids, last_only=last_only)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            os.write(w, str(max(0, peak - before)).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 64):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if status != 0 or not data:
        raise RuntimeError(f"the measuring child failed (status {status})")
    return int(data)


def kv_pool_bytes(engine) -> int:
    """Bytes of the engine's preallocated KV pool (all layers, K and V)."""
    total = 0
    for t in _tensors(engine.runner.cache):
        total += t.numel() * t.element_size()
    return total


def _tensors(obj):
    import torch
    seen = set()
    for v in vars(obj).values():
        items = v if isinstance(v, (list, tuple)) else [v]
        for t in items:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                yield t


__all__ = ["littles_law_concurrency", "littles_law_latency", "cost_per_million_tokens",
           "slo_miss_fractions", "max_concurrency_for_tpot", "step_peak_bytes", "kv_pool_bytes"]
