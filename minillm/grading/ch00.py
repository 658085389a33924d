"""Graders for the chapter 00 problem set (solutions/00_foundations.ipynb).

    ch00.check_cached_attention(cached_attention)   # (a) write this step's K/V, attend causally
    ch00.check_top_p(top_p_filter)                  # (b) nucleus filter
    ch00.check_top_k(top_k_filter)                  # (c) top-k filter

The references are minillm's own `model.causal_attention` and `sampling.top_p_filter` /
`sampling.top_k_filter`. Every case is small, seeded and on the CPU.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..model import causal_attention
from ..sampling import top_k_filter, top_p_filter
from .core import Check, Exercise


def _fmt(values, digits: int = 3) -> str:
    return "[" + ", ".join(f"{float(x):.{digits}g}" for x in values) + "]"


def _tensor_problem(out, shape) -> Optional[str]:
    """None when `out` is a tensor of `shape`, else what is wrong with it."""
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}; expected a tensor of shape {list(shape)}"
    if tuple(out.shape) != tuple(shape):
        return f"returned shape {list(out.shape)}; expected {list(shape)}"
    return None


# =========================================================================== (a) cached attention

class _Case:
    """One call of cached_attention: inputs, and what minillm's reference makes of them."""

    def __init__(self, label, B, T, H, KVH, D, start, max_len, seed):
        self.label, self.T, self.start, self.max_len = label, T, start, max_len
        self.H, self.KVH = H, KVH
        g = torch.Generator().manual_seed(seed)
        self.q = torch.randn(B, T, H, D, generator=g)                 # [B, T, H, D]
        self.k = torch.randn(B, T, KVH, D, generator=g)               # [B, T, KVH, D]
        self.v = torch.randn(B, T, KVH, D, generator=g)
        # Positions < start hold earlier tokens; positions >= start are stale garbage, as in a
        # reused slab. Big values, so reading them by mistake changes the output a lot.
        self.k_cache = torch.randn(B, max_len, KVH, D, generator=g)   # [B, max_len, KVH, D]
        self.v_cache = torch.randn(B, max_len, KVH, D, generator=g)
        self.k_cache[:, start:] = 4 * torch.randn(B, max_len - start, KVH, D, generator=g)
        self.v_cache[:, start:] = 4 * torch.randn(B, max_len - start, KVH, D, generator=g) + 3
        end = start + T
        self.k_ref, self.v_ref = self.k_cache.clone(), self.v_cache.clone()
        self.k_ref[:, start:end], self.v_ref[:, start:end] = self.k, self.v
        self.expected = causal_attention(self.q, self.k_ref[:, :end], self.v_ref[:, :end],
                                         q_start=start)              # [B, T, H, D]

    def describe(self) -> str:
        return (f"{self.label} (start={self.start}, T={self.T}, H={self.H}, KVH={self.KVH}, "
                f"max_len={self.max_len})")

    def run(self, fn):
        """Call the learner on fresh copies; returns (output, k_cache, v_cache) after the call."""
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        out = fn(self.q.clone(), self.k.clone(), self.v.clone(), kc, vc, self.start)
        return out, kc, vc


_PREFILL = dict(label="prefill", B=2, T=5, H=2, KVH=2, D=16, start=0, max_len=12, seed=1)
_DECODE = dict(label="decode step", B=2, T=1, H=2, KVH=2, D=16, start=7, max_len=12, seed=2)
_CHUNK = dict(label="chunk after a prefix", B=1, T=4, H=2, KVH=2, D=16, start=5, max_len=12,
              seed=3)
_GQA = dict(label="GQA", B=2, T=3, H=8, KVH=2, D=16, start=4, max_len=10, seed=4)


