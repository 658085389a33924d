"""Naming a learner's mistake only when the evidence points at one.

A grader that knows the common mistakes computes what each would have returned and compares
with what the learner returned. When two mistakes happen to give the same answer on a case (a
static batch that lasts its first member's length and the continuous schedule can both take 31
steps on one trace), naming either one can send the learner after the wrong bug. So a hint is
given only when exactly one explanation fits:

    hint = one_fit(got, [(value_if_mistake_a, "sentence a"), (value_if_mistake_b, "b")],
                   expected=want)

returns the sentence of the only candidate equal to `got`, or "" when none or several fit.
A candidate equal to the right answer explains nothing and is skipped.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional


def _equal(a, b) -> bool:
    result = a == b
    if hasattr(result, "all"):                       # tensors and arrays compare element-wise
        return bool(result.all()) and getattr(a, "shape", None) == getattr(b, "shape", None)
    return bool(result)


def one_fit(got: Any, candidates: Iterable[tuple[Any, str]], expected: Any = None,
            same: Optional[Callable[[Any, Any], bool]] = None) -> str:
    """The sentence of the one candidate whose value equals `got` (by `same`, default ==), or ""
    when no candidate or more than one distinct explanation fits."""
    same = same or _equal
    fits = []
    for value, sentence in candidates:
        try:
            if not same(value, got):
                continue
            if expected is not None and same(value, expected):
                continue
        except (TypeError, ValueError, RuntimeError):
            continue                                 # shapes or types that cannot be compared
        if sentence not in fits:
            fits.append(sentence)
    return fits[0] if len(fits) == 1 else ""
