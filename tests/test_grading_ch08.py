"""Chapter 08 graders are themselves tested: the solution passes, the unfilled exercise fails, and
planted bugs (goodput counting failed requests, "any" instead of "all", TPOT including the first
token, a strict bound; Little's law inverted or without the prefill; an admission bound off by
one or without the prefill) are caught with a message that names the mistake. The goodput
reference is checked against minillm.metrics.summarize, the one bench_serve.py reports."""
import math

from minillm.grading import ch08, grade
from minillm.metrics import summarize
from minillm.serve.loadgen import RequestResult

from grader_contract import contract_tests, planted_bug_tests

NOTEBOOK = "08_serving.ipynb"
LIMIT = 60
GRADED = {"goodput": ch08.GOODPUT, "max_rate": ch08.MAX_RATE, "max_waiting": ch08.MAX_WAITING,
          "min_p_filter": ch08.MIN_P}

(test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
 test_solution_cells_hold_the_marked_solution) = contract_tests(NOTEBOOK, GRADED, min_checks=4)


def test_chapter_lists_its_exercises_for_batch_grading():
    assert ch08.EXERCISES == (ch08.GOODPUT, ch08.MAX_RATE, ch08.MAX_WAITING, ch08.MIN_P)
    assert [e.id for e in ch08.EXERCISES] == ["ch08.goodput", "ch08.max_rate",
                                              "ch08.max_waiting", "ch08.min_p_filter"]


def test_reference_goodput_is_the_benchmarks_definition():
    # by hand: TPOTs 0.1, 0.2, 0.5 (one-token: 0); SLO ttft 0.5 and tpot 0.25
    reqs = [{"ttft": 0.4, "e2e": 1.4, "output_tokens": 11},     # good
            {"ttft": 0.5, "e2e": 2.5, "output_tokens": 11},     # tpot 0.2, ttft at the bound
            {"ttft": 0.2, "e2e": 5.2, "output_tokens": 11},     # tpot 0.5: bad
            {"ttft": 0.9, "e2e": 0.9, "output_tokens": 1},      # ttft bad
            {"ttft": None, "e2e": None, "output_tokens": 0}]    # failed
    assert ch08.reference_goodput(reqs, {"ttft": 0.5, "tpot": 0.25}, 4.0) == 2 / 4.0
    results = [RequestResult(0, ttft=0.4, e2e_latency=1.4, num_output_tokens=11, finished=True)]
    assert summarize(results, 2.0, tpot_slo=0.1)["request_goodput"] == 0.5
    assert summarize(results, 2.0, tpot_slo=0.09)["request_goodput"] == 0.0


def test_reference_max_waiting_meets_its_own_inequality():
    for args in [(2.0, 16, 0.2, 0.05, 41), (10.0, 8, 0.5, 0.1, 21), (0.3, 8, 0.25, 0.05, 41)]:
        slo, c, p, s, n = args
        k = ch08.reference_max_waiting(*args)
        w = p + (n - 1) * s
        if k > 0:
            assert (k + 1) * w / c + p <= slo + 1e-9 < (k + 2) * w / c + p
        else:
            assert (2 * w / c + p) > slo


# ------------------------------------------------------------------ planted bugs: goodput

def _checks(slos, duration):
    if duration <= 0 or set(slos) - {"ttft", "tpot", "e2el"}:
        raise ValueError("bad input")


def _count(requests, slos, tpot, agg=all, strict=False, skip_failed=True):
    good = 0
    for r in requests:
        if r["ttft"] is None:
            if skip_failed:
                continue
            r = {**r, "ttft": 0.0, "e2e": 0.0}
        value = {"ttft": r["ttft"], "tpot": tpot(r), "e2el": r["e2e"]}
        good += agg((value[k] < b) if strict else (value[k] <= b) for k, b in slos.items()) \
            if slos else True
    return good


def _tpot(r):
    n = r["output_tokens"]
    return (r["e2e"] - r["ttft"]) / (n - 1) if n > 1 else 0.0


def goodput_counts_failed(requests, slos, duration):
    _checks(slos, duration)
    return _count(requests, slos, _tpot, skip_failed=False) / duration


def goodput_any_slo(requests, slos, duration):
    _checks(slos, duration)
    return _count(requests, slos, _tpot, agg=any) / duration


def goodput_tpot_with_first_token(requests, slos, duration):
    _checks(slos, duration)
    return _count(requests, slos, lambda r: (r["e2e"] - r["ttft"]) / r["output_tokens"]
                  if r["output_tokens"] else 0.0) / duration


def goodput_strict_bound(requests, slos, duration):
    _checks(slos, duration)
    return _count(requests, slos, _tpot, strict=True) / duration


def goodput_per_request(requests, slos, duration):
    _checks(slos, duration)
    return _count(requests, slos, _tpot) / len(requests)


def goodput_one_token_crash(requests, slos, duration):
    _checks(slos, duration)
    return _count(requests, slos, lambda r: (r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1)
                  if r["output_tokens"] != 0 else 0.0) / duration


def goodput_trusts_input(requests, slos, duration):
    return _count(requests, {k: v for k, v in slos.items() if k in ("ttft", "tpot", "e2el")},
                  _tpot) / duration


# ------------------------------------------------------------------ planted bugs: max_rate

def _rate_ok(c, p, s, n):
    if c < 1 or n < 1 or p < 0 or s < 0 or p + (n - 1) * s <= 0:
        raise ValueError("bad input")


def rate_inverted(c, p, s, n):
    _rate_ok(c, p, s, n)
    return (p + (n - 1) * s) / c


def rate_all_tokens_decode(c, p, s, n):
    _rate_ok(c, p, s, n)
    return c / (p + n * s)


