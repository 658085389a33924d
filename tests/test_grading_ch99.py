"""The instructor quiz round (solutions/99_quiz_round.ipynb) is graded like every problem set:
the solution passes, the unfilled exercise fails, planted mistakes are caught with the drill's
feedback, and the batch grader scores a folder of submissions."""
import csv
import shutil
from pathlib import Path

import nbformat

from minillm.grading import ch99
from minillm.grading.testing import function_from_notebook

from grader_contract import contract_tests, planted_bug_tests

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "99_quiz_round.ipynb"
GRADED = {"round_numbers": ch99.NUMBERS, "round_letters": ch99.LETTERS}

(test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
 test_solution_cells_hold_the_marked_solution) = contract_tests(NOTEBOOK, GRADED)


def test_chapter_lists_its_exercises_for_batch_grading():
    assert ch99.EXERCISES == (ch99.NUMBERS, ch99.LETTERS)
    assert [e.id for e in ch99.EXERCISES] == ["ch99.numbers", "ch99.letters"]


_solution_numbers = function_from_notebook(ROOT / "solutions" / NOTEBOOK, "round_numbers")
_solution_letters = function_from_notebook(ROOT / "solutions" / NOTEBOOK, "round_letters")


def numbers_in_decimal_kb():
    """KV per token computed in KiB but written as KB."""
    answers = dict(_solution_numbers())
    answers["num.kv-per-token.gqa"] = "504 KB"
    return answers


def numbers_without_factor_two():
    """K and V: the factor 2 forgotten."""
    answers = dict(_solution_numbers())
    answers["num.kv-per-token.gqa"] = f"{2 * 126 * 8 * 128 * 2 // 2} B"
    return answers


def numbers_unparseable():
    answers = dict(_solution_numbers())
    answers["num.decode-step-time"] = "pretty fast"
    return answers


def letters_all_a():
    return {qid: "A" for qid in ch99.LETTER_IDS}


def letters_as_list():
    return list(_solution_letters().values())


BUGS = [
    ("round_numbers", numbers_in_decimal_kb, "num.kv-per-token.gqa", "decimal and binary"),
    ("round_numbers", numbers_without_factor_two, "num.kv-per-token.gqa", "factor of 2"),
    ("round_numbers", numbers_unparseable, "num.decode-step-time", "expected a time"),
    ("round_letters", letters_all_a, "err.phase-bounds-swapped", "Not this one: A)"),
    ("round_letters", letters_as_list, "choice.preempt-victim", "return a dict"),
]

(test_planted_bug_is_caught_with_a_specific_message,
 test_every_exercise_has_at_least_two_planted_bugs) = planted_bug_tests(GRADED, BUGS)


def test_batch_grader_scores_the_round(tmp_path):
    from minillm.grading.__main__ import main
    subs = tmp_path / "subs"
    subs.mkdir()
    shutil.copy(ROOT / "solutions" / NOTEBOOK, subs / f"alice_{NOTEBOOK}")
    nb = nbformat.read(str(ROOT / "exercises" / NOTEBOOK), as_version=4)
    for cell in nb.cells:                      # bob answers the letters only, all "A"
        if "def round_letters" in cell.source:
            cell.source = ("def round_letters():\n    from minillm.grading import ch99\n"
                           "    return {q: 'A' for q in ch99.LETTER_IDS}\n")
    nbformat.write(nb, str(subs / f"bob_{NOTEBOOK}"))
    out = tmp_path / "scores.csv"
    assert main([str(ROOT / "exercises"), "--submissions", str(subs), "--out", str(out)]) == 0
    rows = {r["submission"]: r for r in csv.DictReader(out.open())}
    alice = next(r for k, r in rows.items() if "alice" in k)
    bob = next(r for k, r in rows.items() if "bob" in k)
    assert (alice["ch99.numbers"], alice["ch99.letters"]) == ("6", "5")
    right_a = sum(ch99._instance(q).correct_letter == "A" for q in ch99.LETTER_IDS)
    assert (bob["ch99.numbers"], bob["ch99.letters"]) == ("0", str(right_a))
