"""Chapter 11 graders are themselves tested: the solution passes, the unfilled exercise fails,
and planted bugs are caught with a message that names the mistake: key mod N instead of a ring,
a ring that ignores replicas that are down, a fallback on one threshold only; goodput with OR
instead of AND, TPOT as the largest gap, a strict attainment bound, stopping at the first failing
rate; a reload cost that forgets V or the layers, a recompute cost that keeps the output head."""
import bisect

from minillm import configs
from minillm.grading import ch11
from minillm.kvmath import dtype_bytes
from minillm.roofline import forward_flops
from minillm.serve.routing import Backend, PrefixAffinity, ring_point

from grader_contract import contract_tests, planted_bug_tests

NOTEBOOK = "11_serving_at_scale.ipynb"
GRADED = {"choose_replica": ch11.CHOOSE_REPLICA, "goodput_rate": ch11.GOODPUT_RATE,
          "reload_or_recompute": ch11.RELOAD_OR_RECOMPUTE}

(test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
 test_solution_cells_hold_the_marked_solution) = contract_tests(NOTEBOOK, GRADED, min_checks=3)


def test_chapter_lists_its_exercises_for_batch_grading():
    assert ch11.EXERCISES == (ch11.CHOOSE_REPLICA, ch11.GOODPUT_RATE, ch11.RELOAD_OR_RECOMPUTE)
    assert [e.id for e in ch11.EXERCISES] == ["ch11.choose_replica", "ch11.goodput_rate",
                                              "ch11.reload_or_recompute"]


def test_reference_choice_is_the_routers_policy():
    bs = [Backend("http://a", outstanding=0), Backend("http://b", outstanding=0)]
    pol = PrefixAffinity(["http://a", "http://b"])
    reps = [{"url": b.url, "outstanding": 0, "healthy": True} for b in bs]
    for key in (1, 2 ** 63, 12345678901234):
        assert ch11.reference_choose_replica(key, reps) == pol.choose(bs, key).url


def test_decision_cases_hold_both_answers():
    answers = {ch11.reference_reload_or_recompute(*c) for c in ch11._decision_cases()}
    assert answers == {"reload", "recompute"}


# ------------------------------------------------------------------ planted bugs: choose_replica

def _checked(replicas, vnodes):
    if vnodes < 1 or not replicas:
        raise ValueError("bad input")


def _least(replicas):
    healthy = [r for r in replicas if r["healthy"]]
    return min(healthy, key=lambda r: r["outstanding"]) if healthy else None


def modulo(key, replicas, vnodes=64, balance_abs=4, balance_rel=2.0):
    _checked(replicas, vnodes)
    up = [r for r in replicas if r["healthy"]]
    if not up:
        return None
    return _least(replicas)["url"] if key is None else up[key % len(up)]["url"]


def _ring_owner(key, replicas, vnodes, skip_down=True):
    ring = sorted((ring_point(f"{r['url']}#{v}"), i) for i, r in enumerate(replicas)
                  for v in range(vnodes))
    start = bisect.bisect_left([p for p, _ in ring], key)
    for j in range(len(ring)):
        owner = replicas[ring[(start + j) % len(ring)][1]]
        if owner["healthy"] or not skip_down:
            return owner


def ignores_down(key, replicas, vnodes=64, balance_abs=4, balance_rel=2.0):
    _checked(replicas, vnodes)
    if not _least(replicas):
        return None
    if key is None:
        return _least(replicas)["url"]
    owner = _ring_owner(key, replicas, vnodes, skip_down=False)
    return owner["url"] if owner["healthy"] else _least(replicas)["url"]


def one_threshold(key, replicas, vnodes=64, balance_abs=4, balance_rel=2.0):
    _checked(replicas, vnodes)
    least = _least(replicas)
    if least is None:
        return None
    if key is None:
        return least["url"]
    owner = _ring_owner(key, replicas, vnodes)
    return least["url"] if owner["outstanding"] > balance_abs else owner["url"]


def no_fallback(key, replicas, vnodes=64, balance_abs=4, balance_rel=2.0):
    _checked(replicas, vnodes)
    least = _least(replicas)
    if least is None:
        return None
    return least["url"] if key is None else _ring_owner(key, replicas, vnodes)["url"]


# ------------------------------------------------------------------ planted bugs: goodput_rate

def _rate(runs, ttft_slo, tpot_slo, attainment, good, strict=False, first_fail_stops=False):
    if not 0 < attainment <= 1:
        raise ValueError("attainment")
    best = 0.0
    for rate in sorted(runs):
        reqs = runs[rate]
        if not reqs:
            raise ValueError("empty")
        frac = sum(good(r, ttft_slo, tpot_slo) for r in reqs) / len(reqs)
        ok = frac > attainment if strict else frac >= attainment
        if ok:
            best = max(best, rate)
        elif first_fail_stops:
            break
    return best


