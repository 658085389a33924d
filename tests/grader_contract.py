"""The tests every chapter's grader owes (minillm/grading/README.md): the solution in
solutions/ scores full marks, the generated stub in exercises/ fails every check, and the solution
cell really carries the solution markers. A chapter's test module takes them with

    test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check, \
        test_solution_cells_hold_the_marked_solution = contract_tests("04_x.ipynb", GRADED)

and adds its own planted-bug tests.
"""
from pathlib import Path

import pytest

from minillm.grading import grade
from minillm.grading.testing import function_from_notebook, function_source

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 60          # generous: a loaded 2-core CI machine must never time out a correct solution


def contract_tests(notebook: str, graded: dict, min_checks: int = 5):
    """graded: learner function name -> its Exercise."""
    solutions, exercises = ROOT / "solutions" / notebook, ROOT / "exercises" / notebook

    @pytest.mark.parametrize("name", list(graded))
    def test_solution_scores_full_marks(name):
        result = grade(graded[name], function_from_notebook(solutions, name), time_limit=LIMIT)
        assert result.full_marks, str(result)
        assert result.max >= min_checks

    @pytest.mark.parametrize("name", list(graded))
    def test_unfilled_exercise_fails_every_check(name):
        result = grade(graded[name], function_from_notebook(exercises, name), time_limit=LIMIT)
        assert result.score == 0, str(result)
        assert all("not written yet" in m for m in result.messages), result.messages

    def test_solution_cells_hold_the_marked_solution():
        for name in graded:
            src = function_source(solutions, name)
            assert "### BEGIN SOLUTION" in src and "### END SOLUTION" in src
            assert "### BEGIN SOLUTION" not in function_source(exercises, name)

    return (test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
            test_solution_cells_hold_the_marked_solution)


def planted_bug_tests(graded: dict, bugs: list):
    """bugs: [(learner function name, buggy function, words in the failing check's name, words
    its message must contain)]. Each bug must lose marks on a check whose message names the
    mistake, and every exercise must have at least two planted bugs."""

    @pytest.mark.parametrize("name, bug, check, words", bugs,
                             ids=[f"{b[0]}-{b[1].__name__}-{i}" for i, b in enumerate(bugs)])
    def test_planted_bug_is_caught_with_a_specific_message(name, bug, check, words):
        result = grade(graded[name], bug, time_limit=LIMIT)
        assert not result.full_marks, f"{bug.__name__} got full marks"
        failing = [m for o, m in zip([o for o in result.outcomes if not o.ok], result.messages)
                   if check in o.name]
        assert failing, f"no failed check matching {check!r}:\n{result}"
        assert any(words in m for m in failing), f"{words!r} missing from {failing}"

    def test_every_exercise_has_at_least_two_planted_bugs():
        for name in graded:
            assert len({b.__name__ for n, b, _, _ in bugs if n == name}) >= 2, name

    return (test_planted_bug_is_caught_with_a_specific_message,
            test_every_exercise_has_at_least_two_planted_bugs)
