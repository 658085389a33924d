"""NaN never satisfies a check (issue 17): `abs(x - 1) > tol` is False for x = NaN, so a check
written as "fail when the error exceeds the tolerance" passes a NaN answer. Every exercise of
every chapter (the GRADED tables of the chapters' test modules, as in test_grading_transcript.py)
is fed NaN answers two ways, and no check that looks at an answer may pass:

- a learner that answers NaN to everything (a float NaN that is also callable, so a class's
  attributes and methods answer NaN too);
- the solution with every number of its answers replaced by NaN (tensors filled with NaN, ints,
  floats and bools of lists, tuples and dicts replaced, strings by "nan", and whatever it wrote
  into a float tensor argument in place overwritten with NaN), so that answers keep their shape
  and only their values are NaN.

A check may pass only when its name says it looks at no returned value: it checks that bad input
raises, that an argument is left untouched, or that an empty range gives nothing.
"""
import inspect
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from minillm.grading import grade

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_grading_transcript import _learner, graded_exercises  # noqa: E402

NO_VALUE_LOOKED_AT = re.compile(r"\braises?\b|untouched|an empty range gives no slots")


class NaN(float):
    """NaN as a number, and a function or method that answers NaN."""

    def __new__(cls):
        return super().__new__(cls, "nan")

    def __call__(self, *args, **kwargs):
        return NaN()


class AnswersNaN:
    """A learner class: constructed with anything; every attribute and method answers NaN."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return NaN()


def nanify(x):
    if isinstance(x, (bool, int, float)):
        return float("nan")
    if isinstance(x, str):
        return "nan"
    if isinstance(x, bytes):                   # e.g. a digest used as a key
        return b"nan"
    if isinstance(x, torch.Tensor):
        return torch.full(x.shape, float("nan"), dtype=x.dtype if x.is_floating_point()
                          else torch.float32)
    if isinstance(x, (list, tuple)):
        return type(x)(nanify(v) for v in x)
    if isinstance(x, dict):
        return {k: nanify(v) for k, v in x.items()}
    return x


def nan_function(fn):
    """`fn` whose answers (returned and written in place into float tensors) are NaN."""
    def learner(*args, **kwargs):
        tensors = [a for a in list(args) + list(kwargs.values())
                   if isinstance(a, torch.Tensor) and a.is_floating_point()]
        before = [t.clone() for t in tensors]
        out = fn(*args, **kwargs)
        for t, old in zip(tensors, before):
            t[(t != old) & ~(t.isnan() & old.isnan())] = float("nan")
        return nanify(out)
    learner.__name__ = getattr(fn, "__name__", "learner")
    return learner


def nan_class(cls):
    """`cls` whose method results and attribute values are NaN (len() stays honest)."""
    class NaNified:
        def __init__(self, *args, **kwargs):
            self._inner = cls(*args, **kwargs)

        def __getattr__(self, name):
            value = getattr(self._inner, name)
            if callable(value):
                return lambda *a, **k: nanify(value(*a, **k))
            return nanify(value)

        def __len__(self):
            return len(self._inner)
    NaNified.__name__ = cls.__name__
    return NaNified


CASES = graded_exercises()


def _passed_on_an_answer(result) -> list:
    return [o.name for o in result.outcomes if o.ok and not NO_VALUE_LOOKED_AT.search(o.name)]


@pytest.mark.parametrize("module_name, exercise, name", CASES, ids=[c[1].id for c in CASES])
def test_nan_answers_pass_no_check(module_name, exercise, name):
    solution = _learner(module_name, "solution", name)
    is_class = inspect.isclass(solution)
    constant = AnswersNaN if is_class else NaN()
    shaped = nan_class(solution) if is_class else nan_function(solution)
    for label, learner in (("NaN for everything", constant), ("the solution's answers as NaN",
                                                              shaped)):
        result = grade(exercise, learner, time_limit=60, isolation="none")
        passed = _passed_on_an_answer(result)
        assert not passed, f"{exercise.id}, {label}: NaN answers passed {passed}"
        assert result.score < result.max


def test_the_nan_learners_are_nan():
    assert math.isnan(NaN()) and math.isnan(NaN()(1, 2)) and math.isnan(AnswersNaN(3).tables)
    t = torch.zeros(3)

    def writes(x):
        x[1] = 5.0
        return [1, (2.5, True)], {"a": torch.ones(2, dtype=torch.long)}

    (ints, d) = nan_function(writes)(t)
    assert t[0] == 0 and math.isnan(t[1]) and math.isnan(ints[0]) and math.isnan(ints[1][1])
    assert d["a"].isnan().all()
