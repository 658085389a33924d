"""Graders for the chapter 07 problem set (solutions/07_speculative_decoding.ipynb).

    ch07.check_residual(residual_distribution)   # (a) the normalised residual max(0, p - q)
    ch07.check_rejection_sample(rejection_sample) # (b) one verification step, exact in distribution
    ch07.check_ngram_propose(ngram_propose)       # (c) prompt lookup: longest, latest match
    ch07.check_expected_speedup(expected_speedup) # (d) (1 - a^(k+1)) / ((1 - a)(k c + 1))
    ch07.check_tree_attention_mask(tree_attention_mask)  # (e) the mask of a token tree

References: minillm.spec (rejection.residual, ngram.ngram_propose, theory.speedup) and, for the
sampler, the target distribution itself: the learner's sampler runs many times with a seeded
torch.Generator and its frequencies are compared with p by a chi-square test (deterministic,
since the seed is fixed). Every case is small; no model runs.
"""
from __future__ import annotations

import math
import random

import torch

from ..spec import theory
from ..spec.ngram import ngram_propose as _ref_ngram
from ..spec.rejection import residual as _ref_residual
from ..spec.tree import tree_mask as _ref_tree_mask
from .core import Check, Exercise, Problem


def _fmt(t) -> str:
    return "[" + ", ".join(f"{float(x):.3f}" for x in t) + "]"


# =========================================================================== (a) residual

def _call_residual(fn, p, q) -> torch.Tensor:
    out = fn(p.clone(), q.clone())
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(p.shape):
        raise Problem(f"for p={_fmt(p)}, q={_fmt(q)} you returned "
                      f"{getattr(out, 'shape', type(out).__name__)}; return a tensor shaped like p")
    return out.double()


def _residual_sums_to_one(fn):
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    r = _call_residual(fn, p, q)
    if not abs(float(r.sum()) - 1) <= 1e-6:                     # NaN never passes
        hint = (" -- that is max(0, p - q) without renormalising: divide by its sum"
                if torch.allclose(r, (p - q).clamp_min(0), atol=1e-6) else "")
        raise Problem(f"for p={_fmt(p)}, q={_fmt(q)} your residual {_fmt(r)} sums to "
                      f"{float(r.sum()):.3f}, not 1{hint}")


def _residual_values(fn):
    g = torch.Generator().manual_seed(7)
    for _ in range(5):
        p = torch.rand(6, generator=g, dtype=torch.float64).softmax(0)
        q = torch.rand(6, generator=g, dtype=torch.float64).pow(3).softmax(0)
        r, want = _call_residual(fn, p, q), _ref_residual(p, q)
        if not torch.allclose(r, want, atol=1e-6):
            hint = ""
            if torch.allclose(r, _ref_residual(q, p), atol=1e-6):
                hint = " -- that is max(0, q - p): the residual is where the TARGET wants more"
            raise Problem(f"for p={_fmt(p)}, q={_fmt(q)} you returned {_fmt(r)}, expected "
                          f"{_fmt(want)}{hint}")


def _residual_zero_where_draft_covers(fn):
    p = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    q = torch.tensor([0.4, 0.2, 0.4], dtype=torch.float64)
    r = _call_residual(fn, p, q)
    if not (float(r[0]) <= 1e-9 and float(r[2]) <= 1e-9):        # NaN never passes
        raise Problem(f"for p={_fmt(p)}, q={_fmt(q)} tokens 0 and 2 have q >= p, so the residual "
                      f"must give them 0; you returned {_fmt(r)}")


def _residual_one_hot_draft(fn):
    p = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    q = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    r = _call_residual(fn, p, q)
    want = torch.tensor([0.4, 0.0, 0.6], dtype=torch.float64)
    if not torch.allclose(r, want, atol=1e-6):
        raise Problem(f"a one-hot draft on token 1 with p={_fmt(p)}: the residual is p without "
                      f"token 1, renormalised, {_fmt(want)}; you returned {_fmt(r)}")


