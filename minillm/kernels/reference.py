"""Plain-PyTorch twins of the Triton kernels (chapter 03).

Each function here has the same signature and the same result as its Triton kernel, written
to be read rather than to be fast: a Python loop over sequences, the block table turned into a
gather, grouped-query attention by `repeat_interleave`, softmax in float32. The engine uses
these on CPU; the tests use them as the answer key for the kernels.

The paged layout, once:

    k_cache, v_cache  [num_blocks, block_size, KVH, D]   the pool, shared by every sequence
    block_tables      [B, max_blocks] int32               row b lists sequence b's blocks in order
    token t of sequence b lives at  k_cache[block_tables[b, t // block_size], t % block_size]
    a "slot" is the flat index block_id * block_size + offset (what store_kv writes to)

An fp8 cache (chapter 09) stores x / k_scale (or v_scale) in one byte; `store_kv` quantizes and
the attention twins dequantize what they gather (`kv_quant.py`). With a float cache the scales
are 1.0 and both steps are plain casts.

These functions do not check their inputs; `minillm.kernels` does that before calling them.
"""
from __future__ import annotations

import torch

from .kv_quant import dequantize, quantize


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    """Write k, v [T, KVH, D] into the cache at slot_mapping [T]; slot -1 means skip. In place.
    An fp8 cache gets k / k_scale and v / v_scale, saturated and rounded to fp8."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0                                 # [T] vLLM pads batches with -1
    slots = slot_mapping[keep].long()
    block_ids, offsets = slots // block_size, slots % block_size
    k_cache[block_ids, offsets] = quantize(k[keep], k_cache.dtype, k_scale)   # [kept, KVH, D]
    v_cache[block_ids, offsets] = quantize(v[keep], v_cache.dtype, v_scale)


def gather_kv(cache, block_table_row, seq_len):
    """The first seq_len tokens of one sequence, in order: [seq_len, KVH, D].

    This is the block-table indirection in one line: pick the sequence's blocks out of the
    pool in table order, lay them end to end, and cut the last block at seq_len.
    """
    block_size = cache.shape[1]
    num_used = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table_row[:num_used].long()]        # [num_used, block_size, KVH, D]
    return blocks.flatten(0, 1)[:seq_len]                    # [seq_len, KVH, D]


def _attend(q, k, v, scale, q_positions, tree_mask=None):
    """q [Tq, H, D], k/v [Tk, KVH, D], query i at q_positions[i] sees keys 0..q_positions[i];
    with tree_mask [Tq, Tq] (a tree of speculative drafts in the last Tq slots, chapter 07)
    query i sees the earlier keys and, of the last Tq, only those tree_mask[i] allows."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).float()            # [Tk, H, D]
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale          # [H, Tq, Tk]
    key_positions = torch.arange(k.shape[0], device=q.device)
    future = key_positions[None, :] > q_positions[:, None]                # [Tq, Tk]
    if tree_mask is not None:
        future[:, k.shape[0] - q.shape[0]:] |= ~tree_mask.to(q.device)
    scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)            # [Tq, H, D] float32


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=1.0,
                           v_scale=1.0):
    """One new query per sequence against its whole paged context.

    q [B, H, D]; block_tables [B, max_blocks]; seq_lens [B] (including the new token, whose K/V
    is already stored) -> out [B, H, D].
    """
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        seq_len = int(seq_lens[b])
        k = dequantize(gather_kv(k_cache, block_tables[b], seq_len), k_scale)  # [seq_len, KVH, D]
        v = dequantize(gather_kv(v_cache, block_tables[b], seq_len), v_scale)
        last = torch.tensor([seq_len - 1], device=q.device)  # the query is the newest token
        out[b] = _attend(q[b][None], k, v, scale, last)[0].to(q.dtype)   # [1, H, D] -> [H, D]
    return out


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                            k_scale=1.0, v_scale=1.0, tree_masks=None):
    """Ragged causal queries against paged context.

    q [T, H, D] holds the queries of all sequences back to back; sequence b owns rows
    cu_seqlens_q[b] : cu_seqlens_q[b + 1]. They are the LAST q_len tokens of the sequence, so
    query i sits at position seq_len - q_len + i and sees keys 0 .. that position.
    tree_masks[b] ([q_len, q_len] bool, or None): b's queries are a tree (chapter 07).
    """
    out = torch.empty_like(q)
    for b in range(len(seq_lens)):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if end == start:
            continue
        seq_len, q_len = int(seq_lens[b]), end - start
        k = dequantize(gather_kv(k_cache, block_tables[b], seq_len), k_scale)  # [seq_len, KVH, D]
        v = dequantize(gather_kv(v_cache, block_tables[b], seq_len), v_scale)
        positions = torch.arange(seq_len - q_len, seq_len, device=q.device)
        tree = None if tree_masks is None else tree_masks[b]
        out[start:end] = _attend(q[start:end], k, v, scale, positions, tree).to(q.dtype)
    return out
