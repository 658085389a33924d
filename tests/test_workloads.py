"""Request workloads (chapters 02-03): seeded, documented length mixes, stated clipping."""
import numpy as np
import pytest

from minillm.lab.workloads import MIXES, make_workload, sample_lengths


def test_same_seed_same_trace_and_other_seed_differs():
    a = make_workload("sharegpt", 50, seed=3, rate=5.0)
    b = make_workload("sharegpt", 50, seed=3, rate=5.0)
    c = make_workload("sharegpt", 50, seed=4, rate=5.0)
    assert a.requests == b.requests
    assert a.requests != c.requests


@pytest.mark.parametrize("mix,prompt_mean,output_mean", [("sharegpt", 161.3, 338.0),
                                                         ("alpaca", 19.3, 58.5)])
def test_raw_lengths_match_the_paper_means(mix, prompt_mean, output_mean):
    # The log-normal is fitted so its mean is the paper's mean; check on many draws.
    p, o = sample_lengths(mix, 200_000, np.random.default_rng(0), context_len=2048)
    assert abs(p.mean() / prompt_mean - 1) < 0.02
    assert abs(o.mean() / output_mean - 1) < 0.02
    assert np.median(p) < p.mean() and np.median(o) < o.mean()      # long right tail


def test_paper_mixes_keep_their_means_after_clipping():
    s = make_workload("sharegpt", 5000, seed=1).summary()
    assert 150 < s["mean_prompt_len"] < 172 and 310 < s["mean_output_len"] < 360
    a = make_workload("alpaca", 5000, seed=1).summary()
    assert 18 < a["mean_prompt_len"] < 21 and 54 < a["mean_output_len"] < 63
    assert s["mean_prompt_len"] / a["mean_prompt_len"] > 7           # the paper: ~8.4x longer


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("context_len", [256, 2048])
def test_clipping_is_counted_and_every_request_fits(mix, context_len):
    w = make_workload(mix, 2000, seed=7, context_len=context_len)
    assert all(1 <= r.prompt_len <= context_len - 1 for r in w)
    assert all(r.output_len >= 1 and r.total_len <= context_len for r in w)
    # Recount independently from the raw draws (same seed, same generator order).
    p, o = sample_lengths(mix, 2000, np.random.default_rng(7), context_len)
    p = np.maximum(1, np.round(p)).astype(int)
    o = np.maximum(1, np.round(o)).astype(int)
    expected = int(((p > context_len - 1)
                    | (np.minimum(p, context_len - 1) + o > context_len)).sum())
    assert w.num_clipped == expected
    assert [r.clipped for r in w].count(True) == expected


def test_small_context_clips_sharegpt_and_says_so():
    w = make_workload("sharegpt", 1000, seed=0, context_len=256)
    assert w.num_clipped > 100                                        # the tail does not fit
    assert w.summary()["num_clipped"] == w.num_clipped


def test_reservation_policies():
    ctx = make_workload("sharegpt", 300, seed=2, reserve="context")
    assert all(r.max_len_reserved == 2048 for r in ctx)
    mt = make_workload("sharegpt", 300, seed=2, reserve="max_tokens", max_tokens=256)
    assert all(r.output_len <= 256 for r in mt)
    assert all(r.max_len_reserved == min(r.prompt_len + 256, 2048) for r in mt)
    assert any(r.output_len == 256 and r.clipped for r in mt)         # stopped at max_tokens
    oracle = make_workload("sharegpt", 300, seed=2, reserve="oracle")
    assert all(r.max_len_reserved == r.total_len for r in oracle)
    # same seed: the same prompts whatever the policy
    assert [r.prompt_len for r in ctx] == [r.prompt_len for r in oracle]


def test_arrivals_poisson_and_all_at_zero():
    w = make_workload("alpaca", 5000, seed=0, rate=10.0)
    t = np.array([r.arrival_time for r in w])
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert (gaps >= 0).all()
    assert abs(gaps.mean() - 0.1) < 0.005
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05                 # exponential: cv = 1
    assert all(r.arrival_time == 0 for r in make_workload("alpaca", 20, seed=0))


def test_uniform_and_long_context_shapes():
    u = make_workload("uniform", 3000, seed=0)
    assert min(r.prompt_len for r in u) >= 16 and max(r.prompt_len for r in u) <= 512
    lc = make_workload("long_context", 500, seed=0, context_len=1000)
    assert all(500 <= r.prompt_len <= 900 for r in lc)


@pytest.mark.parametrize("kwargs,match", [
    (dict(mix="sharegtp"), "unknown length mix"),
    (dict(rate=0.0), "rate must be > 0"),
    (dict(reserve="max_tokens"), "needs max_tokens"),
    (dict(reserve="max"), "unknown reserve policy"),
    (dict(num_requests=0), "num_requests"),
    (dict(context_len=1), "context_len"),
])
def test_bad_input_names_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_workload(**kwargs)
