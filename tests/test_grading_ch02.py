"""Chapter 02 graders are themselves tested: the solution passes, the unfilled exercise fails,
and planted bugs (best fit for first fit, free without coalescing, off-by-one extent ends,
fragmentation over the wrong total, ...) are caught with a message that names the mistake."""

import pytest

from minillm.grading import ch02, grade

from grader_contract import contract_tests, planted_bug_tests

NOTEBOOK = "02_contiguous_allocation.ipynb"
LIMIT = 60          # generous: a loaded 2-core CI machine must never time out a correct solution

# function the learner writes -> its exercise
GRADED = {
    "first_fit": ch02.FIRST_FIT,
    "free_slab": ch02.FREE_SLAB,
    "fragmentation": ch02.FRAGMENTATION,
}


# ------------------------------------------------------------------ solution passes, stub fails

(test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
 test_solution_cells_hold_the_marked_solution) = contract_tests(NOTEBOOK, GRADED)


def test_chapter_lists_its_exercises_for_batch_grading():
    assert ch02.EXERCISES == (ch02.FIRST_FIT, ch02.FREE_SLAB, ch02.FRAGMENTATION)
    assert [e.id for e in ch02.EXERCISES] == ["ch02.first_fit", "ch02.free_slab",
                                              "ch02.fragmentation"]


# ------------------------------------------------------------------ planted bugs: first fit

def _fits(free_extents, size):
    if size < 1:
        raise ValueError("size must be >= 1")
    return [(i, s, n) for i, (s, n) in enumerate(free_extents) if n >= size]


def _carve(free_extents, i, start, rest):
    return start, free_extents[:i] + rest + free_extents[i + 1:]


def ff_returns_best_fit(free_extents, size):
    fits = _fits(free_extents, size)
    if not fits:
        return None, list(free_extents)
    i, s, n = min(fits, key=lambda f: f[2])                  # the smallest hole, not the first
    return _carve(free_extents, i, s, [(s + size, n - size)] if n > size else [])


def ff_carves_from_the_end(free_extents, size):
    fits = _fits(free_extents, size)
    if not fits:
        return None, list(free_extents)
    i, s, n = fits[0]
    return _carve(free_extents, i, s + n - size, [(s, n - size)] if n > size else [])


def ff_rest_off_by_one(free_extents, size):
    fits = _fits(free_extents, size)
    if not fits:
        return None, list(free_extents)
    i, s, n = fits[0]
    return _carve(free_extents, i, s, [(s + size + 1, n - size - 1)] if n > size + 1 else [])


def ff_keeps_empty_holes(free_extents, size):
    fits = _fits(free_extents, size)
    if not fits:
        return None, list(free_extents)
    i, s, n = fits[0]
    return _carve(free_extents, i, s, [(s + size, n - size)])  # (end, 0) stays in the list


def ff_strictly_larger(free_extents, size):
    if size < 1:
        raise ValueError("size must be >= 1")
    for i, (s, n) in enumerate(free_extents):
        if n > size:                                          # an exact fit is skipped
            return _carve(free_extents, i, s, [(s + size, n - size)])
    return None, list(free_extents)


def ff_edits_the_callers_list(free_extents, size):
    fits = _fits(free_extents, size)
    if not fits:
        return None, free_extents
    i, s, n = fits[0]
    if n > size:
        free_extents[i] = (s + size, n - size)
    else:
        del free_extents[i]
    return s, free_extents


def ff_no_size_check(free_extents, size):
    for i, (s, n) in enumerate(free_extents):
        if n >= size:
            return _carve(free_extents, i, s, [(s + size, n - size)] if n > size else [])
    return None, list(free_extents)


def ff_squeezes_into_the_largest(free_extents, size):
    fits = _fits(free_extents, size)
    if not fits:                                              # "close enough": take the largest
        i, (s, n) = max(enumerate(free_extents), key=lambda e: e[1][1])
        return _carve(free_extents, i, s, [])
    i, s, n = fits[0]
    return _carve(free_extents, i, s, [(s + size, n - size)] if n > size else [])


# ------------------------------------------------------------------ planted bugs: free

def _merge(extents, touches):
    merged = []
    for s, n in sorted(extents):
        if merged and touches(merged[-1], s):
            ms, mn = merged[-1]
            merged[-1] = (ms, max(ms + mn, s + n) - ms)
        else:
            merged.append((s, n))
    return merged


def _checked(free_extents, start, length):
    if length < 1:
        raise ValueError("length must be >= 1")
    for s, n in free_extents:
        if s < start + length and start < s + n:
            raise ValueError("double free")


def free_without_coalescing(free_extents, start, length):
    _checked(free_extents, start, length)
    return sorted(free_extents + [(start, length)])


def free_merges_a_gap_of_one(free_extents, start, length):
    _checked(free_extents, start, length)
    return _merge(free_extents + [(start, length)], lambda prev, s: prev[0] + prev[1] + 1 >= s)


def free_merges_below_only(free_extents, start, length):
    _checked(free_extents, start, length)
    out = []
    for s, n in sorted(free_extents):
        if s + n == start:
            start, length = s, length + n
        else:
            out.append((s, n))
    return sorted(out + [(start, length)])


def free_appends_unsorted(free_extents, start, length):
    _checked(free_extents, start, length)
    return list(free_extents) + [(start, length)]


def free_trusts_the_caller(free_extents, start, length):
    return _merge(free_extents + [(start, length)], lambda prev, s: prev[0] + prev[1] == s)


