"""A grader names a mistake only when exactly one known mistake explains the learner's answer
(minillm/grading/hints.py). Two mistakes that agree on a case must not produce a hint for
either: naming the wrong one sends the learner after the wrong bug."""
import torch

from minillm.grading import ch00, ch01, ch04, grade
from minillm.grading.hints import one_fit

LIMIT = 60


def test_one_fit_names_only_a_lone_explanation():
    cands = [(3, "three"), (4, "four a"), (4, "four b"), (5, "five"), (5, "five")]
    assert one_fit(3, cands) == "three"
    assert one_fit(4, cands) == ""                       # two explanations agree: no hint
    assert one_fit(5, cands) == "five"                   # the same sentence twice is one
    assert one_fit(6, cands) == ""                       # nothing fits
    assert one_fit(3, cands, expected=3) == ""           # a "mistake" giving the right answer
    t = torch.ones(2)
    assert one_fit(t, [(torch.ones(2), "ones"), (torch.zeros(2), "zeros")]) == "ones"
    assert one_fit(t, [(torch.ones(3), "other shape")]) == ""


# the static trace where a batch lasting its first member's length and the continuous schedule
# both take 31 steps (the right answer is 35)
AMBIGUOUS = ([7, 7, 8, 7, 12, 4, 4, 8], 2)


def test_the_ambiguous_static_trace_really_is_ambiguous():
    lens, slots = AMBIGUOUS
    assert ch04._occupancy_reference(lens, slots, "static")["steps"] == 35
    assert ch04._static_variant(lens, slots, lambda b: b[0]) == 31
    assert ch04._continuous_variant(lens, slots, 0) == 31


def test_occupancy_gives_no_hint_when_two_mistakes_give_the_same_steps():
    lens, slots = AMBIGUOUS
    assert ch04._steps_hint([(lens, slots, "static", 31, 35)]) == ""
    # the same learner on a second trace where only one of the two explains the steps
    other = [5, 2, 2, 9, 1]
    first_member = ch04._static_variant(other, 3, lambda b: b[0])
    assert first_member != ch04._continuous_variant(other, 3, 0)
    hint = ch04._steps_hint([(lens, slots, "static", 31, 35),
                             (other, 3, "static", first_member,
                              ch04._occupancy_reference(other, 3, "static")["steps"])])
    assert "first member's length" in hint


def test_a_late_refill_on_the_example_trace_is_named_by_the_check_not_guessed():
    # [4, 1, 1, 1] in 2 slots: the static schedule and a continuous one refilling a step late
    # both take 5 steps, so that trace alone names neither mistake ...
    assert ch04._steps_hint([([4, 1, 1, 1], 2, "continuous", 5, 4)]) == ""

    def refills_late(output_lens, max_num_seqs, scheduling):
        if scheduling not in ("static", "continuous") or max_num_seqs < 1 or \
                any(m < 1 for m in output_lens):
            raise ValueError("bad input")
        steps = ch04._continuous_variant(output_lens, max_num_seqs, 1) if output_lens else 0
        return {"steps": steps, "idle_slot_steps": 0, "idle_while_waiting": 0}
    # ... but the check's other traces tell them apart, and the message names the late refill
    result = grade(ch04.SLOT_OCCUPANCY, refills_late, time_limit=LIMIT)
    continuous = [m for m in result.messages if m.startswith("continuous: a freed slot")]
    assert continuous and "one step late" in continuous[0]
    assert "static schedule" not in continuous[0]


def test_kv_bytes_gives_no_hint_when_a_factor_two_has_two_explanations():
    """DeepSeek-V3: twice the right answer is K and V counted separately OR, in fp8, fp8 counted
    as 2 bytes, OR, in bf16, bf16 counted as 4 bytes; only in fp32 is it one mistake."""
    from minillm import configs, kvmath
    cfg = configs.get("deepseek-v3")
    for dtype in ("fp8", "bf16"):
        want = kvmath.kv_bytes_per_token(cfg, dtype)
        assert ch01._kv_diagnosis(2 * want, want, cfg, dtype) == ""
    want = kvmath.kv_bytes_per_token(cfg, "float32")
    assert "no factor 2" in ch01._kv_diagnosis(2 * want, want, cfg, "float32")


def test_roofline_weights_per_token_is_not_claimed_for_a_decode():
    """With one token per sequence, weights counted per token and per sequence are the same
    number: only the per-sequence sentence (the one that is right for both) is offered."""
    step = ch00._Step("llama-3-8b", 16, 1, 512, 2, ch00._H100)
    sentences = [s for _, s in step.bytes_variants()]
    assert not any("once per token" in s for s in sentences)
    step = ch00._Step("llama-3-8b", 2, 16, 0, 2, ch00._H100)
    assert any("once per token" in s for _, s in step.bytes_variants())
