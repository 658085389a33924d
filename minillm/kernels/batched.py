"""Batched paged attention in plain PyTorch: the engine's fast path on a CPU (chapter 04).

`reference.py` loops over sequences in Python: the clearest way to read paged attention, and
the answer key of the tests, but each sequence costs its own gather, repeat_interleave and two
einsums in every layer. Here the whole batch takes ONE gather and ONE attention call:

    k_cache[block_tables]      [B, max_blocks, block_size, KVH, D]  every sequence's blocks
      -> keys                  [B, KVH, L, D]     L = max_blocks * block_size, padded per row
    visible[b, i, j]           key j <= position of query i (keys past seq_len[b] fail too)
    scaled_dot_product_attention(q [B, H, Tq, D], keys, values, visible, enable_gqa=True)

Sequences that bring one query (decodes) form one group with Tq = 1; sequences that bring
several (prefill chunks) another, their queries padded to the longest chunk. A padding query
sees only key 0, so no row is all -inf, and its output is dropped. Results equal the reference
up to float rounding (tests/test_kernels.py compares them).

Same signatures as the Triton kernels and the twins. No input checks here: `minillm.kernels`
checks before calling.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_blocks(cache, block_tables):
    """Every sequence's blocks laid end to end: [B, max_blocks * block_size, KVH, D]."""
    blocks = cache[block_tables.long()]                  # [B, max_blocks, block_size, KVH, D]
    return blocks.flatten(1, 2)                          # [B, L, KVH, D]


def _attend(q, k_cache, v_cache, block_tables, seq_lens, positions, scale):
    """q [B, Tq, H, D]; positions [B, Tq]: query i of sequence b sees keys 0..positions[b, i]."""
    k = gather_blocks(k_cache, block_tables).transpose(1, 2)        # [B, KVH, L, D]
    v = gather_blocks(v_cache, block_tables).transpose(1, 2)
    keys = torch.arange(k.shape[2], device=q.device)                # [L]
    # Slots past a sequence's end (table padding, the unwritten tail of its last block) hold
    # whatever an earlier owner left, possibly inf or NaN; a mask alone would not stop a NaN
    # value (0 * NaN = NaN), so those keys and values are zeroed in our gathered copy.
    outside = (keys[None, :] >= seq_lens.long()[:, None])[:, None, :, None]   # [B, 1, L, 1]
    k.masked_fill_(outside, 0)
    v.masked_fill_(outside, 0)
    visible = keys[None, None, :] <= positions[:, :, None]           # [B, Tq, L]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=visible[:, None], scale=scale,
        enable_gqa=q.shape[2] != k.shape[1])                         # [B, H, Tq, D]
    return out.transpose(1, 2)                                       # [B, Tq, H, D]


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """q [B, H, D], one query per sequence at position seq_len - 1 -> out [B, H, D]."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    positions = (seq_lens.long() - 1)[:, None]                       # [B, 1]
    return _attend(q[:, None], k_cache, v_cache, block_tables, seq_lens, positions, scale)[:, 0]


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    """Ragged causal queries, q [T, H, D] (sequence b owns rows cu[b]:cu[b + 1], its last
    q_len tokens) -> out [T, H, D]."""
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()                                       # host ints (CPU path)
    q_lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    one = [b for b, n in enumerate(q_lens) if n == 1]
    many = [b for b, n in enumerate(q_lens) if n > 1]
    if one:                                                          # decodes: Tq = 1
        idx = torch.tensor(one, device=q.device)
        rows = torch.tensor([cu[b] for b in one], device=q.device)
        out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, block_tables[idx],
                                           seq_lens[idx], scale)
    if many:                                                         # chunks: padded to Tq
        idx = torch.tensor(many, device=q.device)
        lens = torch.tensor([q_lens[b] for b in many], device=q.device)            # [Bm]
        starts = torch.tensor([cu[b] for b in many], device=q.device)              # [Bm]
        i = torch.arange(max(q_lens[b] for b in many), device=q.device)            # [Tq]
        valid = i[None, :] < lens[:, None]                                         # [Bm, Tq]
        rows = torch.where(valid, starts[:, None] + i[None, :], 0)                 # [Bm, Tq]
        positions = seq_lens[idx].long()[:, None] - lens[:, None] + i[None, :]
        positions = torch.where(valid, positions, 0)          # padding queries see key 0 only
        padded = _attend(q[rows], k_cache, v_cache, block_tables[idx], seq_lens[idx], positions,
                         scale)                                            # [Bm, Tq, H, D]
        out[rows[valid]] = padded[valid]                                           # [T_m, H, D]
    return out
