"""Back-of-the-envelope models for chapter 11: reload vs recompute, SLO attainment, goodput,
cold start. Estimates, to be labelled as such next to any measurement.

Reload vs recompute (a KV tier, a prefix cached on another machine):
    reload     kv_bytes_per_token(cfg, kv_dtype) x tokens / bandwidth          (bytes moved)
    recompute  forward_flops(cfg, tokens) / (peak FLOP/s x MFU)                (prefill again)
Both grow linearly in the prefix length (recompute a little faster: attention is quadratic), so
the choice is mostly a ratio of bytes per token to FLOPs per token against the link's bandwidth
to the accelerator's FLOP rate. A big model has many FLOPs per KV byte (GQA shrinks the KV, the
weights do not shrink): reload wins. A small model on a fast GPU computes its KV faster than a
disk or even PCIe delivers it: recompute wins.

Goodput (DistServe): the highest request rate at which at least `attainment` of the requests
meet BOTH the TTFT and the TPOT objective.
"""
from __future__ import annotations

import math
from typing import Optional

from ..configs import ModelConfig
from ..kvmath import kv_bytes_per_token
from ..roofline import forward_flops


def reload_seconds(cfg: ModelConfig, tokens: int, bandwidth: float,
                   kv_dtype="bfloat16") -> float:
    """Seconds to move `tokens` tokens of KV (every layer, K and V) at `bandwidth` bytes/s."""
    if tokens < 0 or bandwidth <= 0:
        raise ValueError(f"need tokens >= 0 and bandwidth > 0, got {tokens} and {bandwidth}")
    return kv_bytes_per_token(cfg, kv_dtype) * tokens / bandwidth


def recompute_seconds(cfg: ModelConfig, tokens: int, flops: float, mfu: float = 0.5) -> float:
    """Seconds to prefill `tokens` tokens again at `flops` peak FLOP/s and `mfu` utilisation
    (the logits of the last token only: a recomputed prefix needs no output head)."""
    if tokens < 1 or flops <= 0 or not 0 < mfu <= 1:
        raise ValueError(f"need tokens >= 1, flops > 0 and 0 < mfu <= 1, got {tokens}, {flops}, "
                         f"{mfu}")
    head = cfg.vocab_size * cfg.hidden_size
    return (forward_flops(cfg, tokens, last_only=True) - 2 * head) / (flops * mfu)


def reload_or_recompute(cfg: ModelConfig, tokens: int, bandwidth: float, flops: float,
                        mfu: float = 0.5, kv_dtype="bfloat16") -> str:
    """"reload" when moving the prefix's KV is faster than computing it again, else
    "recompute" (a tie recomputes: no storage to read, nothing to go stale)."""
    r = reload_seconds(cfg, tokens, bandwidth, kv_dtype)
    return "reload" if r < recompute_seconds(cfg, tokens, flops, mfu) else "recompute"


def tpot(itl: list) -> Optional[float]:
    """Time per output token after the first: the mean inter-token gap (None: one token)."""
    return sum(itl) / len(itl) if itl else None


def meets_slos(ttft: Optional[float], itl: list, ttft_slo: float, tpot_slo: float) -> bool:
    """A request meets both objectives (a failed request, ttft None, meets none; a one-token
    request has no TPOT and meets any TPOT objective)."""
    if ttft is None:
        return False
    t = tpot(itl)
    return ttft <= ttft_slo and (t is None or t <= tpot_slo)


def slo_attainment(requests: list, ttft_slo: float, tpot_slo: float) -> float:
    """Fraction of requests ({"ttft": s or None, "itl": [s, ...]}) that meet both objectives."""
    if not requests:
        raise ValueError("no requests: attainment is undefined")
    return sum(meets_slos(r["ttft"], r["itl"], ttft_slo, tpot_slo)
               for r in requests) / len(requests)


def goodput_rate(runs: dict, ttft_slo: float, tpot_slo: float, attainment: float = 0.9) -> float:
    """DistServe's goodput over a sweep: runs = {request rate: [requests]} -> the highest rate
    whose attainment is at least `attainment` (0.0 when none is)."""
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment}")
    good = [rate for rate, reqs in runs.items()
            if slo_attainment(reqs, ttft_slo, tpot_slo) >= attainment]
    return max(good, default=0.0)


def queued_during_cold_start(arrival_rate: float, cold_start: float, capacity_rate: float,
                             replicas: int) -> float:
    """Requests that pile up while a new replica starts, if traffic already exceeds what the
    running `replicas` serve: (arrival rate - replicas x capacity) x cold start."""
    return max(0.0, arrival_rate - replicas * capacity_rate) * cold_start


def replicas_needed(arrival_rate: float, capacity_rate: float, headroom: float = 0.8) -> int:
    """Replicas to run each at most `headroom` of its capacity (its goodput rate)."""
    if capacity_rate <= 0 or not 0 < headroom <= 1:
        raise ValueError("capacity_rate must be > 0 and headroom in (0, 1]")
    return max(1, math.ceil(arrival_rate / (capacity_rate * headroom)))


__all__ = ["reload_seconds", "recompute_seconds", "reload_or_recompute", "tpot", "meets_slos",
           "slo_attainment", "goodput_rate", "queued_during_cold_start", "replicas_needed"]
