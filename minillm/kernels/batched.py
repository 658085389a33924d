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

Everything that depends only on the step (which rows form which group, the masks) is a `Plan`,
built once; every layer of the model then runs `run(plan, ...)` with its own q and cache (the
plan / run split of FlashInfer). `paged_decode_attention` and `paged_prefill_attention` are
plan + run, with the same signatures as the Triton kernels and the twins. No input checks
here: `minillm.kernels` checks before calling.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class Group:
    """Sequences attended together: their tables, which q rows they own, the masks."""
    block_tables: torch.Tensor      # [G, max_blocks]
    q_index: torch.Tensor           # [G, Tq] q row of each (padded) query
    valid: Optional[torch.Tensor]   # [G, Tq] real queries (None: all real)
    outside: torch.Tensor           # [G, 1, L, 1] slots past the sequence's end
    visible: torch.Tensor           # [G, 1, Tq, L] key j visible to query i


@dataclass
class Plan:
    groups: list                    # [Group]: decodes (Tq = 1), prefill chunks (padded Tq)


def _make_group(block_tables, seq_lens, q_index, positions, valid, block_size) -> Group:
    keys = torch.arange(block_tables.shape[1] * block_size, device=seq_lens.device)   # [L]
    # Slots past a sequence's end (table padding, the unwritten tail of its last block) hold
    # whatever an earlier owner left, possibly inf or NaN; a mask alone would not stop a NaN
    # value (0 * NaN = NaN), so `run` zeroes those keys and values in its gathered copy.
    outside = (keys[None, :] >= seq_lens.long()[:, None])[:, None, :, None]      # [G, 1, L, 1]
    visible = (keys[None, None, :] <= positions[:, :, None])[:, None]            # [G, 1, Tq, L]
    return Group(block_tables, q_index, valid, outside, visible)


def plan_decode(block_tables, seq_lens, block_size: int) -> Plan:
    """One query per sequence, at position seq_len - 1."""
    B = seq_lens.shape[0]
    q_index = torch.arange(B, device=seq_lens.device)[:, None]                   # [B, 1]
    positions = (seq_lens.long() - 1)[:, None]                                   # [B, 1]
    return Plan([_make_group(block_tables, seq_lens, q_index, positions, None, block_size)]
                if B else [])


def plan_prefill(cu_seqlens_q, seq_lens, block_tables, block_size: int) -> Plan:
    """Sequence b owns q rows cu[b]:cu[b + 1], its last q_len tokens."""
    dev = seq_lens.device
    cu = cu_seqlens_q.tolist()                                       # host ints (CPU path)
    q_lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    groups = []
    one = [b for b, n in enumerate(q_lens) if n == 1]
    if one:                                                          # decodes: Tq = 1
        idx = torch.tensor(one, device=dev)
        q_index = torch.tensor([[cu[b]] for b in one], device=dev)                  # [G, 1]
        positions = (seq_lens[idx].long() - 1)[:, None]
        groups.append(_make_group(block_tables[idx], seq_lens[idx], q_index, positions, None,
                                  block_size))
    many = [b for b, n in enumerate(q_lens) if n > 1]
    if many:                                                         # chunks: padded to Tq
        idx = torch.tensor(many, device=dev)
        lens = torch.tensor([q_lens[b] for b in many], device=dev)                 # [G]
        starts = torch.tensor([cu[b] for b in many], device=dev)                   # [G]
        i = torch.arange(max(q_lens[b] for b in many), device=dev)                 # [Tq]
        valid = i[None, :] < lens[:, None]                                         # [G, Tq]
        q_index = torch.where(valid, starts[:, None] + i[None, :], 0)              # [G, Tq]
        positions = seq_lens[idx].long()[:, None] - lens[:, None] + i[None, :]
        positions = torch.where(valid, positions, 0)          # padding queries see key 0 only
        groups.append(_make_group(block_tables[idx], seq_lens[idx], q_index, positions, valid,
                                  block_size))
    return Plan(groups)


def gather_blocks(cache, block_tables):
    """Every sequence's blocks laid end to end: [B, max_blocks * block_size, KVH, D]."""
    blocks = cache[block_tables.long()]                  # [B, max_blocks, block_size, KVH, D]
    return blocks.flatten(1, 2)                          # [B, L, KVH, D]


def run(plan: Plan, q, k_cache, v_cache, scale):
    """q [T, H, D] (the rows the plan was made for) -> out [T, H, D]."""
    out = torch.empty_like(q)
    for g in plan.groups:
        k = gather_blocks(k_cache, g.block_tables).transpose(1, 2)    # [G, KVH, L, D]
        v = gather_blocks(v_cache, g.block_tables).transpose(1, 2)
        k.masked_fill_(g.outside, 0)
        v.masked_fill_(g.outside, 0)
        o = F.scaled_dot_product_attention(
            q[g.q_index].transpose(1, 2), k, v, attn_mask=g.visible, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])                      # [G, H, Tq, D]
        o = o.transpose(1, 2)                                          # [G, Tq, H, D]
        if g.valid is None:
            out[g.q_index.flatten()] = o.flatten(0, 1)
        else:
            out[g.q_index[g.valid]] = o[g.valid]
    return out


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """q [B, H, D], one query per sequence at position seq_len - 1 -> out [B, H, D]."""
    return run(plan_decode(block_tables, seq_lens, k_cache.shape[1]), q, k_cache, v_cache, scale)


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    """Ragged causal queries, q [T, H, D] (sequence b owns rows cu[b]:cu[b + 1], its last
    q_len tokens) -> out [T, H, D]."""
    plan = plan_prefill(cu_seqlens_q, seq_lens, block_tables, k_cache.shape[1])
    return run(plan, q, k_cache, v_cache, scale)
