"""Chapter 05 graders are themselves tested: the solution passes, the unfilled exercise fails,
and planted bugs (a plan that overshoots the budget, starves decodes by serving prompts first,
does not chunk, lets a short prompt overtake; metadata without the leading 0 in cu_seqlens_q,
off-by-one positions, seq_lens without the context, ...) are caught with a message that names
the mistake. The references are checked against minillm's own engine."""
import functools
import random
from pathlib import Path

import pytest
import torch

from minillm.cache.blocks import BlockManager
from minillm.configs import get
from minillm.engine.model_runner import ModelRunner
from minillm.engine.request import Request
from minillm.grading import ch05, grade
from minillm.grading.testing import function_from_notebook

from grader_contract import contract_tests, planted_bug_tests
from minillm.loader import random_model
from minillm.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "05_chunked_prefill.ipynb"
SOLUTIONS, EXERCISES = ROOT / "solutions" / NOTEBOOK, ROOT / "exercises" / NOTEBOOK
LIMIT = 60          # generous: a loaded 2-core CI machine must never time out a correct solution

GRADED = {
    "plan_step": ch05.PLAN_STEP,
    "step_metadata": ch05.STEP_METADATA,
}


# ------------------------------------------------------------------ solution passes, stub fails

(test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
 test_solution_cells_hold_the_marked_solution) = contract_tests(NOTEBOOK, GRADED)


def test_chapter_lists_its_exercises_for_batch_grading():
    assert ch05.EXERCISES == (ch05.PLAN_STEP, ch05.STEP_METADATA)
    assert [e.id for e in ch05.EXERCISES] == ["ch05.plan_step", "ch05.step_metadata"]


def test_a_learner_function_that_loops_forever_is_stopped():
    def spins(decodes, prompts, budget, max_num_seqs):
        while True:
            pass
    result = grade(ch05.PLAN_STEP, spins, time_limit=2)
    assert result.score == 0
    assert "time limit" in result.messages[0]


# ------------------------------------------------------------------ the references themselves

def test_reference_plan_matches_the_notebook_examples():
    assert ch05.reference_plan(["a", "b"], [("p", 5), ("q", 7), ("r", 40)], 32, 8) == \
        {"a": 1, "b": 1, "p": 5, "q": 7, "r": 18}
    assert ch05.reference_plan(["a", "b"], [("long", 100), ("short", 3)], 20, 8) == \
        {"a": 1, "b": 1, "long": 18}
    # decodes fill max_num_seqs: the prompt waits although tokens are left
    assert ch05.reference_plan(["a", "b"], [("p", 2)], 16, 2) == {"a": 1, "b": 1}


@functools.lru_cache(maxsize=1)
def _tiny_model():
    cfg = get("smollm2-135m").with_(name="tiny", num_layers=1, num_heads=2, num_kv_heads=1,
                                    head_dim=8, hidden_size=16, intermediate_size=32,
                                    vocab_size=64, max_position_embeddings=512)
    return random_model(cfg, device="cpu", dtype=torch.float32)


