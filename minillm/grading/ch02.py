"""Graders for the chapter 02 problem set (solutions/02_contiguous_allocation.ipynb).

    ch02.check_first_fit(first_fit)           # (a) place a slab in the lowest hole that fits
    ch02.check_free_slab(free_slab)           # (b) give a slab back, merging touching holes
    ch02.check_fragmentation(fragmentation)   # (c) internal / external fragmentation, refusals

A free list is a list of (start, length) holes in address order. The reference is minillm's own
`cache.contiguous.ContiguousArena`: every case is laid out in a real arena, and the expected
answer is what the arena does (`allocate`, `free`, `free_extents`, `internal_fragmentation`,
`external_fragmentation`). Every case is small and seeded.
"""
from __future__ import annotations

import copy
import math
import random
from numbers import Integral, Real
from typing import Optional

from ..lab.arena import ContiguousArena
from .core import Check, Exercise, Problem
from .hints import one_fit

# A layout lists an arena's pieces in address order:
#   ("slab", length, written)           a live request's slab, `written` tokens used
#   ("slab", length, written, "me")     the slab a free_slab case gives back
#   ("hole", length)                    free tokens


def _arena(layout) -> ContiguousArena:
    """A first-fit ContiguousArena laid out exactly as `layout`."""
    arena = ContiguousArena(sum(seg[1] for seg in layout), policy="first_fit")
    holes = []
    for i, seg in enumerate(layout):
        name = seg[3] if len(seg) > 3 else i
        slab = arena.allocate(name, seg[1])      # everything below is taken: lands right here
        if seg[0] == "hole":
            holes.append(name)
        elif seg[2]:
            slab.write(seg[2])
    for name in holes:
        arena.free(name)
    return arena


def _extents_problem(value, what="free list") -> tuple[Optional[list], Optional[str]]:
    """(value as a list of (start, length) int pairs, None) or (None, what is wrong)."""
    if not isinstance(value, (list, tuple)):
        return None, f"the {what} is a {type(value).__name__}; expected a list of (start, length)"
    out = []
    for item in value:
        if (not isinstance(item, (list, tuple)) or len(item) != 2
                or not all(isinstance(x, Integral) and not isinstance(x, bool) for x in item)):
            return None, (f"the {what} holds {item!r}; every entry must be a (start, length) "
                          "pair of ints")
        out.append((int(item[0]), int(item[1])))
    return out, None


def _fmt(extents) -> str:
    return "[" + ", ".join(f"({s}, {n})" for s, n in extents) + "]"


# =========================================================================== (a) first fit

def _first_fit_reference(layout, size):
    """(holes before, start or None, holes after) from the arena."""
    arena = _arena(layout)
    before = arena.free_extents()
    slab = arena.allocate("new", size) if size <= arena.capacity else None
    return before, (slab.start if slab is not None else None), arena.free_extents()


def _call_first_fit(fn, holes, size):
    """(start, new free list, None) or (None, None, problem)."""
    out = fn(list(holes), size)
    if not isinstance(out, (list, tuple)) or len(out) != 2:
        return None, None, (f"returned {out!r}; expected a pair (start or None, the new free "
                            "list)")
    start, extents = out
    if start is not None and (isinstance(start, bool) or not isinstance(start, Integral)):
        return None, None, f"returned start {start!r}; expected an int address or None"
    extents, problem = _extents_problem(extents, "new free list")
    if problem:
        return None, None, problem
    return (None if start is None else int(start)), extents, None


def _start_hint(holes, size, got, expected) -> str:
    fits = [(s, n) for s, n in holes if n >= size]
    if expected is None:
        largest = max((n for _, n in holes), default=0)
        return (f"; no hole holds {size} tokens (the largest has {largest}), so return None "
                "and the free list unchanged")
    if fits[0][1] == size:
        return (f"; the hole ({expected}, {size}) holds exactly {size} tokens, and a hole of "
                "exactly `size` tokens fits: compare with >=, not >")
    if got is None:
        return f"; the hole {fits[0]} fits"
    best = min(fits, key=lambda h: (h[1], h[0]))[0]
    s, n = fits[0]
    hint = one_fit(got, [
        (best, "that is the smallest hole that fits (best fit); first fit takes the lowest "
               "address that fits"),
        (s + n - size, "you placed the slab at the end of the hole; carve it from the front, so "
                       "the slab starts where the hole starts"),
    ] + [(hs, "that hole is too small for the slab") for hs, hn in holes if hn < size],
        expected=expected)
    return f"; {hint}" if hint else ""


