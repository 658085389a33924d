"""minillm.lab.step_trace: the step recorder (run_trace, describe) and the model-free
replay_schedule.

The recorder must report what the engine did, not what it expects: its per-step token counts are
checked against the engine's own StepStats, preemption victims against a run forced to preempt,
and replay_schedule against the engine's schedule on the same trace.
"""
import pytest
import torch

from minillm import SamplingParams, configs
from minillm.engine import LLMEngine
from minillm.lab.step_trace import describe, replay_schedule, run_trace
from minillm.loader import random_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    cfg = configs.get("smollm2-135m").with_(
        name="tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
        eos_token_id=None, bos_token_id=None)
    return random_model(cfg, "cpu", torch.float32, seed=0, std=0.3)


NO_PREFIX_CACHE = dict(enable_prefix_caching=False)   # count only tokens the model computes
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15], [16] * 9]
MAX_TOKENS = [5, 12, 3, 8, 6]
ARRIVE = [0, 0, 2, 3, 3]


def test_run_trace_records_what_the_engine_did(model):
    run = run_trace(model, "continuous", PROMPTS, MAX_TOKENS, ARRIVE, block_size=4,
                    num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=64, **NO_PREFIX_CACHE)
    busy = [rec for rec in run.steps if rec["scheduled"]]
    # the engine's own per-step counts, one for one
    assert [rec["tokens"] for rec in busy] == [s.num_batched_tokens for s in run.engine.step_stats]
    # every prompt token once, every output token but the last once: nothing lost, nothing extra
    assert (sum(rec["tokens"] for rec in busy)
            == sum(len(p) + m - 1 for p, m in zip(PROMPTS, MAX_TOKENS)))
    assert all(len(rec["scheduled"]) <= 2 for rec in run.steps)
    assert sorted(run.outputs) == [f"r{i}" for i in range(len(PROMPTS))]
    assert all(len(run.outputs[f"r{i}"].token_ids) == m for i, m in enumerate(MAX_TOKENS))
    assert run.arrival == {f"r{i}": a for i, a in enumerate(ARRIVE)}
    # a prefill is recorded in the step each request is first scheduled
    for i in range(len(PROMPTS)):
        first = next(rec for rec in run.steps if f"r{i}" in rec["scheduled"])
        assert f"r{i}" in first["prefill"] and first["scheduled"][f"r{i}"] == len(PROMPTS[i])
    # requests arriving later were not added early
    assert "r2" not in run.steps[1]["scheduled"] and "r2" not in run.steps[1]["waiting"]


def test_run_trace_records_preemption_victims(model):
    for mode in ("recompute", "swap"):
        run = run_trace(model, mode, PROMPTS, [30] * 5, [0] * 5, block_size=4, num_kv_blocks=12,
                        max_num_seqs=4, max_num_batched_tokens=64, preemption=mode,
                        **NO_PREFIX_CACHE)
        victims = [v for rec in run.steps for v in rec["preempted"]]
        assert len(victims) == run.engine.num_preemptions > 0
        for rec in run.steps:
            if rec["preempted"]:       # the newest running requests, never the oldest
                assert set(rec["preempted"]) == set(rec["running_before"][-len(rec["preempted"]):])
        if mode == "swap":
            out = sum(n for rec in run.steps for n in rec["swapped_out"].values())
            back = sum(n for rec in run.steps for n in rec["swapped_in"].values())
            assert out == back > 0


def test_run_trace_rejects_mismatched_inputs_and_unfinished_runs(model):
    with pytest.raises(ValueError, match="same length"):
        run_trace(model, "x", PROMPTS, MAX_TOKENS[:2], ARRIVE)
    with pytest.raises(RuntimeError, match="not finished after 3 steps"):
        run_trace(model, "x", PROMPTS, MAX_TOKENS, ARRIVE, max_steps=3, block_size=4,
                  num_kv_blocks=64)


def test_describe_reads_the_record_and_uses_singulars(model):
    run = run_trace(model, "one", [[1, 2, 3]], [3], [0], block_size=4, num_kv_blocks=8,
                    **NO_PREFIX_CACHE)
    text = describe(run, 1)                       # one decode token for one sequence
    assert "scheduled: 1 token for 1 sequence: r0 +1" in text
    assert "free KV blocks" in text and "/8" in text
    assert "scheduled: 3 tokens for 1 sequence: r0 +3 prefill" in describe(run, 0)
    with pytest.raises(ValueError, match="steps 0.."):
        describe(run, len(run.steps))


def test_replay_schedules_like_the_engine(model):
    trace = [(a, f"r{i}", len(p), m)
             for i, (a, p, m) in enumerate(zip(ARRIVE, PROMPTS, MAX_TOKENS))]
    for budget, chunked in ((4, True), (64, False)):
        engine = LLMEngine(model, block_size=16, num_kv_blocks=64, max_num_seqs=4,
                           max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                           **NO_PREFIX_CACHE)
        pending, step = sorted(trace), 0
        while pending or engine.has_unfinished():
            while pending and pending[0][0] <= step:
                _, rid, n, m = pending.pop(0)
                i = int(rid[1:])
                engine.add_request(rid, PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=m,
                                                                   ignore_eos=True))
            engine.step()
            step += 1
        requests, steps = replay_schedule(trace, budget, chunked, lambda scheduled: 1.0,
                                          max_num_seqs=4, num_blocks=64)
        assert steps == [(s.num_batched_tokens, s.num_prefill_tokens) for s in engine.step_stats]
        assert all(r.num_output_tokens == r.params.max_tokens for r in requests)


def test_replay_reports_a_request_that_can_never_run():
    with pytest.raises(RuntimeError, match="cannot fit"):
        replay_schedule([(0.0, "big", 100, 1)], budget=16, chunked=True, step_time=lambda s: 1.0,
                        max_num_seqs=4, num_blocks=4)      # 100 tokens need 7 blocks of 16
