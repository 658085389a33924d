"""Graders for the chapter 04 problem set (solutions/04_continuous_batching.ipynb).

    ch04.check_schedule_step(schedule_step)       # (a) one scheduling step: decodes first, FCFS
                                                  #     admission within the budget, preempt the
                                                  #     most recently admitted when blocks run out
    ch04.check_slot_occupancy(slot_occupancy)     # (b) static vs continuous: steps and idle slots

The reference for both is minillm's own `engine.scheduler.Scheduler` (with chunked prefill off),
driven without a model: every case is laid out as real `Request` objects in a real
`BlockManager`, and the expected answer is what the engine's scheduler does with them. Every
case is small and seeded.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from numbers import Integral
from typing import Optional

from ..cache.blocks import BlockManager
from ..engine.request import Request
from ..engine.scheduler import Scheduler
from ..generate import stop_reason
from ..sampling import SamplingParams
from .core import Check, Exercise, Problem


@dataclass(frozen=True)
class Seq:
    """One sequence as exercise (a) sees it."""
    id: str
    arrival: int          # first-come-first-served order: lower = arrived earlier
    num_tokens: int       # prompt + tokens generated so far
    num_computed: int     # tokens whose keys and values are in the KV cache


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


# =========================================================================== (a) schedule_step

@dataclass(frozen=True)
class _State:
    running: tuple            # of Seq, oldest first, each decoding (num_computed = num_tokens - 1)
    waiting: tuple            # of Seq, oldest first, nothing computed
    free_blocks: int
    block_size: int
    max_num_seqs: int
    token_budget: int

    def args(self):
        return (list(self.running), list(self.waiting), self.free_blocks, self.block_size,
                self.max_num_seqs, self.token_budget)

    def held(self, seq: Seq) -> int:
        return _ceil(seq.num_computed, self.block_size)

    def describe(self) -> str:
        run = ", ".join(f"{s.id} (arrival {s.arrival}, {s.num_computed} of {s.num_tokens} "
                        f"computed, {self.held(s)} blocks)" for s in self.running) or "none"
        wait = ", ".join(f"{s.id} (arrival {s.arrival}, {s.num_tokens} tokens)"
                         for s in self.waiting) or "none"
        return (f"running [{run}], waiting [{wait}], free_blocks={self.free_blocks}, "
                f"block_size={self.block_size}, max_num_seqs={self.max_num_seqs}, "
                f"token_budget={self.token_budget}")


def _run(id, arrival, computed):
    return Seq(id, arrival, computed + 1, computed)


def _wait(id, arrival, tokens):
    return Seq(id, arrival, tokens, 0)


def _reference(state: _State) -> dict:
    """What minillm's Scheduler (chunked prefill off) does with this state."""
    bs = state.block_size
    held = sum(state.held(s) for s in state.running)
    bm = BlockManager(held + state.free_blocks + 1, bs)
    bm.allocate("pad", 1)                       # one extra block, held outside the scheduler
    sched = Scheduler(bm, state.max_num_seqs, state.token_budget, enable_chunked_prefill=False)
    params = SamplingParams(temperature=0.0, max_tokens=10_000)
    for seq_id, s in enumerate(state.running):
        req = Request(seq_id, s.id, [0] * (s.num_tokens - 1), params, 0.0, s.arrival)
        req.output_token_ids = [0]                   # decoding: one sampled token not yet cached
        req.num_computed_tokens = s.num_computed
        bm.allocate(seq_id, s.num_computed)
        sched.add_running(req)
    for seq_id, s in enumerate(state.waiting, start=len(state.running)):
        sched.add(Request(seq_id, s.id, [0] * s.num_tokens, params, 0.0, s.arrival))
    out = sched.schedule()
    return {"scheduled": {r.request_id: n for r, n in out.scheduled},
            "preempted": [r.request_id for r in out.preempted],
            "free_blocks": bm.num_free_blocks}