def _first_fit_cases(cases, compare_list=True):
    def check(fn):
        for layout, size in cases:
            holes, expected, after = _first_fit_reference(layout, size)
            start, extents, problem = _call_first_fit(fn, holes, size)
            what = f"free list {_fmt(holes)}, size {size}"
            if problem:
                raise Problem(f"{what}: {problem}")
            if start != expected:
                raise Problem(f"{what}: you returned start {start}, expected {expected}"
                              + _start_hint(holes, size, start, expected))
            if compare_list and extents != after:
                raise Problem(f"{what}: " + _first_fit_list_hint(holes, size, expected, extents,
                                                                  after))
    return check


def _first_fit_list_hint(holes, size, start, got, after) -> str:
    if start is None:
        return (f"you refused the request (right), but returned the free list {_fmt(got)}, "
                f"expected {_fmt(after)}; a refused request changes nothing")
    text = (f"the slab starts at {start} (right), but you returned the free list {_fmt(got)}, "
            f"expected {_fmt(after)}")
    if got == holes:
        return text + "; shrink the hole you used"
    i = next(i for i, (s, n) in enumerate(holes) if s == start)
    s, n = holes[i]
    if any(e == (s + size, 0) for e in got):
        return text + "; a hole used up completely must leave the list (no zero-length holes)"
    off = [holes[:i] + [(s + size + d, n - size - d)] + holes[i + 1:] for d in (-1, 1)] + \
          [holes[:i] + [(s + size, n - size + d)] + holes[i + 1:] for d in (-1, 1)]
    if got in off:
        return text + (f"; off by one: what stays free of the hole is [start + size, "
                       f"start + length) = ({s + size}, {n - size})")
    return text


# holes (0, 20), (30, 10), (60, 40) between live slabs; 70 tokens free, the largest hole 40
_LAYOUT = [("hole", 20), ("slab", 10, 10), ("hole", 10), ("slab", 20, 5), ("hole", 40),
           ("slab", 5, 5)]
# the first hole is too small for most requests: (0, 5), (30, 10), (60, 40)
_SMALL_FIRST = [("hole", 5), ("slab", 25, 3), ("hole", 10), ("slab", 20, 20), ("hole", 40),
                ("slab", 5, 0)]


def _leaves_input(fn):
    for layout, size in ((_LAYOUT, 8), (_LAYOUT, 20), (_SMALL_FIRST, 10), (_LAYOUT, 45)):
        holes = _arena(layout).free_extents()
        given = copy.deepcopy(holes)
        fn(given, size)
        if given != holes:
            raise Problem(f"free list {_fmt(holes)}, size {size}: after the call your input "
                          f"list reads {given!r}; build and return a new list instead")


def _rejects_bad_size(fn):
    holes = _arena(_LAYOUT).free_extents()
    for size in (0, -3):
        try:
            out = fn(list(holes), size)
        except ValueError:
            continue
        raise Problem(f"size {size}: you returned {out!r}; a slab needs at least one token, so "
                      "raise ValueError with a message that says so")


def _random_trace(fn, seed: int, ops: int, on_alloc=None, on_free=None):
    """Drive a ContiguousArena through seeded random allocations and frees. After each one,
    on_alloc(fn, holes_before, size, start, holes_after, step) or
    on_free(fn, holes_before, start, length, holes_after, step) compares the learner's function
    with what the arena did and returns a message when they disagree."""
    rng = random.Random(seed)
    arena = ContiguousArena(256, policy="first_fit")
    live, counter = [], 0
    for step in range(ops):
        before = arena.free_extents()
        if live and (rng.random() < 0.4 or arena.free_tokens < 8):
            rid = live.pop(rng.randrange(len(live)))
            start, length = arena.slabs[rid].start, arena.slabs[rid].length
            arena.free(rid)
            message = on_free and on_free(fn, before, start, length, arena.free_extents(), step)
        else:
            size = rng.randint(1, 64)
            slab = arena.allocate(counter, size)
            if slab is not None:
                live.append(counter)
                counter += 1
            start = slab.start if slab is not None else None
            message = on_alloc and on_alloc(fn, before, size, start, arena.free_extents(), step)
        if message:
            raise Problem(message)


