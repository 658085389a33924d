"""`python -m minillm.grading exercises/ --submissions DIR --out scores.csv` (see batch.py)."""
from __future__ import annotations

import argparse
import sys

from .batch import grade_folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m minillm.grading",
        description="Run every submitted notebook under DIR (from cleared outputs, each in its "
                    "own supervised kernel), grade the answers it recorded, and write one CSV row "
                    "of scores per notebook as it finishes.")
    ap.add_argument("exercises", help="the exercises/ folder (names the problem sets)")
    ap.add_argument("--submissions", required=True, help="folder of submitted .ipynb files "
                    "(searched recursively; names must contain a problem set's name, "
                    "e.g. alice_00_foundations.ipynb)")
    ap.add_argument("--out", default="scores.csv", help="CSV file to write (default scores.csv)")
    ap.add_argument("--timeout", type=float, default=300,
                    help="seconds one notebook may run in all (default 300)")
    ap.add_argument("--check-time-limit", type=float, default=None,
                    help="seconds each group of checks may run (default 10)")
    ap.add_argument("--cell-timeout", type=float, default=None,
                    help="seconds one cell may run before it is interrupted and the notebook "
                         "goes on (default 120)")
    ap.add_argument("--kernel", default="python3", help="Jupyter kernel name (default python3)")
    ap.add_argument("--executed", default=None,
                    help="folder to save the executed notebooks in, for inspection")
    ap.add_argument("--feedback", default=None,
                    help="folder to write one text report per submission into: the grades "
                         "computed by this command, with each failed check's message")
    args = ap.parse_args(argv)
    try:
        rows = grade_folder(args.exercises, args.submissions, args.out, args.timeout,
                            args.kernel, args.check_time_limit, args.executed,
                            cell_timeout=args.cell_timeout, feedback_dir=args.feedback)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
