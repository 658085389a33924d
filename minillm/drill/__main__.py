"""python -m minillm.drill quiz | review | mock | export-anki FILE.apkg | key-numbers

Every error, bad arguments included, is one line on stderr starting with "error: " and exit
code 2; an interrupt is exit code 130."""
from __future__ import annotations

import argparse
import os
import sys

from . import bank


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse prints the usage and the error on two or more lines and exits; here the error is
    one line that points at --help, and main() returns 2."""

    def error(self, message):
        raise _UsageError(f"{message} (see: {self.prog} --help)")


def _export(args) -> None:
    from .anki import export_anki
    if not args.file.endswith(".apkg"):
        raise ValueError(f"{args.file!r}: the file name must end in .apkg")
    folder = os.path.dirname(args.file) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write {args.file}: the folder {folder} does not exist; "
                         "create it or pick another path")
    questions = _questions(args)
    try:
        n = export_anki(args.file, questions)
    except OSError as exc:
        raise ValueError(f"cannot write {args.file}: {exc.strerror or exc}; pick a writable "
                         "path") from None
    print(f"wrote {n} notes to {args.file}")


def _questions(args):
    return bank.load_bank(topic=args.topic, kind=args.kind)


def main(argv=None) -> int:
    ap = _Parser(prog="python -m minillm.drill",
                                 description="The interview drill: quiz, spaced review, mock "
                                             "design interview, Anki export, key numbers.")
    sub = ap.add_subparsers(dest="command", required=True)

    def filters(p):
        p.add_argument("--topic", help=f"one of: {', '.join(bank.topics())}")
        p.add_argument("--kind", help=f"one of: {', '.join(bank.KINDS)}")

    q = sub.add_parser("quiz", help="answer n questions in the terminal, scored at the end")
    filters(q)
    q.add_argument("--n", type=int, default=10)
    q.add_argument("--seed", default="0", help="draw and parameters (same seed, same quiz)")
    q.add_argument("--no-save", action="store_true", help="do not record progress")

    r = sub.add_parser("review", help="spaced repetition (FSRS) over the bank")
    filters(r)
    r.add_argument("--n", type=int, default=20, help="at most this many cards")
    r.add_argument("--new", type=int, default=10, help="at most this many unseen questions")

    m = sub.add_parser("mock", help="the 45-minute mock design interview")
    m.add_argument("--seed", default=None, help="pick the design prompt (default: random)")
    m.add_argument("--prompt", default=None, help="a design prompt id from bank/mock.yaml")
    m.add_argument("--report-dir", default=None)

    e = sub.add_parser("export-anki", help="write the bank as an Anki deck")
    e.add_argument("file", help="FILE.apkg")
    filters(e)

    sub.add_parser("key-numbers", help="print the one-page sheet of key figures")
    try:
        args = ap.parse_args(argv)
    except _UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.command == "quiz":
            from .quiz import run_quiz
            from .state import Progress
            run_quiz(_questions(args), args.n, args.seed,
                     progress=None if args.no_save else Progress())
        elif args.command == "review":
            from .quiz import run_review
            run_review(_questions(args), args.n, args.new)
        elif args.command == "mock":
            import random
            from .mock import run_mock
            seed = args.seed if args.seed is not None else random.randrange(10**9)
            run_mock(seed=seed, prompt_id=args.prompt, report_dir=args.report_dir)
        elif args.command == "export-anki":
            _export(args)
        elif args.command == "key-numbers":
            from .keynumbers import key_numbers
            print(key_numbers())
    except (ValueError, OSError) as exc:        # OSError: a report folder, a state file
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
