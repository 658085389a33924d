"""Latency and throughput metrics of a serving run (chapters 00, 04 and 08).

Per request (all times in seconds, from one monotonic clock):

    arrival -- queued -- scheduled -- prefill -- token 1 -- itl -- token 2 -- ... -- token n
    |<----------------- TTFT ------------------->|<------ (n - 1) x TPOT ------------>|
    |<----------------------------- end-to-end latency ------------------------------>|

- TTFT (time to first token): arrival -> first output token. Includes queueing and the prefill.
- ITL (inter-token latencies): the gaps between consecutive output tokens.
- TPOT (time per output token): the mean ITL, (last - first) / (n_out - 1). A request with ONE
  output token has no inter-token gap, so its TPOT is None (`time_per_output_token`): it is left
  out of the TPOT statistics, and it meets any TPOT objective. vLLM's serving benchmark does the
  same (its TPOT list skips such requests; its goodput counts their TPOT as 0, which passes
  every bound). A 0.0 instead would pull the mean TPOT down by requests that never decoded.
- queueing time: arrival -> first time the scheduler gave the request any tokens to compute.
- end-to-end latency: arrival -> finished.

Aggregates over a run (`summarize`), one set of names for both sides of a run: the engine's
`RequestMetrics` (timestamps taken inside the server) and the load generator's
`serve.loadgen.RequestResult` (taken by the client, `vllm bench serve`'s definitions). Keys follow
vLLM's benchmark: completed, total_input_tokens, total_output_tokens, request_throughput,
output_throughput, total_token_throughput, request_goodput, and {ttft, tpot, itl, e2e_latency,
queueing_time} x {mean, p50, p90, p95, p99}. Goodput is the completed requests per second that
met EVERY given service-level objective (SLO), e.g. TTFT <= 0.5 s and TPOT <= 0.05 s.
Throughput counts every token; goodput counts only requests a user would have been happy with,
which is what a scheduler trades when it favours one over the other.

The clock is `time.perf_counter` (monotonic, high resolution); the engine takes a `clock`
argument so tests can inject a fake one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import numpy as np

Clock = Callable[[], float]
default_clock: Clock = time.perf_counter

PERCENTILES = (50, 90, 95, 99)
SLO_NAMES = ("ttft", "tpot", "e2e_latency")


def time_per_output_token(first_to_last: Optional[float], num_output_tokens: int
                          ) -> Optional[float]:
    """TPOT: the time from the first to the last output token over the gaps between them,
    first_to_last / (num_output_tokens - 1). None with fewer than two tokens: there is no gap
    to average (see the module docstring for why None and not 0.0)."""
    if first_to_last is None or num_output_tokens < 2:
        return None
    return first_to_last / (num_output_tokens - 1)


@dataclass
class RequestMetrics:
    """Timestamps of one sequence (one sample of a request), filled in by the engine."""
    arrival_time: float
    num_prompt_tokens: int = 0
    first_scheduled_time: Optional[float] = None
    token_times: list = field(default_factory=list)        # one timestamp per output token
    finished_time: Optional[float] = None
    num_preemptions: int = 0
    sample_index: int = 0           # n > 1: which sample; input tokens are counted for index 0 only
    num_draft_tokens: int = 0       # speculative decoding (chapter 07): drafts verified
    num_accepted_tokens: int = 0    # ... and accepted

    def record_scheduled(self, now: float) -> None:
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now

    def record_token(self, now: float) -> None:
        self.token_times.append(now)

    @property
    def finished(self) -> bool:
        return self.finished_time is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> Optional[float]:
        return None if not self.token_times else self.token_times[0] - self.arrival_time

    @property
    def itl(self) -> list:
        """Inter-token latencies: len == num_output_tokens - 1."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> Optional[float]:
        t = self.token_times
        return time_per_output_token(t[-1] - t[0] if t else None, len(t))

    @property
    def queueing_time(self) -> Optional[float]:
        s = self.first_scheduled_time
        return None if s is None else s - self.arrival_time

    @property
    def e2e_latency(self) -> Optional[float]:
        f = self.finished_time
        return None if f is None else f - self.arrival_time


