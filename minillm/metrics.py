"""Latency and throughput metrics of a serving run (chapters 00 and 04).

Per request (all times in seconds, from one monotonic clock):

    arrival -- queued -- scheduled -- prefill -- token 1 -- itl -- token 2 -- ... -- token n
    |<----------------- TTFT ------------------->|<------ (n - 1) x TPOT ------------>|
    |<----------------------------- end-to-end latency ------------------------------>|

- TTFT (time to first token): arrival -> first output token. Includes queueing and the prefill.
- ITL (inter-token latencies): the gaps between consecutive output tokens.
- TPOT (time per output token): the mean ITL, (last - first) / (n_out - 1); None with one token.
- queueing time: arrival -> first time the scheduler gave the request any tokens to compute.
- end-to-end latency: arrival -> finished.

Aggregates over a run (`summarize`): input and output tokens/s over the run's wall time, request
throughput, p50/p95/p99 of each latency, and goodput: the requests per second that met a
service-level objective (SLO), e.g. TTFT <= 0.5 s and TPOT <= 0.05 s. Throughput counts every
token; goodput counts only requests a user would have been happy with, which is what a scheduler
trades when it favours one over the other.

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
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def first_token_time(self) -> Optional[float]:
        return self.token_times[0] if self.token_times else None

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
        return None if len(t) < 2 else (t[-1] - t[0]) / (len(t) - 1)

    @property
    def queueing_time(self) -> Optional[float]:
        s = self.first_scheduled_time
        return None if s is None else s - self.arrival_time

    @property
    def e2e_latency(self) -> Optional[float]:
        f = self.finished_time
        return None if f is None else f - self.arrival_time

    def meets(self, ttft_slo: Optional[float] = None, tpot_slo: Optional[float] = None) -> bool:
        """True when the request finished and met the SLO (a missing TPOT, one token, passes)."""
        if self.finished_time is None or self.ttft is None:
            return False
        if ttft_slo is not None and self.ttft > ttft_slo:
            return False
        if tpot_slo is not None and self.tpot is not None and self.tpot > tpot_slo:
            return False
        return True

    def as_dict(self) -> dict:
        return {"ttft": self.ttft, "tpot": self.tpot, "e2e_latency": self.e2e_latency,
                "queueing_time": self.queueing_time, "num_prompt_tokens": self.num_prompt_tokens,
                "num_output_tokens": self.num_output_tokens,
                "num_preemptions": self.num_preemptions}


def percentiles(values: Iterable[float], ps=(50, 95, 99)) -> dict:
    """{"p50": ..., "p95": ..., "p99": ...} (linear interpolation); None values are dropped."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {f"p{p}": None for p in ps}
    arr = np.percentile(np.asarray(vals, dtype=np.float64), list(ps))
    return {f"p{p}": float(x) for p, x in zip(ps, arr)}


def summarize(metrics: Iterable[RequestMetrics], duration: Optional[float] = None,
              ttft_slo: Optional[float] = None, tpot_slo: Optional[float] = None) -> dict:
    """Aggregate a run. duration: wall seconds of the run (default: first arrival -> last finish).

    Returns a flat dict: num_requests, input/output tokens, *_tokens_per_s, requests_per_s,
    goodput (requests per second meeting the SLO) and slo_attainment (their fraction), and
    {ttft, tpot, itl, e2e_latency, queueing_time} x {mean, p50, p95, p99}.
    """
    ms = list(metrics)
    if not ms:
        raise ValueError("summarize needs at least one RequestMetrics")
    if duration is None:
        ends = [m.finished_time for m in ms if m.finished_time is not None]
        if not ends:
            raise ValueError("no request has finished; pass duration= explicitly")
        duration = max(ends) - min(m.arrival_time for m in ms)
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    n_in = sum(m.num_prompt_tokens for m in ms if m.sample_index == 0)
    n_out = sum(m.num_output_tokens for m in ms)
    good = sum(m.meets(ttft_slo, tpot_slo) for m in ms)
    out = {"num_requests": len(ms), "duration_s": duration,
           "input_tokens": n_in, "output_tokens": n_out,
           "input_tokens_per_s": n_in / duration, "output_tokens_per_s": n_out / duration,
           "requests_per_s": sum(m.finished_time is not None for m in ms) / duration,
           "ttft_slo": ttft_slo, "tpot_slo": tpot_slo,
           "goodput": good / duration, "slo_attainment": good / len(ms)}
    series = {"ttft": [m.ttft for m in ms], "tpot": [m.tpot for m in ms],
              "itl": [x for m in ms for x in m.itl], "e2e_latency": [m.e2e_latency for m in ms],
              "queueing_time": [m.queueing_time for m in ms]}
    for name, vals in series.items():
        vals = [v for v in vals if v is not None]
        out[f"{name}_mean"] = float(np.mean(vals)) if vals else None
        for k, v in percentiles(vals).items():
            out[f"{name}_{k}"] = v
    return out