def _runner_metadata(spans):
    """What minillm's ModelRunner.prepare builds for these spans."""
    model = _tiny_model()
    num_blocks = sum(-(-(c + n) // 4) for c, n in spans)
    bm = BlockManager(num_blocks=num_blocks, block_size=4)
    runner = ModelRunner(model, bm, num_blocks=num_blocks, block_size=4)
    scheduled = []
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for i, (c, n) in enumerate(spans):
        req = Request(i, str(i), [1] * (c + n), params, 0.0, i)
        req.num_computed_tokens = c
        bm.allocate(i, c + n)
        scheduled.append((req, n))
    step, _ = runner.prepare(scheduled)
    return {"cu_seqlens_q": step["cu_seqlens_q"].tolist(), "positions": step["positions"].tolist(),
            "seq_lens": step["seq_lens"].tolist()}


def test_reference_metadata_is_what_the_model_runner_builds():
    cases = ch05._MIXED + ch05._random_spans(7, 200)[:40] + [[(7, 1), (0, 4), (12, 1)]]
    for spans in cases:
        assert ch05.reference_metadata(spans) == _runner_metadata(spans), spans
    assert ch05.reference_metadata([(7, 1), (0, 4), (12, 1)]) == {
        "cu_seqlens_q": [0, 1, 5, 6], "positions": [7, 0, 1, 2, 3, 12], "seq_lens": [8, 4, 13]}


def test_random_plan_cases_cover_chunking_and_the_sequence_limit():
    # the random check is not a formality: its cases chunk prompts and hit max_num_seqs
    chunked = limited = 0
    for decodes, prompts, budget, max_num_seqs in ch05._random_plan_cases(5, 300):
        plan = ch05.reference_plan(decodes, prompts, budget, max_num_seqs)
        chunked += any(0 < plan.get(rid, 0) < r for rid, r in prompts)
        limited += len(plan) == max_num_seqs and any(rid not in plan for rid, _ in prompts)
    assert chunked >= 30 and limited >= 30


# ------------------------------------------------------------------ planted bugs: plan_step

def _validate(decodes, prompts, budget, max_num_seqs):
    if budget < max_num_seqs or len(decodes) > max_num_seqs:
        raise ValueError("bad configuration")
    if any(r < 1 for _, r in prompts):
        raise ValueError("empty prompt")


def plan_prefill_first(decodes, prompts, budget, max_num_seqs):
    _validate(decodes, prompts, budget, max_num_seqs)
    plan, left = {}, budget
    for rid, r in prompts:                        # prompts before decodes: starves them
        if left == 0 or len(plan) == max_num_seqs:
            break
        plan[rid] = min(r, left)
        left -= plan[rid]
    for rid in decodes:
        if left == 0 or len(plan) == max_num_seqs:
            break
        plan[rid] = 1
        left -= 1
    return plan


def plan_overshoots(decodes, prompts, budget, max_num_seqs):
    _validate(decodes, prompts, budget, max_num_seqs)
    plan = {rid: 1 for rid in decodes}
    left = budget - len(decodes)
    for rid, r in prompts:
        if left <= 0 or len(plan) == max_num_seqs:
            break
        plan[rid] = r                             # the whole prompt, whatever the budget
        left -= r
    return plan


def plan_forgets_decodes_in_budget(decodes, prompts, budget, max_num_seqs):
    _validate(decodes, prompts, budget, max_num_seqs)
    plan = {rid: 1 for rid in decodes}
    left = budget                                 # decodes not subtracted
    for rid, r in prompts:
        if left == 0 or len(plan) == max_num_seqs:
            break
        plan[rid] = min(r, left)
        left -= plan[rid]
    return plan


def plan_without_chunking(decodes, prompts, budget, max_num_seqs):
    _validate(decodes, prompts, budget, max_num_seqs)
    plan = {rid: 1 for rid in decodes}
    left = budget - len(decodes)
    for rid, r in prompts:
        if r > left or len(plan) == max_num_seqs:
            break                                 # a prompt that does not fit whole waits
        plan[rid] = r
        left -= r
    return plan


def plan_one_prompt_per_step(decodes, prompts, budget, max_num_seqs):
    _validate(decodes, prompts, budget, max_num_seqs)
    plan = {rid: 1 for rid in decodes}
    left = budget - len(decodes)
    if prompts and left and len(plan) < max_num_seqs:
        rid, r = prompts[0]
        plan[rid] = min(r, left)
    return plan


def plan_shortest_first(decodes, prompts, budget, max_num_seqs):
    _validate(decodes, prompts, budget, max_num_seqs)
    plan = {rid: 1 for rid in decodes}
    left = budget - len(decodes)
    for rid, r in sorted(prompts, key=lambda p: p[1]):    # shortest job first: overtakes
        if left == 0 or len(plan) == max_num_seqs:
            break
        plan[rid] = min(r, left)
        left -= plan[rid]
    return plan


def plan_ignores_max_num_seqs(decodes, prompts, budget, max_num_seqs):
    _validate(decodes, prompts, budget, max_num_seqs)
    plan = {rid: 1 for rid in decodes}
    left = budget - len(decodes)
    for rid, r in prompts:
        if left == 0:
            break
        plan[rid] = min(r, left)
        left -= plan[rid]
    return plan


def plan_keeps_zeros(decodes, prompts, budget, max_num_seqs):
    _validate(decodes, prompts, budget, max_num_seqs)
    plan = {rid: 1 for rid in decodes}
    left = budget - len(decodes)
    for rid, r in prompts:
        if len(plan) == max_num_seqs:
            break
        plan[rid] = min(r, left)                  # 0 once the budget is gone
        left -= plan[rid]
    return plan


def plan_trusts_the_caller(decodes, prompts, budget, max_num_seqs):
    plan = {rid: 1 for rid in decodes}
    left = budget - len(decodes)
    for rid, r in prompts:
        if left <= 0 or len(plan) == max_num_seqs:
            break
        plan[rid] = min(r, left)
        left -= plan[rid]
    return plan


# ------------------------------------------------------------------ planted bugs: step_metadata

def _spans_ok(spans):
    if any(c < 0 or n < 1 for c, n in spans):
        raise ValueError("bad span")


def meta_no_leading_zero(spans):
    _spans_ok(spans)
    cu, total = [], 0
    for _, n in spans:
        total += n
        cu.append(total)
    return {"cu_seqlens_q": cu, "positions": [p for c, n in spans for p in range(c, c + n)],
            "seq_lens": [c + n for c, n in spans]}


def meta_cu_sums_seq_lens(spans):
    _spans_ok(spans)
    cu = [0]
    for c, n in spans:
        cu.append(cu[-1] + c + n)
    return {"cu_seqlens_q": cu, "positions": [p for c, n in spans for p in range(c, c + n)],
            "seq_lens": [c + n for c, n in spans]}


def meta_positions_off_by_one(spans):
    out = ch05.reference_metadata(spans)
    _spans_ok(spans)
    out["positions"] = [p for c, n in spans for p in range(c + 1, c + n + 1)]
    return out


def meta_positions_restart(spans):
    out = ch05.reference_metadata(spans)
    _spans_ok(spans)
    out["positions"] = [p for _, n in spans for p in range(n)]
    return out


def meta_seq_lens_new_only(spans):
    out = ch05.reference_metadata(spans)
    _spans_ok(spans)
    out["seq_lens"] = [n for _, n in spans]
    return out


def meta_seq_lens_context_only(spans):
    out = ch05.reference_metadata(spans)
    _spans_ok(spans)
    out["seq_lens"] = [c for c, _ in spans]
    return out


def meta_trusts_the_caller(spans):
    return ch05.reference_metadata(spans)


def meta_as_tensors_but_float(spans):
    _spans_ok(spans)
    out = ch05.reference_metadata(spans)
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in out.items()}


# exercise, bug, a check it must fail, words that check's message must contain
BUGS = [
    ("plan_step", plan_prefill_first, "decodes are served before prompts", "starves the decodes"),
    ("plan_step", plan_overshoots, "never plans more tokens than the budget",
     "over the budget of 32"),
    ("plan_step", plan_forgets_decodes_in_budget, "never plans more tokens than the budget",
     "decodes come out of the same budget"),
    ("plan_step", plan_without_chunking, "is chunked", "chunk it"),
    ("plan_step", plan_one_prompt_per_step, "several prompts share a step",
     "any number of prompts can share a step"),
    ("plan_step", plan_shortest_first, "first come first served", "never overtaken"),
    ("plan_step", plan_ignores_max_num_seqs, "at most max_num_seqs", "max_num_seqs is 4"),
    ("plan_step", plan_keeps_zeros, "left out of the plan", "get 0 tokens"),
    ("plan_step", plan_trusts_the_caller, "bad input raises ValueError", "instead of raising"),
    ("step_metadata", meta_no_leading_zero, "starts at 0", "leading 0 is missing"),
    ("step_metadata", meta_no_leading_zero, "an empty step", "cu_seqlens_q is [], expected [0]"),
    ("step_metadata", meta_cu_sums_seq_lens, "running sum", "you summed seq_lens"),
    ("step_metadata", meta_positions_off_by_one, "positions continue", "off by one"),
    ("step_metadata", meta_positions_restart, "positions continue", "restart at 0"),
    ("step_metadata", meta_seq_lens_new_only, "seq_lens count", "only the new tokens"),
    ("step_metadata", meta_seq_lens_context_only, "seq_lens count", "only the cached tokens"),
    ("step_metadata", meta_trusts_the_caller, "bad span raises ValueError", "instead of raising"),
    ("step_metadata", meta_as_tensors_but_float, "starts at 0", "dtype torch.float32"),
]


(test_planted_bug_is_caught_with_a_specific_message,
 test_every_exercise_has_at_least_two_planted_bugs) = planted_bug_tests(GRADED, BUGS)


@pytest.mark.parametrize("name, bug", [
    ("plan_step", plan_prefill_first), ("plan_step", plan_overshoots),
    ("plan_step", plan_without_chunking), ("plan_step", plan_shortest_first),
    ("plan_step", plan_ignores_max_num_seqs),
    ("step_metadata", meta_no_leading_zero), ("step_metadata", meta_positions_off_by_one),
    ("step_metadata", meta_seq_lens_new_only)])
def test_a_bug_is_also_caught_by_the_random_check(name, bug):
    result = grade(GRADED[name], bug, time_limit=LIMIT)
    assert any("random" in f for f in result.failed), str(result)


def test_the_grader_does_not_depend_on_dict_order_or_int_type():
    sol = function_from_notebook(SOLUTIONS, "plan_step")

    def reordered(decodes, prompts, budget, max_num_seqs):
        plan = sol(decodes, prompts, budget, max_num_seqs)
        items = list(plan.items())
        random.Random(0).shuffle(items)
        return {rid: torch.tensor(n).item() for rid, n in items}
    assert grade(ch05.PLAN_STEP, reordered, time_limit=LIMIT).full_marks

    meta = function_from_notebook(SOLUTIONS, "step_metadata")

    def as_tensors(spans):
        return {k: torch.tensor(v, dtype=torch.int32) for k, v in meta(spans).items()}
    assert grade(ch05.STEP_METADATA, as_tensors, time_limit=LIMIT).full_marks
