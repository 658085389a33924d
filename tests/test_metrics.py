"""minillm.metrics: per-request latencies and run aggregates, checked with an injected clock."""
import numpy as np
import pytest
import torch

from minillm import SamplingParams, configs
from minillm.engine import LLMEngine
from minillm.loader import random_model
from minillm.metrics import (RequestMetrics, meets_slos, percentiles, summarize,
                             time_per_output_token)


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
    assert meets_slos(m, {"ttft": 1.0, "tpot": 0.2}) and not meets_slos(m, {"ttft": 0.9})
    assert not meets_slos(m, {"tpot": 0.1}) and not meets_slos(m, {"e2e_latency": 1.5})
    one = made_up(0.0, 0.0, [0.3])
    assert one.tpot is None and one.itl == [] and meets_slos(one, {"ttft": 0.5, "tpot": 0.01})
    unfinished = RequestMetrics(arrival_time=0.0)
    assert unfinished.ttft is None and unfinished.e2e_latency is None
    assert not unfinished.finished and not meets_slos(unfinished, {})


def test_summarize_against_numpy():
    ms = [made_up(0.0, 0.0, [0.5, 0.6, 0.7], prompt=10),                 # ttft .5, tpot .1
          made_up(0.0, 0.2, [1.0, 1.5], prompt=20),                      # ttft 1, tpot .5
          made_up(1.0, 1.0, [1.2, 1.3, 1.4, 1.5, 2.0], prompt=30),       # ttft .2, tpot .2
          made_up(1.0, 1.0, [1.2, 1.3, 1.4, 1.5, 2.0], prompt=30, index=1)]  # a 2nd sample
    s = summarize(ms, ttft_slo=0.6, tpot_slo=0.2)
    assert s["duration_s"] == pytest.approx(2.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 4, 0)
    assert s["total_input_tokens"] == 60                 # the second sample shares its prompt
    assert s["total_output_tokens"] == 15
    assert s["output_throughput"] == pytest.approx(7.5)
    assert s["total_token_throughput"] == pytest.approx(37.5)
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["request_goodput"] == pytest.approx(3 / 2.0)  # requests 0, 2, 3 meet the SLO
    assert s["slo_attainment"] == pytest.approx(0.75)
    assert s["slos"] == {"ttft": 0.6, "tpot": 0.2}
    ttfts = [0.5, 1.0, 0.2, 0.2]
    for p in (50, 90, 95, 99):
        assert s[f"ttft_p{p}"] == pytest.approx(np.percentile(ttfts, p))
    itls = [x for m in ms for x in m.itl]
    assert s["itl_p99"] == pytest.approx(np.percentile(itls, 99))
    assert s["tpot_mean"] == pytest.approx(np.mean([0.1, 0.5, 0.2, 0.2]))
    assert s["e2e_latency_mean"] == pytest.approx(np.mean([0.7, 1.5, 1.0, 1.0]))
    assert s["mean_concurrency"] == pytest.approx(4.2 / 2.0)         # Little's law: sum(E2E) / T
    assert s["queueing_time_p50"] == pytest.approx(0.0)
    plain = summarize(ms, duration=4.0)
    assert plain["output_throughput"] == pytest.approx(3.75)
    assert plain["request_goodput"] is None and plain["slo_attainment"] is None  # no SLO given
    assert summarize(ms, e2e_latency_slo=1.0)["request_goodput"] == pytest.approx(3 / 2.0)
    assert percentiles([None, 1.0, 3.0])["p50"] == 2.0
    with pytest.raises(ValueError):
        summarize([])
    with pytest.raises(ValueError):
        summarize(ms, duration=0)
    with pytest.raises(ValueError, match="pass duration="):
        summarize([RequestMetrics(arrival_time=0.0)])


def test_one_token_tpot_rule():
    """One output token: no inter-token gap, so TPOT is None on both sides of a run; it stays
    out of the TPOT statistics (a 0.0 would pull the mean down) and meets any TPOT bound."""
    assert time_per_output_token(0.3, 1) is None and time_per_output_token(None, 5) is None
    assert time_per_output_token(0.3, 4) == pytest.approx(0.1)
    ms = [made_up(0.0, 0.0, [0.5]), made_up(0.0, 0.0, [0.5, 0.7, 0.9])]
    s = summarize(ms, tpot_slo=0.15)
    assert s["tpot_mean"] == pytest.approx(0.2) and s["tpot_p50"] == pytest.approx(0.2)
    assert s["request_goodput"] == pytest.approx(1 / 0.9)            # the one-token request


def test_client_and_engine_records_summarize_alike():
    """The load generator's RequestResult and the engine's RequestMetrics of the same requests
    give the same summary, key for key (the client cannot see queueing: None there)."""
    from minillm.serve.loadgen import RequestResult
    ms = [made_up(0.0, 0.1, [0.5, 0.6, 0.7], prompt=10), made_up(1.0, 1.0, [1.2], prompt=20),
          made_up(1.0, 1.0, [1.5, 2.0], prompt=30)]
    rs = [RequestResult(m.num_prompt_tokens, ttft=m.ttft, itl=m.itl, e2e_latency=m.e2e_latency,
                        num_output_tokens=m.num_output_tokens, finished=True) for m in ms]
    rs.append(RequestResult(5, error="boom"))
    engine = summarize(ms, 2.0, ttft_slo=0.4, tpot_slo=0.3)
    client = summarize(rs, 2.0, ttft_slo=0.4, tpot_slo=0.3)
    assert (client["completed"], client["failed"]) == (3, 1)
    assert client["queueing_time_mean"] is None and engine["queueing_time_mean"] is not None
    for key, value in engine.items():
        if key in ("num_requests", "failed", "slo_attainment") or key.startswith("queueing"):
            continue
        assert client[key] == pytest.approx(value), key
    assert set(client) == set(engine)


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
    assert s["total_output_tokens"] == 14 and s["duration_s"] == max(9, c_start + 1)
