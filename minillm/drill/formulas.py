"""Small formulas the drill needs that the engine does not compute for itself.

Everything here is a plain function of numbers, with the source of the formula in its docstring,
so a generated question's answer is one call away from its working.
"""
from __future__ import annotations

import math


# --- speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via
#     Speculative Decoding", section 3) ------------------------------------------------------

def _check_spec(alpha: float, k: int, c: float = 0.0) -> None:
    if not 0 <= alpha < 1:
        raise ValueError(f"alpha (per-token acceptance rate) must be in [0, 1), got {alpha}")
    if int(k) != k or k < 1:
        raise ValueError(f"k (draft tokens per step) must be a positive integer, got {k}")
    if c < 0:
        raise ValueError(f"c (draft cost relative to one target pass) must be >= 0, got {c}")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens emitted per target forward pass when each of k drafted tokens is accepted
    independently with probability alpha: (1 - alpha^(k+1)) / (1 - alpha).
    Between 1 (nothing accepted: the target's own token) and k + 1 (all accepted + the bonus)."""
    _check_spec(alpha, k)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def speculative_speedup(alpha: float, k: int, c: float) -> float:
    """Expected wall-clock speedup over plain decoding: tokens per step divided by the step's
    cost in target passes (k draft passes of relative cost c, plus one verification pass):
        (1 - alpha^(k+1)) / ((1 - alpha) (k c + 1))
    It assumes verifying k+1 tokens costs one decode step (true while decode is bandwidth-bound)."""
    _check_spec(alpha, k, c)
    return expected_tokens_per_step(alpha, k) / (k * c + 1)


def break_even_alpha(k: int, c: float) -> float:
    """The acceptance rate at which speculation neither helps nor hurts (speedup = 1), by bisection.
    It depends on k and c; there is no single break-even acceptance."""
    _check_spec(0.0, k, c)
    if speculative_speedup(0.0, k, c) >= 1:       # a free draft (c = 0) never hurts
        return 0.0
    lo, hi = 0.0, 1 - 1e-12
    for _ in range(200):
        mid = (lo + hi) / 2
        if speculative_speedup(mid, k, c) < 1:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def acceptance_rate(p, q) -> float:
    """Probability that a token drawn from the draft distribution q is accepted when verifying
    against the target p by rejection sampling: sum_x min(p(x), q(x)) = 1 - TV(p, q)."""
    if len(p) != len(q):
        raise ValueError(f"p and q must have the same length, got {len(p)} and {len(q)}")
    return float(sum(min(a, b) for a, b in zip(p, q)))


# --- queueing -----------------------------------------------------------------------------

def littles_law_concurrency(arrival_rate: float, latency_s: float) -> float:
    """Little's law L = lambda x W: requests in the system on average = arrivals per second x
    seconds each spends in it. Holds for any stable system, whatever the distributions."""
    if arrival_rate < 0 or latency_s < 0:
        raise ValueError("arrival rate and latency must be >= 0")
    return arrival_rate * latency_s


def littles_law_latency(concurrency: float, arrival_rate: float) -> float:
    """W = L / lambda."""
    if arrival_rate <= 0:
        raise ValueError(f"arrival rate must be positive, got {arrival_rate}")
    return concurrency / arrival_rate


def request_latency(ttft_s: float, tpot_s: float, output_tokens: int) -> float:
    """End-to-end latency of one request: the first token at TTFT, then n - 1 gaps of TPOT
    (TPOT is defined as (t_last - t_first) / (n - 1))."""
    if output_tokens < 1:
        raise ValueError(f"output_tokens must be >= 1, got {output_tokens}")
    return ttft_s + (output_tokens - 1) * tpot_s


# --- blocks -------------------------------------------------------------------------------

def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks a sequence of num_tokens occupies: ceil(num_tokens / block_size)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // block_size)


def paged_waste_slots(lengths, block_size: int) -> int:
    """Token slots allocated but empty in the last block of each sequence."""
    return sum(blocks_needed(n, block_size) * block_size - n for n in lengths)


def contiguous_waste_slots(lengths, max_len: int) -> int:
    """Token slots reserved but empty when every sequence reserves max_len slots."""
    if any(n > max_len for n in lengths):
        raise ValueError("a sequence is longer than the reservation max_len")
    return sum(max_len - n for n in lengths)


def fork_blocks(prompt_len: int, num_samples: int, block_size: int) -> dict:
    """Blocks held when num_samples sequences are forked from one prompt (parallel sampling):
    at_fork: the children share the parent's whole table (refcounts only, no copy);
    after_first_write: each sample that writes into the shared, partly filled last block first
    copies it (copy-on-write; the last one holding it writes in place), so only the full blocks
    stay shared; unshared: num_samples independent copies."""
    per_seq = blocks_needed(prompt_len, block_size)
    full = prompt_len // block_size
    partial = per_seq - full
    return dict(at_fork=per_seq, after_first_write=full + partial * num_samples,
                unshared=per_seq * num_samples)


def prefix_cached_tokens(prefix_len: int, block_size: int) -> int:
    """Prompt tokens a block-level prefix cache can serve for a shared prefix of prefix_len tokens:
    only full blocks are hashed and shared, so floor(prefix_len / block_size) x block_size."""
    if block_size < 1 or prefix_len < 0:
        raise ValueError("block_size must be >= 1 and prefix_len >= 0")
    return (prefix_len // block_size) * block_size


def recompute_flop_ratio(num_tokens: int) -> float:
    """Token-positions processed to generate num_tokens tokens without a cache (re-run the whole
    prefix each step: 1 + 2 + ... + N) over with a cache (one position per step: N) = (N + 1) / 2."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    return (num_tokens + 1) / 2


# --- costs and transfers -------------------------------------------------------------------

def cost_per_million_tokens(gpu_dollars_per_hour: float, tokens_per_s: float,
                            num_gpus: int = 1) -> float:
    """Dollars per million output tokens: hourly price of the GPUs / tokens per hour x 1e6."""
    if tokens_per_s <= 0:
        raise ValueError(f"tokens_per_s must be positive, got {tokens_per_s}")
    return gpu_dollars_per_hour * num_gpus / (tokens_per_s * 3600) * 1e6


def transfer_seconds(nbytes: float, bandwidth_bytes_per_s: float) -> float:
    """Time to move nbytes over a link of the given bandwidth (no latency term)."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError("bandwidth must be positive")
    return nbytes / bandwidth_bytes_per_s


def gbit_to_bytes_per_s(gbit_per_s: float) -> float:
    """Network links are quoted in bits: 400 Gb/s = 50 GB/s."""
    return gbit_per_s * 1e9 / 8


def lora_adapter_bytes(num_layers: int, shapes, rank: int, dtype_bytes: float = 2) -> float:
    """A LoRA adapter: for each adapted projection of shape (in, out), A is in x r and B is r x out,
    so r x (in + out) numbers per module and layer: layers x sum(r (in + out)) x bytes."""
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    return num_layers * sum(rank * (i + o) for i, o in shapes) * dtype_bytes


def mlp_activation_bytes(num_tokens: int, intermediate_size: int, dtype_bytes: float = 2) -> float:
    """The gate and up projections' outputs of one MLP for a step of num_tokens tokens:
    num_tokens x 2 x intermediate x bytes, held at once before the SiLU-and-multiply."""
    return num_tokens * 2 * intermediate_size * dtype_bytes


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def percentile_gap(p99: float, p50: float) -> float:
    return p99 / p50 if p50 else math.inf
