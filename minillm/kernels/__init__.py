"""Paged-attention kernels: Triton on a GPU, plain-PyTorch twins everywhere (chapters 03 and 05).

    store_kv(k, v, k_cache, v_cache, slot_mapping)                       write K/V into blocks
    paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale)

Each public function checks its inputs (see `checks.py`), then runs the Triton kernel when the
tensors are on CUDA and, elsewhere, the batched PyTorch path of `batched.py` (one gather and one
attention call for the whole batch). `reference.py` holds the twins: a readable loop over
sequences, the answer key of the tests. `impl="triton"`, `impl="torch"` (batched) or
`impl="reference"` forces one; the tests run the Triton kernels on CPU tensors that way, with
TRITON_INTERPRET=1 set before this package first imports a kernel (Triton decides at kernel
definition time whether it compiles or interprets). The Triton modules are imported only when
first used, so the references work where Triton is not installed.

Files: reference.py (the twins), batched.py (the fast CPU path), kv_quant.py (fp8 cache
conversions), store_kv_kernel.py,
paged_decode.py (single-pass and split-KV decode, and the rule that picks one), paged_prefill.py,
checks.py (input checks), compile_check.py (compile the kernels for a GPU on a machine without one),
int4_gemm.py (chapter 09: the int4 dequant-GEMM that quantized linear layers run on a GPU).

Keyword-only extras (not part of the vLLM-style signature):
    impl          None (by device: "triton" on CUDA, "torch" elsewhere) | "triton" | "torch"
                  | "reference"
    check_values  True: check block ids / lengths / slots against the pool (one small host read
                  on CUDA); False: trust the caller, no sync (hot loops, CUDA graphs)
    split_kv, partition_size   (decode) force flash-decoding on/off and its slice length
    max_query_len              (prefill) longest q_len, if the caller knows it on the host
    k_scale, v_scale           an fp8 cache's per-tensor scales (chapter 09, `kv_quant.py`):
                               a float8_e4m3fn / float8_e5m2 pool stores x / scale in one
                               byte; store_kv quantizes, the attention paths dequantize
"""
from __future__ import annotations

import os

import torch

from . import batched, checks, reference

__all__ = ["store_kv", "paged_decode_attention", "paged_prefill_attention", "tree_bits_for",
           "reference", "batched"]

_IMPLS = (None, "triton", "torch", "reference")


