"""Recording and replaying engine schedules, for chapters 04-05 (lab instrumentation, not serving).

    run = run_trace(model, "continuous", prompts, max_tokens, arrive, scheduling="continuous")
    run.steps[k]            # what step k did: tokens per request, prefills, preemptions, queues
    print(describe(run, k)) # the scheduler's state after step k, as text

    requests, steps = replay_schedule(trace, budget=512, chunked=True,
                                      step_time=lambda scheduled: 1.0)

`run_trace` drives a real `LLMEngine` one `step()` at a time, adding each request before the
step it arrives at, and reads what the scheduler did from the engine's state (nothing in the
engine knows it is being watched). `replay_schedule` runs the same `Scheduler` without a model: a
modelled step time advances the clock, so a schedule can be studied at a scale no CPU runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..cache.blocks import BlockManager
from ..engine.llm_engine import LLMEngine
from ..engine.request import Request, RequestStatus
from ..engine.scheduler import Scheduler
from ..sampling import SamplingParams


@dataclass
class Run:
    """One recorded run. `steps[k]` is a dict per step (see `run_trace`)."""
    name: str
    engine: LLMEngine
    requests: dict = field(default_factory=dict)   # request id -> Request (kept after it finishes)
    arrival: dict = field(default_factory=dict)    # request id -> the step it joined the queue
    steps: list = field(default_factory=list)      # one record per step
    outputs: dict = field(default_factory=dict)    # request id -> RequestOutput
    seconds: float = 0.0                           # wall time spent inside engine.step()


def _ids(queue) -> list:
    return [r.request_id for r in queue]


def run_trace(model, name: str, prompts, max_tokens, arrive, max_steps: int = 10_000,
              priorities=None, **engine_kw) -> Run:
    """Run requests r0, r1, ... (greedy) through a fresh LLMEngine(model, **engine_kw), request i
    joining before step arrive[i], and record every step.

    Each record has: step; scheduled {id: tokens computed in the step}; prefill (ids whose
    tokens were a prompt or a recomputation); sampled (ids that got a token); finished;
    preempted; swapped_out / swapped_in {id: blocks}; running_before (oldest first);
    computed_before {id: num_computed_tokens}; admitted_at {id: step}; tokens (the engine's own
    count, checked against the sum of scheduled); waiting / running / swapped after the step;
    free_blocks. Raises RuntimeError if the run has not finished after max_steps steps and
    AssertionError if the engine leaks KV blocks. Tokens served from a prefix cache would count
    as computed without being in the step; pass enable_prefix_caching=False to count only the
    model's work. priorities: one int per request, for scheduling_policy="priority".
    """
    if not len(prompts) == len(max_tokens) == len(arrive):
        raise ValueError(f"prompts, max_tokens and arrive must have the same length, got "
                         f"{len(prompts)}, {len(max_tokens)}, {len(arrive)}")
    engine = LLMEngine(model, None, **engine_kw)
    run = Run(name, engine)
    order = sorted(range(len(prompts)), key=lambda i: (arrive[i], i))
    nxt, swapped_size, admitted_at = 0, {}, {}
    for step in range(max_steps):
        while nxt < len(order) and arrive[order[nxt]] <= step:
            i = order[nxt]
            engine.add_request(f"r{i}", prompts[i],
                               SamplingParams(temperature=0.0, max_tokens=max_tokens[i]),
                               priority=priorities[i] if priorities is not None else 0)
            run.requests[f"r{i}"] = engine.get_request(f"r{i}")[0]
            run.arrival[f"r{i}"] = step
            nxt += 1
        if not engine.has_unfinished() and nxt == len(order):
            break
        record = dict(step=step, scheduled={}, prefill=set(), sampled=[], finished=[],
                      preempted=[], swapped_out={}, swapped_in={}, running_before=[],
                      computed_before={}, admitted_at=dict(admitted_at), tokens=0)
        if engine.has_unfinished():
            _record_step(engine, run, record, swapped_size, admitted_at)
        s = engine.scheduler
        record.update(waiting=_ids(s.waiting), running=_ids(s.running), swapped=_ids(s.swapped),
                      free_blocks=engine.block_manager.num_free_blocks)
        run.steps.append(record)
    else:
        raise RuntimeError(f"{name}: not finished after {max_steps} steps")
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks, "KV blocks leaked"
    return run


def _record_step(engine, run: Run, record: dict, swapped_size: dict, admitted_at: dict) -> None:
    """Run one engine step and fill `record` from the difference of the requests' states."""
    live = [r for r in run.requests.values() if not r.is_finished]
    before = {r.request_id: (r.num_computed_tokens, r.num_tokens, r.num_output_tokens, r.status)
              for r in live}
    record["running_before"] = _ids(engine.scheduler.running)      # oldest first
    record["computed_before"] = {rid: b[0] for rid, b in before.items()}
    start = time.perf_counter()
    finished = engine.step()
    run.seconds += time.perf_counter() - start
    for out in finished:
        run.outputs[out.request_id] = out
        record["finished"].append(out.request_id)
    for rid, (computed, total, n_out, status) in before.items():
        r = run.requests[rid]
        if status == RequestStatus.RUNNING and r.status in (RequestStatus.PREEMPTED,
                                                            RequestStatus.SWAPPED):
            record["preempted"].append(rid)
            if r.status == RequestStatus.SWAPPED:
                record["swapped_out"][rid] = swapped_size[rid] = len(r.swapped_blocks)
            continue
        n = r.num_computed_tokens - computed
        if n > 0:
            record["scheduled"][rid] = n
            if total - computed > 1 or n_out == 0:
                record["prefill"].add(rid)
            if status != RequestStatus.RUNNING:
                admitted_at[rid] = record["step"]
            if status == RequestStatus.SWAPPED:
                record["swapped_in"][rid] = swapped_size.pop(rid)
        if r.num_output_tokens > n_out:
            record["sampled"].append(rid)
    record["tokens"] = engine.step_stats[-1].num_batched_tokens
    assert sum(record["scheduled"].values()) == record["tokens"], "recorder lost tokens"


