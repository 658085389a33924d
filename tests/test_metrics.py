"""minillm.metrics: per-request latencies and run aggregates, checked with an injected clock."""
import numpy as np
import pytest
import torch

from minillm import SamplingParams, configs
from minillm.engine import LLMEngine
from minillm.loader import random_model
from minillm.metrics import RequestMetrics, percentiles, summarize


def made_up(arrival, scheduled, tokens, finished=None, prompt=10, index=0):
    m = RequestMetrics(arrival_time=arrival, num_prompt_tokens=prompt, sample_index=index)
    m.record_scheduled(scheduled)
    m.record_scheduled(scheduled + 100)            # only the first time counts
    for t in tokens:
        m.record_token(t)
    m.finished_time = tokens[-1] if finished is None else finished
    return m


def test_request_metrics():
    m = made_up(arrival=1.0, scheduled=1.5, tokens=[2.0, 2.1, 2.4, 2.5], finished=2.6)
    assert m.ttft == pytest.approx(1.0)
    assert m.queueing_time == pytest.approx(0.5)
    assert m.itl == pytest.approx([0.1, 0.3, 0.1])
    assert m.tpot == pytest.approx(0.5 / 3)
    assert m.e2e_latency == pytest.approx(1.6)
    assert m.num_output_tokens == 4
    assert m.meets(ttft_slo=1.0, tpot_slo=0.2) and not m.meets(ttft_slo=0.9)
    assert not m.meets(tpot_slo=0.1)
    one = made_up(0.0, 0.0, [0.3])
    assert one.tpot is None and one.itl == [] and one.meets(ttft_slo=0.5, tpot_slo=0.01)
    unfinished = RequestMetrics(arrival_time=0.0)
    assert unfinished.ttft is None and unfinished.e2e_latency is None and not unfinished.meets()


def test_summarize_against_numpy():
    ms = [made_up(0.0, 0.0, [0.5, 0.6, 0.7], prompt=10),                 # ttft .5, tpot .1
          made_up(0.0, 0.2, [1.0, 1.5], prompt=20),                      # ttft 1, tpot .5
          made_up(1.0, 1.0, [1.2, 1.3, 1.4, 1.5, 2.0], prompt=30),       # ttft .2, tpot .2
          made_up(1.0, 1.0, [1.2, 1.3, 1.4, 1.5, 2.0], prompt=30, index=1)]  # a 2nd sample
    s = summarize(ms, ttft_slo=0.6, tpot_slo=0.2)
    assert s["duration_s"] == pytest.approx(2.0)
    assert s["input_tokens"] == 60                       # the second sample shares its prompt
    assert s["output_tokens"] == 15
    assert s["output_tokens_per_s"] == pytest.approx(7.5)
    assert s["input_tokens_per_s"] == pytest.approx(30.0)
    assert s["goodput"] == pytest.approx(3 / 2.0)        # requests 0, 2, 3 meet the SLO
    assert s["slo_attainment"] == pytest.approx(0.75)
    ttfts = [0.5, 1.0, 0.2, 0.2]
    for p in (50, 95, 99):
        assert s[f"ttft_p{p}"] == pytest.approx(np.percentile(ttfts, p))
    itls = [x for m in ms for x in m.itl]
    assert s["itl_p99"] == pytest.approx(np.percentile(itls, 99))
    assert s["tpot_mean"] == pytest.approx(np.mean([0.1, 0.5, 0.2, 0.2]))
    assert summarize(ms, duration=4.0)["output_tokens_per_s"] == pytest.approx(3.75)
    assert percentiles([None, 1.0, 3.0])["p50"] == 2.0
    with pytest.raises(ValueError):
        summarize([])
    with pytest.raises(ValueError):
        summarize(ms, duration=0)


@pytest.fixture(scope="module")
def model():
    cfg = configs.get("smollm2-135m").with_(
        name="tiny", num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2,
        num_kv_heads=1, head_dim=16, vocab_size=64, max_position_embeddings=128,
        eos_token_id=None, bos_token_id=None)
    return random_model(cfg, "cpu", torch.float32, seed=0)


def run_with_step_clock(model, requests, **engine_args):
    """requests: [(id, prompt_len, max_tokens)], all arriving at time 0. The injected clock
    reads the step number, so every latency comes out in steps."""
    now = [0]
    engine = LLMEngine(model, None, clock=lambda: now[0], **engine_args)
    for rid, p, m in requests:
        engine.add_request(rid, [1] * p, SamplingParams(temperature=0.0, max_tokens=m))
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
        now[0] += 1
    return {rid: o.metrics for rid, o in outs.items()}


def test_ttft_counts_prefill_chunks_and_queueing(model):
    m = run_with_step_clock(model, [("a", 10, 3), ("b", 2, 2)], num_kv_blocks=64, block_size=4,
                            max_num_seqs=1, max_num_batched_tokens=4)
    a, b = m["a"], m["b"]
    # a: prefill chunks of 4, 4, 2 in steps 0, 1, 2 -> first token at step 2, then one a step
    assert a.queueing_time == 0 and a.ttft == 2 and a.token_times == [2, 3, 4]
    assert a.itl == [1, 1] and a.tpot == 1 and a.e2e_latency == 4
    # b waits for a (max_num_seqs=1): admitted at step 5, prefill + first token in one step
    assert b.queueing_time == 5 and b.ttft == 5 and b.token_times == [5, 6]


@pytest.mark.parametrize("scheduling, c_start", [("continuous", 2), ("static", 10)])
def test_static_batching_blocks_the_head_of_the_line(model, scheduling, c_start):
    """Two slots; a short and a long request run first. Continuous batching gives the short
    one's slot to c as soon as it frees; static batching keeps it idle until the long one ends."""
    m = run_with_step_clock(model, [("a", 4, 2), ("b", 4, 10), ("c", 4, 2)], num_kv_blocks=64,
                            block_size=4, max_num_seqs=2, scheduling=scheduling)
    assert m["a"].token_times == [0, 1] and m["b"].token_times == list(range(10))
    assert m["c"].first_scheduled_time == c_start
    assert m["c"].ttft == c_start
    s = summarize(m.values())
    assert s["output_tokens"] == 14 and s["duration_s"] == max(9, c_start + 1)
