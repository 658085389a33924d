"""Graded exercises: check functions for the problem sets, and the tools around them.

In a problem-set notebook:

    from minillm.grading import ch00
    ch00.check_top_p(top_p_filter)      # prints a score, one line per check, and a grade line

Tools: `python -m minillm.grading.make_exercises solutions exercises` generates the exercise
notebooks; `python -m minillm.grading exercises/ --submissions DIR --out scores.csv` grades a
folder of submissions: each runs in its own supervised kernel (supervisor.py), its check cells
record the learner's answers as plain data (transcript.py), and the grades are computed from
that record outside the kernel (batch.py). Conventions for adding a chapter, and what the batch
grader does and does not defend against: minillm/grading/README.md.
"""
from .core import (GRADE_LINE_PREFIX, Check, CheckOutcome, Exercise, GradeResult, Problem,
                   grade, parse_grade_lines, report)
from .timelimit import (DEFAULT_TIME_LIMIT, LearnerError, TimeLimitExceeded,
                        run_with_time_limit)

__all__ = ["Check", "CheckOutcome", "Exercise", "GradeResult", "Problem", "grade", "report",
           "parse_grade_lines", "GRADE_LINE_PREFIX", "run_with_time_limit", "TimeLimitExceeded",
           "LearnerError", "DEFAULT_TIME_LIMIT"]