def _first_fit_trace_hook(fn, holes, size, expected, after, step):
    start, extents, problem = _call_first_fit(fn, holes, size)
    where = f"random trace, call {step + 1}: free list {_fmt(holes)}, size {size}"
    if problem:
        return f"{where}: {problem}"
    if start != expected:
        return (f"{where}: you returned start {start}, the arena placed the slab at {expected}"
                + _start_hint(holes, size, start, expected))
    if extents != after:
        return f"{where}: " + _first_fit_list_hint(holes, size, expected, extents, after)
    return None


def _first_fit_trace(fn):
    for seed in (11, 12):
        _random_trace(fn, seed, 80, on_alloc=_first_fit_trace_hook)


FIRST_FIT = Exercise("ch02.first_fit", "first_fit", (
    Check("takes the lowest-address hole that fits, not the smallest",
          _first_fit_cases([(_LAYOUT, 8), (_LAYOUT, 25), (_SMALL_FIRST, 10), (_SMALL_FIRST, 3)],
                           compare_list=False)),
    Check("carves the slab from the front of the hole; the rest of the hole stays free",
          _first_fit_cases([(_LAYOUT, 8), (_LAYOUT, 25), (_SMALL_FIRST, 7)])),
    Check("a hole used up exactly leaves the free list",
          _first_fit_cases([(_LAYOUT, 20), (_SMALL_FIRST, 10)])),
    Check("refuses (None, free list unchanged) when no hole fits, though the free total would",
          _first_fit_cases([(_LAYOUT, 45), (_SMALL_FIRST, 41)])),
    Check("leaves the caller's free list untouched", _leaves_input),
    Check("size < 1 raises ValueError", _rejects_bad_size),
    Check("agrees with minillm's ContiguousArena along random allocate/free traces",
          _first_fit_trace),
))


def check_first_fit(first_fit, time_limit: Optional[float] = None):
    """Grade exercise (a): first_fit(free_extents, size) -> (start or None, new free list)."""
    return FIRST_FIT.check(first_fit, time_limit)


# =========================================================================== (b) free + coalescing

def _free_reference(layout):
    """(holes before, (start, length) of the "me" slab, holes after freeing it)."""
    arena = _arena(layout)
    before, slab = arena.free_extents(), arena.slabs["me"]
    start, length = slab.start, slab.length
    arena.free("me")
    return before, (start, length), arena.free_extents()


def _free_list_hint(holes, start, length, got) -> str:
    inserted = sorted(holes + [(start, length)])
    if got == inserted:
        return ("; the freed range touches a hole: merge them (coalescing), or the list keeps "
                "two small holes where one big one is")
    if sorted(got) != got:
        return "; keep the list sorted by start address"
    if len(got) < len(_coalesce(inserted)):
        return ("; you merged holes that do not touch: a hole (s, n) covers s .. s+n-1, so it "
                "touches a freed range only when that range begins exactly at s + n (or ends "
                "exactly at s)")
    return ""


def _coalesce(extents):
    merged = []
    for s, n in sorted(extents):
        if merged and merged[-1][0] + merged[-1][1] == s:
            merged[-1] = (merged[-1][0], merged[-1][1] + n)
        else:
            merged.append((s, n))
    return merged


def _call_free(fn, holes, start, length):
    out = fn(list(holes), start, length)
    return _extents_problem(out, "free list you returned")


