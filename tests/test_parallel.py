"""Tensor parallelism in the engine (chapter 10): LLM(tensor_parallel_size=N) with worker
processes over gloo, checked token for token against the single-process engine and sequential
generation, under chunked prefill, prefix caching and preemption; clean shutdown; a dead
worker is a bounded, clear error. Each test stops every process it started.
"""
import gc
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from test_engine_modes import VOCAB, sequential, tiny_model

from minillm import LLM, SamplingParams
from minillm.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

# 16 prompts, four of them sharing a 12-token prefix (prefix caching hits)
_rng = random.Random(5)
_shared = [_rng.randrange(VOCAB) for _ in range(12)]
PROMPTS = ([_shared + [_rng.randrange(VOCAB) for _ in range(3)] for _ in range(4)]
           + [[_rng.randrange(VOCAB) for _ in range(_rng.randint(3, 20))] for _ in range(12)])
MAX_TOKENS = 6
# chunked prefill (8-token budget), a pool too small for all 16 at once (preemption)
SMALL = dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=8, max_num_seqs=8)


def no_children():
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return multiprocessing.active_children() == []


def greedy(llm, prompts, max_tokens=MAX_TOKENS, ignore_eos=False):
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                logprobs=0, ignore_eos=ignore_eos),
                        use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return ([o.outputs[0].token_ids for o in outs],
            [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
             for o in outs])


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def reference(model):
    llm = LLM((model, None), **SMALL)
    tokens, logprobs = greedy(llm, PROMPTS)
    assert tokens == sequential(model, PROMPTS, [MAX_TOKENS] * len(PROMPTS))
    assert llm.engine.num_preemptions > 0, "the small pool should force preemption"
    return tokens, logprobs


def test_tp2_equals_one_process_token_for_token(model, reference):
    llm = LLM((model, None), tensor_parallel_size=2, **SMALL)
    try:
        assert len(multiprocessing.active_children()) == 1          # rank 1; rank 0 is here
        tokens, logprobs = greedy(llm, PROMPTS)
        assert tokens == reference[0]
        for got, want in zip(logprobs, reference[1]):
            assert got == pytest.approx(want, abs=1e-4)
        assert llm.engine.num_preemptions > 0
        assert llm.engine.prefix_cache_stats.hits > 0
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in llm.engine.step_stats)
        # every rank counted two all-reduces per layer per forward, of [tokens, hidden] fp32
        stats = llm.engine.executor.comm_stats()
        cfg = model.config
        assert len(stats) == 2 and stats[0].all_reduce_bytes == stats[1].all_reduce_bytes > 0
        assert stats[0].all_reduce_calls % (2 * cfg.num_layers) == 0
        assert stats[0].all_reduce_bytes % (2 * cfg.num_layers * cfg.hidden_size * 4) == 0
    finally:
        llm.shutdown()
    assert no_children()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS[:1], use_tqdm=False)


def test_tp_that_does_not_divide_the_heads_is_a_value_error(model):
    with pytest.raises(ValueError, match=r"sizes that work: \[1, 2, 4\]"):
        LLM((model, None), tensor_parallel_size=3)
    for kw in (dict(tensor_parallel_size=0),
               dict(tensor_parallel_size=2, pipeline_parallel_size=2),
               dict(tensor_parallel_size=2, speculative_config={"method": "ngram",
                                                                "num_speculative_tokens": 2})):
        with pytest.raises(ValueError):
            LLM((model, None), **kw)
    assert no_children()


def test_a_dead_worker_is_a_clear_error_within_bounded_time(model):
    llm = LLM((model, None), tensor_parallel_size=2, **SMALL)
    try:
        greedy(llm, PROMPTS[:2])
        (worker,) = llm.engine.executor.workers
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) died with exit code -9"):
            greedy(llm, PROMPTS)
        assert time.monotonic() - start < 30
        with pytest.raises(RuntimeError, match="rank 1"):       # and stays failed
            greedy(llm, PROMPTS[:1])
    finally:
        llm.shutdown()
    assert no_children()


def test_del_and_interpreter_exit_leave_no_worker(model):
    llm = LLM((model, None), tensor_parallel_size=2, **SMALL)
    assert len(multiprocessing.active_children()) == 1
    del llm
    gc.collect()
    assert no_children()
    # a script that never calls shutdown(): its workers must be gone when it has exited
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        from test_engine_modes import tiny_model
        from minillm import LLM
        if __name__ == "__main__":
            llm = LLM((tiny_model(), None), tensor_parallel_size=2)
            print(*[p.pid for p in llm.engine.executor.workers], flush=True)
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__)],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    (pid,) = map(int, done.stdout.split())
    deadline = time.monotonic() + 10
    while _exists(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _exists(pid), f"worker {pid} outlived its interpreter"


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                                  # a zombie is dead: read its state
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=3),
                                      dict(pipeline_parallel_size=2)], ids=["tp3", "pp2"])
def test_bundled_model_in_parallel_equals_one_process(parallel):
    """The bundled model (9 query / 3 KV heads, 30 layers): tp = 3 holds 3 query heads and 1 KV
    head per rank; pp = 2 holds 15 layers per stage. 16 short prompts, chunked prefill,
    preemption from a small pool (EOS ignored, so every sequence grows and the pool runs
    short)."""
    model, tok = load_model()
    prompts = [f"Question {i}: what is {i} plus {i + 1}?" for i in range(16)]
    kw = dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=32, max_num_seqs=16)
    one = LLM((model, tok), **kw)
    want = greedy(one, prompts, 8, ignore_eos=True)
    assert one.engine.num_preemptions > 0
    llm = LLM((model, tok), **parallel, **kw)
    try:
        got = greedy(llm, prompts, 8, ignore_eos=True)
        assert llm.engine.num_preemptions > 0
    finally:
        llm.shutdown()
    assert no_children()
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1]):
        assert g == pytest.approx(w, abs=1e-3)
