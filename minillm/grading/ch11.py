"""Graders for the chapter 11 problem set (solutions/11_serving_at_scale.ipynb).

    ch11.check_choose_replica(choose_replica)        # (a) prefix affinity: consistent hashing
                                                     #     with a load-aware fallback
    ch11.check_goodput_rate(goodput_rate)            # (b) DistServe's goodput over a rate sweep
    ch11.check_reload_or_recompute(reload_or_recompute)   # (c) a KV tier's decision

(a) choose_replica(key, replicas, vnodes, balance_abs, balance_rel) -> url or None. The
reference is minillm.serve.routing.PrefixAffinity, the router's own policy.
(b) goodput_rate(runs, ttft_slo, tpot_slo, attainment) -> requests/s; reference
minillm.lab.scale.goodput_rate.
(c) reload_or_recompute(cfg, tokens, bandwidth, flops, mfu, kv_dtype) -> "reload" |
"recompute"; reference minillm.lab.scale.reload_or_recompute.
"""
from __future__ import annotations

import math
import random
from typing import Optional

from .core import Check, Exercise, Problem, expect_value_error


# =========================================================================== (a) choose_replica

def reference_choose_replica(key, replicas, vnodes=64, balance_abs=4, balance_rel=2.0):
    from ..serve.routing import Backend, PrefixAffinity
    if vnodes < 1 or not replicas:
        raise ValueError("need vnodes >= 1 and at least one replica")
    backends = [Backend(r["url"], r["healthy"], r["outstanding"]) for r in replicas]
    pol = PrefixAffinity([b.url for b in backends], vnodes, balance_abs, balance_rel)
    b = pol.choose(backends, key)
    return None if b is None else b.url


def _replicas(n, loads=None, down=()):
    return [{"url": f"http://10.0.0.{i + 1}:8000", "outstanding": (loads or [0] * n)[i],
             "healthy": i not in down} for i in range(n)]


def _compare(cases, hint):
    def check(fn):
        for key, reps, kw in cases:
            got = fn(key, [dict(r) for r in reps], **kw)
            want = reference_choose_replica(key, reps, **kw)
            if got != want:
                loads = [(r["outstanding"], r["healthy"]) for r in reps]
                raise Problem(f"key={key}, (outstanding, healthy) per replica={loads}, {kw}: you "
                              f"chose {got!r}, expected {want!r}; {hint(fn, key, reps, kw)}")
    return check


def _ring_hint(fn, key, reps, kw):
    n = len(reps)
    if key is not None and reps[key % n]["url"] == fn(key, [dict(r) for r in reps], **kw):
        return ("this looks like key mod N: that sends almost every key elsewhere when N "
                "changes; put vnodes points per replica on a ring (ring_point(f'{url}#{v}')) and "
                "take the first healthy replica clockwise from the key")
    return ("the owner is the first replica at or after the key on the sorted ring of "
            "ring_point(f'{url}#{v}') points, v = 0 .. vnodes - 1, wrapping around")


_RNG = random.Random(11)
_KEYS = [_RNG.getrandbits(64) for _ in range(60)]
_IDLE = [(k, _replicas(3), {}) for k in _KEYS[:30]] + \
        [(k, _replicas(4), {"vnodes": 8}) for k in _KEYS[30:]]
_DOWN = [(k, _replicas(3, down=(1,)), {}) for k in _KEYS[:30]] + \
        [(k, _replicas(4, down=(0, 2)), {}) for k in _KEYS[30:]]
_NO_KEY = [(None, _replicas(3, [3, 1, 2]), {}), (None, _replicas(3, [0, 5, 0], down=(0,)), {})]


def _fallback_cases():
    cases = []
    for k in _KEYS[:12]:
        owner = reference_choose_replica(k, _replicas(2))
        i = 0 if owner.endswith(".1:8000") else 1
        for own, other in ((4, 0), (5, 2), (5, 1), (9, 4), (3, 0)):
            loads = [0, 0]
            loads[i], loads[1 - i] = own, other
            cases.append((k, _replicas(2, loads), {}))
        loads = [0, 0]
        loads[i], loads[1 - i] = 6, 0
        cases.append((k, _replicas(2, loads), {"balance_abs": 8}))
    return cases


def _fallback_hint(fn, key, reps, kw):
    return ("fall back to the least-loaded healthy replica only when the owner has MORE than "
            "balance_abs requests in flight AND more than balance_rel x (least loaded + 1)")


def _none_when_all_down(fn):
    for reps in (_replicas(2, down=(0, 1)), _replicas(1, down=(0,))):
        for key in (_KEYS[0], None):
            got = fn(key, [dict(r) for r in reps])
            if got is not None:
                raise Problem(f"every replica is down, key={key}: you chose {got!r}; return None "
                              "(the router answers 503)")
    last = _replicas(3, down=(0, 2))                      # and the one left up takes everything
    for key in (_KEYS[0], _KEYS[1], None):
        got = fn(key, [dict(r) for r in last])
        if got != last[1]["url"]:
            raise Problem(f"only {last[1]['url']} is up, key={key}: you chose {got!r}")


