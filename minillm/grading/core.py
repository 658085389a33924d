"""The grading framework: a Check, an Exercise (a group of checks), grade() and report().

A check is a name and a function that takes the learner's function, tries it, and raises
Problem("what went wrong, and the fix") at the first broken expectation; returning means it
passed. It reads like a test, and a helper deep inside can end the check with its message:

    def _keeps_top_token(top_p_filter):
        kept = ...
        if not kept:
            raise Problem("for p=0.1 on [...] you kept no token; the most likely one always stays")

grade() runs every check of an exercise under one time limit (see timelimit.py) and turns
exceptions, time-outs and crashes into failed checks with a message; report() prints

    top_p_filter: 4/5 checks passed
      ok    always keeps the most likely token
      FAIL  keeps the smallest set reaching p: for p=0.5 ... you kept ...
    [minillm-grade] ch00.top_p 4/5

The last line is a machine-readable grade line for self-study tools. The instructor's batch
grader does not read it: in a submission it runs, grade() also records the learner's answers
(transcript.py) and the batch computes every grade again from that record (regrade.py), with
the same _run_check on a stand-in that answers from the record.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from .timelimit import default_time_limit, describe_exception, run_stream
from .transcript import measure, recorder_from_env  # noqa: F401  (measure: for checks)

GRADE_LINE_PREFIX = "[minillm-grade]"
GRADE_LINE_RE = re.compile(r"^\[minillm-grade\] (?P<exercise>[A-Za-z0-9_.\-]+) "
                           r"(?P<score>\d+)/(?P<max>\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Check:
    name: str                                        # what is checked, in words
    fn: Callable[[Callable], None]                   # fn(learner): raises Problem, or passes


@dataclass(frozen=True)
class CheckOutcome:
    name: str
    ok: bool
    message: str = ""


@dataclass
class GradeResult:
    exercise: str                                    # id, e.g. "ch00.top_p"
    title: str                                       # what the learner wrote, e.g. "top_p_filter"
    outcomes: list[CheckOutcome] = field(default_factory=list)

    @property
    def score(self) -> int:
        return sum(o.ok for o in self.outcomes)

    @property
    def max(self) -> int:
        return len(self.outcomes)

    @property
    def full_marks(self) -> bool:
        return self.max > 0 and self.score == self.max

    @property
    def messages(self) -> list[str]:
        """One line per failed check: 'check name: what went wrong'."""
        return [f"{o.name}: {o.message}" for o in self.outcomes if not o.ok]

    @property
    def failed(self) -> list[str]:
        """Names of the failed checks."""
        return [o.name for o in self.outcomes if not o.ok]

    def grade_line(self) -> str:
        return f"{GRADE_LINE_PREFIX} {self.exercise} {self.score}/{self.max}"

    def __str__(self) -> str:
        head = f"{self.title}: {self.score}/{self.max} checks passed"
        lines = [head + (". Full marks." if self.full_marks else "")]
        for o in self.outcomes:
            if o.ok:
                lines.append(f"  ok    {o.name}")
            else:
                text = o.message.replace("\n", "\n        ")
                lines.append(f"  FAIL  {o.name}: {text}")
        lines.append(self.grade_line())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"GradeResult({self.exercise} {self.score}/{self.max})"


@dataclass(frozen=True)
class Exercise:
    id: str                                          # "chNN.short_name": the CSV column
    title: str                                       # the function the learner writes
    checks: tuple[Check, ...]

    @property
    def max(self) -> int:
        return len(self.checks)

    def check(self, learner: Callable, time_limit: Optional[float] = None,
              isolation: Optional[str] = None) -> GradeResult:
        """Grade `learner`, print the report, return the result."""
        return report(grade(self, learner, time_limit, isolation))


class Problem(Exception):
    """A failed expectation inside a check; its text becomes the check's message (one message
    per check: what was asked, what came back, what was expected, and the fix)."""


def expect_value_error(call: Callable, what: str, fix: str = "raise ValueError") -> None:
    """Inside a check: `call()` must raise ValueError. NotImplementedError (an exercise not yet
    written) passes through; any other exception, or a return, is a Problem that names `what`."""
    try:
        out = call()
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as exc:
        raise Problem(f"{what} raised {type(exc).__name__}: {exc}; {fix}") from None
    raise Problem(f"{what}: you returned {str(out)[:60]} instead of raising ValueError")


def _run_check(check: Check, learner: Callable) -> tuple[bool, str]:
    """(ok, message) of one check: Problem fails it with its text, the learner's exceptions fail
    it with theirs, a return passes it."""
    try:
        returned = check.fn(learner)
    except Problem as problem:
        return False, str(problem)
    except NotImplementedError:
        return False, "not written yet: your function raises NotImplementedError"
    except (Exception, SystemExit) as exc:
        name, detail, where = describe_exception(exc)
        return False, f"your code raised {name}: {detail}" + (f" ({where})" if where else "")
    if returned is not None:                 # a grader bug, e.g. an old-style `return ok, msg`
        return False, (f"grader error: the check returned {type(returned).__name__}; a check "
                       "raises core.Problem(message) to fail and returns nothing to pass")
    return True, ""


def grade(exercise: Exercise, learner: Callable, time_limit: Optional[float] = None,
          isolation: Optional[str] = None) -> GradeResult:
    """Run every check of `exercise` on `learner` within one time limit (seconds; default
    10 s or $MINILLM_GRADE_TIME_LIMIT). Never raises because of the learner's code."""
    if not callable(learner):
        why = f"expected a function, got {type(learner).__name__}"
        outcomes = [CheckOutcome(c.name, False, why) for c in exercise.checks]
        return GradeResult(exercise.id, exercise.title, outcomes)
    limit = default_time_limit() if time_limit is None else time_limit
    # In a submission run by the instructor's batch grader, every check also records what the
    # learner's code answered; the batch computes the grade from that record (transcript.py).
    recorder = recorder_from_env(exercise.id, len(exercise.checks), learner)

    def job():
        for index, check in enumerate(exercise.checks):
            yield _run_check(check, recorder.stand_in(index) if recorder else learner)
            if recorder:
                recorder.done(index)

    items, problem = run_stream(job, limit, isolation)
    items = items[:len(exercise.checks)]
    if problem is None and len(items) < len(exercise.checks):
        problem = "the process running it stopped before every check had answered"
    outcomes = [CheckOutcome(c.name, bool(ok), str(msg))
                for c, (ok, msg) in zip(exercise.checks, items)]
    if len(items) < len(exercise.checks):                  # a check never answered: it fails
        if problem == "timeout":
            why = (f"did not finish within the time limit of {limit:g} s (an infinite loop, "
                   "or far too slow?)")
        else:
            why = f"crashed: {problem}"
        if recorder:
            recorder.stopped(len(items), "timeout" if problem == "timeout" else problem)
        outcomes.append(CheckOutcome(exercise.checks[len(items)].name, False, why))
        for c in exercise.checks[len(items) + 1:]:
            outcomes.append(CheckOutcome(c.name, False, "not run: an earlier check "
                                         "did not finish"))
    return GradeResult(exercise.id, exercise.title, outcomes)


def report(result: GradeResult) -> GradeResult:
    """Print the result (score, one line per check, the grade line) and return it."""
    print(result, flush=True)
    return result


def parse_grade_lines(text: str) -> dict[str, tuple[int, int]]:
    """{exercise id: (score, max)} from printed output; a later line for the same id wins."""
    return {m["exercise"]: (int(m["score"]), int(m["max"])) for m in GRADE_LINE_RE.finditer(text)}
