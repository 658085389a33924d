"""Input checks shared by the Triton kernels and their PyTorch twins (chapter 03).

A Triton kernel trusts every pointer it is given: a block id outside the pool or a length
beyond a block table reads some other request's memory (or faults) and nobody notices. So each
public function checks its inputs in Python first and raises a ValueError that names the fix.

Two kinds of checks, with different costs:
- shapes, dtypes and devices: read from tensor metadata on the host, free. Always done.
- values (block ids inside the pool, lengths within a table's capacity, slots in range): the
  numbers live on the device. They are checked with a handful of vectorised tensor ops that
  reduce to ONE boolean per condition, then read back together in one `.tolist()`, so a CUDA call
  pays a single small device-to-host sync, not one per element. Callers in a hot loop that have
  already validated their tables (an engine step, a benchmark, CUDA-graph capture, where a sync
  is not allowed) pass `check_values=False` and skip this part.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)     # a quantized cache (chapter 09)


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k_cache / v_cache [num_blocks, block_size, KVH, D], same shape, dtype and device."""
    require(k_cache.dim() == 4,
             f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape "
             f"{tuple(k_cache.shape)}")
    require(v_cache.shape == k_cache.shape,
             f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape "
             f"{tuple(k_cache.shape)}; allocate both with the same shape")
    require(k_cache.dtype in FLOAT_DTYPES + FP8_DTYPES,
             f"cache dtype {k_cache.dtype} is not supported; use float32, float16, bfloat16, "
             "float8_e4m3fn or float8_e5m2")
    require(v_cache.dtype == k_cache.dtype,
             f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}; use one dtype")
    require(v_cache.device == k_cache.device,
             f"k_cache is on {k_cache.device} but v_cache is on {v_cache.device}")
    require(v_cache.stride() == k_cache.stride(),
             f"k_cache strides {k_cache.stride()} differ from v_cache strides {v_cache.stride()}; "
             "the kernels index both with one layout, so allocate them the same way")
    require(k_cache.shape[0] >= 1 and k_cache.shape[1] >= 1,
             "the cache needs at least one block of at least one token")


def check_same_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        require(t.device == device,
                 f"{name} is on {t.device} but the cache is on {device}; move it with "
                 f".to({str(device)!r})")


def check_int_tensor(name: str, t: torch.Tensor, dim: int, dtypes=(torch.int32,)) -> None:
    require(t.dim() == dim, f"{name} must have {dim} dimension(s), got shape {tuple(t.shape)}")
    allowed = " or ".join(str(d).replace("torch.", "") for d in dtypes)
    require(t.dtype in dtypes, f"{name} has dtype {t.dtype}; convert it with "
                                f".to(torch.{allowed.split(' or ')[0]}) ({allowed} expected)")


def check_query(q: torch.Tensor, k_cache: torch.Tensor, name: str = "q") -> tuple[int, int]:
    """q [..., H, D] against the cache; returns (num_heads, group = H // KVH)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    check_dtype_for_cache(name, q, k_cache)
    require(q.shape[-1] == head_dim,
             f"{name} head_dim {q.shape[-1]} does not match the cache head_dim {head_dim}")
    num_heads = q.shape[-2]
    require(num_heads >= 1 and num_heads % num_kv_heads == 0,
             f"{num_heads} query heads are not a multiple of the cache's {num_kv_heads} KV heads "
             "(grouped-query attention needs H % KVH == 0)")
    return num_heads, num_heads // num_kv_heads


def check_dtype_for_cache(name: str, t: torch.Tensor, k_cache: torch.Tensor,
                          it: str = "") -> None:
    """A float cache takes tensors of its own dtype; an fp8 cache takes any float dtype (it
    quantizes on store and dequantizes on read)."""
    if k_cache.dtype in FP8_DTYPES:
        require(t.dtype in FLOAT_DTYPES, f"{name} is {t.dtype}; an fp8 cache takes float32, "
                                          "float16 or bfloat16 keys, values and queries")
    else:
        require(t.dtype == k_cache.dtype, f"{name} is {t.dtype} but the cache is "
                                          f"{k_cache.dtype}; cast {it or name} with "
                                          f".to({k_cache.dtype})")


def check_kv_scales(k_scale, v_scale, k_cache: torch.Tensor) -> None:
    """Per-tensor fp8 scales: positive finite Python numbers; exactly 1.0 for a float cache."""
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        require(isinstance(s, (int, float)) and not isinstance(s, bool) and 0 < s < float("inf"),
                 f"{name} must be a positive finite Python number, got {s!r}")
        require(k_cache.dtype in FP8_DTYPES or s == 1.0,
                 f"{name}={s!r} but the cache is {k_cache.dtype}, which stores values as they "
                 "are; scales apply to an fp8 cache only (leave them at 1.0)")


def check_scale(scale) -> None:
    require(isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0,
             f"scale must be a positive Python number such as 1/sqrt(head_dim), got {scale!r}")


def raise_failed(conditions: dict[str, torch.Tensor]) -> None:
    """Read all value conditions back in one transfer and raise on the first that is False."""
    names = list(conditions)
    flags = torch.stack([conditions[n].reshape(()) for n in names]).tolist()
    for name, ok in zip(names, flags):
        require(bool(ok), name)


def table_conditions(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int,
                     block_size: int) -> dict[str, torch.Tensor]:
    """Value checks for (block_tables, seq_lens): message -> boolean tensor that must be True.

    Only the entries a sequence actually uses (the first ceil(seq_len / block_size) of its row)
    must point inside the pool; the rest of a row is padding and may hold anything.
    """
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    lens = seq_lens.long()
    blocks_used = (lens + block_size - 1) // block_size                       # [B]
    used = torch.arange(max_blocks, device=lens.device)[None, :] < blocks_used[:, None]
    bad_entry = used & ((block_tables < 0) | (block_tables >= num_blocks))    # [B, max_blocks]
    return {
        "seq_lens must be >= 1 (a sequence with no tokens has nothing to attend to)":
            (lens >= 1).all(),
        f"a seq_len is larger than its block table can hold (max_blocks {max_blocks} x "
        f"block_size {block_size} = {capacity} tokens); widen block_tables or shorten the "
        "sequence": (lens <= capacity).all(),
        f"block_tables has an entry outside the pool of {num_blocks} blocks in a block that "
        "the sequence uses; every used entry must be in [0, num_blocks)": ~bad_entry.any(),
    }
