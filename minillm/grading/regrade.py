"""Grade an exercise again, in the trusted process, from the answers a submission recorded.

The batch grader (batch.py) never runs learner code where it computes a verdict. The learner's
kernel records every question a check asked and every answer (transcript.py); here each check
of the exercise runs once more against a `ReplayChannel` stand-in that answers from that record:

    recorded run ──read_records()──> {exercise id: run}
        for each check i:   run["checks"][i]["io"]  ──ReplayChannel──> stand-in learner
                            _run_check(check, stand-in)  -> (ok, message)   same code, same order
    -> GradeResult, message for message what the kernel printed

A question the record does not hold fails the check, with the reason the record gives (time
limit, crash, a grader changed in the notebook). This module imports the framework (core) and
the record format (transcript); transcript imports neither, so the package has no import cycle.
"""
from __future__ import annotations

from typing import Optional

from .core import CheckOutcome, Exercise, GradeResult, _run_check
from .transcript import ReplayChannel, ReplayEnd

_CHANGED = ("the grader's questions differ from those your notebook answered "
            "(was the grader changed in the notebook?)")


def _ended(end: ReplayEnd, record: dict) -> str:
    """The message of a check whose replay ran out of recorded answers."""
    if end.reason == "invalid":
        return f"the recorded answers are not valid ({end})"
    if end.reason == "mismatch" or record.get("done"):   # it finished without asking
        return _CHANGED
    why = record.get("stopped")
    if why == "timeout":
        return "did not finish within the time limit (an infinite loop, or far too slow?)"
    return ("crashed: " + why) if why else (
        "did not finish: the process running it stopped before your code answered")


def replay_check(check, record: Optional[dict]) -> tuple[bool, str]:
    """(ok, message) of one check, computed here from its recorded answers (None: it never ran)."""
    if record is None:
        return False, "not run: the notebook stopped before this check answered"
    io_records = record["io"]
    if [r.get("seq") for r in io_records] != list(range(len(io_records))):
        return False, "the recorded answers are out of order (was the grader changed?)"
    channel = ReplayChannel(io_records)
    stand_in = channel.proxy(0, "function")
    try:
        ok, message = _run_check(check, stand_in)
    except ReplayEnd as end:
        return False, _ended(end, record)
    except BaseException as exc:              # a replayed KeyboardInterrupt and the like
        if isinstance(exc, KeyboardInterrupt) and not hasattr(exc, "_minillm_where"):
            raise
        return False, f"your code raised {type(exc).__name__}: {exc}"
    if channel.seq != len(io_records):
        return False, _CHANGED
    return ok, message


def replay_transcript(exercise: Exercise, run: Optional[dict]) -> GradeResult:
    """The GradeResult of `exercise` computed from one recorded run (`transcript.read_records`
    gives {exercise id: run}); None: nothing of this exercise was recorded."""
    outcomes = []
    for index, check in enumerate(exercise.checks):
        if run is None:
            ok, message = False, ("not graded: no check of this exercise ran in the notebook "
                                  "(its check cell did not run or failed, or the kernel died "
                                  "first)")
        else:
            ok, message = replay_check(check, run["checks"].get(index))
        outcomes.append(CheckOutcome(check.name, bool(ok), str(message or "")))
    return GradeResult(exercise.id, exercise.title, outcomes)