def meets_slos(request, slos: dict) -> bool:
    """True when `request` completed and meets EVERY objective in `slos` ({"ttft": s, "tpot": s,
    "e2e_latency": s}, any subset), value <= bound. A one-token request (TPOT None) meets any
    TPOT bound: it had no gap between tokens to be slow in."""
    if not request.finished or request.ttft is None:
        return False
    for name, bound in slos.items():
        value = getattr(request, name)
        if value is not None and value > bound:
            return False
    return True


def percentiles(values: Iterable[float], ps=(50, 95, 99)) -> dict:
    """{"p50": ..., "p95": ..., "p99": ...} (linear interpolation); None values are dropped."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {f"p{p:g}": None for p in ps}
    arr = np.percentile(np.asarray(vals, dtype=np.float64), list(ps))
    return {f"p{p:g}": float(x) for p, x in zip(ps, arr)}


def _run_duration(requests: list) -> float:
    """First arrival -> last finish, from the engine's timestamps."""
    ends = [r.finished_time for r in requests if getattr(r, "finished_time", None) is not None]
    if not ends:
        raise ValueError("summarize cannot tell how long the run took (no request has a "
                         "finished_time); pass duration= in seconds (run_load returns it)")
    return max(ends) - min(r.arrival_time for r in requests)


def summarize(requests: Iterable, duration: Optional[float] = None, *,
              ttft_slo: Optional[float] = None, tpot_slo: Optional[float] = None,
              e2e_latency_slo: Optional[float] = None, ps=PERCENTILES) -> dict:
    """Aggregate a run: the one summary of request metrics, engine side and client side.

    requests: `RequestMetrics` (the engine's) or `serve.loadgen.RequestResult` (the client's);
    summarize reads finished, ttft, tpot, itl, e2e_latency, queueing_time, num_prompt_tokens,
    num_output_tokens and sample_index (input tokens count once per request, for sample 0).
    duration: wall seconds of the run (default: first arrival -> last finish, engine side).
    *_slo: bounds in seconds; a request is good when it completed and meets every one given.
    ps: the percentiles reported (default 50, 90, 95, 99).

    Returns a flat dict (seconds, vLLM's benchmark names): num_requests, completed, failed
    (did not finish: an error, or still running), duration_s, total_input_tokens,
    total_output_tokens (of completed requests), request_throughput, output_throughput,
    total_token_throughput (per second), mean_concurrency (sum of E2E latencies / duration:
    Little's law), slos, request_goodput and slo_attainment (good / all; both None without an
    SLO), and {ttft, tpot, itl, e2e_latency, queueing_time}_{mean, p50, ...} (None where no
    request has the value: the client cannot see queueing, a one-token request has no TPOT).
    """
    rs = list(requests)
    if not rs:
        raise ValueError("summarize needs at least one request's metrics")
    duration = _run_duration(rs) if duration is None else duration
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    slos = {name: bound for name, bound in zip(SLO_NAMES, (ttft_slo, tpot_slo, e2e_latency_slo))
            if bound is not None}
    done = [r for r in rs if r.finished]
    n_in = sum(r.num_prompt_tokens for r in done if r.sample_index == 0)
    n_out = sum(r.num_output_tokens for r in done)
    good = sum(meets_slos(r, slos) for r in done)
    out = {"num_requests": len(rs), "completed": len(done), "failed": len(rs) - len(done),
           "duration_s": duration, "total_input_tokens": n_in, "total_output_tokens": n_out,
           "request_throughput": len(done) / duration, "output_throughput": n_out / duration,
           "total_token_throughput": (n_in + n_out) / duration,
           # Little's law: mean requests in the system = arrival rate x mean time in it
           "mean_concurrency": sum(r.e2e_latency for r in done) / duration,
           "slos": slos, "request_goodput": good / duration if slos else None,
           "slo_attainment": good / len(rs) if slos else None}
    series = {"ttft": [r.ttft for r in done], "tpot": [r.tpot for r in done],
              "itl": [x for r in done for x in r.itl], "e2e_latency": [r.e2e_latency for r in done],
              "queueing_time": [r.queueing_time for r in done]}
    for name, vals in series.items():
        vals = [v for v in vals if v is not None]
        out[f"{name}_mean"] = float(np.mean(vals)) if vals else None
        for k, v in percentiles(vals, ps).items():
            out[f"{name}_{k}"] = v
    return out