def _attention_variant(case: _Case, mask: str = "causal", keys: str = "cached",
                       heads: str = "grouped") -> torch.Tensor:
    """Attention with one known mistake, to name the mistake a learner's output matches."""
    q, start, T = case.q, case.start, case.T
    end = start + T
    if keys == "new_only":
        k, v, k_start = case.k, case.v, start
    elif keys == "whole_slab":
        k, v, k_start = case.k_ref, case.v_ref, 0
    else:
        k, v, k_start = case.k_ref[:, :end], case.v_ref[:, :end], 0
    group = case.H // case.KVH
    if heads == "tiled":
        k, v = k.repeat(1, 1, group, 1), v.repeat(1, 1, group, 1)
    else:
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    q_pos = torch.arange(start, end)[:, None] - (start if mask == "ignores_start" else 0)
    k_pos = torch.arange(k_start, k_start + k.shape[1])[None, :]
    if mask in ("causal", "ignores_start"):
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    elif mask == "hides_self":
        scores = scores.masked_fill(k_pos >= q_pos, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


_DIAGNOSES = [
    (dict(mask="none"), "it equals attention with no causal mask: query i also sees the keys "
                        "after it"),
    (dict(mask="ignores_start"), "it equals a mask that places query i at position i instead "
     "of start + i, so the cache offset is ignored (F.scaled_dot_product_attention with "
     "is_causal=True aligns its mask this way when there are more keys than queries)"),
    (dict(mask="hides_self"), "it equals a mask where a query cannot see its own key; a query at "
                              "position p must see keys 0 .. p (key_pos <= query_pos)"),
    (dict(keys="new_only"), "it equals attention over this step's tokens only; the cached "
                            "positions 0 .. start-1 were left out"),
    (dict(keys="whole_slab", mask="none"), "it equals attention over the whole max_len slab; "
     "the stale slots after start + T must not be read"),
    (dict(heads="tiled"), "it equals GQA with query head h reading KV head h % KVH; query "
     "heads come in consecutive groups, so head h reads KV head h // (H // KVH) "
     "(repeat_interleave, not repeat)"),
]


def _attention_output_check(spec):
    def check(fn):
        case = _Case(**spec)
        out, _, _ = case.run(fn)
        problem = _tensor_problem(out, case.expected.shape)
        if problem:
            return False, f"{case.describe()}: {problem}"
        out = out.detach().float()
        if torch.allclose(out, case.expected, atol=1e-4, rtol=1e-4):
            return True, ""
        where = f"{case.describe()}: your output differs from causal attention"
        if torch.isnan(out).any():
            b, i, h, _ = torch.nonzero(torch.isnan(out))[0].tolist()
            return False, (f"{where}: NaN at batch {b}, query {i} (position {case.start + i}), "
                           f"head {h}; a query whose keys are all masked gives NaN")
        for variant, sentence in _DIAGNOSES:
            alt = _attention_variant(case, **variant)
            if not torch.allclose(alt, case.expected, atol=1e-4, rtol=1e-4) and \
                    torch.allclose(out, alt, atol=1e-4, rtol=1e-4):
                return False, f"{where}: {sentence}"
        err = (out - case.expected).abs()                               # [B, T, H, D]
        b, i, h, _ = torch.nonzero(err == err.max())[0].tolist()
        return False, (f"{where}, worst at batch {b}, query {i} (position {case.start + i}), "
                       f"head {h}: max abs error {err.max().item():.3g}")
    return check


def _writes_new_kv(fn):
    for spec in (_PREFILL, _DECODE, _CHUNK, _GQA):
        case = _Case(**spec)
        _, kc, vc = case.run(fn)
        for name, cache, new in (("k_cache", kc, case.k), ("v_cache", vc, case.v)):
            s, e = case.start, case.start + case.T
            if torch.equal(cache[:, s:e], new):
                continue
            found = [[p for p in range(cache.shape[1]) if torch.equal(cache[:, p], new[:, i])]
                     for i in range(case.T)]
            seen = "; ".join(f"token {i} found at {f if f else 'no position'}"
                             for i, f in enumerate(found))
            return False, (f"{case.describe()}: {name}[:, {s}:{e}] does not hold this step's "
                           f"values ({seen}); token i of this step belongs at position start + i")
    return True, ""


def _leaves_rest(fn):
    for spec in (_PREFILL, _DECODE, _CHUNK, _GQA):
        case = _Case(**spec)
        _, kc, vc = case.run(fn)
        s, e = case.start, case.start + case.T
        for name, cache, before in (("k_cache", kc, case.k_cache), ("v_cache", vc, case.v_cache)):
            changed = [p for p in range(cache.shape[1])
                       if not (s <= p < e) and not torch.equal(cache[:, p], before[:, p])]
            if changed:
                return False, (f"{case.describe()}: positions {changed} of {name} changed; only "
                               f"positions {s} .. {e - 1} may be written")
    return True, ""


CACHED_ATTENTION = Exercise("ch00.cached_attention", "cached_attention", (
    Check("writes this step's k and v at positions start .. start+T-1", _writes_new_kv),
    Check("leaves every other cache position untouched", _leaves_rest),
    Check("prefill (start = 0): query i sees keys 0 .. i", _attention_output_check(_PREFILL)),
    Check("decode step (T = 1): the new query sees every cached position and no stale slot",
          _attention_output_check(_DECODE)),
    Check("chunk after a prefix (start > 0, T > 1): query i sits at position start + i",
          _attention_output_check(_CHUNK)),
    Check("GQA: query head h reads KV head h // (H // KVH)", _attention_output_check(_GQA)),
))


def check_cached_attention(cached_attention, time_limit: Optional[float] = None):
    """Grade exercise (a): cached_attention(q, k, v, k_cache, v_cache, start) -> [B, T, H, D]."""
    return CACHED_ATTENTION.check(cached_attention, time_limit)


# =========================================================================== (b), (c) filters

_PROBS = [0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005]     # cumulative .40 .65 .80 .90 ...
_PEAKED = [0.90, 0.05, 0.03, 0.02, 0.0, 0.0, 0.0, 0.0]
_FLAT = [0.16, 0.15, 0.14, 0.13, 0.12, 0.11, 0.10, 0.09]
_SHUFFLE = [5, 2, 7, 0, 3, 6, 1, 4]          # token id of the i-th most likely token


def _logits_from_probs(rows, shuffle=False, offset=2.5) -> torch.Tensor:
    """Logits [B, V] whose softmax is each row of `rows` (0 -> -30, i.e. practically 0)."""
    p = torch.tensor(rows, dtype=torch.float64)
    logits = torch.where(p > 0, p.clamp_min(1e-300).log(), torch.full_like(p, -30.0)) + offset
    if shuffle:
        shuffled = torch.empty_like(logits)
        shuffled[:, _SHUFFLE] = logits
        logits = shuffled
    return logits.float()


def _kept(out: torch.Tensor) -> torch.Tensor:
    """Which tokens a filter kept: everything not set to -inf (NaN counts as dropped)."""
    return out > float("-inf")


def _filter_call(fn, logits, arg):
    """Run fn(logits, arg) on a copy; returns (kept mask or None, output, problem)."""
    out = fn(logits.clone(), arg)
    problem = _tensor_problem(out, logits.shape)
    if problem:
        return None, out, problem
    return _kept(out.detach()), out.detach(), None


def _ids(mask_row) -> list[int]:
    return torch.nonzero(mask_row).flatten().tolist()


def _compare_sets(fn, reference, logits, arg, what, show="probabilities") -> tuple[bool, str]:
    """Kept set of fn vs reference on every row; message names row, argument and both sets."""
    kept, out, problem = _filter_call(fn, logits, arg)
    if problem:
        return False, f"{what}: {problem}"
    expected = _kept(reference(logits.clone(), arg))
    if torch.equal(kept, expected):
        return True, ""
    probs = logits.softmax(-1)
    for b in range(logits.shape[0]):
        if not torch.equal(kept[b], expected[b]):
            row = f", row {b}" if logits.shape[0] > 1 else ""
            mine, want = _ids(kept[b]), _ids(expected[b])
            hint = ""
            if not torch.isinf(out[b]).any() and len(want) < logits.shape[1]:
                hint = " (dropped tokens must be set to -inf)"
            if logits.shape[1] > 12:                    # too long to print: name the difference
                extra, missing = _ids(kept[b] & ~expected[b]), _ids(expected[b] & ~kept[b])
                parts = [f"kept {len(mine)} of {logits.shape[1]} tokens, expected {len(want)}"]
                if missing:
                    parts.append(f"wrongly dropped token ids {missing[:10]}"
                                 f"{' ...' if len(missing) > 10 else ''}")
                if extra:
                    parts.append(f"wrongly kept token ids {extra[:10]}"
                                 f"{' ...' if len(extra) > 10 else ''}")
                return False, f"{what}{row}: you " + "; ".join(parts) + hint
            if show == "probabilities":
                shown = f"probabilities by token id {_fmt(probs[b], 2)}"
                totals = (f" (total probability {probs[b][kept[b]].sum():.3g})",
                          f" (total {probs[b][expected[b]].sum():.3g})")
            else:
                shown, totals = f"logits by token id {_fmt(logits[b], 2)}", ("", "")
            return False, (f"{what}{row}, {shown}: you kept token ids {mine}{totals[0]}, "
                           f"expected {want}{totals[1]}{hint}")
    return False, f"{what}: the kept tokens differ from the reference"


def _keeps_values(fn, logits, arg, reference, what) -> tuple[bool, str]:
    original = logits.clone()
    out = fn(logits, arg)
    if not torch.equal(logits, original):
        return False, f"{what}: your function changed its input logits; work on a copy"
    problem = _tensor_problem(out, logits.shape)
    if problem:
        return False, f"{what}: {problem}"
    expected = reference(original.clone(), arg)
    keep = _kept(expected)
    out = out.detach().float()
    if not torch.allclose(out[keep], original[keep], atol=1e-6, rtol=0):
        return False, (f"{what}: kept logits were changed ({_fmt(out[keep][:4])} ... instead of "
                       f"{_fmt(original[keep][:4])} ...); return the logits themselves, not "
                       "probabilities or shifted values")
    dropped = out[~keep]
    if not (dropped == float("-inf")).all():
        return False, (f"{what}: dropped tokens hold {_fmt(dropped[:4])} ...; they must be -inf "
                       "so softmax gives them probability 0")
    return True, ""


# ---- top-p

def _top_p_sizes(fn):
    logits = _logits_from_probs([_PROBS])
    for p in (0.3, 0.5, 0.7, 0.85, 0.97):
        ok, msg = _compare_sets(fn, top_p_filter, logits, p, f"p={p}")
        if not ok:
            return ok, msg
    return True, ""


def _top_p_keeps_top(fn):
    for rows, p in (([_PROBS], 0.1), ([_PROBS], 0.01), ([_PEAKED], 0.5)):
        ok, msg = _compare_sets(fn, top_p_filter, _logits_from_probs(rows), p, f"p={p}")
        if not ok:
            return ok, msg + "; the most likely token is always kept"
    return True, ""


def _top_p_one_keeps_all(fn):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 64, generator=g) * 3
    logits[:, ::7] = -25.0                                  # a tail of tiny probabilities
    ok, msg = _compare_sets(fn, top_p_filter, logits, 1.0, "p=1.0 (disabled) on 64 tokens")
    if not ok:
        msg += ("; a float cumulative sum can pass 1.0 before the last token, so treat "
                "p >= 1 as 'keep everything'")
    return ok, msg


