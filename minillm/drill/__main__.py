"""python -m minillm.drill quiz | review | mock | export-anki FILE.apkg | key-numbers"""
from __future__ import annotations

import argparse
import sys

from . import bank


def _questions(args):
    return bank.load_bank(topic=args.topic, kind=args.kind)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillm.drill",
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
    args = ap.parse_args(argv)

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
            from .anki import export_anki
            if not args.file.endswith(".apkg"):
                raise ValueError(f"{args.file!r}: the file name must end in .apkg")
            n = export_anki(args.file, _questions(args))
            print(f"wrote {n} notes to {args.file}")
        elif args.command == "key-numbers":
            from .keynumbers import key_numbers
            print(key_numbers())
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
