"""Speculative decoding by the numbers (chapter 07): acceptance, tokens per step, speedup, and
the exact output distribution of the rejection sampler computed by enumeration.

With per-token acceptance probability alpha (assumed the same at every position), k drafted
tokens and a draft that costs c target forward passes per drafted token (Leviathan et al. 2023):

    alpha                   = sum_x min(p(x), q(x)) = 1 - TV(p, q)      (total variation, not KL)
    tokens per verification = (1 - alpha^(k + 1)) / (1 - alpha)           (accepted + 1)
    speedup                 = tokens per verification / (k c + 1)

The "+1" in the cost is the target's verification pass, which costs about as much as one decode
step only while decoding is memory-bound (chapter 00): reading the weights once serves k + 1
positions as cheaply as one.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable

import torch


def acceptance_prob(p: torch.Tensor, q: torch.Tensor) -> float:
    """alpha = sum_x min(p(x), q(x)): the chance a draft token drawn from q is accepted."""
    return float(torch.minimum(p.double(), q.double()).sum())


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p.double() - q.double()).abs().sum())


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted per verification pass: 1 + alpha + ... + alpha^k."""
    if not 0 <= alpha <= 1 or k < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and k >= 0, got alpha={alpha}, k={k}")
    if alpha == 1:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def speedup(alpha: float, k: int, c: float) -> float:
    """Expected speedup over plain decoding: tokens per verification / (k c + 1)."""
    if c < 0:
        raise ValueError(f"the draft's relative cost c must be >= 0, got {c}")
    return expected_tokens(alpha, k) / (k * c + 1)


def break_even_alpha(k: int, c: float, tol: float = 1e-9) -> float:
    """The acceptance rate at which speculation neither gains nor loses (speedup == 1)."""
    if speedup(0.0, k, c) >= 1:
        return 0.0
    if speedup(1.0, k, c) < 1:
        return math.nan                                       # never pays with this k and c
    lo, hi = 0.0, 1.0
    while hi - lo > tol:                                      # speedup grows with alpha
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speedup(mid, k, c) < 1 else (lo, mid)
    return (lo + hi) / 2


# --- the exact output distribution, by enumeration ------------------------------------------------
Dist = Callable[[tuple], torch.Tensor]        # prefix (tuple of token ids) -> probabilities [V]


def round_outcomes(p: Dist, q: Dist, k: int, prefix: tuple = ()) -> dict:
    """Every way one round of draft-then-verify can end, with its probability, computed from
    the formulas (not by running the sampler). p(prefix) and q(prefix) give the target's and
    the draft's next-token distributions; q(prefix) may be one-hot. Returns {emitted tokens:
    probability} over tuples of 1 .. k + 1 tokens."""
    out: dict = {}

    def walk(pre: tuple, emitted: tuple, depth: int, prob: float):
        pt = p(pre).double()
        if depth == k:                                        # all drafts accepted: bonus token
            for x in range(pt.shape[0]):
                if pt[x] > 0:
                    _add(out, emitted + (x,), prob * float(pt[x]))
            return
        qt = q(pre).double()
        rejected = 0.0                                        # P(reject | this position)
        for d in range(qt.shape[0]):
            if qt[d] <= 0:
                continue
            acc = min(1.0, float(pt[d] / qt[d]))
            rejected += float(qt[d]) * (1 - acc)
            if acc > 0:
                walk(pre + (d,), emitted + (d,), depth + 1, prob * float(qt[d]) * acc)
        if rejected > 0:
            r = (pt - qt).clamp_min(0)
            r = r / r.sum()
            for x in range(r.shape[0]):
                if r[x] > 0:
                    _add(out, emitted + (x,), prob * rejected * float(r[x]))

    walk(tuple(prefix), (), 0, 1.0)
    return out


