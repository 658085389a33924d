"""Pipeline parallelism in the engine (chapter 10): LLM(pipeline_parallel_size=P), stage 0 in the
driver and one worker process per later stage, checked token for token (and logprob for
logprob) against the single-process engine under chunked prefill, prefix caching and
preemption (recompute and swap), with 1, 2 and 4 micro-batches per step; a dead stage is a
bounded, clear error; no worker outlives its LLM. No timing assertions: the bubble is measured
by benchmarks/bench_parallel.py."""
import gc
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from test_engine_modes import tiny_model
from test_parallel import MAX_TOKENS, PROMPTS, SMALL, greedy, no_children

from minillm import LLM
from minillm.loader import random_model
from minillm.parallel.pipeline import bubble_fraction
from minillm.parallel.stage import split_micro_batches

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def three_layers():
    """tiny_model's numbers with 3 layers, so that 3 stages hold one layer each."""
    cfg = tiny_model().config.with_(num_layers=3)
    return random_model(cfg, "cpu", torch.float32, seed=3, std=0.3)


def reference(model, **kw):
    llm = LLM((model, None), **kw)
    out = greedy(llm, PROMPTS)
    assert llm.engine.num_preemptions > 0, "the small pool should force preemption"
    return out


def assert_same(got, want):
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1]):
        assert g == pytest.approx(w, abs=1e-4)


def test_split_micro_batches_keeps_order_and_balances_tokens():
    sched = [("a", 8), ("b", 1), ("c", 1), ("d", 6)]
    assert split_micro_batches(sched, 1) == [sched]
    assert split_micro_batches(sched, 2) == [[("a", 8)], [("b", 1), ("c", 1), ("d", 6)]]
    assert split_micro_batches(sched, 4) == [[s] for s in sched]
    assert split_micro_batches(sched, 9) == [[s] for s in sched]      # at most one per request
    assert split_micro_batches([("a", 1), ("b", 1), ("c", 9)], 3) == [[("a", 1)], [("b", 1)],
                                                                       [("c", 9)]]


def test_pp2_equals_one_process_for_1_2_4_micro_batches(model):
    want = reference(model, **SMALL)
    llm = LLM((model, None), pipeline_parallel_size=2, **SMALL)
    try:
        assert len(multiprocessing.active_children()) == 1          # stage 1; stage 0 is here
        ex = llm.engine.executor
        assert ex.num_micro_batches == 2                            # m = p by default
        for m in (1, 2, 4):
            ex.num_micro_batches = m
            llm.reset_prefix_cache()
            ex.timeline.clear()
            stats = ex.comm_stats(reset=True)
            assert_same(greedy(llm, PROMPTS), want)
            # every step: each stage ran every micro-batch once, at most m of them
            steps = list(ex.timeline)
            assert steps and all(sorted({s.stage for s in spans}) == [0, 1] for spans in steps)
            assert max(len(spans) for spans in steps) == 2 * min(m, SMALL["max_num_seqs"])
            assert all(0.0 <= bubble_fraction(spans, 2) < 1.0 for spans in steps)
            # hidden states [T, C] fp32 go 0 -> 1, logits rows [S, V] come back 1 -> 0
            stats = ex.comm_stats()
            C, V = model.config.hidden_size, model.config.vocab_size
            assert stats[0].send_bytes == stats[1].recv_bytes > 0
            assert stats[0].send_bytes % (4 * C) == 0 and stats[0].recv_bytes % (4 * V) == 0
            assert stats[1].send_bytes == stats[0].recv_bytes
        assert llm.engine.num_preemptions > 0
        assert llm.engine.prefix_cache_stats.hits > 0
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in llm.engine.step_stats)
        # each stage's KV pool holds its own layer only
        assert llm.engine.runner.cache.k.shape[0] == 1
    finally:
        llm.shutdown()
    assert no_children()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS[:1], use_tqdm=False)


def test_pp2_with_swap_preemption_copies_blocks_on_every_stage(model):
    kw = dict(SMALL, preemption="swap", num_cpu_blocks=32)
    one = LLM((model, None), **kw)
    want = greedy(one, PROMPTS)
    assert one.engine.scheduler.num_swap_outs > 0
    llm = LLM((model, None), pipeline_parallel_size=2, **kw)
    try:
        assert_same(greedy(llm, PROMPTS), want)
        assert llm.engine.scheduler.num_swap_outs > 0
    finally:
        llm.shutdown()
    assert no_children()


def test_pp3_equals_one_process(three_layers):
    want = reference(three_layers, **SMALL)
    llm = LLM((three_layers, None), pipeline_parallel_size=3, **SMALL)
    try:
        assert len(llm.engine.executor.workers) == 2
        assert_same(greedy(llm, PROMPTS), want)
    finally:
        llm.shutdown()
    assert no_children()


def test_a_stage_that_dies_mid_step_is_a_clear_error_within_bounded_time(three_layers):
    """The middle stage is killed while a long generate runs: the driver may be computing,
    sending or waiting for the last stage's logits (which waits for the dead one)."""
    llm = LLM((three_layers, None), pipeline_parallel_size=3, **SMALL)
    try:
        greedy(llm, PROMPTS[:2])
        middle = llm.engine.executor.workers[0]
        threading.Timer(0.3, os.kill, (middle.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"pipeline worker rank 1 \(pid \d+\) died with "
                                               r"exit code -9"):
            greedy(llm, PROMPTS * 8, max_tokens=60, ignore_eos=True)
        assert time.monotonic() - start < 30
        with pytest.raises(RuntimeError, match="rank 1"):        # and stays failed
            greedy(llm, PROMPTS[:1])
    finally:
        llm.shutdown()
    assert no_children()


def test_refusals_name_what_works(model, three_layers):
    cases = [(dict(pipeline_parallel_size=3), r"between 1 and the 2 layers"),
             (dict(pipeline_parallel_size=2, tensor_parallel_size=2), "use one of them"),
             (dict(pipeline_parallel_size=2, speculative_config={
                 "method": "ngram", "num_speculative_tokens": 2}), "pipeline_parallel_size=1"),
             (dict(pipeline_parallel_size=2, kv_cache_dtype="fp8"), "kv_cache_dtype='auto'"),
             (dict(pipeline_parallel_size=2, quantization="int8"), "pipeline_parallel_size=1"),
             (dict(pipeline_parallel_size=0), "positive integer")]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            LLM((model, None), **kw)
    llm = LLM((model, None), pipeline_parallel_size=2, **SMALL)
    try:
        for bad in (0, 1.5, True):
            with pytest.raises(ValueError, match="num_micro_batches"):
                llm.engine.executor.num_micro_batches = bad
    finally:
        llm.shutdown()
    assert no_children()


def test_del_leaves_no_worker(model):
    llm = LLM((model, None), pipeline_parallel_size=2)
    assert len(multiprocessing.active_children()) == 1
    del llm
    gc.collect()
    assert no_children()


# the bundled model at pp = 2: tests/test_parallel.py::
# test_bundled_model_in_parallel_equals_one_process

assert MAX_TOKENS >= 4      # the comparisons above need a few decode steps per prompt
