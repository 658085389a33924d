"""Replaying token traces through the two prefix indexes of chapter 06 (no model, no K/V).

    replay_hash_chain(prompts, block_size, num_blocks)   the engine's block cache, one request
                                                         at a time: lookup, allocate, cache, free
    replay_radix(prompts, capacity_tokens, batch_size, policy)
                                                         the radix tree, a batch of requests at a
                                                         time, FCFS or longest-prefix-match first
    index_bytes(obj)                                     Python bytes an index occupies

Both count hits the way the engine does: prompt tokens served from the cache, never a prompt's
last token.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from ..cache.prefix import PrefixCachingBlockManager
from .radix import RadixCache


@dataclass
class PrefixReplayResult:
    hit_tokens: int
    prompt_tokens: int
    index_entries: int          # keys in the hash chain / nodes in the tree, at the end
    index_bytes: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def replay_hash_chain(prompts, block_size: int, num_blocks: int = None) -> PrefixReplayResult:
    """Each prompt in turn: find its cached prefix, take its blocks, cache its full blocks, free
    it (its blocks stay cached until evicted). num_blocks=None: room for everything."""
    if num_blocks is None:
        num_blocks = sum(-(-len(p) // block_size) for p in prompts) + 1
    bm = PrefixCachingBlockManager(num_blocks, block_size)
    hits = total = 0
    for i, p in enumerate(prompts):
        found = bm.find_cached_blocks(p)
        bm.allocate(i, len(p), found)
        bm.cache_full_blocks(i, len(p), lambda s, e: p[s:e])
        bm.free(i)
        hits += len(found) * block_size
        total += len(p)
    return PrefixReplayResult(hits, total, bm.num_cached_blocks, index_bytes(bm.pool.cached))


def replay_radix(prompts, capacity_tokens: int = None, batch_size: int = 1,
                 policy: str = "fcfs") -> PrefixReplayResult:
    """Requests wait in a queue and run batch_size at a time; a running batch locks its paths,
    so eviction (to stay within capacity_tokens) takes only other prefixes. policy "fcfs" runs
    them in arrival order, "lpm" (SGLang's cache-aware order) runs the waiting requests with the
    longest cached prefix first."""
    if policy not in ("fcfs", "lpm"):
        raise ValueError(f"policy must be 'fcfs' or 'lpm', got {policy!r}")
    tree = RadixCache(capacity_tokens)
    waiting = [tuple(p) for p in prompts]
    hits = total = 0
    while waiting:
        if policy == "lpm":
            waiting.sort(key=lambda p: -tree.match_prefix(p, touch=False)[0])   # stable
        batch, waiting = waiting[:batch_size], waiting[batch_size:]
        locked = []
        for p in batch:
            matched, _ = tree.match_prefix(p)
            hits += min(matched, len(p) - 1)
            total += len(p)
            tree.insert(p)
            _, node = tree.match_prefix(p)
            tree.lock(node)
            locked.append(node)
        for node in locked:
            tree.unlock(node)
    return PrefixReplayResult(hits, total, tree.num_nodes, index_bytes(tree.root))


def index_bytes(obj) -> int:
    """sys.getsizeof summed over every object reachable from obj through containers and
    __dict__/__slots__ (each object counted once). Ints and token tuples included."""
    seen, stack, total = set(), [obj], 0
    while stack:
        o = stack.pop()
        if id(o) in seen or o is None or isinstance(o, (bool, float, str)):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set)):
            stack.extend(o)
        elif hasattr(o, "__dict__"):
            stack.extend(vars(o).values())
        elif hasattr(type(o), "__slots__"):
            stack.extend(getattr(o, s) for s in type(o).__slots__ if hasattr(o, s))
    return total


__all__ = ["PrefixReplayResult", "replay_hash_chain", "replay_radix", "index_bytes"]