def free_edits_the_callers_list(free_extents, start, length):
    _checked(free_extents, start, length)
    free_extents.append((start, length))
    free_extents[:] = _merge(free_extents, lambda prev, s: prev[0] + prev[1] == s)
    return free_extents


# ------------------------------------------------------------------ planted bugs: fragmentation

def _totals(slabs, free_extents):
    reserved = sum(r for r, _ in slabs)
    written = sum(w for _, w in slabs)
    free = sum(n for _, n in free_extents)
    largest = max((n for _, n in free_extents), default=0)
    return reserved, written, free, largest


def _report(internal, external, refused):
    return {"internal": internal, "external": external, "refused_by_fragmentation": refused}


def frag_mean_of_ratios(slabs, free_extents, request_size):
    _, _, free, largest = _totals(slabs, free_extents)
    internal = sum((r - w) / r for r, w in slabs) / len(slabs) if slabs else 0.0
    return _report(internal, 1 - largest / free if free else 0.0, largest < request_size <= free)


def frag_divides_by_all_memory(slabs, free_extents, request_size):
    reserved, written, free, largest = _totals(slabs, free_extents)
    internal = (reserved - written) / reserved if reserved else 0.0
    external = 1 - largest / (reserved + free) if free else 0.0   # total memory, not free memory
    return _report(internal, external, largest < request_size <= free)


def frag_usable_share(slabs, free_extents, request_size):
    reserved, written, free, largest = _totals(slabs, free_extents)
    internal = (reserved - written) / reserved if reserved else 0.0
    return _report(internal, largest / free if free else 0.0, largest < request_size <= free)


def frag_divides_by_zero(slabs, free_extents, request_size):
    reserved, written, free, largest = _totals(slabs, free_extents)
    return _report((reserved - written) / reserved, 1 - largest / free,
                   largest < request_size <= free)


def frag_blames_every_refusal(slabs, free_extents, request_size):
    reserved, written, free, largest = _totals(slabs, free_extents)
    internal = (reserved - written) / reserved if reserved else 0.0
    return _report(internal, 1 - largest / free if free else 0.0, largest < request_size)


def frag_exact_hole_too_small(slabs, free_extents, request_size):
    reserved, written, free, largest = _totals(slabs, free_extents)
    internal = (reserved - written) / reserved if reserved else 0.0
    return _report(internal, 1 - largest / free if free else 0.0, largest <= request_size <= free)


# exercise, bug, a check it must fail, words that check's message must contain
BUGS = [
    ("first_fit", ff_returns_best_fit, "lowest-address hole", "best fit"),
    ("first_fit", ff_carves_from_the_end, "front of the hole", "end of the hole"),
    ("first_fit", ff_rest_off_by_one, "front of the hole", "off by one"),
    ("first_fit", ff_keeps_empty_holes, "used up exactly", "zero-length"),
    ("first_fit", ff_strictly_larger, "used up exactly", "compare with >="),
    ("first_fit", ff_edits_the_callers_list, "untouched", "your input list reads"),
    ("first_fit", ff_no_size_check, "size < 1", "raise ValueError"),
    ("first_fit", ff_squeezes_into_the_largest, "refuses", "return None"),
    ("free_slab", free_without_coalescing, "ends where the slab begins", "coalescing"),
    ("free_slab", free_without_coalescing, "both sides", "coalescing"),
    ("free_slab", free_merges_a_gap_of_one, "one token away", "expected [(0, 10), (11, 5)"),
    ("free_slab", free_merges_below_only, "begins where the slab ends", "coalescing"),
    ("free_slab", free_appends_unsorted, "address order", "sorted by start"),
    ("free_slab", free_trusts_the_caller, "double free", "raise ValueError"),
    ("free_slab", free_edits_the_callers_list, "untouched", "your input list reads"),
    ("fragmentation", frag_mean_of_ratios, "internal", "mean of each slab"),
    ("fragmentation", frag_divides_by_all_memory, "external", "all memory"),
    ("fragmentation", frag_usable_share, "external", "1 minus it"),
    ("fragmentation", frag_divides_by_zero, "no division by zero", "ZeroDivisionError"),
    ("fragmentation", frag_blames_every_refusal, "too small as well", "plain lack of memory"),
    ("fragmentation", frag_exact_hole_too_small, "exactly the request's size", ">="),
]


(test_planted_bug_is_caught_with_a_specific_message,
 test_every_exercise_has_at_least_two_planted_bugs) = planted_bug_tests(GRADED, BUGS)


def test_a_bug_is_also_caught_by_the_random_trace_check():
    # the trace check is not a formality: it catches each kind of mistake on its own
    for name, bug in (("first_fit", ff_returns_best_fit), ("free_slab", free_without_coalescing),
                      ("fragmentation", frag_divides_by_all_memory)):
        result = grade(GRADED[name], bug, time_limit=LIMIT)
        assert any("random" in f for f in result.failed), str(result)


def test_the_reference_layouts_are_what_the_checks_claim():
    # the cases are built in a real ContiguousArena; make sure they have the intended holes
    assert ch02._arena(ch02._LAYOUT).free_extents() == [(0, 20), (30, 10), (60, 40)]
    assert ch02._arena(ch02._GAP_ONE).free_extents() == [(0, 10), (17, 10)]
    assert ch02._arena(ch02._GAP_ONE).slabs["me"].start == 11
    arena = ch02._arena(ch02._FRAG)
    assert arena.free_extents() == [(100, 20), (130, 10)]
    assert arena.internal_fragmentation == pytest.approx(90 / 110)
    assert arena.external_fragmentation == pytest.approx(1 / 3)
