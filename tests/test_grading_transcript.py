"""The batch grader computes every grade from a transcript of the learner's answers (see
minillm/grading/transcript.py and regrade.py). This proves, for every exercise of every chapter,
that the grade replayed from the transcript is the grade the checks give the function itself,
message for message: the solution, the unfilled stub, and each planted bug of the chapter's
grader tests. A new exercise is covered as soon as its chapter's test module (found by name)
lists it in GRADED and BUGS.
"""
import importlib
from pathlib import Path

import pytest

from minillm.grading import Exercise, grade, transcript
from minillm.grading.regrade import replay_transcript
from minillm.grading.testing import function_from_notebook

ROOT = Path(__file__).resolve().parents[1]
# chapters 00-01 live in test_grading.py; every later chapter in its own test_grading_chNN.py
MODULES = ["test_grading"] + sorted(
    p.stem for p in (ROOT / "tests").glob("test_grading_ch[0-9][0-9].py"))


def graded_exercises() -> list:
    """(test module, Exercise, learner function name) for every exercise of every chapter."""
    cases = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, spec in module.GRADED.items():
            exercise = spec[0] if isinstance(spec, tuple) else spec
            assert isinstance(exercise, Exercise)
            cases.append((module_name, exercise, name))
    return cases


def _cases():
    cases = []
    for module_name, exercise, name in graded_exercises():
        for kind in ("solution", "stub"):
            cases.append((module_name, exercise, kind, name))
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        seen = set()
        for name, bug, *_ in module.BUGS:
            if _bug_name(module, bug) not in seen:      # one case per distinct bug
                seen.add(_bug_name(module, bug))
                spec = module.GRADED[name]
                cases.append((module_name, spec[0] if isinstance(spec, tuple) else spec,
                              ("bug", bug), name))
    return cases


def _bug_name(module, bug) -> str:
    return module.bug_name(bug) if hasattr(module, "bug_name") else bug.__name__


def _label(case) -> str:
    module_name, exercise, kind, _ = case
    if isinstance(kind, tuple):
        kind = _bug_name(importlib.import_module(module_name), kind[1])
    return f"{exercise.id}-{kind}"


def _learner(module_name, kind, name):
    module = importlib.import_module(module_name)
    if isinstance(kind, tuple):                          # a planted bug
        bug = kind[1]
        return module.make_bug(name, bug) if hasattr(module, "make_bug") else bug
    if hasattr(module, kind):                            # the module's own loader (ch03: Triton)
        return getattr(module, kind)(name)
    folder = "solutions" if kind == "solution" else "exercises"
    return function_from_notebook(ROOT / folder / module.NOTEBOOK, name)


CASES = _cases()


@pytest.mark.parametrize("module_name, exercise, kind, name", CASES,
                         ids=[_label(c) for c in CASES])
def test_replayed_grade_equals_the_direct_grade(module_name, exercise, kind, name, tmp_path,
                                                 monkeypatch):
    learner = _learner(module_name, kind, name)
    direct = grade(exercise, learner, time_limit=60, isolation="none")
    path = tmp_path / "records.jsonl"
    monkeypatch.setenv(transcript.RECORD_ENV, str(path))
    recorded = grade(exercise, learner, time_limit=60, isolation="none")
    monkeypatch.delenv(transcript.RECORD_ENV)
    run = transcript.read_records(path)[exercise.id]
    replayed = replay_transcript(exercise, run)
    # what the batch computes is exactly what the kernel saw
    assert [(o.name, o.ok, o.message) for o in replayed.outcomes] == \
        [(o.name, o.ok, o.message) for o in recorded.outcomes]
    # and the grade of the function itself; a check that times the learner's code (its message
    # quotes the measurement) is compared by verdict only
    for index, (mine, want) in enumerate(zip(recorded.outcomes, direct.outcomes)):
        timed = any(r.get("what", "").startswith("measure")
                    for r in run["checks"].get(index, {"io": []})["io"])
        assert (mine.name, mine.ok) == (want.name, want.ok)
        if not timed:
            assert mine.message == want.message


def test_every_chapter_with_exercises_is_covered():
    covered = {c[1].id for c in CASES}
    for n in range(0, 100):
        try:
            module = importlib.import_module(f"minillm.grading.ch{n:02d}")
        except ModuleNotFoundError:
            continue
        missing = [e.id for e in module.EXERCISES if e.id not in covered]
        assert not missing, f"exercises without a replay test: {missing}"
