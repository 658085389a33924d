"""The engine's scheduling modes against sequential generation, on a tiny random model (fast).

Every mode must reproduce `minillm.generate` (one request at a time, contiguous cache) token for
token under greedy decoding: the scheduler may reorder, chunk, preempt and swap work, but it must
never change what each request computes. Randomised configurations then check the invariants:
every request finishes, no block leaks, the token budget and max_num_seqs hold in every step,
admission is FCFS, victims are the newest running requests, nobody starves.
The bundled-model versions of the same checks are in test_engine.py.
"""
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import minillm
from minillm import SamplingParams, configs
from minillm.cache.blocks import BlockManager, BlockPool
from minillm.engine import LLMEngine
from minillm.engine.request import Request, RequestStatus
from minillm.engine.scheduler import Scheduler
from minillm.loader import random_model

VOCAB = 256


# small engine steps: single-threaded (see conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed=0):
    """2 layers, GQA 4/2. Weights with std 0.3 (not the usual 0.02): with tiny weights every
    attention is uniform and the output barely depends on the KV cache, so a corrupted block
    would go unnoticed. `test_tiny_model_depends_on_its_context` checks that it does."""
    cfg = configs.get("smollm2-135m").with_(
        name="tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=128,
        eos_token_id=None, bos_token_id=None)
    return random_model(cfg, "cpu", torch.float32, seed=seed, std=0.3)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def make_workload(n, seed, max_prompt=40, max_out=20):
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))] for _ in range(n)]
    max_tokens = [rng.randint(1, max_out) for _ in range(n)]
    return prompts, max_tokens


def sequential(model, prompts, max_tokens):
    return [minillm.generate(model, None, p, max_new_tokens=m,
                             sampling=SamplingParams(temperature=0.0, max_tokens=m))
            for p, m in zip(prompts, max_tokens)]


@pytest.fixture(scope="module")
def workload(model):
    prompts, max_tokens = make_workload(32, seed=1)
    return prompts, max_tokens, sequential(model, prompts, max_tokens)


