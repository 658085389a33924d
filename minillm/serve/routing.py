"""Which replica gets a request (chapter 11): the routing policies, without any web code.

Many engine replicas behind one address are only as good as the choice made for each request.
The three policies here differ in what they look at:

    policy              looks at                       good at                  bad at
    round_robin         nothing (a counter)            spreading load evenly    prefix-cache hits: a
                                                                                session's turns land
                                                                                on every replica
    least_outstanding   requests in flight per replica uneven request sizes    the same, and a burst
                                                                                reads stale counts
    prefix_affinity     the prompt's first full blocks same-prefix requests     one hot prefix piles
                        (consistent hashing) + load    meet their cached KV     onto one replica:
                                                                                hence the fallback

Prefix affinity hashes the same thing the engine's prefix cache keys on (chapter 06): the chain
of full-block keys of the prompt's tokens. Requests whose first `affinity_blocks` blocks are
equal share a key, so they go to the replica that computed those blocks and find them cached.
The key picks a point on a hash ring where every replica owns `vnodes` points; the request goes
to the first healthy replica clockwise. Adding or removing a replica moves only the keys of the
arcs it owned (about 1/N of them), so the other replicas keep their warm caches.

Affinity alone lets one popular prefix overload its owner. The load-aware fallback sends a
request to the least-loaded replica instead when its owner has more than `balance_abs`
requests in flight AND more than `balance_rel` times (the least-loaded replica's count + 1).
The request then misses the cache on a cold replica (it recomputes its prefix), which is the
price of the fallback; the router counts how often it pays it.

A prompt shorter than one full block has no key (nothing cacheable): it goes to the least-loaded
replica.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional, Sequence

import xxhash

from ..cache.prefix import hash_block_tokens


@dataclass
class Backend:
    """One replica as the router sees it."""
    url: str
    healthy: bool = True
    outstanding: int = 0        # requests sent and not yet answered in full
    served: int = 0             # requests answered (any status)
    failures: int = 0           # transport failures seen (connect, read, timeout)
    missed: int = 0             # health probes missed in a row
    last_error: str = ""


def affinity_key(token_ids: Sequence[int], block_size: int = 16, affinity_blocks: int = 4,
                 cache_salt: Optional[str] = None) -> Optional[int]:
    """The prefix-cache key of the prompt's first min(full blocks, affinity_blocks) blocks
    (the engine's own `hash_block_tokens` chain), or None when not one block is full."""
    if block_size < 1 or affinity_blocks < 1:
        raise ValueError(f"block_size and affinity_blocks must be >= 1, got {block_size} and "
                         f"{affinity_blocks}")
    n = min(len(token_ids) // block_size, affinity_blocks)
    key = None
    for b in range(n):
        key = hash_block_tokens(key, list(token_ids[b * block_size:(b + 1) * block_size]),
                                cache_salt if b == 0 else None)
    return key


def least_loaded(backends: Sequence[Backend]) -> Optional[Backend]:
    """The healthy backend with the fewest requests in flight (first one on ties), or None."""
    healthy = [b for b in backends if b.healthy]
    return min(healthy, key=lambda b: b.outstanding) if healthy else None


class RoundRobin:
    """Each request to the next healthy backend in turn."""
    name = "round_robin"

    def __init__(self):
        self._next = 0

    def choose(self, backends: Sequence[Backend], key: Optional[int] = None) -> Optional[Backend]:
        for i in range(len(backends)):
            b = backends[(self._next + i) % len(backends)]
            if b.healthy:
                self._next = (self._next + i + 1) % len(backends)
                return b
        return None


class LeastOutstanding:
    """Each request to the healthy backend with the fewest requests in flight."""
    name = "least_outstanding"

    def choose(self, backends: Sequence[Backend], key: Optional[int] = None) -> Optional[Backend]:
        return least_loaded(backends)


def ring_point(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode("utf-8"))


class PrefixAffinity:
    """Consistent hashing of the prompt's prefix key, with a load-aware fallback."""
    name = "prefix_affinity"

    def __init__(self, urls: Sequence[str], vnodes: int = 64, balance_abs: int = 4,
                 balance_rel: float = 2.0):
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        # the ring: each backend owns `vnodes` points; a key belongs to the next point clockwise
        self.ring = sorted((ring_point(f"{url}#{v}"), url) for url in urls for v in range(vnodes))
        self._points = [p for p, _ in self.ring]
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.fallbacks = 0          # requests sent away from their owner because it was loaded

    def owner(self, key: int, backends: Sequence[Backend]) -> Optional[Backend]:
        """The first healthy backend clockwise from the key's point on the ring."""
        by_url = {b.url: b for b in backends}
        start = bisect.bisect_left(self._points, key % 2 ** 64)
        for i in range(len(self.ring)):
            b = by_url.get(self.ring[(start + i) % len(self.ring)][1])
            if b is not None and b.healthy:
                return b
        return None

    def overloaded(self, owner: Backend, backends: Sequence[Backend]) -> bool:
        least = least_loaded(backends)
        return (owner.outstanding > self.balance_abs
                and owner.outstanding > self.balance_rel * (least.outstanding + 1))

    def choose(self, backends: Sequence[Backend], key: Optional[int] = None) -> Optional[Backend]:
        if key is None:
            return least_loaded(backends)
        owner = self.owner(key, backends)
        if owner is not None and self.overloaded(owner, backends):
            self.fallbacks += 1
            return least_loaded(backends)
        return owner


POLICIES = ("round_robin", "least_outstanding", "prefix_affinity")


def make_policy(name: str, urls: Sequence[str], **kwargs):
    """The policy called `name` (one of POLICIES) over backends at `urls`."""
    if name == "round_robin":
        return RoundRobin()
    if name == "least_outstanding":
        return LeastOutstanding()
    if name == "prefix_affinity":
        return PrefixAffinity(urls, **kwargs)
    raise ValueError(f"unknown routing policy {name!r}: use one of {', '.join(POLICIES)}")


__all__ = ["Backend", "ring_point", "affinity_key", "least_loaded", "RoundRobin",
           "LeastOutstanding", "PrefixAffinity", "POLICIES", "make_policy"]
