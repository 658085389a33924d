"""Graders for the chapter 08 problem set (solutions/08_serving.ipynb).

    ch08.check_goodput(goodput)              # (a) goodput from per-request client metrics,
                                             #     vLLM's definition
    ch08.check_max_rate(max_rate)            # (b) Little's law: the request rate a server with
                                             #     a fixed number of slots sustains
    ch08.check_max_waiting(max_waiting)      # (c) an admission bound that keeps TTFT under an
                                             #     SLO, checked by replaying an overload
    ch08.check_min_p_filter(min_p_filter)    # (d) min-p filtering, the sampling parameter the
                                             #     server's `min_p` sets

(a) goodput(requests, slos, duration) -> good requests per second. The reference is
minillm.metrics.summarize on the load generator's RequestResult records (vLLM's benchmark
definitions; the exercise names the end-to-end SLO "e2el", as `vllm bench serve --goodput` does).
(b) max_rate(max_num_seqs, prefill_time, step_time, output_len) -> requests/s. The reference
is Little's law, lambda = L / W with L the slots and W the time a request holds one.
(c) max_waiting(ttft_slo, max_num_seqs, prefill_time, step_time, output_len) -> int: the
longest waiting queue a new request may join and still expect its first token within the SLO
(the queue drains at the Little's-law rate of (b)). The solutions notebook replays an overload
through minillm's engine with that bound as the admission rule.
(d) min_p_filter(logits, min_p) -> logits with every token whose probability is below min_p
times the row's top probability set to -inf. The reference is minillm.sampling.min_p_filter.
"""
from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Optional

