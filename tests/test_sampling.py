import numpy as np
import pytest
import torch

from minillm import sampling
from minillm.sampling import (SamplingParams, make_generator, probs, sample, top_k_filter,
                              top_p_filter)


def _logits(seed=0, B=4, V=50):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_greedy():
    logits = _logits()
    out = sample(logits, SamplingParams(temperature=0.0, top_k=3, top_p=0.5))
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_never_leaves_the_k_best():
    logits = _logits(1)
    k = 5
    best = logits.topk(k, dim=-1).indices
    g = make_generator(0)
    params = SamplingParams(temperature=2.0, top_k=k)
    seen = set()
    for _ in range(300):
        tok = sample(logits, params, g)
        for b in range(logits.shape[0]):
            assert tok[b].item() in best[b].tolist()
            seen.add((b, tok[b].item()))
    assert len(seen) > logits.shape[0] * 2       # with temperature 2 it does explore within the k


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].nonzero().flatten().tolist()
    assert kept(0.5) == [0]                      # the top token alone reaches 0.5
    assert kept(0.6) == [0, 1]                   # 0.5 < 0.6 <= 0.7
    assert kept(0.7) == [0, 1]                   # exactly reaching p stops there
    assert kept(0.71) == [0, 1, 2]
    assert kept(0.01) == [0]                     # the top token is always kept
    assert kept(1.0) == [0, 1, 2, 3, 4]


def test_top_p_works_on_unsorted_rows():
    probs = torch.tensor([[0.05, 0.5, 0.1, 0.2, 0.15], [0.25, 0.25, 0.2, 0.2, 0.1]])
    filtered = top_p_filter(probs.log(), 0.75)
    assert torch.isfinite(filtered[0]).nonzero().flatten().tolist() == [1, 3, 4]
    assert torch.isfinite(filtered[1]).sum().item() == 4        # 0.25 + 0.25 + 0.2 + 0.2 > 0.75


def test_top_k_filter_ties_and_disabled():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert torch.isfinite(top_k_filter(logits, 2)).tolist() == [[False, True, True, False]]
    assert torch.equal(top_k_filter(logits, -1), logits)


def test_seed_reproduces_and_differs():
    logits = _logits(2)
    p = SamplingParams(temperature=1.0, top_p=0.9)
    a = [sample(logits, p, make_generator(123)).tolist() for _ in range(3)]
    assert a[0] == a[1] == a[2]
    draws = {tuple(sample(logits, p, make_generator(s)).tolist()) for s in range(20)}
    assert len(draws) > 1


def test_sampling_matches_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    g = make_generator(0)
    n = 4000
    counts = torch.bincount(torch.cat([sample(logits.expand(200, 3), SamplingParams(), g)
                                       for _ in range(n // 200)]), minlength=3).float() / n
    assert torch.allclose(counts, logits.softmax(-1)[0], atol=0.03)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(n=0), "n must"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature="0.5"), "temperature must be a finite number"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=None), "temperature must be a finite number"),
    (dict(top_p=float("nan")), "top_p must be a finite number"),
    (dict(top_k=2.5), "top_k must be an integer"),
    (dict(top_k="5"), "top_k must be an integer"),
    (dict(max_tokens=None), "max_tokens must be an integer.*there is no unlimited"),
    (dict(max_tokens=float("inf")), "max_tokens must be an integer"),
    (dict(max_tokens=float("nan")), "max_tokens must be an integer"),
    (dict(max_tokens=True), "max_tokens must be an integer"),
    (dict(n=1.5), "n must be an integer"),
    (dict(seed="abc"), "seed must be an integer"),
    (dict(seed=1.5), "seed must be an integer"),
    (dict(seed=-1), "seed must be in"),
    (dict(ignore_eos="no"), "ignore_eos must be True or False"),
    (dict(stop=5), "stop must be a non-empty string or a list"),
    (dict(stop=[""]), "stop must be a non-empty string or a list"),
    (dict(stop=["ok", None]), "stop must be a non-empty string or a list"),
    (dict(stop_token_ids=2), "stop_token_ids must be a list of integers"),
    (dict(stop_token_ids="2"), "stop_token_ids must be a list of integers"),
    (dict(stop_token_ids=[1, "2"]), "stop_token_ids must hold integers"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids must hold integers"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be >= 0"),
])
def test_sampling_params_types_are_checked_up_front(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_what_they_accept():
    p = SamplingParams(stop=None, stop_token_ids=None, max_tokens=np.int64(8), top_k=4.0,
                       seed=np.int32(3))
    assert p.stop == [] and p.stop_token_ids == [] and p.max_tokens == 8 and p.top_k == 4
    assert type(p.max_tokens) is int and p.seed == 3
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop_token_ids=(np.int64(2), 3)).stop_token_ids == [2, 3]
    p.stop = None                     # changed after construction: validate() checks again
    p.validate()
    assert p.stop == []


