"""Paged-attention kernels against their plain-PyTorch twins, and the twins against
minillm.model.causal_attention (the vLLM test_triton_unified_attention / ref_paged_attn pattern).

On a machine without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 and the Triton kernels run
through Triton's interpreter on CPU tensors; shapes stay tiny so the file runs in about a minute.
"""
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minillm.kernels as K
from minillm.kernels import batched, paged_decode, reference
from minillm.model import causal_attention

ROOT = Path(__file__).resolve().parents[1]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5),
       torch.float16: dict(atol=2e-3, rtol=1e-2),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
KV_HEADS, HEAD_DIM = 2, 32


def lengths_for(block_size):
    """1, block-1, block, block+1 and several blocks, all in one batch."""
    return [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3]


def paged_kv(lens, block_size, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
             seed=0):
    """A pool holding one sequence per entry of `lens`, in shuffled blocks.

    Returns (k_cache, v_cache, block_tables, seq_lens, ks, vs) where ks[b] / vs[b] are sequence
    b's contiguous [len, KVH, D] keys / values. Every pool row no sequence owns is NaN, and
    table padding points at an all-NaN block: a kernel that reads one key too many, or follows
    an unused table entry, returns NaN.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(blocks_needed) + 2                       # + a poison block + a spare
    poison = num_blocks - 1
    order = torch.randperm(num_blocks - 1, generator=g)      # physical blocks, shuffled
    max_blocks = max(blocks_needed) + 1                       # + one column of padding
    tables = torch.full((len(lens), max_blocks), poison, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    ks, vs, used = [], [], 0
    for b, (n, nb) in enumerate(zip(lens, blocks_needed)):
        tables[b, :nb] = order[used:used + nb].int()
        used += nb
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        for t in range(n):                                    # plain loop: independent of store_kv
            k_cache[tables[b, t // block_size], t % block_size] = k[t]
            v_cache[tables[b, t // block_size], t % block_size] = v[t]
        ks.append(k)
        vs.append(v)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    to = lambda t: t.to(DEVICE)
    return to(k_cache), to(v_cache), to(tables), to(seq_lens), ks, vs


def assert_close(out, ref, dtype):
    assert not torch.isnan(out).any(), "kernel output has NaN: it read a key it should not"
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), **TOL[dtype])


# ----------------------------------------------------------------------------- the twins
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_reference_decode_matches_causal_attention(block_size, group):
    lens = lengths_for(block_size)
    k_cache, v_cache, tables, seq_lens, ks, vs = paged_kv(lens, block_size)
    q = torch.randn(len(lens), KV_HEADS * group, HEAD_DIM, device=DEVICE)
    out = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens,
                                           1 / math.sqrt(HEAD_DIM))
    for b, n in enumerate(lens):                              # one contiguous sequence at a time
        expect = causal_attention(q[b][None, None], ks[b][None].to(DEVICE),
                                  vs[b][None].to(DEVICE), q_start=n - 1)[0, 0]
        torch.testing.assert_close(out[b], expect, atol=1e-5, rtol=1e-5)


def test_reference_decode_equal_lengths_batched():
    """Equal lengths: the whole batch in one causal_attention call over contiguous K/V."""
    lens = [19] * 3
    k_cache, v_cache, tables, seq_lens, ks, vs = paged_kv(lens, 8)
    q = torch.randn(3, KV_HEADS * 4, HEAD_DIM, device=DEVICE)
    out = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, HEAD_DIM ** -0.5)
    expect = causal_attention(q[:, None], torch.stack(ks).to(DEVICE), torch.stack(vs).to(DEVICE),
                              q_start=18)[:, 0]
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 3])
def test_reference_prefill_matches_causal_attention(group):
    pairs = [(9, 9), (1, 17), (5, 21), (0, 4), (16, 32)]      # (q_len, seq_len)
    k_cache, v_cache, tables, seq_lens, ks, vs = paged_kv([s for _, s in pairs], 8)
    q_lens = [ql for ql, _ in pairs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(q_lens), KV_HEADS * group, HEAD_DIM, device=DEVICE)
    out = reference.paged_prefill_attention(q, k_cache, v_cache, cu.to(DEVICE), seq_lens, tables,
                                            HEAD_DIM ** -0.5)
    for b, (ql, n) in enumerate(pairs):
        if ql == 0:
            continue
        rows = slice(int(cu[b]), int(cu[b + 1]))
        expect = causal_attention(q[rows][None], ks[b][None].to(DEVICE), vs[b][None].to(DEVICE),
                                  q_start=n - ql)[0]
        torch.testing.assert_close(out[rows], expect, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- batched (CPU path)
# minillm.kernels.batched: one gather + one SDPA call for the whole batch. The pool from paged_kv
# is NaN wherever no sequence owns a slot, so reading past seq_len would show up as NaN.
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_decode_matches_the_reference(block_size, group, dtype):
    lens = lengths_for(block_size)
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv(lens, block_size, dtype=dtype)
    q = torch.randn(len(lens), KV_HEADS * group, HEAD_DIM, device=DEVICE).to(dtype)
    args = (q, k_cache, v_cache, tables, seq_lens, HEAD_DIM ** -0.5)
    assert_close(batched.paged_decode_attention(*args), reference.paged_decode_attention(*args),
                 dtype)


@pytest.mark.parametrize("bf16_attention", [True, False], ids=["bf16-attention", "fp32-upcast"])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_batched_bf16_queries_attend_in_either_dtype(monkeypatch, bf16_attention, kv_dtype):
    """bf16 queries attend in bf16 on a CPU with AMX, else upcast to fp32 (BF16_ATTENTION):
    both choices, decodes and a ragged prefill, match the reference within bf16 rounding."""
    monkeypatch.setattr(batched, "BF16_ATTENTION", bf16_attention)
    assert batched.bf16_attention_here() is bf16_attention
    pairs = [(1, 13), (4, 9), (1, 3), (6, 6)]                            # (q_len, seq_len)
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv([s for _, s in pairs], 4,
                                                        dtype=torch.bfloat16)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    q = torch.randn(len(pairs), KV_HEADS * 3, HEAD_DIM, device=DEVICE).to(torch.bfloat16)
    args = (q, k_cache, v_cache, tables, seq_lens, HEAD_DIM ** -0.5)
    out = batched.paged_decode_attention(*args)
    assert out.dtype == torch.bfloat16
    assert_close(out, reference.paged_decode_attention(*args), torch.bfloat16)
    q_lens = [ql for ql, _ in pairs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEVICE)
    qp = torch.randn(sum(q_lens), KV_HEADS * 3, HEAD_DIM, device=DEVICE).to(torch.bfloat16)
    args = (qp, k_cache, v_cache, cu, seq_lens, tables, HEAD_DIM ** -0.5)
    assert_close(batched.paged_prefill_attention(*args),
                 reference.paged_prefill_attention(*args), torch.bfloat16)


def test_bf16_attention_follows_the_cpus_amx(monkeypatch):
    monkeypatch.setattr(batched, "BF16_ATTENTION", None)
    for amx in (True, False):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        assert batched.bf16_attention_here() is amx


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("group", [1, 3])
def test_batched_prefill_matches_the_reference(block_size, group):
    """Chunks of several queries, single decodes and an empty chunk in one ragged batch."""
    pairs = [(9, 9), (1, 17), (5, 21), (0, 4), (16, 32), (1, 1), (3, 3)]   # (q_len, seq_len)
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv([s for _, s in pairs], block_size)
    q_lens = [ql for ql, _ in pairs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEVICE)
    q = torch.randn(sum(q_lens), KV_HEADS * group, HEAD_DIM, device=DEVICE)
    args = (q, k_cache, v_cache, cu, seq_lens, tables, HEAD_DIM ** -0.5)
    assert_close(batched.paged_prefill_attention(*args), reference.paged_prefill_attention(*args),
                 torch.float32)


@pytest.mark.parametrize("seq_lens,tree", [([7], False), ([5, 17, 9], False), ([12, 6], True)],
                         ids=["one-sequence", "ragged", "tree"])
@pytest.mark.parametrize("view", [True, False], ids=["view", "switched-off"])
def test_batched_equal_chunks_are_a_view_and_match_the_reference(seq_lens, tree, view,
                                                                 monkeypatch):
    """Every sequence verifying the same number of drafts (3 queries each): the plan is one
    group over q's rows as they are (no index, no scatter back), and the output is the
    reference's; with a tree mask on the first sequence too. VIEW_EQUAL_CHUNKS = False (for
    measurements) takes the padded path, with the same output."""
    monkeypatch.setattr(batched, "VIEW_EQUAL_CHUNKS", view)
    from minillm.spec.tree import tree_mask
    n, bs = 3, 4
    k_cache, v_cache, tables, lens, _, _ = paged_kv(seq_lens, bs)
    cu = torch.arange(0, n * len(seq_lens) + 1, n, dtype=torch.int32, device=DEVICE)
    q = torch.randn(n * len(seq_lens), KV_HEADS * 3, HEAD_DIM, device=DEVICE)
    masks = (tree_mask([-1, 0, 0]),) + (None,) * (len(seq_lens) - 1) if tree else None
    plan = batched.plan_prefill(cu, lens, tables, bs, masks)
    assert len(plan.groups) == 1 and (plan.groups[0].q_index is None) == view
    assert plan.groups[0].q_len == (n if view else 1)
    args = (q, k_cache, v_cache, cu, lens, tables, HEAD_DIM ** -0.5)
    assert_close(batched.paged_prefill_attention(*args, tree_masks=masks),
                 reference.paged_prefill_attention(*args, tree_masks=masks), torch.float32)


@pytest.mark.parametrize("pad", [-1, 10**6])
def test_batched_never_follows_a_padding_entry(pad):
    """Table entries past a sequence's blocks may hold anything (-1, an id past the pool): the
    batched path gathers whole blocks, so it must not index with them."""
    lens = [3, 13, 7]
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv(lens, 4)
    for b, n in enumerate(lens):
        tables[b, math.ceil(n / 4):] = pad
    q = torch.randn(len(lens), KV_HEADS * 3, HEAD_DIM, device=DEVICE)
    args = (q, k_cache, v_cache, tables, seq_lens, HEAD_DIM ** -0.5)
    assert_close(batched.paged_decode_attention(*args), reference.paged_decode_attention(*args),
                 torch.float32)
    cu = torch.tensor([0, 1, 3, 4], dtype=torch.int32, device=DEVICE)
    qp = torch.randn(4, KV_HEADS * 3, HEAD_DIM, device=DEVICE)
    args = (qp, k_cache, v_cache, cu, seq_lens, tables, HEAD_DIM ** -0.5)
    assert_close(batched.paged_prefill_attention(*args), reference.paged_prefill_attention(*args),
                 torch.float32)


def test_impl_torch_matches_impl_reference():
    """The public functions with impl="torch" (the CPU default) and impl="reference" agree."""
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv([3, 12, 7], 4)
    q = torch.randn(3, KV_HEADS * 3, HEAD_DIM, device=DEVICE)
    args = (q, k_cache, v_cache, tables, seq_lens, 0.2)
    assert_close(K.paged_decode_attention(*args, impl="torch"),
                 K.paged_decode_attention(*args, impl="reference"), torch.float32)


def test_reference_gather_follows_the_block_table():
    k_cache, v_cache, tables, seq_lens, ks, vs = paged_kv([13, 3], 4)
    torch.testing.assert_close(reference.gather_kv(k_cache, tables[0], 13), ks[0].to(DEVICE))
    torch.testing.assert_close(reference.gather_kv(v_cache, tables[1], 3), vs[1].to(DEVICE))


# ----------------------------------------------------------------------------- store_kv
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_triton(dtype, slot_dtype):
    num_blocks, block_size, kvh, d = 6, 8, 3, 24               # odd sizes: padded and masked
    g = torch.Generator().manual_seed(1)
    slots = torch.tensor([5, 17, -1, 40, 0, 47, -1, 8], dtype=slot_dtype)
    k = torch.randn(len(slots), kvh, d, generator=g).to(dtype)
    v = torch.randn(len(slots), kvh, d, generator=g).to(dtype)
    k_cache = torch.zeros(num_blocks, block_size, kvh, d, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_dev, v_dev, kc, vc = (t.to(DEVICE) for t in (k, v, k_cache, v_cache))
    K.store_kv(k_dev, v_dev, kc, vc, slots.to(DEVICE), impl="triton")
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for t, s in enumerate(slots.tolist()):                     # the definition, token by token
        if s >= 0:
            expect_k[s // block_size, s % block_size] = k[t]
            expect_v[s // block_size, s % block_size] = v[t]
    assert torch.equal(kc.cpu(), expect_k) and torch.equal(vc.cpu(), expect_v)
    # the twin does the same
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, kc2, vc2, slots)
    assert torch.equal(kc2, expect_k) and torch.equal(vc2, expect_v)


# ----------------------------------------------------------------------------- decode
DECODE_CASES = ([(bs, group, torch.float32) for bs in (8, 16, 32, 128) for group in (1, 3, 8)]
                + [(16, group, dt) for dt in (torch.float16, torch.bfloat16)
                   for group in (1, 3, 8)])


@pytest.mark.parametrize("split_kv", [False, True], ids=["single", "split"])
@pytest.mark.parametrize("block_size,group,dtype", DECODE_CASES,
                         ids=[f"b{b}-g{g}-{str(d)[6:]}" for b, g, d in DECODE_CASES])
def test_paged_decode_triton(block_size, group, dtype, split_kv):
    lens = lengths_for(block_size) + ([2 * 64 + 5] if split_kv else [])   # 3 partitions
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv(lens, block_size, dtype=dtype)
    q = torch.randn(len(lens), KV_HEADS * group, HEAD_DIM).to(dtype).to(DEVICE)
    scale = HEAD_DIM ** -0.5
    ref = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)
    # split: 64-key partitions, so the 133-token sequence spans three (the last partial) and
    # the short ones leave empty partitions behind
    out = K.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, impl="triton",
                                   split_kv=split_kv, partition_size=64 if split_kv else None)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, ref, dtype)


def test_paged_decode_odd_head_dim_and_strided_query():
    """head_dim 24 (padded to 32 inside) and a query that is a non-contiguous view."""
    lens = [1, 9, 30]
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv(lens, 8, num_kv_heads=3, head_dim=24)
    q = torch.randn(3, 24, 9, device=DEVICE).transpose(1, 2)  # [B, H, D], strided
    ref = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3)
    for split in (False, True):
        out = K.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3, impl="triton",
                                       split_kv=split)
        assert_close(out, ref, torch.float32)


def test_split_kv_rule():
    choose = paged_decode.choose_partition_size
    # enough programs to fill 132 SMs: no split, however long the context
    assert choose(64, 8, 4096, 132) is None
    assert choose(44, 3, 4096, 132) is None
    # short context: nothing to split
    assert choose(1, 3, 128, 132) is None
    # one sequence, long context: many partitions, each a power of two >= MIN_PARTITION
    size = choose(1, 3, 4096, 132)
    assert size == 128 and 4096 // size == 32
    assert choose(1, 1, 32768, 132) == 32768 // paged_decode.MAX_PARTITIONS
    # batch 16 of SmolLM2 (48 programs) at 4096: 6 partitions wanted -> 1024 keys each
    assert choose(16, 3, 4096, 132) == 1024
    assert choose(4, 8, 1024, 132) == 128                    # 32 programs x 8 partitions


def test_paged_decode_auto_split_picks_split(monkeypatch):
    """With one long sequence the rule splits, and the split result is right."""
    lens = [300]
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv(lens, 16, num_kv_heads=1)
    q = torch.randn(1, 3, HEAD_DIM, device=DEVICE)
    calls = []
    original = paged_decode.choose_partition_size
    monkeypatch.setattr(paged_decode, "choose_partition_size",
                        lambda *a: calls.append(original(*a)) or calls[-1])
    out = K.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2, impl="triton")
    assert calls == [128]                                     # 320-token table -> 3 partitions
    ref = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2)
    assert_close(out, ref, torch.float32)


def test_partition_size_must_be_a_tile_multiple():
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv([5], 8)
    q = torch.randn(1, 2, HEAD_DIM, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of 64"):
        K.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1, impl="triton",
                                 split_kv=True, partition_size=48)


# ----------------------------------------------------------------------------- prefill
def prefill_batch(block_size):
    """(q_len, seq_len) pairs: a whole prompt, chunks continuing earlier chunks (context ending
    inside a block and on a block boundary), single-token decode rows, a sequence with no new
    queries this step."""
    bs = block_size
    return [(bs + 3, bs + 3),         # whole prompt, q_len == seq_len
            (1, bs + 1),              # decode row
            (5, 2 * bs + 2),          # chunk after 2*bs - 3 context tokens
            (bs, 2 * bs),             # chunk after exactly one block of context
            (1, 1),                   # decode row with one key
            (0, 3),                   # nothing new for this sequence
            (3, 3)]                   # short whole prompt


# block 128 makes long sequences (the interpreter's slowest case): groups 1 and 3 only there
PREFILL_CASES = ([(bs, group, torch.float32) for bs in (8, 16, 32) for group in (1, 3, 8)]
                 + [(128, group, torch.float32) for group in (1, 3)]
                 + [(16, group, dt) for dt in (torch.float16, torch.bfloat16)
                    for group in (1, 3, 8)])


@pytest.mark.parametrize("block_size,group,dtype", PREFILL_CASES,
                         ids=[f"b{b}-g{g}-{str(d)[6:]}" for b, g, d in PREFILL_CASES])
def test_paged_prefill_triton(block_size, group, dtype):
    pairs = prefill_batch(block_size)
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv([s for _, s in pairs], block_size,
                                                        dtype=dtype)
    q_lens = [ql for ql, _ in pairs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEVICE)
    q = torch.randn(sum(q_lens), KV_HEADS * group, HEAD_DIM).to(dtype).to(DEVICE)
    scale = HEAD_DIM ** -0.5
    ref = reference.paged_prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, scale)
    out = K.paged_prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, scale,
                                    impl="triton", max_query_len=max(q_lens))
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, ref, dtype)


def random_tree(n, seed):
    """parents of an n-node tree, parents first (node 0 the root)."""
    g = torch.Generator().manual_seed(seed)
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


@pytest.mark.parametrize("nodes", [6, 64])
def test_paged_prefill_with_tree_masks(nodes):
    """Speculative tree drafts (chapter 07): one sequence's queries are the nodes of a tree
    (after 11 context tokens), beside a plain chunk and a decode row. The Triton kernel (its
    int64 ancestor bits, bit 63 included at 64 nodes), the batched path and the reference
    twin agree, and the tree changes the result (it is not the causal answer)."""
    from minillm.spec.tree import tree_mask
    bs, group = 8, 3
    mask = tree_mask(random_tree(nodes, nodes))
    pairs = [(nodes, 11 + nodes), (5, 2 * bs + 2), (1, bs + 1)]
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv([s for _, s in pairs], bs)
    q_lens = [ql for ql, _ in pairs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEVICE)
    q = torch.randn(sum(q_lens), KV_HEADS * group, HEAD_DIM, device=DEVICE)
    masks, scale = (mask, None, None), HEAD_DIM ** -0.5
    args = (q, k_cache, v_cache, cu, seq_lens, tables, scale)
    ref = reference.paged_prefill_attention(*args, tree_masks=masks)
    out = K.paged_prefill_attention(*args, impl="triton", max_query_len=max(q_lens),
                                    tree_masks=masks)
    assert_close(out, ref, torch.float32)
    assert_close(batched.paged_prefill_attention(*args, tree_masks=masks), ref, torch.float32)
    causal = reference.paged_prefill_attention(*args)
    assert (causal[:nodes] - ref[:nodes]).abs().max() > 1e-2     # the mask mattered
    torch.testing.assert_close(causal[nodes:], ref[nodes:])        # ... for the tree only
    bits = K.tree_bits_for(cu, masks, q.shape[0], DEVICE)
    assert bits[nodes:].eq(-1).all() and int(bits[0]) == 1          # the root sees itself
    with pytest.raises(ValueError, match="tree_masks\\[0\\] has shape"):
        K.tree_bits_for(cu, (mask[:-1, :-1], None, None), q.shape[0], DEVICE)
    with pytest.raises(ValueError, match="one per sequence"):
        K.paged_prefill_attention(*args, impl="triton", tree_masks=(mask,))
    for impl in ("torch", "reference"):          # a mask smaller than its queries: refused too
        with pytest.raises(ValueError, match="tree_masks\\[0\\] has shape"):
            K.paged_prefill_attention(*args, impl=impl, tree_masks=(mask[:-1, :-1], None, None))


def test_paged_prefill_without_max_query_len_and_odd_head_dim():
    pairs = [(40, 40), (1, 7), (6, 30)]
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv([s for _, s in pairs], 16,
                                                        num_kv_heads=1, head_dim=40)
    cu = torch.tensor([0, 40, 41, 47], dtype=torch.int32, device=DEVICE)
    q = torch.randn(47, 3, 40, device=DEVICE)
    ref = reference.paged_prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, 0.15)
    out = K.paged_prefill_attention(q, k_cache, v_cache, cu, seq_lens, tables, 0.15,
                                    impl="triton")
    assert_close(out, ref, torch.float32)


def test_prefill_then_decode_end_to_end():
    """store_kv -> prefill -> store_kv -> decode, all Triton, against causal_attention over the
    same tokens held contiguously."""
    torch.manual_seed(3)
    block_size, kvh, group, d, n = 8, 2, 3, HEAD_DIM, 21
    k = torch.randn(1, n + 1, kvh, d, device=DEVICE)
    v = torch.randn(1, n + 1, kvh, d, device=DEVICE)
    q = torch.randn(1, n + 1, kvh * group, d, device=DEVICE)
    k_cache = torch.zeros(6, block_size, kvh, d, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[4, 0, 5, 2]], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([int(table[0, t // block_size]) * block_size + t % block_size
                          for t in range(n + 1)], device=DEVICE)
    K.store_kv(k[0, :n], v[0, :n], k_cache, v_cache, slots[:n], impl="triton")
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    out = K.paged_prefill_attention(q[0, :n], k_cache, v_cache, cu, lens, table, d ** -0.5,
                                    impl="triton")
    assert_close(out, causal_attention(q[:, :n], k[:, :n], v[:, :n])[0], torch.float32)
    K.store_kv(k[0, n:], v[0, n:], k_cache, v_cache, slots[n:], impl="triton")
    out = K.paged_decode_attention(q[0, n:], k_cache, v_cache, table, lens + 1, d ** -0.5,
                                   impl="triton")
    assert_close(out, causal_attention(q[:, n:], k, v, q_start=n)[0], torch.float32)


# ----------------------------------------------------------------------------- dispatch
def test_dispatch_by_device(monkeypatch):
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv([5, 9], 8)
    q = torch.randn(2, 2, HEAD_DIM, device=DEVICE)
    used = []
    for module in (reference, batched):
        real = module.paged_decode_attention
        monkeypatch.setattr(module, "paged_decode_attention",
                            lambda *a, m=module.__name__, f=real: used.append(m) or f(*a))
    K.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1)
    expect = ["minillm.kernels.batched"] if DEVICE.type == "cpu" else []
    assert used == expect                                  # CPU: batched; CUDA: Triton
    K.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1, impl="triton")
    assert used == expect
    K.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1, impl="reference")
    assert used == expect + ["minillm.kernels.reference"]
    with pytest.raises(ValueError, match="impl must be"):
        K.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1, impl="cuda")


# ----------------------------------------------------------------------------- bad input
@pytest.fixture
def decode_inputs():
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv([5, 9], 4, num_kv_heads=2, head_dim=16)
    q = torch.randn(2, 4, 16, device=DEVICE)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, seq_lens=seq_lens,
                scale=0.25)


BAD_DECODE = {
    "block id past the pool": (lambda a: a["block_tables"].__setitem__((1, 2), 99),
                               "outside the pool"),
    "negative block id": (lambda a: a["block_tables"].__setitem__((0, 0), -1), "outside the pool"),
    "seq_len beyond table": (lambda a: a["seq_lens"].__setitem__(1, 50), "larger than its block"),
    "seq_len zero": (lambda a: a["seq_lens"].__setitem__(0, 0), "must be >= 1"),
    "head_dim mismatch": (lambda a: a.update(q=torch.randn(2, 4, 8, device=DEVICE)),
                          "head_dim 8 does not match"),
    "H not multiple of KVH": (lambda a: a.update(q=torch.randn(2, 3, 16, device=DEVICE)),
                              "not a multiple"),
    "q dtype": (lambda a: a.update(q=a["q"].half()), "cast q"),
    "int64 table": (lambda a: a.update(block_tables=a["block_tables"].long()), "torch.int32"),
    "float seq_lens": (lambda a: a.update(seq_lens=a["seq_lens"].float()), "seq_lens has dtype"),
    "table rows": (lambda a: a.update(block_tables=a["block_tables"][:1]), "one row per sequence"),
    "table on another device": (lambda a: a.update(block_tables=torch.empty(
        2, 4, dtype=torch.int32, device="meta")), "is on meta"),
    "cache shapes differ": (lambda a: a.update(v_cache=a["v_cache"][:, :2]), "v_cache shape"),
    "scale": (lambda a: a.update(scale=0.0), "positive"),
    "q rank": (lambda a: a.update(q=a["q"][None]), r"q must be \[batch"),
}


@pytest.mark.parametrize("impl", ["reference", "torch", "triton"])
@pytest.mark.parametrize("case", list(BAD_DECODE))
def test_decode_bad_input(decode_inputs, case, impl):
    spoil, message = BAD_DECODE[case]
    spoil(decode_inputs)
    with pytest.raises(ValueError, match=message):
        K.paged_decode_attention(**decode_inputs, impl=impl)


def test_decode_table_padding_may_hold_anything(decode_inputs):
    """Entries past a sequence's last used block are padding: not checked, never read."""
    tables = decode_inputs["block_tables"]
    tables[0, 2:] = -1                                         # seq 0 (5 tokens) uses 2 blocks
    tables[1, 3:] = 10 ** 6                                    # seq 1 (9 tokens) uses 3 blocks
    ref = K.paged_decode_attention(**decode_inputs, impl="reference")
    out = K.paged_decode_attention(**decode_inputs, impl="triton")
    assert_close(out, ref, torch.float32)