def _choose_errors(fn):
    expect_value_error(lambda: fn(1, _replicas(2), vnodes=0), "vnodes=0")
    expect_value_error(lambda: fn(1, []), "no replicas at all")


CHOOSE_REPLICA = Exercise("ch11.choose_replica", "choose_replica", (
    Check("a key goes to the first replica clockwise on the ring", _compare(_IDLE, _ring_hint)),
    Check("a replica that is down: its keys go to the next one clockwise",
          _compare(_DOWN, _ring_hint)),
    Check("no key (a prompt under one block): the least-loaded healthy replica",
          _compare(_NO_KEY, lambda *a: "with key None, return the healthy replica with the "
                                       "fewest requests in flight (the first one on ties)")),
    Check("an overloaded owner falls back to the least loaded, both thresholds",
          _compare(_fallback_cases(), _fallback_hint)),
    Check("no healthy replica: None; one left: that one", _none_when_all_down),
    Check("bad input raises ValueError", _choose_errors),
))


def check_choose_replica(choose_replica, time_limit: Optional[float] = None):
    """Grade exercise (a): choose_replica(key, replicas, vnodes, balance_abs, balance_rel)."""
    return CHOOSE_REPLICA.check(choose_replica, time_limit)


# =========================================================================== (b) goodput_rate

def reference_goodput_rate(runs, ttft_slo, tpot_slo, attainment=0.9) -> float:
    from ..lab.scale import goodput_rate
    return goodput_rate(runs, ttft_slo, tpot_slo, attainment)


def _r(ttft, itl=()):
    return {"ttft": ttft, "itl": list(itl)}


def _copy_runs(runs):
    return {rate: [dict(r, itl=list(r["itl"])) for r in reqs] for rate, reqs in runs.items()}


def _goodput_cases(cases, hint):
    def check(fn):
        for runs, slos, att in cases:
            got = fn(_copy_runs(runs), *slos, att)
            want = reference_goodput_rate(runs, *slos, att)
            if not isinstance(got, (int, float)) or isinstance(got, bool) or \
                    not math.isclose(got, want):
                raise Problem(f"runs={runs}, ttft_slo={slos[0]}, tpot_slo={slos[1]}, "
                              f"attainment={att}: you returned {got!r}, expected {want}; {hint}")
    return check


_GOOD = [({0.5: [_r(0.2, [0.05, 0.05])] * 10, 1.0: [_r(0.4, [0.1])] * 9 + [_r(3.0, [0.1])],
           2.0: [_r(2.0, [0.3])] * 10}, (1.0, 0.2), 0.9)]
_BOTH = [({1.0: [_r(0.1, [0.5, 0.5])] * 10, 0.5: [_r(2.0, [0.01])] * 10,
           0.25: [_r(0.1, [0.01])] * 10}, (1.0, 0.2), 0.9)]
_TPOT_MEAN = [({1.0: [_r(0.1, [0.05, 0.05, 0.45])] * 10, 2.0: [_r(0.1, [0.3, 0.3, 0.3])] * 10},
               (1.0, 0.2), 0.9)]
_ONE_TOKEN = [({1.0: [_r(0.3, [])] * 10, 2.0: [_r(0.3, [0.5])] * 10}, (1.0, 0.2), 0.9)]
_FAILED = [({1.0: [_r(None, [])] * 2 + [_r(0.1, [0.01])] * 8, 0.5: [_r(0.1, [0.01])] * 10},
            (1.0, 0.2), 0.9)]
_AT_BOUND = [({1.0: [_r(1.0, [0.2])] * 9 + [_r(5.0, [0.2])]}, (1.0, 0.2), 0.9)]
_NONE = [({1.0: [_r(5.0, [0.1])] * 10}, (1.0, 0.2), 0.9)]
_NOT_MONOTONE = [({0.5: [_r(0.1, [0.01])] * 10, 1.0: [_r(9.0, [0.01])] * 10,
                   2.0: [_r(0.1, [0.01])] * 10}, (1.0, 0.2), 0.9)]


def _goodput_errors(fn):
    expect_value_error(lambda: fn({1.0: [_r(0.1, [])]}, 1.0, 0.2, 0.0), "attainment=0")
    expect_value_error(lambda: fn({1.0: [_r(0.1, [])]}, 1.0, 0.2, 1.5), "attainment=1.5")
    expect_value_error(lambda: fn({1.0: []}, 1.0, 0.2, 0.9), "a rate with no requests")


