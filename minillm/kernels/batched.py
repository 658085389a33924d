"""Batched paged attention in plain PyTorch: the engine's fast path on a CPU (chapter 04).

`reference.py` loops over sequences in Python: the clearest way to read paged attention, and
the answer key of the tests, but each sequence costs its own gather, repeat_interleave and two
einsums in every layer. Here the whole batch takes ONE gather and ONE attention call:

    flat pool [num_blocks * block_size, KVH, D] .index_select(slots [B, L])
      -> keys                  [B, KVH, L, D]     L = the longest sequence; one sequence whose
                                                  blocks are consecutive is a view, no copy
    visible[b, i, j]           key j <= position of query i (keys past seq_len[b] fail too;
                               None when every query sees every key: one decode, or equal ones)
    gqa_attention(q [B, H, Tq, D], keys, values, visible)   minillm.model's fused attention: a
                               decode's query heads folded onto their KV head (keys read once)

Sequences that bring one query (decodes) form one group with Tq = 1; sequences that bring
several (prefill chunks) another, their queries padded to the longest chunk. When every
sequence brings the same number (speculative verification of k drafts each), q's rows are
already [B, Tq] in order: one group, a view, no padding and no scatter back. A padding query
sees only key 0, so no row is all -inf, and its output is dropped. Results equal the reference
up to float rounding (tests/test_kernels.py compares them).

Every op here runs once per layer, 30 times a step for SmolLM2, so the per-layer work is kept
to the gather, one attention call and no masks it can skip; `store_kv` writes a step's K/V
with one `index_copy_` per pool (the reference's boolean filter and 2-D index_put cost more
than the copy at a decode step's few rows).

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

from ..model import gqa_attention
from .kv_quant import as_bytes, quantize


@dataclass
class Group:
    """Sequences attended together: where their keys are, which q rows they own, the mask."""
    keys: object                    # slice(start, start + L) of the flat pool (one sequence
                                    # whose blocks are consecutive: a view, no copy) or
                                    # [G, L] int64 slot of each key (a gather)
    q_index: Optional[torch.Tensor] # [G, Tq] q row of each (padded) query (None: the rows in
                                    # order, q_len per sequence: a view of q, the only group)
    valid: Optional[torch.Tensor]   # [G, Tq] real queries (None: all real)
    visible: Optional[torch.Tensor] # [G, 1, Tq, L] key j visible to query i (None: all keys)
    q_len: int = 1                  # Tq when q_index is None


@dataclass
class Plan:
    groups: list                    # [Group]: decodes (Tq = 1), prefill chunks (padded Tq)
    slots: Optional[torch.Tensor] = None      # [T] int64 store_kv's slots (see plan_store)
    keep: Optional[torch.Tensor] = None       # [T] rows to store (None: every row)


def slot_table(block_tables, seq_lens, block_size: int):
    """Where each sequence's keys are in the flat pool [num_blocks * block_size, KVH, D]:
    slots [G, L] (L = the longest sequence) and visible [G, L] (key j < seq_len). Keys past a
    sequence's end point at its key 0: real, finite values (the rest of a block may hold
    anything an earlier owner left, even NaN) that the mask hides. The compiled decode step
    (engine/compiled.py) gathers through it too."""
    lens = seq_lens.long()                                            # [G]
    L = int(lens.max())
    j = torch.arange(L, device=seq_lens.device)                       # [L]
    used = block_tables[:, :-(-L // block_size)].long()               # [G, blocks]
    slots = used[:, j // block_size] * block_size + j % block_size    # [G, L]
    visible = j[None, :] < lens[:, None]                              # [G, L]
    return torch.where(visible, slots, slots[:, :1]), visible


def _key_slots(block_tables, seq_lens, block_size):
    """slot_table's slots, or a slice of the flat pool when there is one sequence and its
    blocks are consecutive (a view, no copy); with L and whether the lengths differ."""
    lens = seq_lens.tolist()                                          # host ints (CPU path)
    L = max(lens)
    used = block_tables[:, :-(-L // block_size)].long()               # [G, blocks]
    if len(lens) == 1 and (used.numel() == 1 or bool((used.diff(dim=1) == 1).all())):
        start = int(used[0, 0]) * block_size
        return slice(start, start + L), L, False
    return slot_table(block_tables, seq_lens, block_size)[0], L, min(lens) < L


def _make_group(block_tables, seq_lens, q_index, positions, valid, block_size) -> Group:
    keys, L, ragged = _key_slots(block_tables, seq_lens, block_size)
    if positions.shape[1] == 1 and not ragged:                        # every key is visible
        return Group(keys, q_index, valid, None)
    j = torch.arange(L, device=seq_lens.device)
    visible = (j[None, None, :] <= positions[:, :, None])[:, None]    # [G, 1, Tq, L]
    return Group(keys, q_index, valid, visible)


def plan_decode(block_tables, seq_lens, block_size: int) -> Plan:
    """One query per sequence, at position seq_len - 1; q rows 0..B-1 in order."""
    B = seq_lens.shape[0]
    positions = (seq_lens.long() - 1)[:, None]                                   # [B, 1]
    return Plan([_make_group(block_tables, seq_lens, None, positions, None, block_size)]
                if B else [])


VIEW_EQUAL_CHUNKS = True    # equal chunks as a view of q (False: padded and scattered like
                            # unequal ones; for measurements: bench_spec_step.py's "before")


def plan_prefill(cu_seqlens_q, seq_lens, block_tables, block_size: int,
                 tree_masks=None) -> Plan:
    """Sequence b owns q rows cu[b]:cu[b + 1], its last q_len tokens. tree_masks[b] (an [n, n]
    bool ancestor mask, or None): b's n queries are a tree of speculative drafts (chapter 07)
    in its last n slots, and query i sees those slots only where mask[i] says, not causally."""
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
    if many and not one and len(set(q_lens)) == 1 and VIEW_EQUAL_CHUNKS:   # equal chunks (
        n = q_lens[0]                                            # k drafts each): q as is
        positions = seq_lens.long()[:, None] - n + torch.arange(n, device=dev)[None, :]
        group = _make_group(block_tables, seq_lens, None, positions, None, block_size)
        group.q_len = n
        _and_trees(group, range(len(q_lens)), seq_lens, tree_masks)
        return Plan([group])
    if many:                                                         # chunks: padded to Tq
        idx = torch.tensor(many, device=dev)
        lens = torch.tensor([q_lens[b] for b in many], device=dev)                 # [G]
        starts = torch.tensor([cu[b] for b in many], device=dev)                   # [G]
        i = torch.arange(max(q_lens[b] for b in many), device=dev)                 # [Tq]
        valid = i[None, :] < lens[:, None]                                         # [G, Tq]
        q_index = torch.where(valid, starts[:, None] + i[None, :], 0)              # [G, Tq]
        positions = seq_lens[idx].long()[:, None] - lens[:, None] + i[None, :]
        positions = torch.where(valid, positions, 0)          # padding queries see key 0 only
        group = _make_group(block_tables[idx], seq_lens[idx], q_index, positions, valid,
                            block_size)
        _and_trees(group, many, seq_lens, tree_masks)
        groups.append(group)
    return Plan(groups)


def _and_trees(group: Group, members, seq_lens, tree_masks) -> None:
    """AND each member's tree mask (if any) into the group's causal mask: member b's n queries
    see the last n slots only where tree_masks[b] says."""
    for g, b in enumerate(members):
        m = None if tree_masks is None else tree_masks[b]
        if m is not None:
            n, end = m.shape[0], int(seq_lens[b])
            group.visible[g, 0, :n, end - n:end] &= m


def plan_store(plan: Plan, slot_mapping) -> Plan:
    """Add store_kv's slots to a plan (slot -1 skips a token: its row is dropped once, here)."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        plan.slots, plan.keep = slot_mapping.long(), None
    else:
        plan.slots, plan.keep = slot_mapping[keep].long(), keep
    return plan


