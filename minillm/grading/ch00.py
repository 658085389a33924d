"""Graders for the chapter 00 problem set (solutions/00_foundations.ipynb).

    ch00.check_cached_attention(cached_attention)   # (a) write this step's K/V, attend causally
    ch00.check_top_p(top_p_filter)                  # (b) nucleus filter
    ch00.check_top_k(top_k_filter)                  # (c) top-k filter
    ch00.check_roofline_step(roofline_step)         # (d) FLOPs, bytes and roofline time of a step

The references are minillm's own `model.causal_attention`, `sampling.top_p_filter` /
`sampling.top_k_filter` and the counts of `minillm.roofline` (`forward_flops`, `bytes_moved`,
`ridge_point`, `attainable`). Every case is small, seeded and on the CPU.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import roofline
from ..configs import get as _get_config
from ..kvmath import param_count
from ..model import causal_attention
from ..sampling import top_k_filter, top_p_filter
from .core import Check, Exercise, Problem, expect_value_error
from .hints import one_fit


def _close_tensors(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-4, rtol=1e-4)


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
            raise Problem(f"{case.describe()}: {problem}")
        out = out.detach().float()
        if torch.allclose(out, case.expected, atol=1e-4, rtol=1e-4):
            return
        where = f"{case.describe()}: your output differs from causal attention"
        if torch.isnan(out).any():
            b, i, h, _ = torch.nonzero(torch.isnan(out))[0].tolist()
            raise Problem(f"{where}: NaN at batch {b}, query {i} (position {case.start + i}), "
                          f"head {h}; a query whose keys are all masked gives NaN")
        sentence = one_fit(out, [(_attention_variant(case, **v), s) for v, s in _DIAGNOSES],
                           expected=case.expected, same=_close_tensors)
        if sentence:
            raise Problem(f"{where}: {sentence}")
        err = (out - case.expected).abs()                               # [B, T, H, D]
        b, i, h, _ = torch.nonzero(err == err.max())[0].tolist()
        raise Problem(f"{where}, worst at batch {b}, query {i} (position {case.start + i}), "
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
            raise Problem(f"{case.describe()}: {name}[:, {s}:{e}] does not hold this step's "
                          f"values ({seen}); token i of this step belongs at position start + i")


def _leaves_rest(fn):
    for spec in (_PREFILL, _DECODE, _CHUNK, _GQA):
        case = _Case(**spec)
        _, kc, vc = case.run(fn)
        s, e = case.start, case.start + case.T
        for name, cache, before in (("k_cache", kc, case.k_cache), ("v_cache", vc, case.v_cache)):
            changed = [p for p in range(cache.shape[1])
                       if not (s <= p < e) and not torch.equal(cache[:, p], before[:, p])]
            if changed:
                raise Problem(f"{case.describe()}: positions {changed} of {name} changed; only "
                              f"positions {s} .. {e - 1} may be written")


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


def _compare_sets(fn, reference, logits, arg, what, show="probabilities", fix="") -> None:
    """Kept set of fn vs reference on every row; the Problem names row, argument and both sets
    (then `fix`, when the case teaches one)."""
    kept, out, problem = _filter_call(fn, logits, arg)
    if problem:
        raise Problem(f"{what}: {problem}{fix}")
    expected = _kept(reference(logits.clone(), arg))
    if torch.equal(kept, expected):
        return
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
                raise Problem(f"{what}{row}: you " + "; ".join(parts) + hint + fix)
            if show == "probabilities":
                shown = f"probabilities by token id {_fmt(probs[b], 2)}"
                totals = (f" (total probability {probs[b][kept[b]].sum():.3g})",
                          f" (total {probs[b][expected[b]].sum():.3g})")
            else:
                shown, totals = f"logits by token id {_fmt(logits[b], 2)}", ("", "")
            raise Problem(f"{what}{row}, {shown}: you kept token ids {mine}{totals[0]}, "
                          f"expected {want}{totals[1]}{hint}{fix}")
    raise Problem(f"{what}: the kept tokens differ from the reference{fix}")


def _keeps_values(fn, logits, arg, reference, what) -> None:
    original = logits.clone()
    out = fn(logits, arg)
    if not torch.equal(logits, original):
        raise Problem(f"{what}: your function changed its input logits; work on a copy")
    problem = _tensor_problem(out, logits.shape)
    if problem:
        raise Problem(f"{what}: {problem}")
    expected = reference(original.clone(), arg)
    keep = _kept(expected)
    out = out.detach().float()
    if not torch.allclose(out[keep], original[keep], atol=1e-6, rtol=0):
        raise Problem(f"{what}: kept logits were changed ({_fmt(out[keep][:4])} ... instead of "
                      f"{_fmt(original[keep][:4])} ...); return the logits themselves, not "
                      "probabilities or shifted values")
    dropped = out[~keep]
    if not (dropped == float("-inf")).all():
        raise Problem(f"{what}: dropped tokens hold {_fmt(dropped[:4])} ...; they must be -inf "
                      "so softmax gives them probability 0")


# ---- top-p

def _top_p_sizes(fn):
    logits = _logits_from_probs([_PROBS])
    for p in (0.3, 0.5, 0.7, 0.85, 0.97):
        _compare_sets(fn, top_p_filter, logits, p, f"p={p}")


def _top_p_keeps_top(fn):
    for rows, p in (([_PROBS], 0.1), ([_PROBS], 0.01), ([_PEAKED], 0.5)):
        _compare_sets(fn, top_p_filter, _logits_from_probs(rows), p, f"p={p}",
                      fix="; the most likely token is always kept")


def _top_p_one_keeps_all(fn):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 64, generator=g) * 3
    logits[:, ::7] = -25.0                                  # a tail of tiny probabilities
    _compare_sets(fn, top_p_filter, logits, 1.0, "p=1.0 (disabled) on 64 tokens",
                  fix="; a float cumulative sum can pass 1.0 before the last token, so treat "
                      "p >= 1 as 'keep everything'")


def _top_p_shuffled(fn):
    logits = _logits_from_probs([_PROBS], shuffle=True)
    for p in (0.5, 0.7):
        _compare_sets(fn, top_p_filter, logits, p, f"p={p} with the tokens in shuffled order",
                      fix="; after sorting, map the decision back to the original token ids")


def _top_p_batch(fn):
    rows = [_PROBS, _PEAKED, _FLAT]
    logits = _logits_from_probs(rows, shuffle=True)
    logits[1] = logits[1].flip(0)
    _compare_sets(fn, top_p_filter, logits, 0.6, "p=0.6 on a batch of 3 rows")


def _top_p_values(fn):
    _keeps_values(fn, _logits_from_probs([_PROBS, _FLAT], shuffle=True), 0.7, top_p_filter,
                  "p=0.7")


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
        _compare_sets(fn, top_k_filter, logits, k, f"k={k}", show="logits")


def _top_k_disabled(fn):
    _compare_sets(fn, top_k_filter, _distinct_logits(2, 7), -1, "k=-1 (disabled)",
                  show="logits")


def _top_k_large(fn):
    logits = _distinct_logits(2, 8)
    for k in (10, 50):
        _compare_sets(fn, top_k_filter, logits, k, f"k={k} with 10 tokens", show="logits")


def _top_k_batch(fn):
    _compare_sets(fn, top_k_filter, _distinct_logits(3, 9), 2, "k=2 on a batch of 3 rows",
                  show="logits")


def _top_k_values(fn):
    _keeps_values(fn, _distinct_logits(2, 10), 4, top_k_filter, "k=4")


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



# =========================================================================== (d) roofline step

_DTYPE_NAMES = {4: "float32", 2: "bfloat16", 1: "fp8"}
_FIELDS = ("flops", "bytes", "intensity", "seconds", "bound")
# machines: (name, bandwidth bytes/s, peak FLOP/s)
_H100 = ("H100 SXM (datasheet, bf16)", 3.35e12, 989e12)
_A100 = ("A100 SXM (datasheet, bf16)", 2.039e12, 312e12)
_LAPTOP = ("a CPU core (measured in chapter 00)", 6.6e9, 100e9)


class _Step:
    """One call of roofline_step and what minillm.roofline makes of it."""

    def __init__(self, model, batch, num_tokens, context, bytes_per_value, machine):
        self.model, self.cfg = model, _get_config(model)
        self.batch, self.num_tokens, self.context = batch, num_tokens, context
        self.bytes_per_value = bytes_per_value
        self.machine, self.bandwidth, self.peak = machine
        flops = roofline.forward_flops(self.cfg, num_tokens, context, batch)
        nbytes = roofline.bytes_moved(self.cfg, batch, num_tokens, context,
                                      dtype=_DTYPE_NAMES[bytes_per_value])
        intensity = flops / nbytes
        self.expected = {
            "flops": flops, "bytes": nbytes, "intensity": intensity,
            "seconds": flops / roofline.attainable(intensity, self.bandwidth, self.peak),
            "bound": ("memory" if intensity < roofline.ridge_point(self.bandwidth, self.peak)
                      else "compute"),
        }

    def args(self):
        return (self.cfg, self.batch, self.num_tokens, self.context, self.bytes_per_value,
                self.bandwidth, self.peak)

    def describe(self) -> str:
        kind = "decode" if self.num_tokens == 1 else "prefill"
        return (f"{self.model}, {kind} batch={self.batch} num_tokens={self.num_tokens} "
                f"context={self.context}, {self.bytes_per_value} bytes per value, "
                f"on {self.machine}")

    # --- what the common mistakes produce, field by field
    def _attention(self, per_key=4, heads=None, keys="causal"):
        cfg, nt, ctx = self.cfg, self.num_tokens, self.context
        seen = nt * (ctx + nt) if keys == "square" else nt * ctx + nt * (nt + 1) // 2
        return (self.batch * cfg.num_layers * (heads or cfg.num_heads) * per_key * cfg.head_dim
                * seen)

    def flops_variants(self):
        cfg, tokens = self.cfg, self.batch * self.num_tokens
        matmul = roofline.matmul_params(cfg)
        head = cfg.vocab_size * cfg.hidden_size
        attn = self._attention()
        return [
            (2 * param_count(cfg) * tokens + attn, "you counted 2 FLOPs for every parameter; "
             "only the matmul weights multiply (q/k/v/o, MLP, output head): norms are "
             "element-wise and the input embedding is a lookup"),
            (2 * (matmul - head) * tokens + attn, "the output head (vocab x hidden) is missing: "
             "it multiplies every token too"),
            (2 * matmul * tokens, "attention's FLOPs are missing: 4 x head_dim per query head, "
             "layer and visible key"),
            (2 * matmul * tokens + self._attention(per_key=2), "attention counts only half: q.k "
             "costs 2 x head_dim per key and p.v another 2 x head_dim, so 4 x head_dim"),
            (2 * matmul * tokens + self._attention(keys="square"), "attention is not causal "
             "here: query p sees p + 1 keys, so a step of T new tokens after C cached ones sees "
             "T x C + T (T + 1) / 2 keys in all, not T x (C + T)"),
            (2 * matmul * tokens + self._attention(heads=cfg.num_kv_heads), "attention uses the "
             "KV heads; every query head does its own products (GQA shares K/V, not the work), "
             "so count num_heads"),
            (2 * matmul * self.num_tokens + attn // self.batch, "the batch is missing: every "
             "sequence of the batch does the same work"),
            (2 * matmul + attn, "the matmul work is counted once per step; it is per token"),
        ]

    def bytes_variants(self):
        cfg, bpv, b = self.cfg, self.bytes_per_value, self.batch
        weights = roofline.weight_read_params(cfg) * bpv
        kv_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * bpv
        kv = b * (self.context + self.num_tokens) * kv_token
        per_token = [] if self.num_tokens == 1 else [   # with 1 token per sequence: the same
            (weights * b * self.num_tokens + kv, "the weights are counted once per token; a step "
             "reads them once, whatever the number of tokens")]
        return per_token + [
            (weights * b + kv, "the weights are counted once per sequence; a step reads them "
             "once, whatever the batch (that is why batching helps)"),
            (param_count(cfg) * bpv + kv, "the whole input-embedding table is counted; an untied "
             "embedding is a lookup that reads only its tokens' rows (count param_count minus "
             "vocab x hidden when the embedding is not tied to the output head)"),
            (weights + b * self.context * kv_token, "the K/V writes of the new tokens are "
             "missing: each new token stores its keys and values (batch x num_tokens x KV bytes "
             "per token)"),
            (weights + (self.context + self.num_tokens) * kv_token, "the KV cache is counted "
             "once; every sequence of the batch reads its own"),
            (weights + kv * cfg.num_heads // cfg.num_kv_heads, "the KV cache is counted with "
             "num_heads; it holds num_kv_heads heads (GQA)"),
            (weights + kv // 2, "the KV cache counts only K or only V: 2 x layers x KV heads x "
             "head_dim values per token"),
            (roofline.weight_read_params(cfg) * 2 + kv // bpv * 2, "you used 2 bytes per value; "
             "use bytes_per_value"),
            (weights, "the KV cache is missing: each sequence reads its cached K/V and writes its "
             "new tokens' K/V"),
        ]

    def seconds_variants(self):
        f, m = self.expected["flops"], self.expected["bytes"]
        return [
            (f / self.peak + m / self.bandwidth, "you added compute time and memory time; the "
             "roofline bound is the slower of the two (they overlap), max(F / peak, M / bw)"),
            (min(f / self.peak, m / self.bandwidth), "you took the faster of the two times; the "
             "step cannot beat the slower one: max(F / peak, M / bw)"),
            (f / self.bandwidth, "you divided FLOPs by the bandwidth"),
        ]


def _close(a, b, rel=1e-9) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


def _call_roofline(fn, step: _Step) -> dict:
    out = fn(*step.args())
    if not isinstance(out, dict) or any(k not in out for k in _FIELDS):
        keys = sorted(out) if isinstance(out, dict) else type(out).__name__
        raise Problem(f"{step.describe()}: you returned {keys}; return a dict with the keys "
                      "'flops', 'bytes', 'intensity', 'seconds' and 'bound'")
    for k in _FIELDS[:4]:
        v = out[k]
        if hasattr(v, "item") and getattr(v, "numel", lambda: 1)() == 1:
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise Problem(f"{step.describe()}: {k} is {v!r}; expected a number")
        out[k] = v
    return out


def _roofline_check(steps, fields=_FIELDS):
    def check(fn):
        for step in steps:
            got, want = _call_roofline(fn, step), step.expected
            for k in fields:
                if k == "bound":
                    if got[k] == want[k]:
                        continue
                    ridge = roofline.ridge_point(step.bandwidth, step.peak)
                    hint = (f"intensity {want['intensity']:.4g} FLOP/byte against a ridge of "
                            f"{ridge:.4g}: a step left of the ridge waits on memory")
                    if got[k] not in ("memory", "compute"):
                        hint = "bound is 'memory' or 'compute'"
                    raise Problem(f"{step.describe()}: bound is {got[k]!r}, expected "
                                  f"{want[k]!r}; {hint}")
                if _close(got[k], want[k]):
                    continue
                variants = {"flops": step.flops_variants, "bytes": step.bytes_variants,
                            "seconds": step.seconds_variants}.get(k, list)()
                if k == "intensity":
                    variants = [(want["bytes"] / want["flops"], "that is bytes / FLOPs; "
                                 "intensity is FLOPs per byte")]
                hint = one_fit(got[k], variants, expected=want[k], same=_close)
                raise Problem(f"{step.describe()}: {k} is {got[k]:,.6g}, expected "
                              f"{want[k]:,.6g}" + (f"; {hint}" if hint else ""))
    return check


def _roofline_errors(fn):
    base = _Step("smollm2-135m", 1, 1, 16, 2, _H100)
    cfg, b, nt, ctx, bpv, bw, peak = base.args()
    for args, why in (((cfg, 0, nt, ctx, bpv, bw, peak), "batch 0"),
                      ((cfg, b, 0, ctx, bpv, bw, peak), "num_tokens 0: a step computes >= 1 token"),
                      ((cfg, b, nt, -1, bpv, bw, peak), "a negative context"),
                      ((cfg, b, nt, ctx, bpv, 0.0, peak), "bandwidth 0"),
                      ((cfg, b, nt, ctx, bpv, bw, -1.0), "a negative peak FLOP/s")):
        expect_value_error(lambda: fn(*args), why,
                           "raise ValueError with a message that names the bad argument")


def _random_roofline_steps(seed: int, n: int):
    import random
    rng = random.Random(seed)
    models = ["smollm2-135m", "llama-2-7b", "llama-3-8b", "llama-3-70b", "llama-3.2-1b",
              "mistral-7b", "qwen2.5-7b", "qwen2.5-0.5b"]
    steps = []
    for _ in range(n):
        decode = rng.random() < 0.5
        steps.append(_Step(rng.choice(models), rng.choice([1, 2, 8, 64, 256]) if decode else
                           rng.choice([1, 2, 4]),
                           1 if decode else rng.choice([2, 16, 100, 512, 3000]),
                           rng.randint(0, 8000), rng.choice([1, 2, 4]),
                           rng.choice([_H100, _A100, _LAPTOP])))
    return steps


ROOFLINE_STEP = Exercise("ch00.roofline_step", "roofline_step", (
    Check("decode FLOPs: 2 per matmul weight per token, plus attention over the context",
          _roofline_check([_Step("smollm2-135m", 1, 1, 256, 2, _H100),
                           _Step("llama-3-8b", 1, 1, 1000, 2, _H100)], ("flops",))),
    Check("prefill FLOPs: causal attention, query p sees p + 1 keys",
          _roofline_check([_Step("smollm2-135m", 1, 512, 0, 2, _H100),
                           _Step("smollm2-135m", 1, 50, 100, 2, _H100)], ("flops",))),
    Check("a batch multiplies the FLOPs, not the weight reads",
          _roofline_check([_Step("llama-3-8b", 16, 1, 512, 2, _H100)], ("flops", "bytes"))),
    Check("bytes: weights once per step, each sequence's K/V read, the new K/V written",
          _roofline_check([_Step("smollm2-135m", 1, 1, 256, 2, _H100),
                           _Step("smollm2-135m", 4, 8, 64, 2, _H100)], ("bytes",))),
    Check("an untied input embedding is a lookup, not a full read",
          _roofline_check([_Step("llama-3-8b", 1, 1, 64, 2, _H100)], ("bytes",))),
    Check("bytes_per_value scales weights and KV cache (fp32 4, bf16 2, fp8 1)",
          _roofline_check([_Step("qwen2.5-0.5b", 2, 1, 300, 4, _LAPTOP),
                           _Step("qwen2.5-0.5b", 2, 1, 300, 1, _A100)], ("bytes",))),
    Check("intensity and seconds: FLOPs / bytes, and the slower of compute and memory time",
          _roofline_check([_Step("smollm2-135m", 1, 1, 256, 2, _H100),
                           _Step("smollm2-135m", 1, 2048, 0, 2, _H100),
                           _Step("llama-3-8b", 1, 512, 0, 4, _LAPTOP)])),
    Check("bound: 'memory' left of the ridge, 'compute' from the ridge on",
          _roofline_check([_Step("smollm2-135m", 1, 291, 0, 2, _H100),
                           _Step("smollm2-135m", 1, 292, 0, 2, _H100),
                           _Step("llama-3-8b", 512, 1, 16, 2, _H100)])),
    Check("bad input raises ValueError", _roofline_errors),
    Check("agrees with minillm.roofline on 200 random steps of 8 models",
          _roofline_check(_random_roofline_steps(3, 200))),
))


def check_roofline_step(roofline_step, time_limit: Optional[float] = None):
    """Grade exercise (d): roofline_step(cfg, batch, num_tokens, context, bytes_per_value,
    bandwidth, peak_flops) -> {"flops", "bytes", "intensity", "seconds", "bound"}."""
    return ROOFLINE_STEP.check(roofline_step, time_limit)


EXERCISES = (CACHED_ATTENTION, TOP_P, TOP_K, ROOFLINE_STEP)