def _call_schedule(fn, state: _State):
    """(the learner's plan in canonical form, None) or (None, what is wrong with it)."""
    out = fn(*state.args())
    want = "a dict with keys 'scheduled', 'preempted' and 'free_blocks'"
    if not isinstance(out, dict):
        return None, f"you returned {type(out).__name__} {out!r}; expected {want}"
    missing = [k for k in ("scheduled", "preempted", "free_blocks") if k not in out]
    if missing:
        return None, f"your dict has no key {missing[0]!r}; expected {want}"
    sched, pre, free = out["scheduled"], out["preempted"], out["free_blocks"]
    if not isinstance(sched, dict) or not all(isinstance(k, str) and _is_int(v)
                                              for k, v in sched.items()):
        return None, (f"'scheduled' is {sched!r}; expected a dict {{sequence id: number of "
                      "tokens}}, e.g. {'a': 1, 'd': 12}")
    if not isinstance(pre, (list, tuple)) or not all(isinstance(k, str) for k in pre):
        return None, f"'preempted' is {pre!r}; expected a list of sequence ids"
    if not _is_int(free):
        return None, f"'free_blocks' is {free!r}; expected an int"
    return {"scheduled": {k: int(v) for k, v in sched.items()}, "preempted": list(pre),
            "free_blocks": int(free)}, None


def _fmt_plan(plan: dict) -> str:
    return (f"scheduled={plan['scheduled']}, preempted={plan['preempted']}, "
            f"free_blocks={plan['free_blocks']}")


def _diagnose(state: _State, got: dict, want: dict) -> str:
    """A sentence naming the known mistake that explains the difference, or ''."""
    running_ids = [s.id for s in state.running]
    waiting_ids = [s.id for s in state.waiting]
    by_id = {s.id: s for s in state.running + state.waiting}
    total = sum(got["scheduled"].values())
    if total > state.token_budget:
        return (f"; your step schedules {total} tokens, more than the token budget of "
                f"{state.token_budget}: admit a waiting sequence only if all its tokens fit in "
                "what is left of the budget")
    got_in = [i for i in got["scheduled"] if i in waiting_ids]
    want_in = [i for i in want["scheduled"] if i in waiting_ids]
    stay = len([i for i in running_ids if i not in got["preempted"]])
    if stay + len(got_in) > state.max_num_seqs:
        return (f"; that leaves {stay + len(got_in)} sequences running, more than "
                f"max_num_seqs={state.max_num_seqs}")
    if want["preempted"] and got["preempted"] != want["preempted"]:
        if got["preempted"] and got["preempted"][0] == running_ids[0] != want["preempted"][0]:
            return ("; you preempted the OLDEST running sequence. Preempt the most recently "
                    "admitted one (the largest arrival): the oldest has waited longest and "
                    "holds the most computed work, so it keeps its blocks")
        if not got["preempted"]:
            return ("; a running sequence needs a new block and none is free: preempt the most "
                    "recently admitted running sequence (possibly the one that needs the block) "
                    "until the block fits")
    if want["preempted"] and got_in:
        return ("; nobody is admitted in a step that preempted: memory is short, and a new "
                "sequence would only be preempted again")
    if got["preempted"] == want["preempted"] and want["preempted"]:
        victims = sum(state.held(by_id[v]) for v in want["preempted"])
        if got["free_blocks"] < want["free_blocks"] <= got["free_blocks"] + victims:
            return (f"; the preempted sequences held {victims} block(s) and they must all go "
                    "back to the free pool (recompute frees them); yours did not all come back: "
                    "a leak")
    if got_in != want_in and not want["preempted"]:
        newest = max(got_in, key=waiting_ids.index) if got_in else None
        skipped = [i for i in waiting_ids[:waiting_ids.index(newest)] if i not in got_in] \
            if got_in else []
        if skipped and skipped[0] in want_in:
            if got_in[0] == waiting_ids[-1]:
                return ("; you admitted the newest waiting sequence first (LIFO). Admission is "
                        "first come, first served: a LIFO queue starves the oldest request")
            return (f"; {skipped[0]} arrived before {newest} and fits: admit waiting "
                    "sequences oldest first")
        if skipped:
            return (f"; you admitted {newest} although the older {skipped[0]} does not fit: "
                    "admission stops at the first waiting sequence that does not fit. Letting "
                    "smaller, later ones overtake it can starve a long request forever")
        if len(got_in) < len(want_in):
            nxt = by_id[want_in[len(got_in)]]
            return (f"; {nxt.id} fits: {nxt.num_tokens} tokens within the budget left and "
                    f"{_ceil(nxt.num_tokens, state.block_size)} block(s), and a slot is free "
                    "(a sequence that exactly fills the budget or the free blocks fits: compare "
                    "with <=)")
    if got["free_blocks"] != want["free_blocks"] and got["scheduled"] == want["scheduled"]:
        return ("; count the blocks: a decode needs a new block only when its last block is "
                "full (num_computed is a multiple of block_size), and an admitted sequence "
                "needs ceil(num_tokens / block_size) blocks")
    return ""