def store_kv(plan: Plan, k, v, k_cache, v_cache, k_scale=1.0, v_scale=1.0) -> None:
    """k, v [T, KVH, D] into their slots (plan_store): one index_copy_ per pool. An fp8 pool
    gets k / k_scale, v / v_scale in fp8, copied as bytes."""
    if plan.keep is not None:
        k, v = k[plan.keep], v[plan.keep]
    flat = (-1,) + tuple(k_cache.shape[2:])
    as_bytes(k_cache).view(flat).index_copy_(0, plan.slots,
                                             as_bytes(quantize(k, k_cache.dtype, k_scale)))
    as_bytes(v_cache).view(flat).index_copy_(0, plan.slots,
                                             as_bytes(quantize(v, v_cache.dtype, v_scale)))


def _keys(cache, keys):
    """The group's keys (or values) [G, KVH, L, D]: a view of one run of blocks, or a gather."""
    flat = cache.view((-1,) + tuple(cache.shape[2:]))    # [num_blocks * block_size, KVH, D]
    if isinstance(keys, slice):
        return flat[keys][None].transpose(1, 2)          # [1, KVH, L, D], no copy
    G, L = keys.shape
    return flat.index_select(0, keys.flatten()).view(G, L, *flat.shape[1:]).transpose(1, 2)