def choose_impl(impl, device: torch.device) -> str:
    """Which implementation runs: "triton", "torch" (batched.py) or "reference"."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be None, 'triton', 'torch' or 'reference', got {impl!r}")
    if impl is None:
        return "triton" if device.type == "cuda" else "torch"
    if impl == "triton" and device.type != "cuda":
        from .paged_decode import interpreting       # the kernels are defined on first import
        if not interpreting():
            raise ValueError(
                "impl='triton' on CPU tensors needs Triton's interpreter: set the environment "
                "variable TRITON_INTERPRET=1 before minillm.kernels first runs a Triton kernel "
                f"(it is {os.environ.get('TRITON_INTERPRET')!r}), or move the tensors to CUDA")
    return impl


def _use_triton(impl, device: torch.device) -> bool:
    return choose_impl(impl, device) == "triton"


def store_kv(k, v, k_cache, v_cache, slot_mapping, *, impl=None, check_values=True,
             k_scale=1.0, v_scale=1.0):
    """Write k, v [T, KVH, D] into k_cache, v_cache [num_blocks, block_size, KVH, D] in place.

    slot_mapping [T] (int32 or int64): token t goes to block slot // block_size, row
    slot % block_size; a slot of -1 skips the token (padding, vLLM convention). An fp8 cache
    stores k / k_scale and v / v_scale (kv_quant.py).
    """
    checks.check_cache(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    for name, t in (("k", k), ("v", v)):
        checks.require(t.dim() == 3 and tuple(t.shape[1:]) == (num_kv_heads, head_dim),
                        f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match the "
                        f"cache, got shape {tuple(t.shape)}")
        checks.check_dtype_for_cache(name, t, k_cache, it="it")
    checks.check_kv_scales(k_scale, v_scale, k_cache)
    checks.require(v.shape == k.shape, f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    checks.check_int_tensor("slot_mapping", slot_mapping, 1, (torch.int32, torch.int64))
    checks.require(slot_mapping.shape[0] == k.shape[0],
                    f"slot_mapping has {slot_mapping.shape[0]} entries for {k.shape[0]} tokens")
    checks.check_same_device(k_cache.device, k=k, v=v, slot_mapping=slot_mapping)
    if check_values and slot_mapping.numel():
        num_slots = num_blocks * block_size
        checks.raise_failed({
            f"slot_mapping has a slot outside the pool: slots must be -1 (skip) or in "
            f"[0, num_blocks * block_size = {num_slots})":
                ((slot_mapping >= -1) & (slot_mapping < num_slots)).all(),
        })
    if _use_triton(impl, k_cache.device):
        from .store_kv_kernel import store_kv_triton
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale))
    else:
        reference.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def _check_tables(block_tables, seq_lens, batch, device):
    checks.check_int_tensor("block_tables", block_tables, 2)
    checks.check_int_tensor("seq_lens", seq_lens, 1)
    checks.require(block_tables.shape[0] == batch and seq_lens.shape[0] == batch,
                    f"block_tables {tuple(block_tables.shape)} and seq_lens "
                    f"{tuple(seq_lens.shape)} must both have one row per sequence ({batch})")
    checks.check_same_device(device, block_tables=block_tables, seq_lens=seq_lens)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, *, impl=None,
                           check_values=True, split_kv=None, partition_size=None,
                           k_scale=1.0, v_scale=1.0):
    """Decode attention over a paged cache: q [B, H, D] -> out [B, H, D].

    block_tables [B, max_blocks] int32; seq_lens [B] int32 counts each sequence's keys, the
    current token included (its K/V must already be stored). k_scale / v_scale: an fp8
    cache's per-tensor scales (stored x = x / scale).
    """
    checks.check_cache(k_cache, v_cache)
    checks.require(q.dim() == 3, f"q must be [batch, num_heads, head_dim], got shape "
                                  f"{tuple(q.shape)}")
    checks.check_query(q, k_cache)
    checks.check_scale(scale)
    checks.check_kv_scales(k_scale, v_scale, k_cache)
    _check_tables(block_tables, seq_lens, q.shape[0], k_cache.device)
    checks.check_same_device(k_cache.device, q=q)
    if check_values and q.shape[0]:
        checks.raise_failed(checks.table_conditions(block_tables, seq_lens, *k_cache.shape[:2]))
    chosen = choose_impl(impl, k_cache.device)
    if chosen == "triton":
        from .paged_decode import paged_decode_triton
        return paged_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, float(scale),
                                   split_kv=split_kv, partition_size=partition_size,
                                   k_scale=float(k_scale), v_scale=float(v_scale))
    twin = batched if chosen == "torch" else reference
    return twin.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                       k_scale, v_scale)


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale, *,
                            impl=None, check_values=True, max_query_len=None, k_scale=1.0,
                            v_scale=1.0, tree_masks=None, tree_bits=None):
    """Causal attention for ragged query chunks over a paged cache: q [T, H, D] -> [T, H, D].

    Sequence b owns q rows cu_seqlens_q[b] : cu_seqlens_q[b + 1] ([B + 1] int32); they are its
    last q_len tokens (K/V already stored), so query i sits at position seq_len - q_len + i.
    tree_masks (chapter 07): per sequence None or a [q_len, q_len] bool ancestor mask, when its
    queries are the nodes of a tree of speculative drafts: query i then sees, of its own q_len
    slots, only those mask[i] allows. The Triton kernel reads the same masks as `tree_bits`
    [T] int64 (one per query; pass them precomputed to skip the conversion).
    """
    checks.check_cache(k_cache, v_cache)
    checks.require(q.dim() == 3, f"q must be [num_tokens, num_heads, head_dim], got shape "
                                  f"{tuple(q.shape)}")
    checks.check_query(q, k_cache)
    checks.check_scale(scale)
    checks.check_kv_scales(k_scale, v_scale, k_cache)
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    _check_tables(block_tables, seq_lens, batch, k_cache.device)
    checks.check_int_tensor("cu_seqlens_q", cu_seqlens_q, 1)
    checks.require(cu_seqlens_q.shape[0] == batch + 1,
                    f"cu_seqlens_q must have batch + 1 = {batch + 1} entries, got "
                    f"{cu_seqlens_q.shape[0]}")
    checks.check_same_device(k_cache.device, q=q, cu_seqlens_q=cu_seqlens_q)
    if max_query_len is not None:
        checks.require(isinstance(max_query_len, int) and max_query_len >= 0,
                        f"max_query_len must be a non-negative int, got {max_query_len!r}")
    if check_values and batch:
        cu = cu_seqlens_q.long()
        q_lens = cu[1:] - cu[:-1]                                  # [B]
        conditions = {
            "cu_seqlens_q must start at 0": cu[0] == 0,
            f"cu_seqlens_q must end at the number of query tokens ({q.shape[0]})":
                cu[-1] == q.shape[0],
            "cu_seqlens_q must be non-decreasing (each sequence owns q rows cu[b]:cu[b + 1])":
                (q_lens >= 0).all(),
            "a sequence has more queries than tokens (q_len > seq_len); seq_lens must count "
            "the context AND the new queries": (q_lens <= seq_lens.long()).all(),
        }
        if max_query_len is not None:
            conditions[f"a sequence has more than max_query_len={max_query_len} queries"] = (
                q_lens <= max_query_len).all()
        conditions.update(checks.table_conditions(block_tables, seq_lens, *k_cache.shape[:2]))
        checks.raise_failed(conditions)
    if tree_masks is not None:
        checks.require(len(tree_masks) == batch,
                       f"tree_masks has {len(tree_masks)} entries for {batch} sequences; give "
                       "one per sequence (None where its queries are not a tree)")
        _check_tree_masks(cu_seqlens_q.tolist(), tree_masks)           # every impl
    chosen = choose_impl(impl, k_cache.device)
    if chosen == "triton":
        from .paged_prefill import paged_prefill_triton
        if tree_masks is not None and tree_bits is None:
            tree_bits = tree_bits_for(cu_seqlens_q, tree_masks, q.shape[0], q.device)
        return paged_prefill_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                                    float(scale), max_query_len=max_query_len,
                                    k_scale=float(k_scale), v_scale=float(v_scale),
                                    tree_bits=tree_bits)
    twin = batched if chosen == "torch" else reference
    return twin.paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens,
                                        block_tables, scale, k_scale, v_scale, tree_masks)


MAX_TREE_NODES = 64             # one int64 of ancestor bits per query (the Triton kernel)


def tree_bits_for(cu_seqlens_q, tree_masks, num_tokens: int, device) -> torch.Tensor:
    """The Triton kernel's form of tree_masks: [T] int64, bit j of a tree node's entry set when
    it sees node j of its tree; -1 (every bit) for the queries of other sequences."""
    bits = torch.full((num_tokens,), -1, dtype=torch.int64)
    cu = cu_seqlens_q.tolist()
    _check_tree_masks(cu, tree_masks)
    for b, m in enumerate(tree_masks):
        if m is None:
            continue
        n = m.shape[0]
        weights = torch.ones(n, dtype=torch.int64) << torch.arange(n)       # bit j = 2^j
        bits[cu[b]:cu[b + 1]] = (m.cpu().long() * weights).sum(1)          # wraps at bit 63
    return bits.to(device)


def _check_tree_masks(cu: list, tree_masks) -> None:
    """Each mask [q_len, q_len] for its sequence's queries, at most MAX_TREE_NODES of them."""
    for b, m in enumerate(tree_masks):
        if m is None:
            continue
        n = m.shape[0]
        checks.require(tuple(m.shape) == (n, n) and n == cu[b + 1] - cu[b] and
                       n <= MAX_TREE_NODES,
                       f"tree_masks[{b}] has shape {tuple(m.shape)}; it must be [q_len, q_len] "
                       f"for that sequence's q_len = {cu[b + 1] - cu[b]} queries, at most "
                       f"{MAX_TREE_NODES} (one int64 of bits per query)")