def _compare(state: _State, fn, where: str) -> Optional[str]:
    want = _reference(state)
    got, problem = _call_schedule(fn, state)
    what = f"{where}{state.describe()}"
    if problem:
        return f"{what}: {problem}"
    if got != want:
        return (f"{what}: you returned {_fmt_plan(got)}; expected {_fmt_plan(want)}"
                + _diagnose(state, got, want))
    return None


def _schedule_cases(states):
    def check(fn):
        for state in states:
            problem = _compare(state, fn, "")
            if problem:
                raise Problem(problem)
    return check


# decodes only, none at a block boundary: no new block
_DECODES = _State((_run("a", 0, 5), _run("b", 1, 9), _run("c", 2, 2)), (), 3, 4, 4, 16)
# a and b sit at a block boundary (8 and 4 computed): each takes a new block
_BOUNDARY = _State((_run("a", 0, 8), _run("b", 1, 4), _run("c", 2, 6)), (), 5, 4, 4, 16)
_BOUNDARY_ONE = _State((_run("a", 0, 7), _run("b", 1, 3)), (), 2, 1, 4, 16)
# room for everyone: d, e, f admitted in arrival order
_ADMIT = _State((_run("a", 0, 5),), (_wait("d", 3, 6), _wait("e", 4, 3), _wait("f", 5, 5)),
                10, 4, 4, 32)
_ADMIT_EMPTY = _State((), (_wait("d", 0, 4), _wait("e", 1, 9)), 4, 4, 8, 64)
# the budget: 2 decodes + d (10) leave 4, e needs 7; with budget 19, e fits exactly
_BUDGET = _State((_run("a", 0, 5), _run("b", 1, 6)), (_wait("d", 2, 10), _wait("e", 3, 7)),
                 20, 4, 4, 16)
_BUDGET_EXACT = _State((_run("a", 0, 5), _run("b", 1, 6)), (_wait("d", 2, 10), _wait("e", 3, 7)),
                       20, 4, 4, 19)
_BLOCKS_EXACT = _State((_run("a", 0, 5),), (_wait("d", 2, 12), _wait("e", 3, 1)), 3, 4, 4, 64)
# the head does not fit (blocks, then budget): the small one behind it must wait too
_HEAD_BLOCKS = _State((_run("a", 0, 5),), (_wait("d", 3, 20), _wait("e", 4, 2)), 3, 4, 4, 64)
_HEAD_BUDGET = _State((_run("a", 0, 5), _run("b", 1, 2)), (_wait("d", 2, 15), _wait("e", 3, 2)),
                      20, 4, 4, 16)
_SEQS = _State((_run("a", 0, 5), _run("b", 1, 5), _run("c", 2, 5)),
               (_wait("d", 3, 2), _wait("e", 4, 2)), 10, 4, 4, 64)
