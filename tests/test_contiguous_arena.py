"""The contiguous KV arena of chapter 02 (minillm.lab.arena, beside the real ContiguousKVCache):
slabs, first/best fit, fragmentation, the simulation (minillm.lab.memory_sim)."""
import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from minillm import kvmath                                           # noqa: E402
from minillm.cache.contiguous import ContiguousKVCache              # noqa: E402
from minillm.configs import get                                      # noqa: E402
from minillm.lab.arena import ContiguousArena                        # noqa: E402
from minillm.lab.memory_sim import plot_memory_map, simulate_arena   # noqa: E402
from minillm.lab.workloads import WorkloadRequest, make_workload     # noqa: E402
from minillm.loader import random_model                              # noqa: E402

TINY = get("smollm2-135m").with_(name="tiny", num_layers=2, num_heads=4, num_kv_heads=2,
                                 head_dim=16, hidden_size=64, intermediate_size=128, vocab_size=128,
                                 max_position_embeddings=256)


def holey_arena(policy):
    """Holes [0, 20) and [30, 40) between two live slabs."""
    arena = ContiguousArena(100, policy=policy)
    for rid, n in enumerate([20, 10, 10, 60]):
        arena.allocate(rid, n)
    arena.free(0)
    arena.free(2)
    return arena


def test_first_fit_and_best_fit_pick_different_holes():
    assert holey_arena("first_fit").allocate("x", 10).start == 0     # lowest address
    assert holey_arena("best_fit").allocate("x", 10).start == 30     # tightest hole
    assert holey_arena("best_fit").allocate("y", 15).start == 0      # only hole that fits


def test_external_fragmentation_and_refusals():
    arena = holey_arena("first_fit")
    assert arena.free_extents() == [(0, 20), (30, 10)]
    assert arena.free_tokens == 30 and arena.largest_free_extent == 20
    assert arena.external_fragmentation == pytest.approx(1 - 20 / 30)
    assert arena.allocate("a", 25) is None                           # 30 free, no hole of 25
    assert (arena.num_refused, arena.num_refused_fragmented) == (1, 1)
    assert arena.allocate("b", 35) is None                           # simply not enough space
    assert (arena.num_refused, arena.num_refused_fragmented) == (2, 1)
    arena.free(1)                                                    # holes merge: [0, 40)
    assert arena.free_extents() == [(0, 40)] and arena.external_fragmentation == 0
    assert arena.allocate("a", 40).start == 0


def test_internal_fragmentation_and_bytes():
    arena = ContiguousArena.from_config(TINY, capacity_tokens=64)
    assert arena.bytes_per_token == kvmath.kv_bytes_per_token(TINY, "float32")
    assert arena.nbytes == 64 * arena.bytes_per_token
    a, b = arena.allocate("a", 10), arena.allocate("b", 30)
    a.write(3)
    b.write(30)
    s = arena.stats()
    assert (s["reserved_tokens"], s["used_tokens"], s["free_tokens"]) == (40, 33, 24)
    assert s["internal_fragmentation"] == pytest.approx(7 / 40)
    assert s["reserved_bytes"] == 40 * arena.bytes_per_token
    assert s["used_bytes"] == 33 * arena.bytes_per_token


def test_slab_writes_land_in_the_arena_tensor():
    arena = ContiguousArena(50, num_layers=2, num_kv_heads=1, head_dim=2)
    arena.allocate("a", 10)
    b = arena.allocate("b", 20)
    b.write(4, value=7.0)
    assert (arena.k[:, 10:14] == 7).all() and (arena.v[:, 10:14] == 7).all()
    assert (arena.k[:, :10] == 0).all() and (arena.k[:, 14:] == 0).all()


def test_bad_input():
    arena = ContiguousArena(20)
    s = arena.allocate(1, 5)
    with pytest.raises(ValueError, match="already holds a slab"):
        arena.allocate(1, 5)
    with pytest.raises(ValueError, match="capacity"):
        arena.allocate(2, 21)
    with pytest.raises(ValueError, match="reserve a larger max_len"):
        s.write(6)
    arena.free(1)
    with pytest.raises(ValueError, match="freed twice"):
        arena.free(1)
    with pytest.raises(ValueError, match="policy"):
        ContiguousArena(20, policy="worst_fit")