def _free_cases(layouts):
    def check(fn):
        for layout in layouts:
            holes, (start, length), after = _free_reference(layout)
            got, problem = _call_free(fn, holes, start, length)
            what = f"free list {_fmt(holes)}, freeing ({start}, {length})"
            if problem:
                raise Problem(f"{what}: {problem}")
            if got != after:
                raise Problem(f"{what}: you returned {_fmt(got)}, expected {_fmt(after)}"
                              + _free_list_hint(holes, start, length, got))
    return check


_ME = ("slab", 5, 5, "me")
_BETWEEN = [("hole", 10), ("slab", 10, 10), _ME, ("slab", 25, 3), ("hole", 10)]
_BELOW = [("hole", 10), _ME, ("slab", 35, 9), ("hole", 10)]
_ABOVE = [("hole", 10), ("slab", 35, 9), _ME, ("hole", 10)]
_BOTH = [("hole", 10), ("slab", 10, 10, "me"), ("hole", 10), ("slab", 4, 4)]
_BOTH_MIDDLE = [("slab", 3, 3), ("hole", 7), ("slab", 6, 1, "me"), ("hole", 9), ("slab", 8, 8),
                ("hole", 4)]
_GAP_ONE = [("hole", 10), ("slab", 1, 1), _ME, ("slab", 1, 1), ("hole", 10), ("slab", 5, 5)]
_ONLY = [("slab", 12, 2), ("slab", 6, 6, "me"), ("slab", 12, 12)]


def _rejects_double_free(fn):
    holes = _arena(_BETWEEN).free_extents()                 # [(0, 10), (50, 10)]
    for start, length in ((5, 10), (50, 10), (45, 6), (0, 60), (20, 0)):
        try:
            out = fn(list(holes), start, length)
        except ValueError:
            continue
        why = ("a slab holds at least one token" if length < 1 else
               "part of that range is already free, so this is a double free or a wrong address")
        raise Problem(f"free list {_fmt(holes)}, freeing ({start}, {length}): you returned "
                      f"{out!r}; {why}: raise ValueError")


def _free_leaves_input(fn):
    for layout in (_BETWEEN, _BOTH, _BELOW):
        holes, (start, length), _ = _free_reference(layout)
        given = copy.deepcopy(holes)
        fn(given, start, length)
        if given != holes:
            raise Problem(f"free list {_fmt(holes)}, freeing ({start}, {length}): after the "
                          f"call your input list reads {given!r}; build and return a new list")


def _free_trace_hook(fn, holes, start, length, after, step):
    got, problem = _call_free(fn, holes, start, length)
    where = (f"random trace, call {step + 1}: free list {_fmt(holes)}, freeing "
             f"({start}, {length})")
    if problem:
        return f"{where}: {problem}"
    if got != after:
        return (f"{where}: you returned {_fmt(got)}, the arena's free list is {_fmt(after)}"
                + _free_list_hint(holes, start, length, got))
    return None


def _free_trace(fn):
    for seed in (21, 22):
        _random_trace(fn, seed, 90, on_free=_free_trace_hook)


FREE_SLAB = Exercise("ch02.free_slab", "free_slab", (
    Check("puts the freed range back in address order", _free_cases([_BETWEEN, _ONLY])),
    Check("merges with the hole that ends where the slab begins", _free_cases([_BELOW])),
    Check("merges with the hole that begins where the slab ends", _free_cases([_ABOVE])),
    Check("merges the holes on both sides into one", _free_cases([_BOTH, _BOTH_MIDDLE])),
    Check("keeps a hole that is one token away separate", _free_cases([_GAP_ONE])),
    Check("a range that overlaps a free hole (double free) or is empty raises ValueError",
          _rejects_double_free),
    Check("leaves the caller's free list untouched", _free_leaves_input),
    Check("agrees with minillm's ContiguousArena along random allocate/free traces",
          _free_trace),
))


def check_free_slab(free_slab, time_limit: Optional[float] = None):
    """Grade exercise (b): free_slab(free_extents, start, length) -> the new free list."""
    return FREE_SLAB.check(free_slab, time_limit)


# =========================================================================== (c) fragmentation

_KEYS = ("internal", "external", "refused_by_fragmentation")