_SEQS_FULL = _State((_run("a", 0, 5), _run("b", 1, 5)), (_wait("d", 3, 2),), 10, 4, 2, 64)
# a needs a block, none is free: c (newest, 3 blocks) is preempted, a takes one of them
_PREEMPT = _State((_run("a", 0, 8), _run("b", 1, 5), _run("c", 2, 10)), (), 0, 4, 4, 16)
_PREEMPT_BIG = _State((_run("a", 0, 4), _run("b", 1, 16), _run("c", 2, 30), _run("d", 3, 21)),
                      (), 0, 4, 4, 16)
# the newest needs the block itself: it preempts itself
_SELF = _State((_run("a", 0, 5), _run("b", 1, 8)), (), 0, 4, 4, 16)
# two need a block and each victim frees one: two preemptions, newest first
_REPEAT = _State((_run("a", 0, 4), _run("b", 1, 4), _run("c", 2, 4), _run("d", 3, 2)), (), 0,
                 4, 4, 16)
# preemption frees blocks, and e would fit in them: still nobody is admitted this step
_NO_ADMIT = _State(_PREEMPT.running, (_wait("e", 5, 1),), 0, 4, 4, 16)
_NO_ADMIT_SELF = _State(_SELF.running, (_wait("e", 5, 2),), 0, 4, 4, 16)


def _untouched(fn):
    for state in (_ADMIT, _PREEMPT, _NO_ADMIT, _HEAD_BUDGET):
        running, waiting, *rest = state.args()
        fn(running, waiting, *rest)
        if running != list(state.running) or waiting != list(state.waiting):
            raise Problem(f"{state.describe()}: after the call your input lists read running "
                          f"{[s.id for s in running]}, waiting {[s.id for s in waiting]}; "
                          "leave them as they were and return the plan instead")


def _random_state(rng: random.Random) -> _State:
    bs = rng.choice([1, 2, 4, 4, 8])
    max_num_seqs = rng.randint(1, 6)
    n_run = rng.randint(0, max_num_seqs)
    n_wait = rng.randint(0, 5)
    arrivals = sorted(rng.sample(range(100), n_run + n_wait))
    tight = rng.random() < 0.25                      # short sequences, all at a boundary, no
    running = []                                     # free block: a cascade of preemptions
    for i in range(n_run):
        computed = rng.randint(1, 24)
        if tight or rng.random() < 0.5:
            computed = bs * rng.randint(1, 2 if tight else 6)   # at a block boundary: needs a block
        running.append(_run(f"r{i}", arrivals[i], computed))
    waiting = [_wait(f"w{i}", arrivals[n_run + i], rng.randint(1, 24)) for i in range(n_wait)]
    biggest = max((s.num_tokens for s in waiting), default=1)
    budget = rng.randint(max(max_num_seqs, biggest), 48)
    free = 0 if tight else rng.randint(0, 10)
    return _State(tuple(running), tuple(waiting), free, bs, max_num_seqs, budget)


def _random_states(fn):
    rng = random.Random(404)
    for i in range(300):
        problem = _compare(_random_state(rng), fn, f"random state {i + 1}: ")
        if problem:
            raise Problem(problem)


SCHEDULE_STEP = Exercise("ch04.schedule_step", "schedule_step", (
    Check("decodes every running sequence, one token each", _schedule_cases([_DECODES])),
    Check("a decode takes a new block only when its last block is full",
          _schedule_cases([_BOUNDARY, _BOUNDARY_ONE])),
    Check("admits waiting sequences oldest first while slots, budget and blocks allow",
          _schedule_cases([_ADMIT, _ADMIT_EMPTY])),
    Check("never schedules more tokens than the token budget (an exact fit fits)",
          _schedule_cases([_BUDGET, _BUDGET_EXACT, _BLOCKS_EXACT])),
    Check("stops at the first waiting sequence that does not fit (no overtaking, no starving)",
          _schedule_cases([_HEAD_BLOCKS, _HEAD_BUDGET])),
    Check("keeps at most max_num_seqs sequences running", _schedule_cases([_SEQS, _SEQS_FULL])),
    Check("out of blocks: preempts the most recently admitted, and its blocks come back",
          _schedule_cases([_PREEMPT, _PREEMPT_BIG])),
    Check("the newest sequence needing a block preempts itself", _schedule_cases([_SELF])),
    Check("preempts again, newest first, until the block fits", _schedule_cases([_REPEAT])),
    Check("admits nobody in a step that preempted", _schedule_cases([_NO_ADMIT, _NO_ADMIT_SELF])),
    Check("leaves the caller's lists untouched", _untouched),
    Check("agrees with minillm's Scheduler on random states", _random_states),
))