@torch.no_grad()
def test_model_runs_on_a_slab_like_on_the_contiguous_cache():
    model = random_model(TINY, device="cpu", dtype=torch.float32, std=0.2)
    arena = ContiguousArena.from_config(TINY, capacity_tokens=80)
    other = arena.allocate("other", 30)                              # a neighbour below ours
    other.write(30, value=3.0)
    slab = arena.allocate("me", 40)
    ref = ContiguousKVCache(TINY, batch_size=1, max_len=40)
    ids = torch.randint(0, TINY.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    a, b = model(ids, cache=ref), model(ids, cache=slab)
    for _ in range(4):
        assert (a - b).abs().max().item() <= 1e-5
        nxt = a[:, -1:].argmax(-1)
        assert torch.equal(nxt, b[:, -1:].argmax(-1))
        a, b = model(nxt, cache=ref), model(nxt, cache=slab)
    assert slab.seq_len == 13
    assert torch.equal(arena.k[:, 30:43], ref.k[:, 0, :13])         # our K sits at our addresses
    assert (arena.k[:, :30] == 3).all()                             # the neighbour is untouched
    with pytest.raises(ValueError, match="from_config"):
        model(ids, cache=ContiguousArena(50).allocate(0, 20))        # wrong geometry


def check_trace(trace, requests, capacity):
    by_id = {r.id: r for r in requests}
    for s in trace.steps:
        assert s["reserved_tokens"] + s["free_tokens"] == capacity
        assert 0 <= s["used_tokens"] <= s["reserved_tokens"]
        assert s["largest_free_extent"] <= s["free_tokens"]
    assert trace.summary()["finished"] == len(requests)
    for rid, info in trace.requests.items():
        r = by_id[rid]
        # admitted, then output_len decode steps, then freed
        assert info["finish_step"] - info["admit_step"] == r.output_len
        assert info["admit_step"] * 0.05 >= r.arrival_time - 1e-9


def test_simulation_reproduces_the_reservation_waste():
    w = make_workload("sharegpt", 120, seed=0, rate=50.0, reserve="context")
    arena = ContiguousArena(8 * 2048)
    trace = simulate_arena(w.requests, arena, map_every=20)
    check_trace(trace, w.requests, arena.capacity)
    summ = trace.summary()
    expected = 1 - sum(r.total_len for r in w) / sum(r.max_len_reserved for r in w)
    assert summ["wasted_fraction"] == pytest.approx(expected)
    assert 0.6 < summ["wasted_fraction"] < 0.85                      # the paper's 60-80% waste
    assert summ["peak_concurrency"] == 8                              # capacity / 2048
    assert not arena.slabs                                            # everything freed


def test_variable_slabs_fragment_the_arena():
    w = make_workload("sharegpt", 150, seed=0, rate=50.0, reserve="max_tokens", max_tokens=512)
    for policy in ("first_fit", "best_fit"):
        arena = ContiguousArena(6000, policy=policy)
        trace = simulate_arena(w.requests, arena, map_every=50)
        check_trace(trace, w.requests, arena.capacity)
        s = trace.summary()
        assert s["requests_blocked_by_fragmentation"] > 0
        assert s["num_refused_fragmented"] > 0
        assert max(st["external_fragmentation"] for st in trace.steps) > 0.3


def test_simulation_rejects_requests_that_can_never_fit():
    reqs = [WorkloadRequest(id=0, prompt_len=10, output_len=10, arrival_time=0.0,
                            max_len_reserved=300)]
    with pytest.raises(ValueError, match="make the arena larger"):
        simulate_arena(reqs, ContiguousArena(200))


def test_memory_map_plot():
    w = make_workload("alpaca", 30, seed=0, rate=100.0, reserve="oracle")
    trace = simulate_arena(w.requests, ContiguousArena(600), map_every=2, map_bins=100)
    ax = plot_memory_map(trace)
    img = ax.get_images()[0].get_array()
    assert img.shape == (100, len(trace.maps), 3)
    assert (img == 1.0).all(axis=-1).any()                           # some free (white) space
