"""Graders for the chapter 05 problem set (solutions/05_chunked_prefill.ipynb).

    ch05.check_plan_step(plan_step)            # (a) split one step's token budget: decodes
                                               #     first, then prompts FCFS, chunked to fit
    ch05.check_step_metadata(step_metadata)    # (b) flatten a step into cu_seqlens_q,
                                               #     positions and seq_lens

(a) plan_step(decodes, prompts, budget, max_num_seqs) -> {request_id: num_tokens}. The reference
is minillm's own `engine.Scheduler`: each case builds real Requests in exactly the state the
case describes (running decodes, waiting prompts), calls `schedule()` once and reads what it
planned.

(b) step_metadata(spans) -> {"cu_seqlens_q": [...], "positions": [...], "seq_lens": [...]} for
spans [(num_computed, num_new)]. The reference writes out the rules `engine.ModelRunner.prepare`
follows; tests/test_grading_ch05.py checks that both give the same tensors.

Every case is small and seeded; no model runs.
"""
from __future__ import annotations

import random
from numbers import Integral
from typing import Optional

from ..cache.blocks import BlockManager
from ..engine.request import Request
from ..engine.scheduler import Scheduler
from ..sampling import SamplingParams
from .core import Check, Exercise
from .core import Problem as _Problem
from .core import checked as _checked


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


# =========================================================================== (a) plan_step

_BLOCK = 16
_DECODE_CONTEXT = 3          # a running decode's prompt length in the reference (any value works)