GOODPUT_RATE = Exercise("ch11.goodput_rate", "goodput_rate", (
    Check("the highest rate whose attainment reaches the target",
          _goodput_cases(_GOOD, "per rate, count the requests meeting both SLOs")),
    Check("a request must meet BOTH objectives",
          _goodput_cases(_BOTH, "a request is good only if TTFT <= ttft_slo AND TPOT <= "
                                "tpot_slo")),
    Check("TPOT is the mean gap after the first token",
          _goodput_cases(_TPOT_MEAN, "TPOT = mean of the inter-token gaps (itl), not their "
                                     "maximum or their sum")),
    Check("a one-token request meets any TPOT objective",
          _goodput_cases(_ONE_TOKEN, "with no gap (itl == []) a request has no TPOT: only its "
                                     "TTFT counts")),
    Check("a failed request (ttft None) is never good",
          _goodput_cases(_FAILED, "ttft None means no token ever came: count it as missed")),
    Check("attainment exactly at the target counts; a value at the SLO meets it",
          _goodput_cases(_AT_BOUND, "use >= for the attainment and <= for the SLOs")),
    Check("no rate qualifies: 0.0", _goodput_cases(_NONE, "return 0.0 when no rate qualifies")),
    Check("the highest qualifying rate, even after a failing one",
          _goodput_cases(_NOT_MONOTONE, "take the maximum over every qualifying rate, do not "
                                        "stop at the first failing one")),
    Check("bad input raises ValueError", _goodput_errors),
))


def check_goodput_rate(goodput_rate, time_limit: Optional[float] = None):
    """Grade exercise (b): goodput_rate(runs, ttft_slo, tpot_slo, attainment)."""
    return GOODPUT_RATE.check(goodput_rate, time_limit)


# ================================================================ (c) reload_or_recompute

def reference_reload_or_recompute(cfg, tokens, bandwidth, flops, mfu=0.5,
                                  kv_dtype="bfloat16") -> str:
    from ..lab.scale import reload_or_recompute
    return reload_or_recompute(cfg, tokens, bandwidth, flops, mfu, kv_dtype)


def _decision_cases():
    from .. import configs
    out = []
    for name in ("llama-3-8b", "llama-2-70b", "smollm2-135m", "mistral-7b"):
        cfg = configs.get(name)
        for bw, fl, mfu in ((7e9, 989e12, 0.5), (25e9, 989e12, 0.5), (64e9, 312e12, 0.4),
                            (2e9, 100e12, 0.3), (50e9, 989e12, 0.6), (1e9, 20e12, 0.5)):
            for tokens in (512, 4096):
                out.append((cfg, tokens, bw, fl, mfu, "bfloat16"))
        out.append((cfg, 2048, 7e9, 989e12, 0.5, "float32"))
    return out


def _decision_hint(fn, cfg, tokens, bw, fl, mfu, dtype) -> str:
    from ..lab.scale import recompute_seconds, reload_seconds
    r, c = reload_seconds(cfg, tokens, bw, dtype), recompute_seconds(cfg, tokens, fl, mfu)
    return (f"reload moves {r * bw / tokens:.0f} bytes per token (K and V, every layer, "
            f"kv_heads x head_dim, {dtype}) = {r * 1e3:.3g} ms; recompute costs the prefill's "
            f"FLOPs / (flops x mfu) = {c * 1e3:.3g} ms")


def _decisions(fn):
    for case in _decision_cases():
        cfg, tokens, bw, fl, mfu, dtype = case
        got = fn(cfg, tokens, bw, fl, mfu, dtype)
        want = reference_reload_or_recompute(*case)
        if got != want:
            raise Problem(f"{cfg.name}, {tokens} tokens, {bw / 1e9:g} GB/s, {fl / 1e12:g} "
                          f"TFLOP/s, mfu {mfu}, {dtype}: you said {got!r}, expected {want!r}; "
                          + _decision_hint(fn, *case))


def _both_answers_occur(fn):
    from .. import configs
    big, small = configs.get("llama-2-70b"), configs.get("smollm2-135m")
    got = {fn(big, 4096, 25e9, 989e12, 0.5, "bfloat16"), fn(small, 4096, 7e9, 989e12, 0.5,
                                                            "bfloat16")}
    if got != {"reload", "recompute"}:
        raise Problem(f"a 70B model over PCIe and a 135M model from NVMe on the same GPU gave "
                      f"{sorted(got)}; the big model has far more FLOPs per byte of KV (reload "
                      "wins), the small one computes its KV faster than the disk delivers it")


def _decision_errors(fn):
    from .. import configs
    cfg = configs.get("llama-3-8b")
    expect_value_error(lambda: fn(cfg, 0, 7e9, 989e12, 0.5, "bfloat16"), "tokens=0")
    expect_value_error(lambda: fn(cfg, 128, 0, 989e12, 0.5, "bfloat16"), "bandwidth=0")
    expect_value_error(lambda: fn(cfg, 128, 7e9, 989e12, 1.5, "bfloat16"), "mfu=1.5")


RELOAD_OR_RECOMPUTE = Exercise("ch11.reload_or_recompute", "reload_or_recompute", (
    Check("big model over PCIe reloads, small model from disk recomputes", _both_answers_occur),
    Check("the decision for four models, six links/GPUs, two lengths, two dtypes", _decisions),
    Check("bad input raises ValueError", _decision_errors),
))


def check_reload_or_recompute(reload_or_recompute, time_limit: Optional[float] = None):
    """Grade exercise (c): reload_or_recompute(cfg, tokens, bandwidth, flops, mfu, kv_dtype)."""
    return RELOAD_OR_RECOMPUTE.check(reload_or_recompute, time_limit)


EXERCISES = (CHOOSE_REPLICA, GOODPUT_RATE, RELOAD_OR_RECOMPUTE)