def _add(d: dict, key, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


def sequence_distribution(p: Dist, q: Dist, k: int, length: int) -> dict:
    """Distribution of the first `length` tokens speculative decoding emits (as many rounds as
    it takes), by enumeration: {tuple of `length` ids: probability}."""
    return rounds_distribution(lambda prefix: round_outcomes(p, q, k, prefix), length)


def rounds_distribution(one_round: Callable, length: int) -> dict:
    """{first `length` tokens: probability} when rounds repeat, each round's outcomes given by
    one_round(prefix) -> {emitted tokens: probability} (a chain's `round_outcomes`, a tree's
    `tree.tree_round_outcomes` / `tree.static_tree_outcomes`), by enumeration."""
    out: dict = {}

    def grow(prefix: tuple, prob: float):
        if len(prefix) >= length:
            _add(out, prefix[:length], prob)
            return
        for emitted, pr in one_round(prefix).items():
            grow(prefix + emitted, prob * pr)

    grow((), 1.0)
    return out


def target_sequence_distribution(p: Dist, vocab_size: int, length: int) -> dict:
    """The same for plain sampling from the target: prod_t p(x_t | x_<t)."""
    out = {}
    for seq in itertools.product(range(vocab_size), repeat=length):
        prob = 1.0
        for t in range(length):
            prob *= float(p(seq[:t])[seq[t]])
        out[seq] = prob
    return out


def max_abs_difference(a: dict, b: dict) -> float:
    keys = set(a) | set(b)
    return max(abs(a.get(x, 0.0) - b.get(x, 0.0)) for x in keys)


def random_tree(vocab_size: int, seed: int, zeros: float = 0.0, one_hot: bool = False) -> Dist:
    """A random next-token distribution for every prefix (memoised), for the exactness proofs:
    `zeros` is the chance that an entry is 0 (q = 0 where p > 0 appears this way); one_hot
    gives a draft that proposes one token with certainty, like n-gram lookup."""
    memo: dict = {}

    def dist(prefix: tuple) -> torch.Tensor:
        if prefix not in memo:
            g = torch.Generator().manual_seed(hash((seed,) + tuple(prefix)) % 2**62)
            if one_hot:
                x = torch.zeros(vocab_size, dtype=torch.float64)
                x[int(torch.randint(vocab_size, (1,), generator=g))] = 1.0
            else:
                x = torch.rand(vocab_size, generator=g, dtype=torch.float64) ** 2
                if zeros:
                    mask = torch.rand(vocab_size, generator=g, dtype=torch.float64) < zeros
                    keep = int(torch.randint(vocab_size, (1,), generator=g))
                    mask[keep] = False                        # never all zero
                    x = x.masked_fill(mask, 0.0)
                x = x / x.sum()
            memo[prefix] = x
        return memo[prefix]

    return dist


def run_rounds(p: Dist, q: Dist, k: int, length: int, generator: torch.Generator,
               sampler=None) -> tuple:
    """Sample `length` tokens by speculative decoding with the real sampler (default
    minillm.spec.rejection_sample): drafts drawn from q, verified against p. Returns the tuple."""
    if sampler is None:
        from .rejection import rejection_sample as sampler
    seq: tuple = ()
    while len(seq) < length:
        drafts, qs, ps = [], [], []
        for _ in range(k):
            qt = q(seq + tuple(drafts))
            ps.append(p(seq + tuple(drafts)))
            qs.append(qt)
            drafts.append(int(torch.multinomial(qt.float(), 1, generator=generator)))
        ps.append(p(seq + tuple(drafts)))
        seq += tuple(sampler(torch.stack(ps), drafts, torch.stack(qs), generator))
    return seq[:length]


def chi_square(counts: dict, probs: dict) -> tuple:
    """Pearson's chi-square statistic of observed counts against expected probabilities, and
    its p-value (upper tail, df = cells with probability > 0, minus 1)."""
    n = sum(counts.values())
    cells = [x for x, pr in probs.items() if pr > 0]
    if any(counts.get(x, 0) for x in counts if probs.get(x, 0) == 0):
        return math.inf, 0.0                                   # an impossible outcome happened
    stat = sum((counts.get(x, 0) - n * probs[x]) ** 2 / (n * probs[x]) for x in cells)
    df = len(cells) - 1
    pval = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, pval