# Which dtype attention computes in when q is bf16. On the course's 2-core Xeon, which has AMX
# tile units for bf16 matrices, torch's CPU attention in bf16 took 0.52-0.58x the time of
# upcasting to fp32 at 16-64 decoding sequences; on its AMD CPU (AVX-512 BF16, no AMX) bf16
# attention ran 5x SLOWER than fp32. AMX is the rule's proxy for "bf16 attention is fast here".
# None: decide by the CPU (`bf16_attention_here`); True / False force it (tests, benchmarks).
BF16_ATTENTION = None


def bf16_attention_here() -> bool:
    """Whether bf16 queries attend in bf16 here (else the pool's keys and values are upcast to
    fp32 first): BF16_ATTENTION, or by the CPU's AMX tile support."""
    if BF16_ATTENTION is not None:
        return BF16_ATTENTION
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(amx is not None and amx())


def run(plan: Plan, q, k_cache, v_cache, scale, k_scale=1.0, v_scale=1.0):
    """q [T, H, D] (the rows the plan was made for) -> out [T, H, D]. An fp8 pool's k_scale
    joins the softmax scale and its v_scale multiplies the output (see kv_quant.py)."""
    out, scale = None, scale * k_scale
    # fp32 like the reference, or bf16 for bf16 queries where the CPU has AMX (BF16_ATTENTION)
    dt = torch.bfloat16 if q.dtype == torch.bfloat16 and bf16_attention_here() else torch.float32
    for g in plan.groups:
        k = _keys(k_cache, g.keys).to(dt)                              # [G, KVH, L, D]
        v = _keys(v_cache, g.keys).to(dt)
        qg = (q.view(-1, g.q_len, *q.shape[1:]) if g.q_index is None  # [G, Tq, H, D]
              else q[g.q_index])
        o = gqa_attention(qg.transpose(1, 2).to(dt), k, v, attn_mask=g.visible,
                          scale=scale).transpose(1, 2)                          # [G, Tq, H, D]
        o = (o * v_scale if v_scale != 1.0 else o).to(q.dtype)
        if g.q_index is None:                              # decodes or equal chunks, in order
            return o.reshape(q.shape)
        if out is None:
            out = torch.empty_like(q)
        if g.valid is None:
            out[g.q_index.flatten()] = o.flatten(0, 1)
        else:
            out[g.q_index[g.valid]] = o[g.valid]
    return torch.empty_like(q) if out is None else out


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=1.0,
                           v_scale=1.0):
    """q [B, H, D], one query per sequence at position seq_len - 1 -> out [B, H, D]."""
    return run(plan_decode(block_tables, seq_lens, k_cache.shape[1]), q, k_cache, v_cache, scale,
               k_scale, v_scale)


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                            k_scale=1.0, v_scale=1.0, tree_masks=None):
    """Ragged causal queries, q [T, H, D] (sequence b owns rows cu[b]:cu[b + 1], its last
    q_len tokens) -> out [T, H, D]; tree_masks as in plan_prefill."""
    plan = plan_prefill(cu_seqlens_q, seq_lens, block_tables, k_cache.shape[1], tree_masks)
    return run(plan, q, k_cache, v_cache, scale, k_scale, v_scale)