def _top_p_shuffled(fn):
    logits = _logits_from_probs([_PROBS], shuffle=True)
    for p in (0.5, 0.7):
        ok, msg = _compare_sets(fn, top_p_filter, logits, p, f"p={p} with the tokens in "
                                "shuffled order")
        if not ok:
            return ok, msg + "; after sorting, map the decision back to the original token ids"
    return True, ""


def _top_p_batch(fn):
    rows = [_PROBS, _PEAKED, _FLAT]
    logits = _logits_from_probs(rows, shuffle=True)
    logits[1] = logits[1].flip(0)
    return _compare_sets(fn, top_p_filter, logits, 0.6, "p=0.6 on a batch of 3 rows")


def _top_p_values(fn):
    return _keeps_values(fn, _logits_from_probs([_PROBS, _FLAT], shuffle=True), 0.7,
                         top_p_filter, "p=0.7")


TOP_P = Exercise("ch00.top_p", "top_p_filter", (
    Check("keeps the smallest set of most likely tokens whose probability reaches p",
          _top_p_sizes),
    Check("always keeps the most likely token, even when p is below its probability",
          _top_p_keeps_top),
    Check("p = 1.0 keeps every token", _top_p_one_keeps_all),
    Check("keeps the right token ids when the vocabulary is not sorted", _top_p_shuffled),
    Check("filters each row of a batch on its own", _top_p_batch),
    Check("returns logits: kept ones unchanged, dropped ones -inf, input untouched",
          _top_p_values),
))