from .core import Check, Exercise, Problem, expect_value_error


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def _close(a, b, rel=1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


# =========================================================================== (a) goodput

def reference_goodput(requests, slos, duration) -> float:
    from ..metrics import summarize
    from ..serve.loadgen import RequestResult
    results = [RequestResult(prompt_len=0, ttft=r.get("ttft"), e2e_latency=r.get("e2e"),
                             num_output_tokens=r.get("output_tokens", 0),
                             finished=r.get("ttft") is not None) for r in requests]
    out = summarize(results, duration, ttft_slo=slos.get("ttft"), tpot_slo=slos.get("tpot"),
                    e2e_latency_slo=slos.get("e2el"))
    return out["request_goodput"] if slos else out["request_throughput"]


def _req(ttft, e2e, n):
    return {"ttft": ttft, "e2e": e2e, "output_tokens": n}


def _goodput_cases(cases, hint=None):
    def check(fn):
        for requests, slos, duration in cases:
            what = f"requests={requests}, slos={slos}, duration={duration}"
            got = fn([dict(r) for r in requests], dict(slos), duration)
            if not _is_num(got):
                raise Problem(f"{what}: you returned {got!r}; return a number (requests/s)")
            want = reference_goodput(requests, slos, duration)
            if not _close(float(got), want):
                why = _goodput_diagnosis(float(got), requests, slos, duration)
                raise Problem(f"{what}: you returned {got:.6g}, expected {want:.6g}"
                              + (f"; {why}" if why else (f"; {hint}" if hint else "")))
    return check


def _goodput_diagnosis(got, requests, slos, duration) -> str:
    ok = [r for r in requests if r["ttft"] is not None]

    def tpot(r):
        n = r["output_tokens"]
        return (r["e2e"] - r["ttft"]) / (n - 1) if n > 1 else 0.0

    def count(rs, agg=all, tp=tpot, cmp=lambda a, b: a <= b):
        good = 0
        for r in rs:
            vals = {"ttft": r["ttft"], "tpot": tp(r), "e2el": r["e2e"]}
            good += agg(cmp(vals[k], v) for k, v in slos.items()) if slos else True
        return good

    variants = [
        (count(ok), "the reference"),
        (count([r if r["ttft"] is not None else {**r, "ttft": 0.0, "e2e": r.get("e2e") or 0.0}
                for r in requests]),
         "you counted failed requests (ttft None); a request that never produced a token is "
         "never good"),
        (count(ok, agg=any), "a request is good only when it meets EVERY SLO given (all, not "
                             "any)"),
        (count(ok, tp=lambda r: (r["e2e"] - r["ttft"]) / r["output_tokens"]
               if r["output_tokens"] else 0.0),
         "TPOT excludes the first token: (e2e - ttft) / (output_tokens - 1)"),
        (count(ok, tp=lambda r: r["e2e"] / r["output_tokens"] if r["output_tokens"] else 0.0),
         "TPOT excludes the first token: (e2e - ttft) / (output_tokens - 1), not e2e / tokens"),
        (count(ok, cmp=lambda a, b: a < b), "meeting the SLO means value <= bound (a request "
                                            "exactly at the bound is good)"),
    ]
    for good, why in variants[1:]:
        if _close(got, good / duration):
            return why
    ref = variants[0][0]
    if requests and _close(got, ref / len(requests)):
        return "goodput is per second of the run: divide by duration, not by the request count"
    if _close(got, float(ref)):
        return "goodput is a rate: divide the good requests by the duration"
    return ""


_R1 = [_req(0.2, 1.2, 11), _req(0.9, 2.0, 12), _req(0.3, 5.3, 11), _req(None, None, 0)]
_BASIC = [(_R1, {"ttft": 0.5}, 10.0), (_R1, {"ttft": 1.0, "e2el": 3.0}, 4.0),
          ([_req(0.1, 0.5, 5)] * 3, {"ttft": 0.2}, 2.0)]
_TPOT = [([_req(0.5, 1.5, 11), _req(0.5, 1.5, 6), _req(0.5, 1.5, 21)], {"tpot": 0.1}, 1.0),
         ([_req(1.0, 2.0, 11), _req(0.0, 1.0, 10)], {"tpot": 0.1}, 2.0)]
_ONE_TOKEN = [([_req(0.4, 0.4, 1), _req(0.4, 3.0, 2)], {"tpot": 0.5}, 1.0)]
_ALL = [([_req(0.1, 9.0, 10), _req(0.9, 1.0, 2), _req(0.1, 1.0, 10)], {"ttft": 0.5, "tpot": 0.2},
         3.0)]
_FAILED = [([_req(None, None, 0), _req(None, None, 0), _req(0.1, 0.5, 5)], {"ttft": 1.0}, 5.0),
           ([_req(None, None, 0)], {"ttft": 1.0}, 1.0)]
_EDGE = [([_req(0.5, 1.5, 11), _req(0.25, 2.0, 8)], {"ttft": 0.5, "tpot": 0.25}, 1.0)]
_NO_SLO = [(_R1, {}, 2.0)]


def _goodput_errors(fn):
    for requests, slos, duration, why in (
            (_R1, {"ttft": 1.0}, 0.0, "duration 0"),
            (_R1, {"ttft": 1.0}, -2.0, "negative duration"),
            (_R1, {"latency": 1.0}, 1.0, "unknown SLO name 'latency'")):
        expect_value_error(lambda: fn([dict(r) for r in requests], dict(slos), duration),
                           f"slos={slos}, duration={duration} ({why})",
                           "raise ValueError naming the problem")


GOODPUT = Exercise("ch08.goodput", "goodput", (
    Check("counts requests that meet the TTFT / E2E SLO, per second", _goodput_cases(_BASIC)),
    Check("TPOT excludes the first token", _goodput_cases(_TPOT)),
    Check("a one-token output has TPOT 0", _goodput_cases(_ONE_TOKEN)),
    Check("a request must meet every SLO", _goodput_cases(_ALL)),
    Check("failed requests are never good", _goodput_cases(_FAILED)),
    Check("a value exactly at the bound meets it", _goodput_cases(_EDGE)),
    Check("no SLO: every completed request counts", _goodput_cases(_NO_SLO)),
    Check("bad input raises ValueError", _goodput_errors),
))


def check_goodput(goodput, time_limit: Optional[float] = None):
    """Grade exercise (a): goodput(requests, slos, duration) -> good requests per second."""
    return GOODPUT.check(goodput, time_limit)


# =========================================================================== (b) max_rate

def reference_max_rate(max_num_seqs, prefill_time, step_time, output_len) -> float:
    """Little's law lambda = L / W: L = max_num_seqs slots, each held for W = the prefill step
    plus output_len - 1 decode steps (the first token comes out of the prefill step)."""
    return max_num_seqs / (prefill_time + (output_len - 1) * step_time)


def _rate_cases(cases):
    def check(fn):
        for args in cases:
            what = ("max_num_seqs={}, prefill_time={}, step_time={}, output_len={}"
                    .format(*args))
            got = fn(*args)
            if not _is_num(got):
                raise Problem(f"{what}: you returned {got!r}; return requests per second")
            want = reference_max_rate(*args)
            if not _close(float(got), want, 1e-6):
                raise Problem(f"{what}: you returned {got:.6g}, expected {want:.6g}; "
                              + _rate_diagnosis(float(got), *args))
    return check


def _rate_diagnosis(got, c, p, s, n) -> str:
    w = p + (n - 1) * s
    for value, why in (
            (w / c, "you returned W / L: Little's law L = lambda x W gives lambda = L / W"),
            (c / (p + n * s), "the first output token comes out of the prefill step, so a "
                              "request holds its slot for the prefill plus output_len - 1 "
                              "decode steps"),
            (c / ((n - 1) * s) if n > 1 else math.inf, "the prefill step is part of the time "
                                                       "a request holds its slot"),
            (1 / w, "all max_num_seqs slots work at once: the rate is L / W with L = "
                    "max_num_seqs, not 1 / W"),
            (c * w, "lambda = L / W, not L x W")):
        if _close(got, value, 1e-6):
            return why
    return "lambda = max_num_seqs / (prefill_time + (output_len - 1) x step_time)"


_RATE_BASIC = [(16, 0.2, 0.05, 41), (1, 0.5, 0.1, 11), (64, 0.05, 0.02, 201)]
_RATE_ONE = [(8, 0.3, 0.05, 1), (4, 1.0, 0.5, 1)]


def _rate_errors(fn):
    for args, why in (((0, 0.2, 0.05, 10), "max_num_seqs 0"),
                      ((8, 0.2, 0.05, 0), "output_len 0"),
                      ((8, -0.1, 0.05, 10), "negative prefill_time"),
                      ((8, 0.0, 0.0, 10), "zero time: a request would take no time")):
        expect_value_error(lambda: fn(*args), f"max_rate{args} ({why})")


MAX_RATE = Exercise("ch08.max_rate", "max_rate", (
    Check("lambda = L / W with the slots as L", _rate_cases(_RATE_BASIC)),
    Check("a one-token output holds its slot for the prefill only", _rate_cases(_RATE_ONE)),
    Check("bad input raises ValueError", _rate_errors),
    Check("agrees with Little's law on 200 random cases", _rate_cases(
        [(1 + (i * 7) % 64, 0.01 + (i % 13) * 0.03, 0.005 + (i % 7) * 0.01, 1 + (i * 11) % 300)
         for i in range(200)])),
))


def check_max_rate(max_rate, time_limit: Optional[float] = None):
    """Grade exercise (b): max_rate(max_num_seqs, prefill_time, step_time, output_len)."""
    return MAX_RATE.check(max_rate, time_limit)


# =========================================================================== (c) max_waiting

def reference_max_waiting(ttft_slo, max_num_seqs, prefill_time, step_time, output_len) -> int:
    """A request that finds k others waiting and every slot busy starts after k + 1 slots free
    up. Slots free up at lambda_max = max_num_seqs / W per second (Little's law), so it waits
    about (k + 1) / lambda_max, then needs prefill_time for its first token. The bound is the
    largest k with (k + 1) x W / max_num_seqs + prefill_time <= ttft_slo (0 if none)."""
    w = prefill_time + (output_len - 1) * step_time
    k = math.floor((ttft_slo - prefill_time) * max_num_seqs / w + 1e-9) - 1
    return max(0, k)


def _waiting_cases(cases):
    def check(fn):
        for args in cases:
            what = ("ttft_slo={}, max_num_seqs={}, prefill_time={}, step_time={}, output_len={}"
                    .format(*args))
            got = fn(*args)
            if not _is_int(got):
                raise Problem(f"{what}: you returned {got!r}; return an int (requests)")
            want = reference_max_waiting(*args)
            if got != want:
                raise Problem(f"{what}: you returned {got}, expected {want}; "
                              + _waiting_diagnosis(got, *args))
    return check


def _waiting_diagnosis(got, slo, c, p, s, n) -> str:
    w = p + (n - 1) * s
    raw = (slo - p) * c / w
    matches = []
    for value, why in (
            (math.floor(raw + 1e-9), "off by one: the new request itself needs a slot too, so "
                                     "with k waiting ahead it waits for k + 1 slots to free up"),
            (max(0, math.floor(slo * c / w + 1e-9) - 1), "its TTFT also includes its own "
                                                         "prefill_time after it gets a slot"),
            (max(0, math.floor((slo - p) / w + 1e-9) - 1), "max_num_seqs slots free up in "
                                                           "parallel: the queue drains at "
                                                           "max_num_seqs / W per second"),
            (max(0, math.ceil(raw - 1e-9) - 1), "round down: a bound that lets one request "
                                                "too many in breaks the SLO")):
        if got == value:
            matches.append(why)
    if matches:                          # several mistakes can give the same number
        return "; or ".join(matches)
    if got < 0:
        return "a queue bound is never negative (0: admit only when nobody waits)"
    return "k = floor((ttft_slo - prefill_time) x max_num_seqs / W) - 1, W = prefill_time + " \
           "(output_len - 1) x step_time, at least 0"


_WAIT_BASIC = [(2.0, 16, 0.2, 0.05, 41), (10.0, 8, 0.5, 0.1, 21), (1.0, 64, 0.05, 0.02, 101)]
_WAIT_TIGHT = [(0.3, 8, 0.25, 0.05, 41), (0.1, 4, 0.2, 0.05, 11)]


def _waiting_errors(fn):
    for args, why in (((0.0, 8, 0.2, 0.05, 10), "ttft_slo 0"),
                      ((1.0, 0, 0.2, 0.05, 10), "max_num_seqs 0"),
                      ((1.0, 8, 0.2, 0.05, 0), "output_len 0")):
        expect_value_error(lambda: fn(*args), f"max_waiting{args} ({why})")


MAX_WAITING = Exercise("ch08.max_waiting", "max_waiting", (
    Check("the longest queue whose last request still meets the TTFT SLO",
          _waiting_cases(_WAIT_BASIC)),
    Check("a tight SLO gives 0, never a negative bound", _waiting_cases(_WAIT_TIGHT)),
    Check("bad input raises ValueError", _waiting_errors),
    Check("agrees with the formula on 200 random cases", _waiting_cases(
        [(0.2 + (i % 17) * 0.4, 1 + (i * 5) % 48, 0.02 + (i % 9) * 0.05,
          0.005 + (i % 5) * 0.01, 1 + (i * 13) % 200) for i in range(200)])),
))


def check_max_waiting(max_waiting, time_limit: Optional[float] = None):
    """Grade exercise (c): max_waiting(ttft_slo, max_num_seqs, prefill_time, step_time,
    output_len) -> int."""
    return MAX_WAITING.check(max_waiting, time_limit)


# =========================================================================== (d) min_p_filter

def reference_min_p_filter(logits, min_p):
    from ..sampling import min_p_filter
    if not 0.0 <= min_p <= 1.0:
        raise ValueError("min_p must be in [0, 1]")
    return min_p_filter(logits, min_p)


def _rows(probs):
    import torch
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def _min_p_cases(cases):
    def check(fn):
        import torch
        for case, min_p in cases:
            logits = case.clone()              # a learner that writes in place spoils a copy
            before = logits.clone()
            got = fn(logits, min_p)
            if not isinstance(got, torch.Tensor) or got.shape != logits.shape:
                raise Problem(f"min_p={min_p}: return a tensor of the logits' shape "
                              f"{tuple(logits.shape)}, got {got!r:.60}")
            if not torch.equal(logits, before):
                raise Problem("you changed the logits passed in; return a new tensor "
                              "(masked_fill, not masked_fill_)")
            want = reference_min_p_filter(logits, min_p)
            kept, want_kept = torch.isfinite(got), torch.isfinite(want)
            if not torch.equal(kept, want_kept) or not torch.equal(got[kept], logits[kept]):
                probs = logits.softmax(-1)[0].tolist()
                raise Problem(f"min_p={min_p}, probabilities {probs!r:.90}"
                              f": you kept {kept[0].tolist()}, expected {want_kept[0].tolist()}; "
                              + _min_p_diagnosis(got, logits, min_p))
    return check


def _min_p_diagnosis(got, logits, min_p) -> str:
    import torch
    p = logits.softmax(-1)
    kept = torch.isfinite(got)
    for mask, why in (
            (p >= min_p, "the threshold is relative: min_p times the row's TOP probability, "
                         "not min_p itself"),
            (logits >= min_p * logits.max(-1, keepdim=True).values,
             "compare probabilities (softmax), not logits"),
            (p < min_p * p.max(-1, keepdim=True).values, "you dropped the tokens to keep: keep "
                                                          "p >= min_p x p_max"),
            (p >= min_p * p.max(), "each row has its own top probability")):
        if torch.equal(kept, mask):
            return why
    return "keep exactly the tokens with p >= min_p x max(p) in their row; the rest -> -inf"


def _min_p_errors(fn):
    import torch
    for v in (-0.1, 1.5):
        expect_value_error(lambda: fn(torch.zeros(1, 4), v), f"min_p_filter(logits, {v})")


_MIN_P_BASIC = [(_rows([[0.5, 0.3, 0.1, 0.06, 0.04]]), 0.15),
                (_rows([[0.02, 0.9, 0.05, 0.03]]), 0.05),
                (_rows([[0.25, 0.25, 0.25, 0.25]]), 0.5)]
_MIN_P_EDGES = [(_rows([[0.7, 0.2, 0.1]]), 0.0), (_rows([[0.7, 0.2, 0.1]]), 1.0)]


def _min_p_random():
    import torch
    g = torch.Generator().manual_seed(8)
    return [(torch.randn(1 + i % 3, 50, generator=g) * (1 + i % 4), 0.02 + (i % 7) * 0.07)
            for i in range(60)]


MIN_P = Exercise("ch08.min_p_filter", "min_p_filter", (
    Check("keeps the tokens with p >= min_p x the top probability", _min_p_cases(_MIN_P_BASIC)),
    Check("min_p 0 keeps everything, 1 keeps only the top (ties included)",
          _min_p_cases(_MIN_P_EDGES)),
    Check("each row has its own top probability", _min_p_cases(
        [(_rows([[0.9, 0.05, 0.05], [0.4, 0.35, 0.25]]), 0.3)])),
    Check("bad input raises ValueError", _min_p_errors),
    Check("agrees with minillm.sampling.min_p_filter on 60 random batches",
          _min_p_cases(_min_p_random())),
))


def check_min_p_filter(min_p_filter, time_limit: Optional[float] = None):
    """Grade exercise (d): min_p_filter(logits [B, V], min_p) -> filtered logits [B, V]."""
    return MIN_P.check(min_p_filter, time_limit)


EXERCISES = (GOODPUT, MAX_RATE, MAX_WAITING, MIN_P)