def _arena_state(arena: ContiguousArena, size: int) -> tuple[list, list, dict]:
    """What the learner is given about `arena` (slabs, free list) and what the arena says."""
    slabs = [(s.length, s.seq_len) for s in sorted(arena.slabs.values(), key=lambda s: s.start)]
    expected = {"internal": arena.internal_fragmentation,
                "external": arena.external_fragmentation,
                "refused_by_fragmentation": (not arena.can_allocate(size)
                                             and arena.free_tokens >= size)}
    return slabs, arena.free_extents(), expected


def _fragmentation_reference(layout, size) -> tuple[list, list, dict]:
    return _arena_state(_arena(layout), size)


def _call_fragmentation(fn, slabs, holes, size):
    out = fn(list(slabs), list(holes), size)
    if not isinstance(out, dict):
        return None, f"returned {type(out).__name__}; expected a dict with keys {list(_KEYS)}"
    missing = [k for k in _KEYS if k not in out]
    if missing:
        return None, f"your dict has no key {missing[0]!r}; it needs {list(_KEYS)}"
    for key in ("internal", "external"):
        if isinstance(out[key], bool) or not isinstance(out[key], Real):
            return None, f"{key!r} is {out[key]!r}; expected a float in [0, 1]"
    flag = out["refused_by_fragmentation"]
    if type(flag).__name__ not in ("bool", "bool_"):
        return None, f"'refused_by_fragmentation' is {flag!r}; expected True or False"
    return out, None


def _internal_hint(slabs, got, want) -> str:
    reserved = sum(r for r, _ in slabs)
    written = sum(w for _, w in slabs)
    candidates = []
    if slabs:
        candidates.append((sum((r - w) / r for r, w in slabs) / len(slabs), "that is the mean of "
                           "each slab's own fraction, so a small slab counts as much as a big "
                           "one; divide the unwritten tokens of all slabs by all reserved tokens"))
    if reserved:
        candidates.append((written / reserved, "that is the share that was written; the waste is "
                                               "the share that was not"))
    hint = one_fit(got, candidates, expected=want, same=_isclose)
    return f"; {hint}" if hint else ""


def _external_hint(slabs, holes, got, want) -> str:
    free = sum(n for _, n in holes)
    largest = max((n for _, n in holes), default=0)
    capacity = free + sum(r for r, _ in slabs)
    candidates = []
    if free:
        candidates.append((largest / free, "that is the share of free memory in the largest "
                           "hole, the part that is still usable; fragmentation is 1 minus it"))
    if capacity:
        candidates.append((1 - largest / capacity, "you divided by all memory (reserved + "
                           "free); external fragmentation is measured against the free memory "
                           "only"))
    if free and len(holes) > 1:
        candidates.append((1 - min(n for _, n in holes) / free, "use the largest hole, the "
                           "biggest request that can still be placed"))
    hint = one_fit(got, candidates, expected=want, same=_isclose)
    return f"; {hint}" if hint else ""


def _isclose(a, b) -> bool:
    return math.isclose(a, b, abs_tol=1e-9)


def _fragmentation_mismatch(out, expected, keys, slabs, holes, size) -> Optional[str]:
    """None when `out` agrees with `expected` on `keys`, else what differs and why."""
    for key in keys:
        got, want = out[key], expected[key]
        if key == "refused_by_fragmentation":
            if bool(got) != want:
                return (f"you returned {key}={bool(got)}, expected {want}"
                        + _refusal_hint(holes, size, want))
        elif not math.isclose(float(got), want, abs_tol=1e-9):
            hint = (_internal_hint(slabs, float(got), want) if key == "internal" else
                    _external_hint(slabs, holes, float(got), want))
            return f"you returned {key}={float(got):.4g}, expected {want:.4g}{hint}"
    return None


def _fragmentation_cases(cases, keys):
    def check(fn):
        for layout, size in cases:
            slabs, holes, expected = _fragmentation_reference(layout, size)
            out, problem = _call_fragmentation(fn, slabs, holes, size)
            what = f"slabs {slabs} (reserved, written), free list {_fmt(holes)}, request {size}"
            problem = problem or _fragmentation_mismatch(out, expected, keys, slabs, holes, size)
            if problem:
                raise Problem(f"{what}: {problem}")
    return check


