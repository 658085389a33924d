"""Capacity arithmetic for a serving deployment (chapter 08).

    littles_law_concurrency(rate, latency)  requests in the system = arrival rate x time in it
    max_rate(concurrency, latency)          the inverse: how fast a fixed number of slots drains
    cost_per_million_tokens(price, tok/s)   dollars per 1e6 tokens at a measured throughput
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


def max_rate(concurrency: float, mean_latency: float) -> float:
    """lambda = L / W: the request rate `concurrency` slots sustain at `mean_latency` s each."""
    if concurrency < 0 or mean_latency <= 0:
        raise ValueError(f"need concurrency >= 0 and latency > 0, got {concurrency}, "
                         f"{mean_latency}")
    return concurrency / mean_latency


def cost_per_million_tokens(price_per_hour: float, tokens_per_s: float) -> float:
    """Dollars per 1e6 tokens for a machine at `price_per_hour` producing `tokens_per_s`."""
    if price_per_hour < 0 or tokens_per_s <= 0:
        raise ValueError(f"need price >= 0 and throughput > 0, got {price_per_hour}, "
                         f"{tokens_per_s}")
    return price_per_hour / (tokens_per_s * 3600.0) * 1e6


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


__all__ = ["littles_law_concurrency", "max_rate", "cost_per_million_tokens", "step_peak_bytes",
           "kv_pool_bytes"]