def rate_one_slot(c, p, s, n):
    _rate_ok(c, p, s, n)
    return 1 / (p + (n - 1) * s)


def rate_no_prefill(c, p, s, n):
    _rate_ok(c, p, s, n)
    w = (n - 1) * s
    return c / w if w > 0 else math.inf


def rate_no_validation(c, p, s, n):
    w = p + (n - 1) * s
    return c / w if w else 0.0


# ------------------------------------------------------------------ planted bugs: max_waiting

def _wait_ok(slo, c, n):
    if slo <= 0 or c < 1 or n < 1:
        raise ValueError("bad input")


def waiting_off_by_one(slo, c, p, s, n):
    _wait_ok(slo, c, n)
    w = p + (n - 1) * s
    return max(0, math.floor((slo - p) * c / w + 1e-9))


def waiting_no_prefill(slo, c, p, s, n):
    _wait_ok(slo, c, n)
    w = p + (n - 1) * s
    return max(0, math.floor(slo * c / w + 1e-9) - 1)


def waiting_one_slot(slo, c, p, s, n):
    _wait_ok(slo, c, n)
    w = p + (n - 1) * s
    return max(0, math.floor((slo - p) / w + 1e-9) - 1)


def waiting_negative(slo, c, p, s, n):
    _wait_ok(slo, c, n)
    w = p + (n - 1) * s
    return math.floor((slo - p) * c / w + 1e-9) - 1


def waiting_float(slo, c, p, s, n):
    _wait_ok(slo, c, n)
    w = p + (n - 1) * s
    return max(0.0, (slo - p) * c / w - 1)


# ------------------------------------------------------------------ planted bugs: min_p_filter

def _min_p_check(min_p):
    if not 0.0 <= min_p <= 1.0:
        raise ValueError("min_p must be in [0, 1]")


def min_p_absolute(logits, min_p):
    _min_p_check(min_p)
    return logits.masked_fill(logits.softmax(-1) < min_p, float("-inf"))


def min_p_on_logits(logits, min_p):
    _min_p_check(min_p)
    return logits.masked_fill(logits < min_p * logits.max(-1, keepdim=True).values,
                              float("-inf"))


def min_p_inverted(logits, min_p):
    _min_p_check(min_p)
    p = logits.softmax(-1)
    return logits.masked_fill(p >= min_p * p.max(-1, keepdim=True).values, float("-inf"))


def min_p_batch_max(logits, min_p):
    _min_p_check(min_p)
    p = logits.softmax(-1)
    return logits.masked_fill(p < min_p * p.max(), float("-inf"))


def min_p_in_place(logits, min_p):
    _min_p_check(min_p)
    p = logits.softmax(-1)
    return logits.masked_fill_(p < min_p * p.max(-1, keepdim=True).values, float("-inf"))


def min_p_no_validation(logits, min_p):
    p = logits.softmax(-1)
    return logits.masked_fill(p < min_p * p.max(-1, keepdim=True).values, float("-inf"))


BUGS = [
    ("goodput", goodput_counts_failed, "failed requests are never good",
     "counted failed requests"),
    ("goodput", goodput_any_slo, "must meet every SLO", "EVERY SLO"),
    ("goodput", goodput_tpot_with_first_token, "TPOT excludes the first token",
     "(output_tokens - 1)"),
    ("goodput", goodput_strict_bound, "exactly at the bound", "value <= bound"),
    ("goodput", goodput_per_request, "per second", "divide by duration"),
    ("goodput", goodput_one_token_crash, "one-token output", "ZeroDivisionError"),
    ("goodput", goodput_trusts_input, "bad input raises ValueError", "raise ValueError naming"),
    ("max_rate", rate_inverted, "lambda = L / W", "W / L"),
    ("max_rate", rate_all_tokens_decode, "lambda = L / W", "output_len - 1"),
    ("max_rate", rate_one_slot, "lambda = L / W", "not 1 / W"),
    ("max_rate", rate_no_prefill, "one-token output", "prefill step is part"),
    ("max_rate", rate_no_validation, "bad input raises ValueError", "instead of raising"),
    ("max_waiting", waiting_off_by_one, "longest queue", "off by one"),
    ("max_waiting", waiting_no_prefill, "longest queue", "its own prefill_time"),
    ("max_waiting", waiting_one_slot, "longest queue", "in parallel"),
    ("max_waiting", waiting_negative, "never a negative bound", "never negative"),
    ("max_waiting", waiting_float, "longest queue", "return an int"),
    ("min_p_filter", min_p_absolute, "keeps the tokens", "relative"),
    ("min_p_filter", min_p_on_logits, "keeps the tokens", "not logits"),
    ("min_p_filter", min_p_inverted, "keeps the tokens", "dropped the tokens to keep"),
    ("min_p_filter", min_p_batch_max, "own top probability", "each row"),
    ("min_p_filter", min_p_in_place, "keeps the tokens", "changed the logits"),
    ("min_p_filter", min_p_no_validation, "bad input raises ValueError", "ValueError"),
]

(test_planted_bug_is_caught_with_a_specific_message,
 test_every_exercise_has_at_least_two_planted_bugs) = planted_bug_tests(GRADED, BUGS)


def test_reference_min_p_filter_is_the_samplers():
    import torch

    from minillm.sampling import SamplingParams, probs
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    kept = torch.isfinite(ch08.reference_min_p_filter(logits, 0.15))
    assert kept.tolist() == [[True, True, True, False, False]]
    assert torch.equal(probs(logits, SamplingParams(min_p=0.15)) > 0, kept)


def test_a_learner_function_that_loops_forever_is_stopped():
    def spins(requests, slos, duration):
        while True:
            pass
    result = grade(ch08.GOODPUT, spins, time_limit=2)
    assert result.score == 0 and "time limit" in result.messages[0]
