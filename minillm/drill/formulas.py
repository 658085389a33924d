"""Small formulas the drill needs that neither the engine nor the lab computes for itself.

Everything here is a plain function of numbers, with the source of the formula in its docstring,
so a generated question's answer is one call away from its working. Formulas the course already
has are called, not copied: speculative decoding (tokens per step, speedup, break-even acceptance)
from `minillm.spec.theory`, Little's law and cost per token from `minillm.lab.capacity`, KV and
weight bytes from `minillm.kvmath`.
"""
from __future__ import annotations



# --- queueing -----------------------------------------------------------------------------

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
    prefix each step: 1 + 2 + ... + N) over with a cache (one position per step: N)
    = (N + 1) / 2."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    return (num_tokens + 1) / 2


# --- costs and transfers -------------------------------------------------------------------

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