def reference_plan(decodes, prompts, budget: int, max_num_seqs: int) -> dict:
    """What minillm's Scheduler schedules in one step: running decodes `decodes` (ids, oldest
    first), waiting prompts `prompts` [(id, remaining tokens)] in arrival order."""
    num_blocks = len(decodes) + sum(-(-r // _BLOCK) for _, r in prompts) + 1   # never short
    bm = BlockManager(num_blocks, _BLOCK)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      enable_chunked_prefill=True)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    order = 0
    for rid in decodes:
        req = Request(order, rid, [0] * _DECODE_CONTEXT, params, 0.0, order)
        req.output_token_ids = [0]                      # the last sampled token is not cached
        req.num_computed_tokens = _DECODE_CONTEXT
        bm.allocate(order, _DECODE_CONTEXT)
        sched.add_running(req)
        order += 1
    for rid, remaining in prompts:
        sched.add(Request(order, rid, [0] * remaining, params, 0.0, order))
        order += 1
    out = sched.schedule()
    return {req.request_id: n for req, n in out.scheduled}


def _describe_plan_case(decodes, prompts, budget, max_num_seqs) -> str:
    return (f"decodes={list(decodes)}, prompts={[tuple(p) for p in prompts]}, budget={budget}, "
            f"max_num_seqs={max_num_seqs}")


def _call_plan(fn, decodes, prompts, budget, max_num_seqs) -> dict:
    out = fn(list(decodes), [tuple(p) for p in prompts], budget, max_num_seqs)
    if not isinstance(out, dict):
        raise _Problem(f"{_describe_plan_case(decodes, prompts, budget, max_num_seqs)}: you "
                       f"returned a {type(out).__name__} ({str(out)[:60]}); return a dict "
                       "{request_id: number of tokens this step}")
    for rid, n in out.items():
        if not _is_int(n):
            raise _Problem(f"{_describe_plan_case(decodes, prompts, budget, max_num_seqs)}: "
                           f"request {rid!r} maps to {n!r}; every value must be an int token "
                           "count")
    return {rid: int(n) for rid, n in out.items()}


def _plan_diagnosis(got: dict, decodes, prompts, budget: int, max_num_seqs: int) -> str:
    """Which rule the learner's plan breaks, in words (the first one found)."""
    remaining = dict(prompts)
    unknown = [rid for rid in got if rid not in remaining and rid not in decodes]
    if unknown:
        return f"{unknown} are neither running decodes nor waiting prompts"
    zeros = [rid for rid, n in got.items() if n == 0]
    if zeros:
        return (f"{zeros} get 0 tokens; leave a request that computes nothing this step out "
                "of the dict")
    negative = [rid for rid, n in got.items() if n < 0]
    if negative:
        return f"{negative} get a negative number of tokens"
    wrong_decodes = [rid for rid in decodes if rid in got and got[rid] != 1]
    if wrong_decodes:
        return (f"decodes {wrong_decodes} get {[got[r] for r in wrong_decodes]} tokens; a "
                "running decode computes exactly 1 token per step (its last sampled token)")
    too_many = [rid for rid, r in prompts if got.get(rid, 0) > r]
    if too_many:
        rid = too_many[0]
        return (f"prompt {rid!r} has only {remaining[rid]} tokens left but you gave it "
                f"{got[rid]}")
    total = sum(got.values())
    served_decodes = sum(1 for rid in decodes if rid in got)
    if total > budget:
        prompt_tokens = total - served_decodes
        if prompt_tokens <= budget and served_decodes:
            return (f"you planned {total} tokens, over the budget of {budget}: the prompts alone "
                    f"take {prompt_tokens}, and the {served_decodes} decodes come out of the "
                    "same budget, so subtract them before giving prompts their share")
        return (f"you planned {total} tokens, over the budget of {budget}; a prompt that does "
                "not fit takes only what is left of the budget (a chunk)")
    if len(got) > max_num_seqs:
        return (f"{len(got)} sequences in one step, but max_num_seqs is {max_num_seqs}; the "
                "running decodes count too")
    missing = [rid for rid in decodes if rid not in got]
    if missing:
        served = [rid for rid, _ in prompts if rid in got]
        if served:
            return (f"decodes {missing} get nothing while prompts {served} are served: this "
                    "starves the decodes. Serve every running decode first (1 token each), "
                    "then give prompts what is left, so a long prompt never stalls them")
        return f"the running decodes {missing} get nothing; each needs its 1 token"
    for i, (rid, r) in enumerate(prompts):
        later = [p for p, _ in prompts[i + 1:] if p in got]
        if got.get(rid, 0) < r and later:
            return (f"prompt {later[0]!r} got tokens although {rid!r}, which arrived earlier, "
                    f"did not get all of its {r}: first come, first served, so an earlier "
                    "prompt is never overtaken (not even by a shorter one)")
    left = budget - total
    if left > 0 and len(got) < max_num_seqs:
        waiting = [(rid, r) for rid, r in prompts if got.get(rid, 0) < r]
        if waiting:
            rid, r = waiting[0]
            partial = [p for p, rp in prompts if 0 < got.get(p, 0) < rp]
            if rid not in got and r > left and not partial:
                return (f"{left} tokens of the budget stay unused while prompt {rid!r} "
                        f"({r} tokens left) waits: chunk it, give it the {left} tokens that "
                        "fit now; the rest follows in later steps")
            return (f"{left} tokens of the budget stay unused while prompt {rid!r} waits: any "
                    "number of prompts can share a step, each taking what is left, in arrival "
                    "order")
    return ""


def _plan_cases(cases):
    @_checked
    def check(fn):
        for decodes, prompts, budget, max_num_seqs in cases:
            got = _call_plan(fn, decodes, prompts, budget, max_num_seqs)
            want = reference_plan(decodes, prompts, budget, max_num_seqs)
            if got != want:
                why = _plan_diagnosis(got, decodes, prompts, budget, max_num_seqs)
                raise _Problem(f"{_describe_plan_case(decodes, prompts, budget, max_num_seqs)}: "
                               f"you returned {got}, expected {want}" + (f"; {why}" if why else ""))
    return check


_D3 = ["d0", "d1", "d2"]
_D8 = [f"d{i}" for i in range(8)]

_FITS = [(_D3, [("p", 10)], 64, 8), (["a"], [("p", 1), ("q", 2)], 16, 4), (_D3, [], 8, 8)]
_STARVE = [(["d0", "d1", "d2", "d3"], [("long", 300)], 16, 8), (_D8, [("long", 500)], 16, 16)]
_BUDGET = [(_D3, [("p", 100)], 32, 8), (["a", "b"], [("p", 20), ("q", 30)], 24, 4),
           ([], [("p", 40)], 16, 4)]
_CHUNK = [(_D3, [("p", 100)], 32, 8), ([], [("p", 40)], 16, 4),
          (["a"], [("p", 6), ("q", 50)], 20, 4)]
_SHARE = [(["a", "b"], [("p", 5), ("q", 7), ("r", 40)], 32, 8),
          (["a"], [("long", 100), ("short", 3)], 20, 4),
          ([], [("p", 3), ("q", 3), ("r", 3), ("s", 30)], 16, 8)]
_MAX_SEQS = [(_D3, [("p", 2), ("q", 2), ("r", 2)], 64, 4),
             ([], [("p", 2), ("q", 2), ("r", 2), ("s", 2), ("t", 2)], 64, 2),
             (["a", "b"], [("p", 2)], 16, 2)]
_LEFT_OUT = [(["d0", "d1", "d2", "d3"], [("p", 10)], 4, 4),
             (["a", "b"], [("p", 2), ("q", 2)], 8, 3),
             (["a"], [("p", 7), ("q", 5)], 8, 8)]


@_checked
def _plan_errors(fn):
    for decodes, prompts, budget, max_num_seqs, why in (
            (["a"], [("p", 5)], 3, 4, "budget 3 < max_num_seqs 4: a full batch of decodes "
                                      "would not fit in one step"),
            (["a", "b", "c"], [("p", 5)], 16, 2, "3 running decodes but max_num_seqs is 2"),
            (["a"], [("p", 5), ("q", 0)], 16, 4, "prompt 'q' has 0 tokens left"),
            ([], [("p", -2)], 16, 4, "prompt 'p' has -2 tokens left")):
        what = f"{_describe_plan_case(decodes, prompts, budget, max_num_seqs)} ({why})"
        try:
            out = fn(list(decodes), [tuple(p) for p in prompts], budget, max_num_seqs)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as exc:
            raise _Problem(f"{what} raised {type(exc).__name__}: {exc}; raise ValueError with a "
                           "message that names the problem")
        raise _Problem(f"{what}: you returned {str(out)[:60]} instead of raising ValueError")


def _random_plan_cases(seed: int, n: int):
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        max_num_seqs = rng.randint(1, 12)
        budget = rng.randint(max_num_seqs, 96)
        decodes = [f"d{i}" for i in range(rng.randint(0, max_num_seqs))]
        prompts = [(f"p{i}", rng.choice([1, 2, rng.randint(1, 40), rng.randint(1, 200)]))
                   for i in range(rng.randint(0, 5))]
        cases.append((decodes, prompts, budget, max_num_seqs))
    return cases


PLAN_STEP = Exercise("ch05.plan_step", "plan_step", (
    Check("every running decode gets 1 token; a prompt that fits gets all of it",
          _plan_cases(_FITS)),
    Check("decodes are served before prompts (a long prompt never starves them)",
          _plan_cases(_STARVE)),
    Check("never plans more tokens than the budget, decodes included", _plan_cases(_BUDGET)),
    Check("a prompt that does not fit is chunked: it takes what is left of the budget",
          _plan_cases(_CHUNK)),
    Check("several prompts share a step, first come first served", _plan_cases(_SHARE)),
    Check("at most max_num_seqs sequences per step, decodes included", _plan_cases(_MAX_SEQS)),
    Check("requests that get no tokens are left out of the plan", _plan_cases(_LEFT_OUT)),
    Check("bad input raises ValueError", _plan_errors),
    Check("agrees with minillm's Scheduler on 300 random steps",
          _plan_cases(_random_plan_cases(5, 300))),
))


def check_plan_step(plan_step, time_limit: Optional[float] = None):
    """Grade exercise (a): plan_step(decodes, prompts, budget, max_num_seqs) ->
    {request_id: num_tokens}."""
    return PLAN_STEP.check(plan_step, time_limit)


# =========================================================================== (b) step metadata

_FIELDS = ("cu_seqlens_q", "positions", "seq_lens")


def reference_metadata(spans) -> dict:
    """The rules of ModelRunner.prepare: sequence b computes positions [c, c + n) of its tokens;
    its queries are rows cu[b] : cu[b + 1] of the flat batch; it attends over c + n keys."""
    cu, positions, seq_lens = [0], [], []
    for c, n in spans:
        positions += range(c, c + n)
        seq_lens.append(c + n)
        cu.append(cu[-1] + n)
    return {"cu_seqlens_q": cu, "positions": positions, "seq_lens": seq_lens}


def _as_int_list(value, name: str, what: str) -> list:
    if hasattr(value, "tolist") and hasattr(value, "dim"):          # a torch tensor
        if value.dim() != 1 or value.is_floating_point():
            raise _Problem(f"{what}: {name} is a tensor of shape {list(value.shape)} and dtype "
                           f"{value.dtype}; expected a list of ints (or a 1-D integer tensor)")
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(_is_int(x) for x in value):
        raise _Problem(f"{what}: {name} is {type(value).__name__} {str(value)[:60]}; expected a "
                       "list of ints")
    return [int(x) for x in value]


def _call_metadata(fn, spans) -> dict:
    what = f"spans={list(spans)}"
    out = fn([tuple(s) for s in spans])
    if not isinstance(out, dict) or any(k not in out for k in _FIELDS):
        keys = sorted(out) if isinstance(out, dict) else type(out).__name__
        raise _Problem(f"{what}: you returned {keys}; return a dict with the keys "
                       "'cu_seqlens_q', 'positions' and 'seq_lens'")
    return {k: _as_int_list(out[k], k, what) for k in _FIELDS}


def _variants(spans) -> dict:
    """The metadata the common mistakes produce, field by field: [(value, explanation)]."""
    new = [n for _, n in spans]
    cum = [sum(new[:i + 1]) for i in range(len(new))]
    cum_lens = [sum(c + n for c, n in spans[:i + 1]) for i in range(len(spans))]
    return {
        "cu_seqlens_q": [
            (cum, "the leading 0 is missing: sequence b owns rows cu_seqlens_q[b] : "
                  "cu_seqlens_q[b + 1], so the list starts at 0 and has one entry more than "
                  "there are sequences"),
            ([0] + cum_lens, "you summed seq_lens (cached tokens included); the rows of q are "
                             "only this step's new tokens, so add up num_new"),
            ([0] + new, "these are the new-token counts themselves; cu_seqlens_q is their "
                        "running sum"),
        ],
        "positions": [
            ([p for c, n in spans for p in range(c + 1, c + n + 1)],
             "off by one: positions are 0-based, so the first new token of a sequence that has "
             "num_computed tokens cached sits at position num_computed"),
            ([p for c, n in spans for p in range(n)],
             "the positions restart at 0 for every sequence; a chunk after the first, and a "
             "decode, continue where the cache ends (RoPE needs each token's true position)"),
            ([p for c, n in spans for p in range(c, n)],
             "range(num_computed, num_new) mixes a start with a length; the new tokens are "
             "positions num_computed .. num_computed + num_new - 1"),
        ],
        "seq_lens": [
            (new, "these count only the new tokens; seq_lens is every key the sequence attends "
                  "over: the cached ones plus this step's (their K/V are stored before "
                  "attention runs)"),
            ([c for c, _ in spans], "these count only the cached tokens; this step's own tokens "
                                    "are keys too (each query sees itself), so add num_new"),
            ([c + n - 1 for c, n in spans], "one short: seq_lens is num_computed + num_new"),
        ],
    }


def _metadata_cases(cases, fields=_FIELDS):
    @_checked
    def check(fn):
        for spans in cases:
            got = _call_metadata(fn, spans)
            want = reference_metadata(spans)
            for name in fields:
                if got[name] == want[name]:
                    continue
                hint = next((why for value, why in _variants(spans)[name]
                             if value == got[name] and value != want[name]), "")
                raise _Problem(f"spans={list(spans)}: {name} is {got[name]}, expected "
                               f"{want[name]}" + (f"; {hint}" if hint else ""))
    return check


@_checked
def _metadata_errors(fn):
    for spans, why in (([(0, 4), (5, 0)], "a span with num_new = 0 computes nothing"),
                       ([(-1, 3)], "num_computed cannot be negative"),
                       ([(3, 1), (0, -2)], "num_new cannot be negative")):
        what = f"spans={spans} ({why})"
        try:
            out = fn(list(spans))
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as exc:
            raise _Problem(f"{what} raised {type(exc).__name__}: {exc}; raise ValueError that "
                           "names the bad span")
        raise _Problem(f"{what}: you returned {str(out)[:60]} instead of raising ValueError")


def _random_spans(seed: int, n: int):
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        spans = []
        for _ in range(rng.randint(1, 6)):
            kind = rng.random()
            if kind < 0.5:
                spans.append((rng.randint(1, 300), 1))                       # decode
            elif kind < 0.75:
                spans.append((0, rng.randint(1, 64)))                        # first chunk
            else:
                spans.append((rng.randint(1, 300), rng.randint(2, 64)))      # later chunk
        cases.append(spans)
    return cases


_MIXED = [[(7, 1), (0, 4), (12, 1)], [(5, 1), (3, 1), (13, 13)]]

STEP_METADATA = Exercise("ch05.step_metadata", "step_metadata", (
    Check("cu_seqlens_q starts at 0 and has one entry more than there are sequences",
          _metadata_cases([[(0, 5)], [(7, 1), (0, 4), (12, 1)]], ("cu_seqlens_q",))),
    Check("cu_seqlens_q is the running sum of the new tokens",
          _metadata_cases([[(10, 3), (0, 4), (20, 1)], [(100, 2), (50, 1), (0, 6)]],
                          ("cu_seqlens_q",))),
    Check("positions continue where each sequence's cache ends (a later chunk, a decode)",
          _metadata_cases([[(16, 8)], [(5, 1), (3, 1), (13, 13)]], ("positions",))),
    Check("seq_lens count the cached tokens and this step's new ones",
          _metadata_cases([[(16, 8)], [(7, 1), (0, 4), (12, 1)]], ("seq_lens",))),
    Check("a decode-only step: one row per sequence, at position num_computed",
          _metadata_cases([[(12, 1), (3, 1), (40, 1)]])),
    Check("an empty step: cu_seqlens_q == [0], no positions, no seq_lens",
          _metadata_cases([[]])),
    Check("a bad span raises ValueError", _metadata_errors),
    Check("agrees with minillm's model runner on 200 random mixed steps",
          _metadata_cases(_MIXED + _random_spans(7, 200))),
))


def check_step_metadata(step_metadata, time_limit: Optional[float] = None):
    """Grade exercise (b): step_metadata([(num_computed, num_new), ...]) ->
    {"cu_seqlens_q": [...], "positions": [...], "seq_lens": [...]}."""
    return STEP_METADATA.check(step_metadata, time_limit)


EXERCISES = (PLAN_STEP, STEP_METADATA)
