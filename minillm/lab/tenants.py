"""A seeded multi-tenant, multi-turn trace for chapter 11 (token ids, no tokenizer needed).

Each tenant has its own system prompt; each session belongs to one tenant and sends `turns`
prompts, turn k re-sending the system prompt, the earlier turns and their (fixed) answers:

    tenant 0 (popular)  system0 | u1            session 0, turn 1
                        system0 | u1 a1 u2       session 0, turn 2    (extends turn 1)
                        system0 | v1            session 1, turn 1    (shares system0 only)
    tenant 1            system1 | w1 ...

Two kinds of sharing follow, and they reward different routing: every session of a tenant
shares the system prompt (a few blocks, reused by many sessions), and each session's turns share
everything before the last user message (many blocks, reused by one session). `popular_share`
of the sessions go to tenant 0, the rest spread evenly over the others: the hot prefix that
loads one replica under pure affinity.

Arrivals are open-loop: sessions start at Poisson times (`rate` sessions/s) and send turn k at
start + k * turn_gap seconds, so the trace does not depend on how fast anything answers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minillm.cache.prefix import num_cacheable_blocks


@dataclass(frozen=True)
class TenantRequest:
    arrival_time: float
    tenant: int
    session: int
    turn: int
    prompt_ids: tuple
    shared_system_len: int          # the tenant's system prompt tokens at its start


def multi_tenant_trace(num_tenants: int = 4, num_sessions: int = 16, turns: int = 3,
                       system_len: int = 96, user_len: int = 24, answer_len: int = 24,
                       popular_share: float = 0.5, rate: float = 1.0, turn_gap: float = 4.0,
                       vocab_size: int = 49152, seed: int = 0, first_id: int = 10) -> list:
    """[TenantRequest] sorted by arrival time (see the module docstring)."""
    if num_tenants < 1 or num_sessions < 1 or turns < 1 or not 0 <= popular_share <= 1:
        raise ValueError("num_tenants, num_sessions and turns must be >= 1 and popular_share "
                         "in [0, 1]")
    rng = np.random.default_rng(seed)

    def toks(n):
        return rng.integers(first_id, vocab_size, size=n).tolist()

    systems = [toks(system_len) for _ in range(num_tenants)]
    starts = np.cumsum(rng.exponential(1.0 / rate, size=num_sessions)) if rate else \
        np.zeros(num_sessions)
    out = []
    for s in range(num_sessions):
        popular = num_tenants == 1 or rng.random() < popular_share
        tenant = 0 if popular else int(rng.integers(1, num_tenants))
        history = list(systems[tenant])
        for t in range(turns):
            history += toks(user_len)
            out.append(TenantRequest(float(starts[s] + t * turn_gap), tenant, s, t,
                                     tuple(history), system_len))
            history += toks(answer_len)
    return sorted(out, key=lambda r: r.arrival_time)


def ideal_hit_rate(trace, block_size: int = 16) -> float:
    """The prompt-token hit rate if every request met all earlier requests' prefixes in one
    cache that never evicts: what one big replica, or perfect affinity, could reach.

    A hit covers full blocks and never the prompt's last token (the engine's rule,
    `cache.prefix.num_cacheable_blocks`), but once a prompt is computed EVERY full block of it is
    cached, the last one included: turn 2 of a session hits turn 1's whole prompt."""
    seen: set = set()
    hit = total = 0
    for r in trace:
        ids = r.prompt_ids
        keys = [ids[:(b + 1) * block_size] for b in range(len(ids) // block_size)]
        n = 0
        while n < num_cacheable_blocks(len(ids), block_size) and keys[n] in seen:
            n += 1
        hit += n * block_size
        total += len(ids)
        seen.update(keys)
    return hit / total if total else 0.0


__all__ = ["TenantRequest", "multi_tenant_trace", "ideal_hit_rate"]