def check_schedule_step(schedule_step, time_limit: Optional[float] = None):
    """Grade exercise (a): schedule_step(running, waiting, free_blocks, block_size, max_num_seqs,
    token_budget) -> {"scheduled": {id: tokens}, "preempted": [ids], "free_blocks": int}."""
    return SCHEDULE_STEP.check(schedule_step, time_limit)


# =========================================================================== (b) slot occupancy

_OCC_KEYS = ("steps", "idle_slot_steps", "idle_while_waiting")


def _occupancy_reference(output_lens, max_num_seqs: int, scheduling: str) -> dict:
    """Drive minillm's Scheduler without a model: every request has a 1-token prompt and
    generates output_lens[i] tokens; all arrive before step 0, in list order."""
    n = len(output_lens)
    bm = BlockManager(sum(_ceil(m + 1, 16) for m in output_lens) + 1, 16)
    sched = Scheduler(bm, max_num_seqs, max(max_num_seqs, 16), enable_chunked_prefill=False,
                      scheduling=scheduling)
    for i, m in enumerate(output_lens):
        sched.add(Request(i, f"r{i}", [0], SamplingParams(temperature=0.0, max_tokens=m), 0.0, i))
    steps = idle = idle_waiting = 0
    while sched.has_unfinished():
        out = sched.schedule()
        empty = max_num_seqs - len(out.scheduled)
        idle += empty
        if sched.waiting:
            idle_waiting += empty
        for req, k in out.scheduled:
            req.num_computed_tokens += k
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(0)
                stop = stop_reason(req.params, req.output_token_ids)     # the engine's stop rule
                if stop is not None:
                    sched.finish(req, stop.reason)
        steps += 1
        if steps > 10 * (sum(output_lens) + n + 1):
            raise RuntimeError("the reference scheduler did not finish; this is a grader bug")
    return {"steps": steps, "idle_slot_steps": idle, "idle_while_waiting": idle_waiting}


def _call_occupancy(fn, output_lens, max_num_seqs, scheduling):
    out = fn(list(output_lens), max_num_seqs, scheduling)
    if not isinstance(out, dict):
        return None, (f"you returned {type(out).__name__} {out!r}; expected a dict with keys "
                      f"{list(_OCC_KEYS)}")
    missing = [k for k in _OCC_KEYS if k not in out]
    if missing:
        return None, f"your dict has no key {missing[0]!r}; it needs {list(_OCC_KEYS)}"
    bad = [k for k in _OCC_KEYS if not _is_int(out[k])]
    if bad:
        return None, f"{bad[0]!r} is {out[bad[0]]!r}; expected an int"
    return {k: int(out[k]) for k in _OCC_KEYS}, None


def _static_variant(lens, slots, batch_len, order=None):
    """Steps of a static schedule whose batch lasts batch_len(batch) steps (hint helper)."""
    lens = list(lens) if order is None else order(list(lens))
    return sum(batch_len(lens[i:i + slots]) for i in range(0, len(lens), slots))


def _continuous_variant(lens, slots, delay):
    """Steps of a continuous schedule where a slot is reusable `delay` steps after the end of
    its request's last step (delay 0: the next step, as it should be)."""
    free_at = [0] * slots
    end = 0
    for m in lens:
        s = min(range(slots), key=lambda j: free_at[j])
        start = free_at[s]
        end = max(end, start + m)
        free_at[s] = start + m + delay
    return end