def _residual_equal_distributions(fn):
    p = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    r = _call_residual(fn, p, p.clone())
    if torch.isnan(r).any() or abs(float(r.sum()) - 1) > 1e-6 or (r < 0).any():
        raise Problem(f"for p == q = {_fmt(p)} (a rejection can never happen) you returned "
                      f"{_fmt(r)}; return any valid distribution (e.g. p), not 0/0 = nan")


RESIDUAL = Exercise("ch07.residual", "residual_distribution", (
    Check("the residual sums to 1", _residual_sums_to_one),
    Check("equals max(0, p - q) / sum(max(0, p - q))", _residual_values),
    Check("is 0 wherever the draft already gives enough mass", _residual_zero_where_draft_covers),
    Check("a one-hot draft: p without the drafted token, renormalised", _residual_one_hot_draft),
    Check("p == q gives a valid distribution, no nan", _residual_equal_distributions),
))


def check_residual(residual_distribution, time_limit=None):
    return RESIDUAL.check(residual_distribution, time_limit)


# =========================================================================== (b) rejection_sample

def _call_rs(fn, p, drafts, q, g) -> list:
    out = fn(p.clone(), list(drafts), None if q is None else q.clone(), g)
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    if not isinstance(out, (list, tuple)) or not all(isinstance(t, int) for t in out):
        raise Problem(f"you returned {str(out)[:60]}; return a list of int token ids")
    k = len(drafts)
    if not 1 <= len(out) <= k + 1:
        raise Problem(f"with k={k} drafts you returned {len(out)} tokens {out}; one "
                      f"verification emits between 1 and k + 1 = {k + 1}")
    if list(out[:-1]) != list(drafts[:len(out) - 1]):
        raise Problem(f"drafts {drafts}: you returned {out}; every token before the last must be "
                      "an accepted draft, in order")
    return list(out)


def _case(seed: int, V: int = 4, k: int = 2, zeros: bool = True):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, V, generator=g, dtype=torch.float64) ** 2
    q = torch.rand(k, V, generator=g, dtype=torch.float64) ** 2
    if zeros:
        p[0, 0] = 0.0
        q[0, 1] = 0.0                                # q = 0 where p > 0
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    return p, q


def _first_token_test(fn, p, q, n: int, seed: int, one_hot_draft=None) -> tuple:
    """Frequencies of the first emitted token against p[0] (drafts drawn from q, or one-hot)."""
    g = torch.Generator().manual_seed(seed)            # the learner's randomness
    gd = torch.Generator().manual_seed(seed + 1000)    # the drafts': kept apart, so the batch
    V, k = p.shape[1], p.shape[0] - 1                  # grader's replay asks the same questions
    counts = {}
    for _ in range(n):
        if one_hot_draft is None:
            drafts = [int(torch.multinomial(q[i].float(), 1, generator=gd)) for i in range(k)]
            out = _call_rs(fn, p, drafts, q, g)
        else:
            drafts = list(one_hot_draft)
            out = _call_rs(fn, p, drafts, None, g)
        counts[(out[0],)] = counts.get((out[0],), 0) + 1
    expected = {(x,): float(p[0, x]) for x in range(V)}
    stat, pval = theory.chi_square(counts, expected)
    freqs = [counts.get((x,), 0) / n for x in range(V)]
    return pval, freqs


def _rs_structure(fn):
    for seed in range(20):
        p, q = _case(seed, V=5, k=3)
        g = torch.Generator().manual_seed(seed)
        drafts = [int(torch.multinomial(q[i].float(), 1, generator=g)) for i in range(3)]
        _call_rs(fn, p, drafts, q, g)


def _rs_bonus(fn):
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    out = _call_rs(fn, p, [1, 2], p[:2].clone(), torch.Generator().manual_seed(0))
    if out != [1, 2, 0]:
        hint = (" -- the bonus token is missing: when all k drafts are accepted, draw one more "
                "from target_probs[k]" if out == [1, 2] else "")
        raise Problem(f"p = q, certain drafts [1, 2], bonus distribution certain on token 0: "
                      f"expected [1, 2, 0], you returned {out}{hint}")