def test_prefill_bad_input():
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv([5, 9], 4)
    q = torch.randn(7, 2, HEAD_DIM, device=DEVICE)
    good = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)

    def call(cu=good, lens=seq_lens, **kw):
        return K.paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, 0.2, **kw)

    call()                                                     # the good call works
    bad_cu = {"end at the number": [0, 3, 6], "start at 0": [1, 3, 7],
              "non-decreasing": [0, 8, 7]}
    for message, values in bad_cu.items():
        with pytest.raises(ValueError, match=message):
            call(torch.tensor(values, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="batch \\+ 1"):
        call(good[:2])
    with pytest.raises(ValueError, match="q_len > seq_len"):
        call(lens=torch.tensor([2, 9], dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="max_query_len=3"):
        call(max_query_len=3)
    with pytest.raises(ValueError, match="cu_seqlens_q has dtype"):
        call(good.long())
    with pytest.raises(ValueError, match="larger than its block"):
        call(lens=torch.tensor([5, 17], dtype=torch.int32, device=DEVICE))   # table holds 16


def test_store_kv_bad_input():
    k_cache = torch.zeros(4, 8, 2, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(3, 2, 16, device=DEVICE)
    slots = torch.tensor([0, 5, 31], device=DEVICE)
    K.store_kv(k, k, k_cache, v_cache, slots)                  # fine
    with pytest.raises(ValueError, match="slot outside the pool"):
        K.store_kv(k, k, k_cache, v_cache, torch.tensor([0, 5, 32], device=DEVICE))
    with pytest.raises(ValueError, match="slot outside the pool"):
        K.store_kv(k, k, k_cache, v_cache, torch.tensor([0, -2, 3], device=DEVICE))
    with pytest.raises(ValueError, match="slot_mapping has dtype"):
        K.store_kv(k, k, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="3 tokens"):
        K.store_kv(k, k, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match=r"k must be \[num_tokens, 2, 16\]"):
        K.store_kv(k[:, :1], k[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="cast it"):
        K.store_kv(k.half(), k.half(), k_cache, v_cache, slots)


def test_check_values_false_skips_the_value_checks(decode_inputs, monkeypatch):
    from minillm.kernels import checks
    monkeypatch.setattr(checks, "raise_failed", lambda *a: pytest.fail("values were checked"))
    K.paged_decode_attention(**decode_inputs, impl="reference", check_values=False)
    with pytest.raises(pytest.fail.Exception):
        K.paged_decode_attention(**decode_inputs, impl="reference")


# ----------------------------------------------------------------------------- benchmark
def load_benchmark():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "bench_paged_decode", ROOT / "benchmarks" / "bench_paged_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_smoke(tmp_path):
    """--smoke runs every method on a tiny shape (interpreter on CPU) and writes JSON + PNG."""
    bench = load_benchmark()
    assert bench.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    written = list(tmp_path.glob("paged_decode_*_smoke.json"))
    assert len(written) == 1 and written[0].with_suffix(".png").exists()
    import json
    result = json.loads(written[0].read_text())
    assert result["smoke"] is True and result["versions"]["triton"]
    methods = {(row["method"], row["block_size"]) for row in result["rows"]}
    assert {("triton", 16), ("triton", 128), ("twin", 16), ("sdpa_contiguous", 16),
            ("flex_paged", 16)} <= methods
    assert all(row["max_abs_err_vs_twin"] < 1e-4 for row in result["rows"])


def test_benchmark_refuses_full_sweep_without_cuda(tmp_path, monkeypatch, capsys):
    bench = load_benchmark()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--smoke" in err and "CUDA" in err
    assert not list(tmp_path.iterdir())


def test_triton_on_cpu_without_interpreter_is_a_clear_error():
    code = ("import torch, minillm.kernels as K\n"
            "kc = torch.zeros(2, 4, 1, 16)\n"
            "try:\n"
            "    K.store_kv(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), kc, kc.clone(),\n"
            "               torch.tensor([0]), impl='triton')\n"
            "except ValueError as e:\n"
            "    print('ValueError:', e)\n")
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, cwd=ROOT)
    assert "ValueError:" in run.stdout and "TRITON_INTERPRET=1" in run.stdout, run.stderr[-1000:]


def test_kernels_compile_for_h100_without_spills():
    """The interpreter never compiles a kernel; this does: Triton IR -> PTX -> cubin for sm_90
    with the ptxas that Triton's wheel ships, no GPU needed (minillm.kernels.compile_check)."""
    code = ("import json, torch\n"
            "from minillm.kernels.compile_check import check\n"
            "print(json.dumps(check(90, torch.bfloat16, geometries=((9, 3, 64), (32, 8, 128)))))\n")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    import json
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in rows} == {"_paged_decode_kernel", "_merge_partitions_kernel",
                                           "_paged_prefill_kernel", "_store_kv_kernel"}
    for r in rows:
        assert r["stack_bytes"] == 0, f"{r['variant']} spills registers: {r}"
        assert r["shared_bytes"] <= 228 * 1024, r                # H100 shared memory per SM


def _consecutive_pool(n, block_size, dtype=torch.float32):
    """One sequence of n tokens in blocks 1, 2, ... (consecutive), every other row NaN."""
    k_cache, v_cache, tables, seq_lens, ks, vs = paged_kv([n], block_size, dtype=dtype)
    nb = math.ceil(n / block_size)
    k_cache.fill_(float("nan"))
    v_cache.fill_(float("nan"))
    tables[0, :nb] = torch.arange(1, nb + 1, dtype=torch.int32)
    for t in range(n):
        k_cache[1 + t // block_size, t % block_size] = ks[0][t]
        v_cache[1 + t // block_size, t % block_size] = vs[0][t]
    return k_cache, v_cache, tables, seq_lens


@pytest.mark.parametrize("q_len", [1, 5])
def test_batched_reads_consecutive_blocks_as_a_view_and_stops_at_seq_len(q_len):
    """One sequence whose blocks are consecutive is attended through a slice of the pool (no
    gather); the NaN rows right after its last key must stay unread."""
    n, block_size = 13, 4
    k_cache, v_cache, tables, seq_lens = _consecutive_pool(n, block_size)
    q = torch.randn(q_len, KV_HEADS * 3, HEAD_DIM, device=DEVICE)
    cu = torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE)
    plan = batched.plan_prefill(cu, seq_lens, tables, block_size)
    assert isinstance(plan.groups[0].keys, slice)
    args = (q, k_cache, v_cache, cu, seq_lens, tables, HEAD_DIM ** -0.5)
    assert_close(batched.paged_prefill_attention(*args), reference.paged_prefill_attention(*args),
                 torch.float32)


def test_batched_store_kv_skips_negative_slots_like_the_reference():
    k_cache, v_cache, _, _, _, _ = paged_kv([6], 4)
    k2, v2 = k_cache.clone(), v_cache.clone()
    k, v = (torch.randn(4, KV_HEADS, HEAD_DIM, device=DEVICE) for _ in range(2))
    slots = torch.tensor([5, -1, 0, 9], device=DEVICE)
    plan = batched.plan_store(batched.Plan([]), slots)
    batched.store_kv(plan, k, v, k_cache, v_cache)
    reference.store_kv(k, v, k2, v2, slots)
    torch.testing.assert_close(k_cache, k2, equal_nan=True)
    torch.testing.assert_close(v_cache, v2, equal_nan=True)
