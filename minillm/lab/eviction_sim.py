"""Eviction policies for cached prefix blocks, replayed on token traces (chapter 06, no model).

    replay_eviction(prompts, block_size, capacity_blocks, policy="lru")      plain LRU
    replay_eviction(prompts, block_size, capacity_blocks, policy="slru",     segmented LRU
                    protected_fraction=0.5)
    scan_trace(...)          a hot shared prefix interleaved with bursts of one-off prompts

Blocks are named by the engine's chained keys (`minillm.cache.prefix.hash_block_tokens`), a
prompt's hit is its longest run of cached leading full blocks (never the last token), and after
the lookup every full block of the prompt is cached (hits are touched, misses inserted).

An **eviction storm**: a burst of prompts that are each seen once (a batch job, a crawl, many
new users) inserts more blocks than the cache holds, and under LRU every one of them is "more
recent" than the hot system prompt that all normal traffic shares, so the hot prefix is evicted
and recomputed after every burst. A **segmented LRU** (SLRU) keeps two queues: new blocks enter
a probationary segment; a block that is hit moves to a protected segment (at most
protected_fraction of the capacity; its overflow is demoted back to probation). Eviction takes
probation's least recently used block first, so one-off blocks evict each other and a prefix
that has been reused survives the scan. (2Q and ARC are relatives of the same idea.)
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

from ..cache.prefix import hash_block_tokens, num_cacheable_blocks


@dataclass
class EvictionReplay:
    hit_tokens: int = 0
    prompt_tokens: int = 0
    per_prompt_hits: list = field(default_factory=list)      # cached tokens of each prompt
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _SegmentedLRU:
    """protected_fraction = 0 is plain LRU (everything lives in probation)."""

    def __init__(self, capacity: int, protected_fraction: float):
        self.capacity = capacity
        self.protected_cap = int(capacity * protected_fraction)
        self.probation: OrderedDict = OrderedDict()
        self.protected: OrderedDict = OrderedDict()
        self.evictions = 0

    def __contains__(self, key) -> bool:
        return key in self.probation or key in self.protected

    def hit(self, key) -> None:
        if key in self.protected:
            self.protected.move_to_end(key)
            return
        del self.probation[key]
        if self.protected_cap == 0:                  # plain LRU: back to the recent end
            self.probation[key] = None
            return
        self.protected[key] = None
        while len(self.protected) > self.protected_cap:    # demote, do not drop
            old, _ = self.protected.popitem(last=False)
            self.probation[old] = None

    def insert(self, key) -> None:
        self.probation[key] = None
        while len(self.probation) + len(self.protected) > self.capacity:
            (self.probation or self.protected).popitem(last=False)
            self.evictions += 1


def replay_eviction(prompts, block_size: int, capacity_blocks: int, policy: str = "lru",
                    protected_fraction: float = 0.5) -> EvictionReplay:
    """Replay prompts one at a time through a block cache of capacity_blocks full blocks."""
    if policy not in ("lru", "slru"):
        raise ValueError(f"policy must be 'lru' or 'slru', got {policy!r}")
    if capacity_blocks < 1 or not 0 < protected_fraction < 1:
        raise ValueError("capacity_blocks must be >= 1 and 0 < protected_fraction < 1, got "
                         f"{capacity_blocks} and {protected_fraction}")
    cache = _SegmentedLRU(capacity_blocks, protected_fraction if policy == "slru" else 0.0)
    out = EvictionReplay()
    for p in prompts:
        keys, parent = [], None
        for i in range(len(p) // block_size):
            parent = hash_block_tokens(parent, p[i * block_size:(i + 1) * block_size])
            keys.append(parent)
        hit = 0
        for key in keys[:num_cacheable_blocks(len(p), block_size)]:
            if key not in cache:
                break
            hit += 1
        for key in keys:                             # every full block is cached now
            if key in cache:
                cache.hit(key)
            else:
                cache.insert(key)
        out.per_prompt_hits.append(hit * block_size)
        out.hit_tokens += hit * block_size
        out.prompt_tokens += len(p)
    out.evictions = cache.evictions
    return out


def scan_trace(rounds: int = 6, hot_per_round: int = 8, scan_per_round: int = 12,
               system_len: int = 256, question_len: int = 24, scan_len: int = 512,
               vocab_size: int = 49152, seed: int = 0):
    """(prompts, is_hot): each round sends hot_per_round requests that share one system prompt,
    then a burst of scan_per_round one-off prompts that share nothing with anything."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(vocab_size) for _ in range(n)]   # noqa: E731
    system = draw(system_len)
    prompts, is_hot = [], []
    for _ in range(rounds):
        for _ in range(hot_per_round):
            prompts.append(system + draw(question_len))
            is_hot.append(True)
        for _ in range(scan_per_round):
            prompts.append(draw(scan_len))
            is_hot.append(False)
    return prompts, is_hot


__all__ = ["EvictionReplay", "replay_eviction", "scan_trace"]