def _refusal_hint(holes, size, want) -> str:
    free = sum(n for _, n in holes)
    largest = max((n for _, n in holes), default=0)
    if want:
        return (f"; the largest hole holds {largest} < {size} tokens while {free} >= {size} are "
                "free: the request is refused because of fragmentation")
    if free < size:
        return (f"; only {free} tokens are free in all, fewer than {size}: that is plain lack of "
                "memory, not fragmentation")
    return (f"; the hole of {largest} tokens holds the request (a hole of exactly the request's "
            "size fits: compare with >=)")


# holes of 20 and 10 tokens (30 free) between slabs of 100 (10 written) and 10 (all written)
_FRAG = [("slab", 100, 10), ("hole", 20), ("slab", 10, 10), ("hole", 10)]
_THREE_HOLES = [("hole", 6), ("slab", 12, 3), ("hole", 18), ("slab", 30, 29), ("hole", 12),
                ("slab", 2, 1)]
_ONE_HOLE = [("slab", 40, 40), ("slab", 8, 2), ("hole", 25)]
_NO_SLABS = [("hole", 50)]
_FULL = [("slab", 30, 10), ("slab", 20, 20)]


def _fragmentation_trace(fn):
    rng = random.Random(31)
    arena = ContiguousArena(300, policy="first_fit")
    live, counter = [], 0
    for step in range(120):
        if live and (rng.random() < 0.45 or arena.free_tokens < 10):
            arena.free(live.pop(rng.randrange(len(live))))
        else:
            slab = arena.allocate(counter, rng.randint(1, 70))
            if slab is not None:
                slab.write(rng.randint(0, slab.length))
                live.append(counter)
                counter += 1
        if step % 6:
            continue
        size = rng.randint(1, 80)
        slabs, holes, expected = _arena_state(arena, size)
        out, problem = _call_fragmentation(fn, slabs, holes, size)
        problem = problem or _fragmentation_mismatch(out, expected, _KEYS, slabs, holes, size)
        if problem:
            raise Problem(f"random arena state after {step + 1} operations: slabs {slabs}, "
                          f"free list {_fmt(holes)}, request {size}: {problem}")


FRAGMENTATION = Exercise("ch02.fragmentation", "fragmentation", (
    Check("internal: unwritten tokens of all slabs over all reserved tokens (not a mean of "
          "ratios)", _fragmentation_cases([(_FRAG, 5), (_THREE_HOLES, 5)], ["internal"])),
    Check("external: 1 - largest hole / total free memory",
          _fragmentation_cases([(_ONE_HOLE, 5), (_THREE_HOLES, 5), (_FRAG, 5)], ["external"])),
    Check("0.0 when nothing is reserved or nothing is free (no division by zero)",
          _fragmentation_cases([(_NO_SLABS, 5), (_FULL, 5)], ["internal", "external"])),
    Check("refused_by_fragmentation: no hole fits, yet the holes together would",
          _fragmentation_cases([(_FRAG, 25), (_THREE_HOLES, 30)],
                               ["refused_by_fragmentation"])),
    Check("not fragmentation when the free total is too small as well",
          _fragmentation_cases([(_FRAG, 35), (_FULL, 1), (_THREE_HOLES, 37)],
                               ["refused_by_fragmentation"])),
    Check("a hole of exactly the request's size fits",
          _fragmentation_cases([(_FRAG, 20), (_THREE_HOLES, 18), (_ONE_HOLE, 25)],
                               ["refused_by_fragmentation"])),
    Check("agrees with minillm's ContiguousArena on random arena states", _fragmentation_trace),
))


def check_fragmentation(fragmentation, time_limit: Optional[float] = None):
    """Grade exercise (c): fragmentation(slabs, free_extents, request_size) -> dict with
    "internal", "external" and "refused_by_fragmentation"."""
    return FRAGMENTATION.check(fragmentation, time_limit)


EXERCISES = (FIRST_FIT, FREE_SLAB, FRAGMENTATION)