def run_engine(engine, prompts, max_tokens, arrive_at=None, params=None, max_steps=10_000):
    """Drive engine.step() to the end; requests arrive at the given step numbers (default 0).
    params: one SamplingParams per request (default greedy with max_tokens).
    Returns ({request_id: RequestOutput}, steps)."""
    arrive_at = arrive_at or [0] * len(prompts)
    params = params or [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    order = sorted(range(len(prompts)), key=lambda i: arrive_at[i])
    outs, step, k = {}, 0, 0
    while k < len(order) or engine.has_unfinished():
        while k < len(order) and arrive_at[order[k]] <= step:
            i = order[k]
            engine.add_request(str(i), prompts[i], params[i])
            k += 1
        for out in engine.step():
            outs[out.request_id] = out
        check_request_state(engine)
        step += 1
        assert step < max_steps, "the engine did not finish: a request starves or livelocks"
    return outs, step


def check_request_state(engine):
    """Each live request holds its KV record (req.kv) exactly while the manager indexes it under
    its seq_id: one record, two views, never out of step (running, swapped, preempted, finished)."""
    bm = engine.block_manager
    live = [r for group in engine.groups.values() for r in group]
    for req in live:
        if bm.has(req.seq_id):
            assert req.kv is bm.kv(req.seq_id), f"{req} holds another record than the manager's"
        else:
            assert req.kv is None, f"{req} still holds a record the manager dropped"
    assert set(bm.seqs) <= {r.seq_id for r in live}, "the manager holds blocks of no live request"


def check_invariants(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == engine.num_kv_blocks, "KV blocks leaked"
    assert not bm.tables, f"block tables left behind: {list(bm.tables)}"
    if engine.cpu_pool is not None:
        assert engine.cpu_pool.num_free_blocks == engine.cpu_pool.num_blocks, "CPU blocks leaked"
    s = engine.scheduler
    for st_ in engine.step_stats:
        assert st_.num_batched_tokens <= s.max_num_batched_tokens
        assert st_.num_seqs <= s.max_num_seqs


def test_tiny_model_depends_on_its_context(model, workload):
    """Changing the FIRST prompt token must change most greedy outputs, or the equality tests
    below could not see a wrong block, a stale copy or a skipped swap-in."""
    prompts, max_tokens, expected = workload
    edited = [[(p[0] + 1) % VOCAB] + p[1:] for p in prompts]
    changed = sum(a != b for a, b in zip(sequential(model, edited, max_tokens), expected))
    assert changed >= 0.75 * len(prompts)


MODES = {
    "continuous": dict(),
    "static": dict(scheduling="static", max_num_seqs=6),
    "chunked_small_budget": dict(max_num_batched_tokens=12, max_num_seqs=8),
    "no_chunking": dict(enable_chunked_prefill=False, max_num_batched_tokens=48),
    "recompute_tiny_pool": dict(num_kv_blocks=16, block_size=4),
    "swap_tiny_pool": dict(num_kv_blocks=16, block_size=4, preemption="swap"),
    "swap_small_cpu_pool_static": dict(num_kv_blocks=16, block_size=4, preemption="swap",
                                       num_cpu_blocks=5, scheduling="static", max_num_seqs=8),
    "block_size_1_chunked_preempt": dict(num_kv_blocks=60, block_size=1,
                                         max_num_batched_tokens=16),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_matches_sequential_greedy(model, workload, mode):
    prompts, max_tokens, expected = workload
    kw = dict(num_kv_blocks=400, block_size=4, max_num_seqs=16, max_num_batched_tokens=64)
    kw.update(MODES[mode])
    engine = LLMEngine(model, None, **kw)
    outs, _ = run_engine(engine, prompts, max_tokens)
    for i, ref in enumerate(expected):
        o = outs[str(i)]
        assert o.token_ids == ref, f"{mode}: request {i} differs from sequential generation"
        assert o.finish_reason == "length"
    check_invariants(engine)
    if "tiny_pool" in mode or "preempt" in mode:
        assert engine.num_preemptions > 0, "the tiny pool was meant to force preemption"
    if mode.startswith("swap"):
        assert engine.scheduler.num_swap_outs > 0
    if mode == "chunked_small_budget":   # some step chunked two or more prompts together
        assert any(s.num_prefill_seqs >= 2 for s in engine.step_stats)
        assert any(s.num_prefill_seqs and s.num_decode_tokens for s in engine.step_stats)


def test_randomised_configs(model):
    """Seeded random pool sizes, block sizes, budgets, modes and arrival times."""
    rng = random.Random(1234)
    for trial in range(12):
        prompts, max_tokens = make_workload(rng.randint(1, 12), seed=100 + trial,
                                            max_prompt=30, max_out=12)
        block_size = rng.choice([1, 2, 4, 8, 16])
        biggest = max(-(-(len(p) + m - 1) // block_size) for p, m in zip(prompts, max_tokens))
        num_kv_blocks = biggest + rng.randint(0, 2 * biggest)
        max_num_seqs = rng.randint(1, 8)
        kw = dict(block_size=block_size, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=rng.randint(max_num_seqs, 48),
                  enable_chunked_prefill=rng.random() < 0.8,
                  scheduling=rng.choice(["continuous", "static"]),
                  preemption=rng.choice(["recompute", "swap"]))
        if not kw["enable_chunked_prefill"]:
            kw["max_num_batched_tokens"] = max(kw["max_num_batched_tokens"],
                                               max(len(p) for p in prompts))
        if kw["preemption"] == "swap":
            kw["num_cpu_blocks"] = rng.randint(1, num_kv_blocks)
        arrive_at = [rng.randint(0, 20) for _ in prompts]
        ns = [min(rng.choice([1, 1, 2, 3]), max_num_seqs) for _ in prompts]
        params = [SamplingParams(temperature=0.0, max_tokens=m, n=n)
                  for m, n in zip(max_tokens, ns)]
        engine = LLMEngine(model, None, **kw)
        outs, steps = run_engine(engine, prompts, max_tokens, arrive_at, params)
        expected = sequential(model, prompts, max_tokens)
        for i, ref in enumerate(expected):
            samples = outs[str(i)].outputs
            assert len(samples) == ns[i]
            for c in samples:       # greedy: every sample is the sequential answer
                assert c.token_ids == ref, f"trial {trial} {kw}: request {i} differs"
        check_invariants(engine)


@pytest.mark.parametrize("kw", [dict(num_kv_blocks=14, block_size=4, preemption="recompute"),
                                dict(num_kv_blocks=14, block_size=4, preemption="swap"),
                                dict(num_kv_blocks=14, block_size=4, preemption="swap",
                                     max_num_batched_tokens=9)])
def test_sampled_forks_survive_preemption(model, kw):
    """n = 3 seeded samples per prompt share the prompt's blocks (fork, copy-on-write). Under a
    pool so small that forks get preempted, swapped and copied, each sample must still draw
    exactly what it draws with plenty of memory: any corrupted block would change the logits."""
    prompts, max_tokens = make_workload(6, seed=7, max_prompt=14, max_out=12)
    params = [SamplingParams(temperature=1.0, max_tokens=m, n=3, seed=10 * i)
              for i, m in enumerate(max_tokens)]
    roomy = LLMEngine(model, None, num_kv_blocks=400, block_size=4)
    expected, _ = run_engine(roomy, prompts, max_tokens, params=params)
    tight = LLMEngine(model, None, max_num_seqs=9, **kw)
    got, _ = run_engine(tight, prompts, max_tokens, params=params)
    assert tight.num_preemptions > 0
    for i in range(len(prompts)):
        a = [c.token_ids for c in expected[str(i)].outputs]
        b = [c.token_ids for c in got[str(i)].outputs]
        assert a == b, f"request {i}: samples changed under preemption"
        assert len({tuple(x) for x in a}) > 1, "seeded samples should differ from each other"
    check_invariants(tight)


# --- the scheduler alone, driven by hypothesis (no model: tokens are made up) ---------------

@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_scheduler_invariants(data):
    block_size = data.draw(st.sampled_from([1, 2, 4, 8]))
    lengths = data.draw(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 15),
                                           st.integers(0, 30)), min_size=1, max_size=12))
    biggest = max(-(-(p + m - 1) // block_size) for p, m, _ in lengths)
    num_blocks = biggest + data.draw(st.integers(0, 2 * biggest))
    max_num_seqs = data.draw(st.integers(1, 6))
    budget = data.draw(st.integers(max_num_seqs, 64))
    chunked = data.draw(st.booleans())
    if not chunked:
        budget = max(budget, max(p for p, _, _ in lengths))
    scheduling = data.draw(st.sampled_from(["continuous", "static"]))
    preemption = data.draw(st.sampled_from(["recompute", "swap"]))
    bm = BlockManager(num_blocks, block_size)
    cpu_pool = BlockPool(data.draw(st.integers(1, num_blocks)), block_size)
    step = [0]
    sched = Scheduler(bm, max_num_seqs, budget, chunked, scheduling, preemption,
                      cpu_pool=cpu_pool, clock=lambda: step[0])
    reqs = [Request(i, str(i), [7] * p, SamplingParams(temperature=0.0, max_tokens=m),
                    arrival_time=a, arrival_order=i) for i, (p, m, a) in enumerate(
                        sorted(lengths, key=lambda x: x[2]))]
    pending = list(reqs)
    bound = 50 * sum(p + m for p, m, _ in lengths) + 100
    static_batches = []
    while pending or sched.has_unfinished():
        while pending and pending[0].metrics.arrival_time <= step[0]:
            sched.add(pending.pop(0))
        running_before = {r.seq_id for r in sched.running}
        out = sched.schedule()
        assert out.num_batched_tokens <= budget
        assert sched.num_running_slots <= max_num_seqs
        ids = [r.seq_id for r, _ in out.scheduled]
        assert len(ids) == len(set(ids))
        for r, n in out.scheduled:
            assert r.status == RequestStatus.RUNNING and r not in out.preempted
            assert 1 <= n <= r.num_uncomputed_tokens
            assert bm.num_tokens(r.seq_id) == r.num_computed_tokens + n
            if not chunked and r.num_output_tokens == 0:
                assert n == r.num_uncomputed_tokens, "chunked prefill is off"
        for v in out.preempted:       # victims are newer than everyone still running
            assert all(r.sort_key < v.sort_key for r in sched.running)
            assert not bm.has(v.seq_id)
        if out.preempted:
            assert all(r.seq_id in running_before for r, _ in out.scheduled), \
                "nobody is admitted in a step that preempted"
        if scheduling == "static" and out.scheduled:
            batch = frozenset(sched.static_batch)
            if not static_batches or static_batches[-1] != batch:
                static_batches.append(batch)
            assert all(r.request_id in batch for r, _ in out.scheduled)
        for r, n in out.scheduled:
            r.num_computed_tokens += n
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(3)
                if r.num_output_tokens >= r.params.max_tokens:
                    sched.finish(r, "length")
                    r.metrics.finished_time = step[0]
        step[0] += 1
        assert step[0] < bound, "a request starves"
        if not out.scheduled:
            assert pending, "nothing scheduled although requests wait"
    assert bm.num_free_blocks == num_blocks and not bm.tables
    assert cpu_pool.num_free_blocks == cpu_pool.num_blocks
    assert all(r.finish_reason == "length" for r in reqs)
    # FCFS: first admissions happen in arrival order
    firsts = [r.metrics.first_scheduled_time for r in reqs]
    assert firsts == sorted(firsts)
    if scheduling == "static":    # batches are disjoint: nobody joins a running batch
        for a, b in zip(static_batches, static_batches[1:]):
            assert not (a & b)


def test_preempting_an_already_scheduled_fork_swaps_the_right_blocks():
    """Decodes are scheduled before prefill chunks, so an older request's chunk can preempt
    newer requests that were already planned in this step. One of them planned a copy-on-write
    that has not run: its swap-out must read the shared source block, not the empty copy."""
    bm, cpu = BlockManager(4, 4), BlockPool(8, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, preemption="swap",
                      cpu_pool=cpu)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    old = Request(0, "old", list(range(12)), greedy, arrival_time=0.0, arrival_order=0)
    parent = Request(1, "new", list(range(6)), greedy, arrival_time=1.0, arrival_order=1)
    bm.allocate(old.seq_id, 4)                 # old: 4 of 12 prompt tokens computed, 1 block
    old.num_computed_tokens = 4
    bm.allocate(parent.seq_id, 6)              # parent: prompt of 6 computed, 2 blocks
    parent.num_computed_tokens = 6
    parent.output_token_ids = [9]
    child = Request(2, "new", list(range(6)), greedy, 1.0, 1, sample_index=1)
    child.num_computed_tokens, child.output_token_ids = 6, [9]
    bm.fork(parent.seq_id, child.seq_id)       # shares both blocks; 1 block left free
    shared = bm.block_table(parent.seq_id)
    for r in (old, parent, child):
        sched.add_running(r)
    out = sched.schedule()
    # parent planned a copy of its shared last block, then both forks were preempted for `old`
    assert [r for r, _ in out.scheduled] == [old] and not out.copies.get(parent.seq_id)
    assert out.preempted == [child, parent]
    assert parent.status == child.status == RequestStatus.SWAPPED
    swapped_from = [g for g, _ in out.blocks_to_swap_out]
    assert swapped_from == shared + shared, "swap-out must read the blocks that hold the KV"
    assert out.num_batched_tokens == 8 and bm.num_tokens(old.seq_id) == 12


def test_running_decodes_are_served_before_prefill_chunks():
    """With 4 tokens of budget, an older request halfway through its prompt and a newer one that
    is decoding: the decode gets its token first, the prompt chunk takes the remaining 3."""
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    old = Request(0, "old", list(range(20)), greedy, arrival_time=0.0, arrival_order=0)
    new = Request(1, "new", list(range(5)), greedy, arrival_time=1.0, arrival_order=1)
    bm.allocate(old.seq_id, 8)
    old.num_computed_tokens = 8
    bm.allocate(new.seq_id, 5)
    new.num_computed_tokens, new.output_token_ids = 5, [1]
    for r in (old, new):
        sched.add_running(r)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("new", 1), ("old", 3)]