def _steps_explanations(lens, slots, scheduling) -> list:
    """[(steps, sentence)]: the steps each known mistake would give on this trace."""
    if scheduling == "static":
        return [
            (_static_variant(lens, slots, lambda b: b[0]), "your batches last the first "
             "member's length; a static batch runs until its LONGEST member has finished"),
            (_static_variant(lens, slots, lambda b: round(sum(b) / len(b))), "your batches "
             "last the mean length; a static batch runs until its LONGEST member has finished"),
            (_static_variant(lens, slots, min), "your batches last the shortest member's "
             "length; a static batch runs until its LONGEST member has finished"),
            (_static_variant(lens, slots, max, sorted), "you grouped the requests by length; "
             "batches are formed in arrival order (first come, first served): the first "
             "max_num_seqs, the next ..."),
            (_continuous_variant(lens, slots, 0), "that is the continuous schedule: under "
             "static batching nobody joins until the whole batch has finished"),
        ]
    return [
        (_continuous_variant(lens, slots, 1), "your slots are refilled one step late: a "
         "request that samples its last token in step k leaves at the end of step k, and a "
         "waiting one takes its slot in step k + 1"),
        (_continuous_variant(lens, slots, -1), "your slots are refilled in the step where "
         "their request samples its last token; it still holds the slot in that step, the next "
         "one can start in step k + 1"),
        (_static_variant(lens, slots, max), "that is the static schedule: under continuous "
         "batching a freed slot is refilled at once, whatever the rest of the batch does"),
    ]


def _steps_hint(runs) -> str:
    """runs: [(lens, slots, scheduling, got_steps, want_steps)] of one check. A mistake is named
    only when it alone gives the learner's steps on EVERY trace of the check (two mistakes can
    agree on one trace: [4, 1, 1, 1] in 2 slots takes 5 steps under the static schedule and
    under a continuous one that refills a step late)."""
    fits = None
    for lens, slots, scheduling, got, _want in runs:
        here = {sentence for value, sentence in _steps_explanations(lens, slots, scheduling)
                if value == got}
        fits = here if fits is None else fits & here
    # a mistake that gives the right steps on every trace explains no difference
    wrong = {sentence for lens, slots, scheduling, got, want in runs if got != want
             for value, sentence in _steps_explanations(lens, slots, scheduling) if value != want}
    fits = (fits or set()) & wrong
    return f"; {fits.pop()}" if len(fits) == 1 else ""


def _occupancy_hint(lens, slots, scheduling, got, want, runs=None) -> str:
    if not lens:
        return "; with no requests there are no steps, so every count is 0"
    if got["steps"] != want["steps"]:
        same_policy = [r for r in runs or [] if r[2] == scheduling]   # a static bug leaves
        return _steps_hint(same_policy or [(lens, slots, scheduling, got["steps"],   # continuous
                                            want["steps"])])                        # runs alone
    if got["idle_slot_steps"] != want["idle_slot_steps"]:
        busy = sum(lens)
        if got["idle_slot_steps"] == got["steps"] * slots:
            return "; count the empty slots only: each request fills a slot in each of its steps"
        return (f"; every step has {slots} slots and the requests fill {busy} slot-steps in all, "
                f"so steps x slots - {busy}")
    if got["idle_while_waiting"] == want["idle_slot_steps"] != want["idle_while_waiting"]:
        return ("; you counted every idle slot-step; count only the steps in which some request "
                "has not been admitted yet (it waits while the slot is empty)")
    return ""


