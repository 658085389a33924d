"""Graders for the instructor quiz round (solutions/99_quiz_round.ipynb).

A round is a fixed list of drill questions instanced with one seed, so every learner gets the
same numbers and the batch grader (`python -m minillm.grading`) can score a folder of
submissions. The learner writes two functions that return {question id: answer}; each question
is one check, graded by the drill's own grader (units and tolerance for numbers, one letter for
the others), and a failed check quotes the drill's feedback.
"""
from __future__ import annotations

from .core import Check, Exercise, Problem

ROUND_SEED = "round-1"
NUMBER_IDS = ("num.kv-per-token.gqa", "num.max-concurrency", "num.decode-step-time",
              "num.blocks-for-mix", "num.spec-speedup", "num.littles-concurrency")
LETTER_IDS = ("err.phase-bounds-swapped", "err.spec-break-even-50", "err.prefix-hit-cow",
              "scen.p99-itl-spikes", "choice.preempt-victim")


def _instance(qid: str):
    from ..drill import get
    return get(qid).instance(ROUND_SEED)


def show_round(ids=NUMBER_IDS + LETTER_IDS) -> None:
    """Print the round's questions, each under its id."""
    for i, qid in enumerate(ids, 1):
        print(f"Q{i} [{qid}]\n{_instance(qid).prompt}\n")


def as_read(qid: str, answer) -> str:
    """How the drill's grader reads `answer` to question `qid`: the value in base units, or why
    it cannot be read."""
    from ..drill.units import UnitError, fmt_value, parse_quantity
    inst = _instance(qid)
    if not inst.dimension:
        return str(answer).strip()[:1].upper() or "(empty)"
    try:
        q = parse_quantity(str(answer), inst.dimension, inst._numeric.unit)
    except UnitError as exc:
        return f"unreadable: {exc}"
    return fmt_value(q.value, inst.dimension)


def _grade_one(qid: str):
    def check(answers_fn):
        answers = answers_fn()
        if not isinstance(answers, dict):
            raise Problem(f"return a dict {{question id: answer}}, e.g. {{'{qid}': '...'}}; "
                          f"you returned a {type(answers).__name__}")
        if qid not in answers:
            raise Problem(f"no answer for {qid!r} (your keys: {sorted(answers)[:6]})")
        g = _instance(qid).grade(str(answers[qid]))
        first = g.feedback.splitlines()[0]
        if not g.correct:
            raise Problem(f"you answered {answers[qid]!r}. {first}")
    check.__name__ = f"check_{qid}"
    return check


NUMBERS = Exercise("ch99.numbers", "round_numbers",
                   tuple(Check(f"{qid}: the number, in any unit, within tolerance", _grade_one(qid))
                         for qid in NUMBER_IDS))
LETTERS = Exercise("ch99.letters", "round_letters",
                   tuple(Check(f"{qid}: the right option", _grade_one(qid)) for qid in LETTER_IDS))


def check_round_numbers(round_numbers, time_limit=None):
    return NUMBERS.check(round_numbers, time_limit)


def check_round_letters(round_letters, time_limit=None):
    return LETTERS.check(round_letters, time_limit)


EXERCISES = (NUMBERS, LETTERS)