def _rs_acceptance_rate(fn):
    """One draft with p(d) = 0.2, q(d) = 0.8: accepted 25% of the time."""
    p = torch.tensor([[0.2, 0.8], [0.5, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.8, 0.2]], dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    n = 1000
    acc = sum(len(_call_rs(fn, p, [0], q, g)) == 2 for _ in range(n)) / n
    if not abs(acc - 0.25) <= 0.05:
        hint = (" -- that is min(1, q/p): the ratio is p(d) / q(d), target over draft"
                if acc > 0.9 else "")
        raise Problem(f"a draft token with p=0.2 and q=0.8 must be accepted with probability "
                      f"min(1, p/q) = 0.25; yours was accepted {acc:.1%} of {n} times{hint}")


def _rs_distribution(fn):
    for seed in (3,):
        p, q = _case(seed)
        pval, freqs = _first_token_test(fn, p, q, 1500, seed)
        if not pval >= 1e-4:                          # a NaN p-value fails too
            raise Problem(f"p[0]={_fmt(p[0])}, q={_fmt(q[0])} (q is 0 on a token where p > 0): "
                          f"your first emitted token has frequencies {_fmt(freqs)} over 1500 "
                          f"runs (chi-square p-value {pval:.1e}); they must follow p[0]. Check the "
                          "residual: max(0, p - q), renormalised, sampled at the first rejection")


def _rs_one_hot(fn):
    p = torch.tensor([[0.3, 0.5, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)
    pval, freqs = _first_token_test(fn, p, None, 1500, 9, one_hot_draft=[1])
    if not pval >= 1e-4:
        raise Problem(f"draft_probs=None (a one-hot draft of token 1), p[0]={_fmt(p[0])}: your "
                      f"first tokens have frequencies {_fmt(freqs)}; they must follow p[0] "
                      "(accept with probability p(1), else sample p without token 1)")


def _rs_second_position(fn):
    """Given the first draft is accepted, the second emitted token follows p[1]."""
    p, q = _case(5, V=3, k=2, zeros=False)
    g = torch.Generator().manual_seed(5)               # the learner's randomness
    gd = torch.Generator().manual_seed(1005)           # the drafts' (see _first_token_test)
    counts, n = {}, 0
    d0 = int(p[0].argmax())
    for _ in range(1500):
        d1 = int(torch.multinomial(q[1].float(), 1, generator=gd))
        out = _call_rs(fn, p, [d0, d1], q, g)
        if len(out) >= 2:
            counts[(out[1],)] = counts.get((out[1],), 0) + 1
            n += 1
    stat, pval = theory.chi_square(counts, {(x,): float(p[1, x]) for x in range(3)})
    if n < 100 or not pval >= 1e-4:
        freqs = [counts.get((x,), 0) / max(n, 1) for x in range(3)]
        raise Problem(f"after an accepted first draft, the second token must follow p[1]="
                      f"{_fmt(p[1])}; yours had frequencies {_fmt(freqs)} (chi-square p "
                      f"{pval:.1e}); position i uses target_probs[i] and draft_probs[i]")


REJECTION = Exercise("ch07.rejection_sample", "rejection_sample", (
    Check("returns the accepted drafts then one token, 1 .. k + 1 in all", _rs_structure),
    Check("all drafts accepted: a bonus token from target_probs[k]", _rs_bonus),
    Check("accepts a draft with probability min(1, p/q)", _rs_acceptance_rate),
    Check("emitted tokens follow the target (chi-square), q = 0 where p > 0 included",
          _rs_distribution),
    Check("a one-hot draft (draft_probs=None) keeps the target distribution", _rs_one_hot),
    Check("later positions use their own rows", _rs_second_position),
))


def check_rejection_sample(rejection_sample, time_limit=None):
    return REJECTION.check(rejection_sample, time_limit)


# =========================================================================== (c) ngram_propose

def _ng(fn, ids, k, lo, hi):
    out = fn(list(ids), k, lo, hi)
    if isinstance(out, torch.Tensor):
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise Problem(f"you returned a {type(out).__name__}; return a list of token ids")
    return list(out)


def _ng_expect(fn, ids, k, lo, hi, why: str):
    got, want = _ng(fn, ids, k, lo, hi), _ref_ngram(ids, k, lo, hi)
    if got != want:
        raise Problem(f"token_ids={list(ids)}, k={k}, prompt_lookup_min={lo}, max={hi}: you "
                      f"proposed {got}, expected {want} ({why})")


def _ng_basic(fn):
    _ng_expect(fn, [4, 5, 6, 7, 8, 1, 5, 6], 3, 1, 2,
               "[5, 6] occurred at index 1, followed by 7, 8, 1")


def _ng_longest(fn):
    _ng_expect(fn, [1, 2, 3, 8, 8, 5, 2, 3, 6, 1, 2, 3], 2, 1, 3,
               "the longest n that matches wins: [1, 2, 3] at index 0 beats the later [2, 3]")


def _ng_latest(fn):
    _ng_expect(fn, [2, 3, 9, 9, 2, 3, 7, 7, 2, 3], 2, 2, 2,
               "of several earlier occurrences, take the latest")


def _ng_adjacent(fn):
    _ng_expect(fn, [7, 7, 7], 4, 1, 2,
               "a match may end right before the suffix and overlap it: [7, 7] at index 0, "
               "followed by one 7")
    _ng_expect(fn, [1, 2, 1, 2], 3, 2, 2,
               "the occurrence right before the suffix counts ([1, 2] at index 0)")


def _ng_edges(fn):
    _ng_expect(fn, [1, 2, 3, 4], 3, 1, 3, "nothing repeats: propose []")
    _ng_expect(fn, [5], 3, 1, 3, "a single token has nothing earlier to match")
    _ng_expect(fn, [1, 2, 1, 2, 1, 2], 10, 2, 2, "stop at the end of the sequence")


def _ng_random(fn):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(4) for _ in range(rng.randint(1, 20))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 4)
        _ng_expect(fn, ids, rng.randint(1, 4), lo, hi, "random case")


NGRAM = Exercise("ch07.ngram_propose", "ngram_propose", (
    Check("proposes what followed an earlier occurrence of the last n tokens", _ng_basic),
    Check("tries the longest n first", _ng_longest),
    Check("takes the latest earlier occurrence", _ng_latest),
    Check("an occurrence right before the suffix counts (no off-by-one)", _ng_adjacent),
    Check("no match, one token, the sequence end", _ng_edges),
    Check("agrees with minillm on 200 random sequences", _ng_random),
))


def check_ngram_propose(ngram_propose, time_limit=None):
    return NGRAM.check(ngram_propose, time_limit)


# =========================================================================== (d) expected_speedup

def _sp(fn, a, k, c):
    out = fn(a, k, c)
    try:
        return float(out)
    except (TypeError, ValueError):
        raise Problem(f"expected_speedup({a}, {k}, {c}) returned {out!r}; "
                      "return a number") from None


def _sp_expect(fn, a, k, c, why=""):
    got, want = _sp(fn, a, k, c), theory.speedup(a, k, c)
    if not math.isclose(got, want, rel_tol=1e-6):
        hints = []
        if a < 1 and math.isclose(got, (1 - a ** k) / (1 - a) / (k * c + 1), rel_tol=1e-6):
            hints.append("you used a^k: k drafts give up to k + 1 tokens (the bonus), so a^(k+1)")
        if math.isclose(got, theory.expected_tokens(a, k) / max(k * c, 1e-12), rel_tol=1e-6):
            hints.append("the cost is k c + 1: the target's verification pass counts too")
        if math.isclose(got, theory.expected_tokens(a, k), rel_tol=1e-6) and c:
            hints.append("divide by the cost k c + 1")
        raise Problem(f"expected_speedup(alpha={a}, k={k}, c={c}) = {got:.4f}, expected "
                      f"{want:.4f}{' (' + why + ')' if why else ''}"
                      f"{' -- ' + '; '.join(hints) if hints else ''}")


def _sp_free_draft(fn):
    _sp_expect(fn, 0.5, 4, 0.0, "a free draft: 1 + a + a^2 + a^3 + a^4 tokens per pass")


def _sp_with_cost(fn):
    _sp_expect(fn, 0.5, 4, 0.05)
    _sp_expect(fn, 0.8, 3, 0.2)


def _sp_perfect(fn):
    _sp_expect(fn, 1.0, 4, 0.1, "alpha = 1: every draft accepted, k + 1 tokens; mind 0/0")


def _sp_useless(fn):
    _sp_expect(fn, 0.0, 4, 0.1, "alpha = 0: one token per pass and the draft's cost on top")


def _sp_break_even(fn):
    for k, c in ((4, 0.05), (4, 0.2), (2, 0.5)):
        a = theory.break_even_alpha(k, c)
        got = _sp(fn, a, k, c)
        if not abs(got - 1) <= 1e-4:                   # NaN never passes
            raise Problem(f"at alpha={a:.3f}, k={k}, c={c} speculation breaks even (speedup 1); "
                          f"you returned {got:.4f}")


SPEEDUP = Exercise("ch07.expected_speedup", "expected_speedup", (
    Check("a free draft: expected tokens per verification", _sp_free_draft),
    Check("divides by the cost k c + 1", _sp_with_cost),
    Check("alpha = 1 gives k + 1 tokens per pass", _sp_perfect),
    Check("alpha = 0 makes speculation a loss", _sp_useless),
    Check("speedup 1 at the break-even acceptance", _sp_break_even),
))


def check_expected_speedup(expected_speedup, time_limit=None):
    return SPEEDUP.check(expected_speedup, time_limit)


# =========================================================================== (e) tree mask

def _tm(fn, parents) -> torch.Tensor:
    out = fn(list(parents))
    n = len(parents)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (n, n):
        raise Problem(f"tree_attention_mask({parents}) returned "
                      f"{getattr(out, 'shape', type(out).__name__)}; return a [{n}, {n}] tensor")
    return out.bool()


def _tm_expect(fn, parents, what):
    got, want = _tm(fn, parents), _ref_tree_mask(parents)
    if torch.equal(got, want):
        return
    i, j = [int(x) for x in (got != want).nonzero()[0]]
    hints = []
    if not got.diagonal().all():
        hints.append("a node must see itself (its own key is in its row)")
    if torch.equal(got, want.T):
        hints.append("row i is the QUERY node i: it sees its ancestors, the lower-left")
    if torch.equal(got, torch.ones(len(parents), len(parents)).tril().bool()):
        hints.append("that is the causal mask: in a tree, a node does not see a sibling's branch")
    ancestor = want[i, j]
    raise Problem(f"for parents={parents} ({what}), mask[{i}, {j}] is {bool(got[i, j])}, but node "
                  f"{j} is {'an ancestor of (or equal to)' if ancestor else 'not an ancestor of'}"
                  f" node {i}{' -- ' + '; '.join(hints) if hints else ''}")


def _tm_chain(fn):
    _tm_expect(fn, [-1], "the root alone")
    _tm_expect(fn, [-1, 0, 1, 2], "a chain: its mask is the causal one")


def _tm_star(fn):
    _tm_expect(fn, [-1, 0, 0, 0], "three siblings under the root")


def _tm_deep(fn):
    _tm_expect(fn, [-1, 0, 0, 1, 1, 2, 3], "a node at depth 3 sees its grandparent too")


def _tm_binary(fn):
    _tm_expect(fn, [-1, 0, 0, 1, 1, 2, 2], "two branches of two: each leaf sees its own path only")


def _tm_random(fn):
    rng = random.Random(11)
    for _ in range(50):
        n = rng.randint(2, 12)
        _tm_expect(fn, [-1] + [rng.randrange(i) for i in range(1, n)], "a random tree")


TREE_MASK = Exercise("ch07.tree_attention_mask", "tree_attention_mask", (
    Check("a one-node tree, and a chain gives the causal mask", _tm_chain),
    Check("siblings do not see each other", _tm_star),
    Check("a node sees every ancestor, not only its parent", _tm_deep),
    Check("two levels of two branches", _tm_binary),
    Check("agrees with minillm on 50 random trees", _tm_random),
))


def check_tree_attention_mask(tree_attention_mask, time_limit=None):
    return TREE_MASK.check(tree_attention_mask, time_limit)


EXERCISES = (RESIDUAL, REJECTION, NGRAM, SPEEDUP, TREE_MASK)