def _occupancy_cases(cases, keys=_OCC_KEYS):
    def check(fn):
        runs, first_wrong = [], None
        for lens, slots, scheduling in cases:
            want = _occupancy_reference(lens, slots, scheduling)
            got, problem = _call_occupancy(fn, lens, slots, scheduling)
            what = f"output_lens={list(lens)}, max_num_seqs={slots}, scheduling={scheduling!r}"
            if problem:
                raise Problem(f"{what}: {problem}")
            runs.append((lens, slots, scheduling, got["steps"], want["steps"]))
            if first_wrong is None and any(got[k] != want[k] for k in keys):
                first_wrong = (what, lens, slots, scheduling, got, want)
        if first_wrong is None:
            return
        what, lens, slots, scheduling, got, want = first_wrong
        shown = {k: got[k] for k in keys}
        expected = {k: want[k] for k in keys}
        raise Problem(f"{what}: you returned {shown}, expected {expected}"
                      + _occupancy_hint(lens, slots, scheduling, got, want, runs))
    return check


def _occupancy_bad_input(fn):
    for args, why in ((([3, 1], 2, "dynamic"), "scheduling must be 'static' or 'continuous'"),
                      (([3, 1], 0, "static"), "max_num_seqs must be at least 1"),
                      (([3, 0, 2], 2, "continuous"), "every request generates at least 1 token")):
        try:
            out = fn(*args)
        except ValueError:
            continue
        raise Problem(f"slot_occupancy{args!r}: you returned {out!r}; {why}, so raise "
                      "ValueError with a message that says so")


def _occupancy_random(fn):
    rng = random.Random(4040)
    for i in range(120):
        lens = [rng.choice([1, 2, 3, 5, 8, 13, 30]) for _ in range(rng.randint(1, 14))]
        slots = rng.randint(1, 5)
        scheduling = rng.choice(["static", "continuous"])
        try:
            _occupancy_cases([(lens, slots, scheduling)])(fn)
        except Problem as problem:
            raise Problem(f"random trace {i + 1}: {problem}") from None


_TAIL = [4, 1, 1, 1]               # the example of the problem set
_MIXED = [3, 1, 2, 4, 2, 6, 1]

SLOT_OCCUPANCY = Exercise("ch04.slot_occupancy", "slot_occupancy", (
    Check("static: a batch lasts as long as its longest member",
          _occupancy_cases([(_TAIL, 2, "static"), ([5, 2, 2, 9, 1], 3, "static")], ("steps",))),
    Check("static: batches are the next max_num_seqs requests in arrival order",
          _occupancy_cases([(_MIXED, 3, "static"), ([1, 9, 1, 9, 1, 9], 2, "static")],
                           ("steps",))),
    Check("continuous: a freed slot is taken in the very next step",
          _occupancy_cases([(_TAIL, 2, "continuous"), (_MIXED, 3, "continuous"),
                            ([2, 2, 2, 2, 2], 2, "continuous")], ("steps",))),
    Check("idle_slot_steps: empty slots summed over all steps",
          _occupancy_cases([(_TAIL, 2, "static"), (_TAIL, 2, "continuous"),
                            ([7], 4, "continuous"), (_MIXED, 3, "static")],
                           ("steps", "idle_slot_steps"))),
    Check("idle_while_waiting: only steps in which some request has not been admitted",
          _occupancy_cases([(_TAIL, 2, "static"), (_MIXED, 3, "static"), (_MIXED, 3, "continuous"),
                            ([1, 1, 8], 2, "continuous")])),
    Check("an empty trace takes 0 steps",
          _occupancy_cases([([], 4, "static"), ([], 1, "continuous")])),
    Check("bad input raises ValueError", _occupancy_bad_input),
    Check("agrees with minillm's Scheduler on random traces", _occupancy_random),
))


def check_slot_occupancy(slot_occupancy, time_limit: Optional[float] = None):
    """Grade exercise (b): slot_occupancy(output_lens, max_num_seqs, scheduling) -> {"steps",
    "idle_slot_steps", "idle_while_waiting"}."""
    return SLOT_OCCUPANCY.check(slot_occupancy, time_limit)


EXERCISES = (SCHEDULE_STEP, SLOT_OCCUPANCY)