def _tpot(r):
    return sum(r["itl"]) / len(r["itl"]) if r["itl"] else None


def _good(r, a, b):
    t = _tpot(r)
    return r["ttft"] is not None and r["ttft"] <= a and (t is None or t <= b)


def either_slo(runs, ttft_slo, tpot_slo, attainment=0.9):
    def good(r, a, b):
        t = _tpot(r)
        return r["ttft"] is not None and (r["ttft"] <= a or (t is not None and t <= b))
    return _rate(runs, ttft_slo, tpot_slo, attainment, good)


def max_gap(runs, ttft_slo, tpot_slo, attainment=0.9):
    def good(r, a, b):
        t = max(r["itl"]) if r["itl"] else None
        return r["ttft"] is not None and r["ttft"] <= a and (t is None or t <= b)
    return _rate(runs, ttft_slo, tpot_slo, attainment, good)


def strict_attainment(runs, ttft_slo, tpot_slo, attainment=0.9):
    return _rate(runs, ttft_slo, tpot_slo, attainment, _good, strict=True)


def stops_at_first_failure(runs, ttft_slo, tpot_slo, attainment=0.9):
    return _rate(runs, ttft_slo, tpot_slo, attainment, _good, first_fail_stops=True)


def one_token_fails(runs, ttft_slo, tpot_slo, attainment=0.9):
    def good(r, a, b):
        return r["ttft"] is not None and r["ttft"] <= a and bool(r["itl"]) and _tpot(r) <= b
    return _rate(runs, ttft_slo, tpot_slo, attainment, good)


# ------------------------------------------------------------------ planted bugs: reload

def _decide(cfg, tokens, bandwidth, flops, mfu, kv_dtype, kv_factor=2, layers=True, head=False):
    if tokens < 1 or bandwidth <= 0 or flops <= 0 or not 0 < mfu <= 1:
        raise ValueError("bad input")
    per = kv_factor * (cfg.num_layers if layers else 1) * cfg.num_kv_heads * cfg.head_dim \
        * dtype_bytes(kv_dtype)
    work = forward_flops(cfg, tokens) if head else \
        forward_flops(cfg, tokens, last_only=True) - 2 * cfg.vocab_size * cfg.hidden_size
    return "reload" if per * tokens / bandwidth < work / (flops * mfu) else "recompute"


def k_only(cfg, tokens, bandwidth, flops, mfu=0.5, kv_dtype="bfloat16"):
    return _decide(cfg, tokens, bandwidth, flops, mfu, kv_dtype, kv_factor=1)


def one_layer(cfg, tokens, bandwidth, flops, mfu=0.5, kv_dtype="bfloat16"):
    return _decide(cfg, tokens, bandwidth, flops, mfu, kv_dtype, layers=False)


def with_output_head(cfg, tokens, bandwidth, flops, mfu=0.5, kv_dtype="bfloat16"):
    return _decide(cfg, tokens, bandwidth, flops, mfu, kv_dtype, head=True)


def always_reload(cfg, tokens, bandwidth, flops, mfu=0.5, kv_dtype="bfloat16"):
    _decide(cfg, tokens, bandwidth, flops, mfu, kv_dtype)
    return "reload"


BUGS = [
    ("choose_replica", modulo, "first replica clockwise", "key mod N"),
    ("choose_replica", ignores_down, "down", "next one clockwise"),
    ("choose_replica", one_threshold, "both thresholds", "AND more than balance_rel"),
    ("choose_replica", no_fallback, "falls back", "least-loaded"),
    ("goodput_rate", either_slo, "BOTH", "AND"),
    ("goodput_rate", max_gap, "mean gap", "mean of the inter-token gaps"),
    ("goodput_rate", strict_attainment, "exactly at the target", ">="),
    ("goodput_rate", stops_at_first_failure, "after a failing one", "maximum over every"),
    ("goodput_rate", one_token_fails, "one-token", "no TPOT"),
    ("reload_or_recompute", k_only, "decision", "K and V"),
    ("reload_or_recompute", one_layer, "decision", "every layer"),
    ("reload_or_recompute", with_output_head, "decision", "FLOPs"),
    ("reload_or_recompute", always_reload, "small model from disk recomputes", "computes its KV"),
]

(test_planted_bug_is_caught_with_a_specific_message,
 test_every_exercise_has_at_least_two_planted_bugs) = planted_bug_tests(GRADED, BUGS)


def test_the_bundled_model_recomputes_from_nvme_on_an_h100_but_a_70b_reloads():
    # the lecture's claim, from the reference: 135M computes 16 tokens' KV faster than NVMe
    # delivers it; Llama-2-70B has ~500x the FLOPs per KV byte
    small, big = configs.get("smollm2-135m"), configs.get("llama-2-70b")
    assert ch11.reference_reload_or_recompute(small, 2048, 7e9, 989e12) == "recompute"
    assert ch11.reference_reload_or_recompute(big, 2048, 7e9, 989e12) == "reload"