@pytest.mark.parametrize("t", [1e-39, 1e-6, 0.0])
def test_tiny_temperature_samples_greedily(t):
    logits = _logits(3)
    assert SamplingParams(temperature=t).greedy
    assert torch.equal(sample(logits, SamplingParams(temperature=t)), logits.argmax(-1))
    assert not SamplingParams(temperature=1e-4).greedy


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=10),
                                dict(temperature=1.3, top_p=0.8),
                                dict(temperature=0.5, top_k=20, top_p=0.9)])
def test_probs_and_sample_agree(kw):
    """sample draws exactly from probs: same seed -> the same tokens as draw_from(probs)."""
    logits = _logits(4, B=6, V=50)
    params = SamplingParams(**kw)
    p = probs(logits, params)
    assert p.dtype == torch.float32 and p.shape == (6, 50)
    assert torch.allclose(p.sum(-1), torch.ones(6))
    g1, g2 = make_generator(11), make_generator(11)
    for _ in range(20):
        want = sampling.draw_from(p, g1)
        assert torch.equal(sample(logits, params, g2), want)
    assert (p > 0).sum(-1).max() <= (params.top_k if params.top_k > 0 else 50)
    keep = torch.isfinite(top_p_filter(top_k_filter(logits / params.temperature, params.top_k),
                                       params.top_p))
    assert torch.equal(p > 0, keep)                  # the filters' support, nothing else


def test_probs_greedy_is_one_hot_on_the_argmax():
    logits = _logits(5)
    p = probs(logits, SamplingParams(temperature=0.0, top_k=3))
    assert torch.equal(p.argmax(-1), logits.argmax(-1)) and torch.equal(p.sum(-1), torch.ones(4))
    assert torch.equal((p == 1).sum(-1), torch.ones(4, dtype=torch.long))
    assert torch.equal(sample(logits, SamplingParams(temperature=0.0)), p.argmax(-1))


def test_greedy_ids_is_argmax_with_the_first_of_ties():
    """greedy_ids (max(dim), faster than argmax on a CPU) picks exactly what argmax picks."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 301, generator=g)
    x[1, [5, 200]] = 50.0                                    # a tie: the first index wins
    x[2, :] = 0.0                                            # a row of ties
    x[3, [0, 300]] = 9.0                                     # tie at both ends
    for dt in (torch.float32, torch.bfloat16):
        got = sampling.greedy_ids(x.to(dt))
        assert got.tolist() == x.to(dt).float().argmax(-1).tolist()
    assert sampling.greedy_ids(x)[1:4].tolist() == [5, 0, 0]
    assert sampling.greedy_ids(x[0]).item() == int(x[0].argmax())      # one row, [V]


def test_draw_from_has_each_rows_distribution():
    """draw_from (the inverse-CDF draw every sampled token goes through) against exact
    probabilities: zeros at the ends and in the middle are never drawn, rows are unnormalised
    and independent, and the counts pass a chi-square test per row."""
    from minillm.sampling import draw_from
    from minillm.spec.theory import chi_square
    p = torch.tensor([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0],
                      [3.0, 0.0, 1.0, 0.0, 0.0, 4.0],          # unnormalised (sums to 8)
                      [0.0, 0.0, 0.0, 0.0, 0.0, 2.0],          # all mass on the last id
                      [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])         # ... on the first
    g = make_generator(0)
    n = 6000
    ids = torch.stack([draw_from(p, g) for _ in range(n)])      # [n, 4]
    assert ids.shape == (n, 4) and ids.dtype == torch.long
    for r in range(4):
        want = {i: float(p[r, i] / p[r].sum()) for i in range(6)}
        counts = {i: int((ids[:, r] == i).sum()) for i in range(6)}
        assert all(counts[i] == 0 for i in range(6) if want[i] == 0), (r, counts)
        if sum(v > 0 for v in want.values()) > 1:
            assert chi_square(counts, want)[1] > 1e-3, (r, counts)


def test_draw_from_never_draws_a_zero_at_the_top_of_the_range(monkeypatch):
    """u is kept below the row's total: a uniform of (almost) 1 still lands on the last token
    with probability, not on a zero-probability token after it."""
    from minillm.sampling import draw_from
    p = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, 1, dtype=torch.float64))
    assert int(draw_from(p)) == 1


@pytest.mark.parametrize("row", [[0.0, 0.0, 0.0], [0.5, float("nan"), 0.5],
                                 [0.5, float("inf"), 0.0], [0.7, -0.2, 0.5]])
def test_draw_from_refuses_rows_it_cannot_draw_from(row):
    """A row of zeros, a NaN or an infinity (NaN logits, a mask that left nothing) or a negative
    entry raises, as torch.multinomial did, instead of returning an id past the row's end."""
    from minillm.sampling import draw_from
    good = [0.2, 0.3, 0.5]
    with pytest.raises(ValueError, match="cannot draw from these probabilities"):
        draw_from(torch.tensor([good, row]))
    assert 0 <= int(draw_from(torch.tensor([good]))) < 3
    one = draw_from(torch.tensor(good))                     # a single row [V]: a 0-d id
    assert one.dim() == 0 and 0 <= int(one) < 3