def describe(run: Run, k: int) -> str:
    """The scheduler's state after step k of a recorded run, as text."""
    if not 0 <= k < len(run.steps):
        raise ValueError(f"step {k} is not in {run.name!r}, which has steps "
                         f"0..{len(run.steps) - 1}")
    rec = run.steps[k]
    done = [rid for r in run.steps[:k + 1] for rid in r["finished"]]

    def names(xs):
        return " ".join(xs) if xs else "-"

    def count(n, word):
        return f"{n} {word}" + ("" if n == 1 else "s")

    work = [f"{rid} +{n}" + (" prefill" if rid in rec["prefill"] else "")
            for rid, n in rec["scheduled"].items()]
    lines = [f"{run.name}: step {k} of {len(run.steps) - 1}    "
             f"free KV blocks {rec['free_blocks']}/{run.engine.num_kv_blocks}",
             f"scheduled: {count(rec['tokens'], 'token')} for "
             f"{count(len(rec['scheduled']), 'sequence')}: {', '.join(work) or 'nothing'}",
             f"running  ({len(rec['running'])}): {names(rec['running'])}",
             f"waiting  ({len(rec['waiting'])}): {names(rec['waiting'])}",
             f"swapped  ({len(rec['swapped'])}): {names(rec['swapped'])}",
             f"finished ({len(done)}): {names(done)}"]
    if rec["preempted"]:
        lines.append(f"preempted in this step: {names(rec['preempted'])} "
                     f"(running before the step, oldest first: {names(rec['running_before'])})")
    return "\n".join(lines)


def replay_schedule(trace, budget: int, chunked: bool, step_time, max_num_seqs: int = 64,
                    num_blocks: int = 40_000, block_size: int = 16):
    """Replay requests through minillm's Scheduler without a model.

    trace: (arrival_time, request_id, prompt_len, max_tokens) tuples. step_time(scheduled) ->
    seconds stands in for the forward pass of [(request, num_new_tokens), ...]. Every request
    ignores EOS and gets one (dummy) token each time its computed tokens reach its length, as
    the engine's step() does. Returns (requests, steps): the Request objects (with metrics on
    the modelled clock) and (num_batched_tokens, num_prefill_tokens) per step.
    """
    sched = Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, chunked)
    trace = sorted(trace)
    now, i, requests, steps = 0.0, 0, [], []
    while i < len(trace) or sched.has_unfinished():
        while i < len(trace) and trace[i][0] <= now:                 # arrivals so far
            t, rid, prompt_len, max_tokens = trace[i]
            req = Request(i, rid, [0] * prompt_len,
                          SamplingParams(max_tokens=max_tokens, ignore_eos=True), t, i)
            sched.add(req)
            requests.append(req)
            i += 1
        out = sched.schedule()
        if out.is_empty:                                             # idle until the next arrival
            if i == len(trace):
                raise RuntimeError("the scheduler scheduled nothing and no request is left to "
                                   "arrive: a request cannot fit the block pool or the budget")
            now = trace[i][0]
            continue
        now += step_time(out.scheduled)                              # the "forward pass"
        steps.append((out.num_batched_tokens, sum(n for r, n in out.scheduled if r.is_prefill)))
        for req, n in out.scheduled:                                 # what the engine does next
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:            # reached its end: one token
                req.output_token_ids.append(0)
                req.metrics.record_token(now)
                if req.num_output_tokens == req.params.max_tokens:
                    sched.finish(req, "length")
                    req.metrics.finished_time = now
    return requests, steps
