"""The paged KV cache behind the model's seam (chapter 03), against the contiguous cache.

The contiguous cache and the no-cache forward use `causal_attention`, plain PyTorch nobody here
changed for paging; the paged cache goes through block tables and minillm.kernels.
"""
import dataclasses

import pytest
import torch

from minillm.cache.contiguous import ContiguousKVCache
from minillm.cache.blocks import BlockManager
from minillm.cache.paged import PagedKVCache, SimplePagedKVCache, build_step_metadata
from minillm.configs import get
from minillm.loader import random_model

TOL = 1e-4
TINY = get("smollm2-135m").with_(name="tiny", num_layers=2, num_heads=4, num_kv_heads=2,
                                 head_dim=16, hidden_size=64, intermediate_size=128, vocab_size=128,
                                 max_position_embeddings=256)


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, device="cpu", dtype=torch.float32, std=0.2)


def ids_of(*shape, seed=0):
    return torch.randint(0, TINY.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def max_diff(a, b):
    return (a - b).abs().max().item()


@torch.no_grad()
@pytest.mark.parametrize("block_size,prompt_len", [(1, 7), (4, 8), (4, 6), (16, 16), (16, 21)])
def test_simple_mode_matches_contiguous_cache(model, block_size, prompt_len):
    B, steps = 2, 6
    total = prompt_len + steps
    ref = ContiguousKVCache(TINY, batch_size=B, max_len=total)
    paged = SimplePagedKVCache(TINY, num_blocks=B * -(-total // block_size), block_size=block_size,
                               batch_size=B)
    ids = ids_of(B, prompt_len, seed=prompt_len)
    a, b = model(ids, cache=ref), model(ids, cache=paged)
    for _ in range(steps):
        assert a.shape == b.shape and max_diff(a, b) <= TOL
        nxt = a[:, -1:].argmax(-1)                                     # [B, 1]
        assert torch.equal(nxt, b[:, -1:].argmax(-1))                  # same greedy tokens
        a, b = model(nxt, cache=ref), model(nxt, cache=paged)
    assert max_diff(a, b) <= TOL
    bm = paged.block_manager
    assert paged.seq_len == total
    assert all(len(bm.block_table(s)) == -(-total // block_size) for s in paged.seq_ids)
    assert bm.num_free_blocks == 0                                    # sized exactly: no waste
    # the K of sequence 1, gathered through its block table, is the contiguous cache's K
    slots = torch.tensor(bm.slot_mapping(1, 0, total))
    flat = paged.k[0].flatten(0, 1)                                   # [num_blocks * bs, KVH, D]
    assert torch.equal(flat[slots], ref.k[0, 1, :total])


@torch.no_grad()
def test_simple_mode_matches_full_forward_without_cache(model):
    ids = ids_of(1, 13, seed=5)
    paged = SimplePagedKVCache(TINY, num_blocks=4, block_size=4, batch_size=1)
    out = torch.cat([model(ids[:, :5], cache=paged), model(ids[:, 5:9], cache=paged),
                     model(ids[:, 9:], cache=paged)], dim=1)          # three chunks
    assert max_diff(out, model(ids)) <= TOL


@torch.no_grad()
def test_fork_shares_the_prompt_and_copies_on_write(model):
    prompt = ids_of(1, 6, seed=1)                                    # 6 tokens, blocks of 4
    paged = SimplePagedKVCache(TINY, num_blocks=8, block_size=4, batch_size=1)
    logits = model(prompt, cache=paged)
    rows = [0, paged.fork(0), paged.fork(0)]
    assert rows == [0, 1, 2]
    bm = paged.block_manager
    shared = bm.block_table(0)
    assert all(bm.block_table(s) == shared for s in paged.seq_ids)
    assert bm.num_free_blocks == 6                                    # the prompt is stored once
    ref = ContiguousKVCache(TINY, batch_size=3, max_len=10)
    ref_logits = model(prompt.expand(3, -1), cache=ref)
    assert max_diff(ref_logits[:1], logits) <= TOL
    tokens = torch.tensor([[3], [50], [99]])                          # each row samples its own
    for _ in range(4):
        a, b = model(tokens, cache=ref), model(tokens, cache=paged)
        assert max_diff(a, b) <= TOL
        tokens = a[:, -1:].argmax(-1)
    tables = [bm.block_table(s) for s in paged.seq_ids]
    assert all(t[0] == shared[0] for t in tables)                     # full block still shared
    assert len({t[1] for t in tables}) == 3                           # partial block copied
    assert bm.pool.refcount(shared[0]) == 3


def engine_reference(model, ids_chunks):
    """Run one sequence alone on a contiguous cache, chunk by chunk; logits per chunk."""
    total = sum(c.shape[1] for c in ids_chunks)
    cache = ContiguousKVCache(TINY, batch_size=1, max_len=total)
    return [model(c, cache=cache) for c in ids_chunks]


@torch.no_grad()
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_engine_mode_ragged_steps_match_each_sequence_alone(model, block_size):
    a_ids, b_ids = ids_of(1, 9, seed=11), ids_of(1, 17, seed=12)
    # step 1: A prefills 5 tokens, B prefills 11 (ragged, one forward)
    # step 2: both decode one token (decode kernel)
    # step 3: A decodes one, B prefills a 3-token chunk (mixed: prefill kernel)
    # step 4: A adds 2, B adds 2 (prefill kernel)
    plan = [((0, 5), (0, 11)), ((5, 6), (11, 12)), ((6, 7), (12, 15)), ((7, 9), (15, 17))]
    ref_a = engine_reference(model, [a_ids[:, s:e] for (s, e), _ in plan])
    ref_b = engine_reference(model, [b_ids[:, s:e] for _, (s, e) in plan])
    cache = PagedKVCache(TINY, num_blocks=64 // block_size + 4, block_size=block_size)
    bm = cache.block_manager
    for i, ((sa, ea), (sb, eb)) in enumerate(plan):
        bm.allocate("A", ea)
        bm.allocate("B", eb)
        positions = cache.prepare_step([("A", sa, ea), ("B", sb, eb)])
        assert cache._meta.is_decode_only == (i == 1)
        ids = torch.cat([a_ids[:, sa:ea], b_ids[:, sb:eb]], dim=1)    # [1, T_total]
        out = model(ids, positions=positions, cache=cache)
        assert max_diff(out[:, :ea - sa], ref_a[i]) <= TOL
        assert max_diff(out[:, ea - sa:], ref_b[i]) <= TOL


@torch.no_grad()
def test_engine_mode_needs_a_step_and_positions(model):
    cache = PagedKVCache(TINY, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="positions="):
        model(ids_of(1, 3), cache=cache)                             # reads cache.seq_len
    with pytest.raises(ValueError, match="set_step"):
        model(ids_of(1, 3), positions=torch.arange(3)[None], cache=cache)
    with pytest.raises(ValueError, match="build_step_metadata"):
        cache.set_step(build_step_metadata([(0, 2)]))                 # no block tables


def test_step_metadata_is_built_once_by_one_pure_function():
    bm = BlockManager(8, 4)
    bm.allocate("a", 8)
    bm.allocate("b", 5)
    tables = [bm.block_table("a"), bm.block_table("b")]
    meta = build_step_metadata([(7, 1), (0, 5)], tables, 4)
    assert meta.positions.tolist() == [7, 0, 1, 2, 3, 4]
    assert meta.cu_seqlens_q.tolist() == [0, 1, 6] and meta.seq_lens.tolist() == [8, 5]
    assert meta.slot_mapping.tolist() == (bm.slot_mapping("a", 7, 8) + bm.slot_mapping("b", 0, 5))
    assert meta.block_tables.tolist() == [tables[0], tables[1]] and not meta.is_decode_only
    assert tables == [bm.block_table("a"), bm.block_table("b")]           # nothing mutated
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.positions = None                                               # frozen
    with pytest.raises(ValueError, match="allocate its blocks first"):
        build_step_metadata([(8, 1)], [tables[0]], 4)
    with pytest.raises(ValueError, match="num_new >= 1"):
        build_step_metadata([(0, 0)])


@torch.no_grad()
def test_simple_mode_out_of_blocks_is_a_clear_error(model):
    cache = SimplePagedKVCache(TINY, num_blocks=2, block_size=4, batch_size=2)
    model(ids_of(2, 4), cache=cache)
    with pytest.raises(ValueError, match="out of KV blocks"):
        model(ids_of(2, 1), cache=cache)
    assert cache.block_manager.num_free_blocks == 0


def test_copy_blocks_copies_every_layer():
    cache = PagedKVCache(TINY, num_blocks=4, block_size=2)
    cache.k[:, 1] = torch.randn_like(cache.k[:, 1])
    cache.v[:, 1] = torch.randn_like(cache.v[:, 1])
    cache.copy_blocks([(1, 3)])
    assert torch.equal(cache.k[:, 3], cache.k[:, 1]) and torch.equal(cache.v[:, 3], cache.v[:, 1])
    assert (cache.k[:, 0] == 0).all() and (cache.k[:, 2] == 0).all()


@torch.no_grad()
def test_swap_out_and_back_into_other_blocks(model):
    ids = ids_of(1, 12, seed=3)
    ref = ContiguousKVCache(TINY, batch_size=1, max_len=12)
    ref_logits = [model(ids[:, :10], cache=ref), model(ids[:, 10:11], cache=ref)]
    cache = PagedKVCache(TINY, num_blocks=8, block_size=4, num_cpu_blocks=3)
    bm = cache.block_manager
    bm.allocate("s", 10)
    out = model(ids[:, :10], positions=cache.prepare_step([("s", 0, 10)]), cache=cache)
    assert max_diff(out, ref_logits[0]) <= TOL
    gpu = bm.block_table("s")
    cache.swap_out_blocks(list(zip(gpu, [2, 0, 1])))                  # to CPU blocks 2, 0, 1
    bm.free("s")
    bm.allocate("s", 10)                                              # fresh blocks
    new = bm.block_table("s")
    assert not set(new) & set(gpu)
    cache.k[:, gpu], cache.v[:, gpu] = 9.0, 9.0                       # the old blocks get reused
    cache.swap_in_blocks(list(zip([2, 0, 1], new)))
    bm.allocate("s", 11)
    out = model(ids[:, 10:11], positions=cache.prepare_step([("s", 10, 11)]), cache=cache)
    assert max_diff(out, ref_logits[1]) <= TOL
    k_cpu, v_cpu = cache.swap_out(new)                                # the plain helpers agree
    assert k_cpu.device.type == "cpu" and k_cpu.shape == (2, 3, 4, 2, 16)
    assert torch.equal(k_cpu[:, 0], cache.cpu_k[:, 2])


@torch.no_grad()
def test_triton_kernels_under_the_interpreter():
    """The same check through the Triton kernels (interpreted on CPU; compiled on a GPU)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(TINY, device=dev, dtype=torch.float32, std=0.2)
    ids = ids_of(2, 6, seed=9).to(dev)
    ref = ContiguousKVCache(TINY, batch_size=2, max_len=8, device=dev)
    paged = SimplePagedKVCache(TINY, num_blocks=4, block_size=4, batch_size=2, impl="triton",
                               device=dev)
    a, b = model(ids, cache=ref), model(ids, cache=paged)
    assert max_diff(a, b) <= TOL
    for _ in range(2):
        nxt = a[:, -1:].argmax(-1)
        a, b = model(nxt, cache=ref), model(nxt, cache=paged)
        assert max_diff(a, b) <= TOL
