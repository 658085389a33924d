"""Disaggregated prefill/decode (chapter 11): two worker processes on gloo give the colocated
engine's greedy tokens, move exactly the prompt's KV bytes, and leave no process behind, even
when a worker dies."""
import os
import random
import time

import pytest
import torch

from minillm import SamplingParams, configs, kvmath
from minillm.engine import LLM
from minillm.loader import random_model
from minillm.serve.disagg import DisaggregatedLLM, WorkerSpec

CFG = configs.get("smollm2-135m").with_(
    name="tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=512, vocab_size=512)


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def spec(**kw):
    return WorkerSpec(CFG, weights="random", seed=0, engine_kwargs={"block_size": 16, **kw})


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Long enough that requests overlap on the decode worker whatever the two processes' relative
# speed: each decodes for 31 steps while the prefill worker hands off a prompt every <= 3 steps,
# and two long prompts (up to 60 + 32 tokens, 6 blocks each) overflow its 10-block pool.
LONG = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def disagg():
    # prefill chunks prompts (budget 24 tokens); the decode pool is small enough to preempt
    d = DisaggregatedLLM(spec(max_num_batched_tokens=24, max_num_seqs=4, num_kv_blocks=32),
                         spec(num_kv_blocks=10, max_num_seqs=4), timeout=120)
    yield d
    d.close()


def test_disaggregated_greedy_equals_the_colocated_engine_token_for_token(disagg):
    ps = prompts(10)
    model = random_model(CFG, "cpu", torch.float32, seed=0)
    ref = LLM((model, None), num_kv_blocks=64, block_size=16).generate(ps, LONG,
                                                                       use_tqdm=False)
    outs = disagg.generate(ps, LONG)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert all(o.finish_reason == "length" for o in outs)
    per_token = kvmath.kv_bytes_per_token(CFG, dtype="float32")
    assert [o.kv_bytes for o in outs] == [per_token * len(p) for p in ps]   # chapter 01's formula
    assert all(o.ttft is not None and len(o.itl) == 31 for o in outs)
    # the decode engine computed no prompt token: all came from the transfer (or its own prefix
    # cache), and it preempted and recomputed some requests on its small pool
    assert [o.decode_cached_tokens for o in outs] == [len(p) for p in ps]
    assert sum(o.decode_preemptions for o in outs) > 0


def test_one_token_requests_never_leave_the_prefill_worker(disagg):
    outs = disagg.generate(prompts(2, seed=1), SamplingParams(temperature=0.0, max_tokens=1))
    assert [len(o.token_ids) for o in outs] == [1, 1] and all(o.kv_bytes == 0 for o in outs)


def test_a_worker_that_dies_is_an_error_not_a_hang_and_nothing_is_left():
    d = DisaggregatedLLM(spec(), spec(), timeout=60)
    pids = [p.pid for p in d.procs.values()]
    os.kill(d.procs["decode"].pid, 9)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="decode worker .* died"):
        d.generate(prompts(2), GREEDY)
    assert time.monotonic() - t < 30
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(ValueError, match="closed"):
        d.submit("x", [1, 2, 3], GREEDY)
