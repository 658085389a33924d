"""Replay a request trace through the real engine on a virtual clock (chapter 08 lab experiments).

Load experiments on a real server take minutes per point on a CPU and come out noisy. Here the
scheduler, the KV block pool, preemption and the metrics are minillm's own and run for real; only
time is modelled: each step advances a virtual clock by a `StepCost` measured on this machine
(`fit_step_cost` fits it to real step timings). Requests enter the engine at their arrival times
on that clock. A sweep of 100-request traces then takes seconds and is deterministic, and every
number it reports (TTFT, ITL, queueing, preemptions) comes out of the same code paths the server
uses.

    cost = fit_step_cost(measured_step_stats)                    # seconds per step, fitted
    run = replay_serving(model, trace, cost, max_num_seqs=16, num_kv_blocks=256)
    summarize([o.metrics for o in run.outputs])                  # minillm.metrics
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from ..engine import LLMEngine
from ..sampling import SamplingParams
from ..serve.loadgen import arrival_gaps


class VirtualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError(f"time only moves forward, got dt={dt}")
        self.now += dt


@dataclass(frozen=True)
class StepCost:
    """Modelled duration of one engine step, in seconds:
    fixed + per_token x batched tokens + per_seq x sequences in the step."""
    fixed: float
    per_token: float
    per_seq: float = 0.0

    def __call__(self, num_tokens: int, num_seqs: int) -> float:
        return self.fixed + self.per_token * num_tokens + self.per_seq * num_seqs


def fit_step_cost(step_stats: Sequence) -> StepCost:
    """Least-squares fit of StepCost to real steps (LLMEngine.step_stats: num_batched_tokens,
    num_seqs, duration). Coefficients are clipped at 0 (a step never gets cheaper with work)."""
    rows = [(s.num_batched_tokens, s.num_seqs, s.duration) for s in step_stats]
    if len(rows) < 3:
        raise ValueError(f"need at least 3 measured steps to fit a cost, got {len(rows)}")
    a = np.array([[1.0, t, n] for t, n, _ in rows])
    y = np.array([d for _, _, d in rows])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return StepCost(*(float(max(c, 0.0)) for c in coef))


def measure_step_cost(model, shapes=((1, 256), (4, 64), (16, 8)), decode_steps: int = 4,
                      repeats: int = 2) -> tuple:
    """Time real engine steps of controlled shapes on this machine and fit a StepCost.

    shapes: (num_seqs, prompt_len) pairs; each runs `repeats` times: one prefill step of
    num_seqs x prompt_len tokens, then `decode_steps` decode steps of num_seqs tokens. The fit
    uses the median duration of each distinct (tokens, sequences) step, so one step slowed by
    another process does not bend it. Returns (StepCost, {(tokens, seqs): median seconds})."""
    import torch

    vocab = model.config.vocab_size
    durations: dict = {}
    for _ in range(repeats):
        for num_seqs, prompt_len in shapes:
            per_seq = -(-(prompt_len + decode_steps + 1) // 16)
            engine = LLMEngine(model, None, num_kv_blocks=num_seqs * per_seq + 1, block_size=16,
                               max_num_seqs=num_seqs, enable_prefix_caching=False,
                               max_num_batched_tokens=max(num_seqs * prompt_len, 16))
            g = torch.Generator().manual_seed(prompt_len)
            for i in range(num_seqs):
                ids = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
                engine.add_request(str(i), ids, SamplingParams(temperature=0.0, ignore_eos=True,
                                                               max_tokens=decode_steps + 1))
            while engine.has_unfinished():
                engine.step()
            for st in engine.step_stats:
                durations.setdefault((st.num_batched_tokens, st.num_seqs), []).append(st.duration)
    medians = {k: float(np.median(v)) for k, v in sorted(durations.items())}
    rows = [_Step(t, n, d) for (t, n), d in medians.items()]
    return fit_step_cost(rows), medians


@dataclass
class _Step:
    num_batched_tokens: int
    num_seqs: int
    duration: float


@dataclass
class TraceRequest:
    arrival_time: float            # seconds on the virtual clock
    prompt: list                   # token ids
    max_tokens: int


@dataclass
class StepRecord:
    start: float
    duration: float
    num_tokens: int
    num_seqs: int
    num_in_system: int             # requests that arrived and have not finished (at step start)
    num_waiting: int
    num_preempted: int


@dataclass
class ServingReplayResult:
    outputs: list                  # RequestOutput per trace request, in trace order
                                   # (None: rejected)
    steps: list = field(default_factory=list)      # StepRecord per step
    engine: Optional[LLMEngine] = None
    end_time: float = 0.0
    rejected: list = field(default_factory=list)   # trace indices the admission rule refused

    @property
    def metrics(self) -> list:
        """RequestMetrics of the admitted requests."""
        return [o.metrics for o in self.outputs if o is not None]

    def time_average_in_system(self) -> float:
        """Mean number of requests in the system over the busy and idle time of the run,
        sampled at every step (idle gaps count as 0): the L of Little's law."""
        if self.end_time <= 0:
            return 0.0
        return sum(s.num_in_system * s.duration for s in self.steps) / self.end_time