def check_top_p(top_p_filter, time_limit: Optional[float] = None):
    """Grade exercise (b): top_p_filter(logits [B, V], p) -> logits with dropped tokens at -inf."""
    return TOP_P.check(top_p_filter, time_limit)


# ---- top-k

def _distinct_logits(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.linspace(-3.0, 4.0, 10)                     # distinct values, no ties
    return torch.stack([base[torch.randperm(10, generator=g)] for _ in range(rows)])


def _top_k_sizes(fn):
    logits = _distinct_logits(1, 6)
    for k in (1, 3, 5):
        ok, msg = _compare_sets(fn, top_k_filter, logits, k, f"k={k}", show="logits")
        if not ok:
            return ok, msg
    return True, ""


def _top_k_disabled(fn):
    return _compare_sets(fn, top_k_filter, _distinct_logits(2, 7), -1, "k=-1 (disabled)",
                         show="logits")


def _top_k_large(fn):
    logits = _distinct_logits(2, 8)
    for k in (10, 50):
        ok, msg = _compare_sets(fn, top_k_filter, logits, k, f"k={k} with 10 tokens",
                                show="logits")
        if not ok:
            return ok, msg
    return True, ""


def _top_k_batch(fn):
    return _compare_sets(fn, top_k_filter, _distinct_logits(3, 9), 2, "k=2 on a batch of 3 rows",
                         show="logits")


def _top_k_values(fn):
    return _keeps_values(fn, _distinct_logits(2, 10), 4, top_k_filter, "k=4")


TOP_K = Exercise("ch00.top_k", "top_k_filter", (
    Check("keeps exactly the k largest logits", _top_k_sizes),
    Check("k = -1 keeps every token", _top_k_disabled),
    Check("k at or above the vocabulary size keeps every token", _top_k_large),
    Check("filters each row of a batch on its own", _top_k_batch),
    Check("returns logits: kept ones unchanged, dropped ones -inf, input untouched",
          _top_k_values),
))


def check_top_k(top_k_filter, time_limit: Optional[float] = None):
    """Grade exercise (c): top_k_filter(logits [B, V], k) -> logits with dropped tokens at -inf."""
    return TOP_K.check(top_k_filter, time_limit)


EXERCISES = (CACHED_ATTENTION, TOP_P, TOP_K)