def poisson_trace(prompts: Sequence[list], max_tokens: Sequence[int], rate: float,
                  seed: int = 0, burstiness: float = 1.0) -> list:
    """TraceRequests with gamma(burstiness) inter-arrival gaps of mean 1/rate (Poisson at 1)."""
    gaps = arrival_gaps(len(prompts), rate, burstiness, seed)
    times = np.cumsum(gaps)
    return [TraceRequest(float(t), list(p), int(m)) for t, p, m in zip(times, prompts, max_tokens)]


def replay_serving(model, trace: Sequence[TraceRequest], cost: StepCost, tokenizer=None,
                   admit: Optional[Callable[[int, int], bool]] = None,
                   **engine_kwargs) -> ServingReplayResult:
    """Run `trace` through a fresh LLMEngine whose clock is virtual: a step's duration is
    cost(batched tokens, sequences). Greedy, EOS ignored (outputs have exactly max_tokens);
    prefix caching off unless enable_prefix_caching=True is passed.
    admit(num_waiting, num_running) -> bool, if given, decides at each arrival whether the
    request enters (a server would answer 429 otherwise)."""
    clock = VirtualClock()
    # trace prompts are stand-in token ids (often all alike): sharing them through the prefix
    # cache would measure the cache, not the load, so it is off unless asked for
    engine_kwargs.setdefault("enable_prefix_caching", False)
    engine = LLMEngine(model, tokenizer, clock=clock, **engine_kwargs)
    run = engine.runner.run

    def timed_run(scheduled):                    # the forward pass "takes" its modelled time
        out = run(scheduled)
        clock.advance(cost(sum(n for _, n in scheduled), len(scheduled)))
        return out

    engine.runner.run = timed_run
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_time)
    results: dict = {}
    steps: list = []
    rejected: list = []
    nxt = 0
    while len(results) < len(trace):
        while nxt < len(order) and trace[order[nxt]].arrival_time <= clock.now:
            i = order[nxt]
            r = trace[i]
            if admit is not None and not admit(len(engine.scheduler.waiting),
                                               len(engine.scheduler.running)):
                results[i] = None
                rejected.append(i)
                nxt += 1
                continue
            engine.add_request(str(i), r.prompt,
                               SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                              ignore_eos=True), arrival_time=r.arrival_time)
            nxt += 1
        if not engine.has_unfinished():          # idle: jump to the next arrival
            if nxt < len(order):
                clock.now = max(clock.now, trace[order[nxt]].arrival_time)
            continue
        start = clock.now
        in_system = nxt - len(results)           # arrived, not finished (rejected are in results)
        waiting = len(engine.scheduler.waiting)
        before = engine.num_preemptions
        for out in engine.step():
            results[int(out.request_id)] = out
        stats = engine.step_stats[-1] if engine.step_stats else None
        steps.append(StepRecord(start, clock.now - start,
                                stats.num_batched_tokens if stats else 0,
                                stats.num_seqs if stats else 0, in_system, waiting,
                                engine.num_preemptions - before))
    return ServingReplayResult([results[i] for i in range(len(trace))], steps, engine, clock.now,
                               rejected)


__all__ = ["VirtualClock", "StepCost", "fit_step_cost", "measure_step_cost", "TraceRequest",
           "StepRecord", "ServingReplayResult", "poisson_trace", "replay_serving"]
