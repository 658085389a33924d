"""Prefix caching on the block pool (chapter 06): hash-chained FULL blocks, LRU free queue.

A request whose prompt starts with tokens some earlier request already computed (a shared
system prompt, the earlier turns of a chat) can reuse their keys and values instead of
recomputing them. Chapter 03's block pool makes that cheap: keep freed blocks' contents, give
every full block a key that names the exact prefix it ends, and let a new request's block table
point at blocks with matching keys.

    tokens      | The cap ital of Fr| ance is Paris . | Its popul ation |      (block_size 4)
    block key    k0 = H(salt, t0..3)  k1 = H(k0, t4..7)  (partial: no key)

* Only FULL blocks get a key. A token's K/V depends on every token before it, so a block's key
  must name its whole prefix: it chains the parent block's key with the block's own token ids
  (`hash_block_tokens`). Equal keys mean equal prefixes; a partly filled block is still being
  written and is never shared.
* A hash can collide, so a hit is also checked: the cached block stores its token ids and a
  reference to its parent's entry, and `find_cached_blocks` accepts a block only when both match
  what the request holds. By induction from the first block a hit is then the exact prefix.
* Freed blocks keep their contents and key. They go to the tail of a least-recently-used free
  queue (a request frees its table tail first, so its deepest blocks sit nearest the head and are
  evicted first); blocks with no key go to the head, they are worth nothing. A hit on a free
  cached block takes it back out of the queue (O(1): the queue is an OrderedDict). Allocation
  takes the head: the least recently used block, whose key is dropped (eviction).
* A hit never covers the whole prompt: at least the last token is computed, so its logits exist
  even when the prompt is an exact multiple of the block size.
* Prefix caching is not copy-on-write. A block shared by a hit is full and nobody writes into it
  again; the request's own writes start in a block of its own. Copy-on-write stays what chapter
  03 made it: forks of ONE request (n > 1) that share a partly filled last block.
* `cache_salt` (any string, e.g. a tenant id) is mixed into the first block's key, so requests
  with different salts never share: the defence against the timing side channel of chapter 06.

Names follow vLLM v1 (block_pool.py, kv_cache_manager.py, `hash_block_tokens`,
`find_longest_cache_hit`); the code is our own.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Callable, Optional

import xxhash

from .blocks import BlockManager, BlockPool


def hash_block_tokens(parent_key: Optional[int], token_ids,
                      cache_salt: Optional[str] = None) -> int:
    """The key of a full block: xxh3-64 of (parent key, salt, this block's token ids).

    parent_key is None for a sequence's first block; the salt only enters there (the chain
    carries it to every later block)."""
    h = xxhash.xxh3_64()
    if parent_key is None:
        h.update(b"root")
        if cache_salt is not None:
            h.update(cache_salt.encode("utf-8"))
    else:
        h.update(parent_key.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


@dataclass(eq=False)
class CachedBlock:
    """What the cache knows about one full block: its key, the exact tokens it holds, and the
    entry of the block before it (None for a first block)."""
    key: int
    token_ids: tuple
    parent: Optional["CachedBlock"]
    cache_salt: Optional[str]
    block_id: int

    def matches(self, token_ids, parent: Optional["CachedBlock"], cache_salt) -> bool:
        return (self.parent is parent and self.token_ids == tuple(token_ids)
                and (parent is not None or self.cache_salt == cache_salt))


def num_cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks a hit may cover for a sequence of num_tokens tokens: full
    blocks only, and never the last token (it must be computed to get its logits)."""
    return max(0, num_tokens - 1) // block_size


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up (queries) and found (hits), counted in tokens, as vLLM does."""
    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_cached_tokens: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_cached_tokens


class PrefixCache:
    """The prefix-cache side of a BlockManager built with enable_caching=True: lookups over the
    pool's index, registration of computed full blocks, and each sequence's chain of entries.

        hits = bm.find_cached_blocks(token_ids, cache_salt)    # longest cached prefix, in blocks
        if bm.can_allocate(seq_id, num_tokens, hits):
            bm.allocate(seq_id, num_tokens, hits)              # table = hits + fresh blocks
        ...                                                    # compute from len(hits) * block_size
        bm.cache_full_blocks(seq_id, num_computed, get_tokens, cache_salt)   # after the forward

    Blocks are registered after their K/V is computed, never before, so no request can hit a
    block whose contents are not there yet (its owner might still be preempted in this step).
    So that two requests with the same prefix do not both compute it, the blocks a running
    sequence is computing are listed by key (`mark_pending`); a newcomer whose next block is
    among them waits (`is_computing`) and hits once the block is cached.
    """

    def __init__(self, manager):
        self.manager = manager
        self.pool = manager.pool
        self.block_size = manager.block_size
        self.pending: dict = {}          # key of a full block being computed now -> seq_id
        # per sequence (its KVBlocks record): prefix_chain, the CachedBlocks naming its leading
        # full blocks; chain_broken after a collision; pending, the (index, key) it must compute

    # --- lookup --------------------------------------------------------------------------------
    def find_cached_blocks(self, token_ids, cache_salt: Optional[str] = None) -> list[int]:
        """Block ids of the longest cached prefix of token_ids (full blocks, last token never)."""
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string or None, got "
                             f"{type(cache_salt).__name__}")
        bs, parent, hits = self.block_size, None, []
        for i in range(num_cacheable_blocks(len(token_ids), bs)):
            block = token_ids[i * bs:(i + 1) * bs]
            entry = self.pool.get_cached_block(
                hash_block_tokens(None if parent is None else parent.key, block, cache_salt))
            if entry is None or not entry.matches(block, parent, cache_salt):
                break
            hits.append(entry.block_id)
            parent = entry
        return hits

    def is_computing(self, token_ids, hits, cache_salt: Optional[str] = None) -> bool:
        """Is the block right after the hit (a full block, not the last token's) being computed
        by a running sequence at this moment? Then waiting a step or two turns it into a hit
        instead of computing the same prefix twice."""
        i = len(hits)
        if i >= num_cacheable_blocks(len(token_ids), self.block_size) or not self.pending:
            return False
        parent = self.pool.block_entry[hits[-1]] if hits else None
        bs = self.block_size
        key = hash_block_tokens(None if parent is None else parent.key,
                                token_ids[i * bs:(i + 1) * bs], cache_salt)
        return key in self.pending

    def mark_pending(self, seq_id, token_ids, cache_salt: Optional[str] = None) -> None:
        """After admission: the keys of the full blocks of token_ids that seq_id will compute
        (after its hit), so `is_computing` can tell a newcomer with the same prefix to wait."""
        kv = self.manager.kv(seq_id)
        self._clear_pending(seq_id, kv)
        bs, chain = self.block_size, kv.prefix_chain
        parent_key = chain[-1].key if chain else None
        for i in range(len(chain), len(token_ids) // bs):
            parent_key = hash_block_tokens(parent_key, token_ids[i * bs:(i + 1) * bs], cache_salt)
            kv.pending.append((i, parent_key))
            self.pending.setdefault(parent_key, seq_id)

    def _clear_pending(self, seq_id, kv, below: Optional[int] = None) -> None:
        """Forget seq_id's pending keys (those of blocks with index < below, or all)."""
        while kv.pending and (below is None or kv.pending[0][0] < below):
            _, key = kv.pending.pop(0)
            if self.pending.get(key) == seq_id:
                del self.pending[key]

    # --- registration --------------------------------------------------------------------------
    def cache_block(self, block_id: int, token_ids, parent: Optional[CachedBlock],
                    cache_salt: Optional[str]) -> Optional[CachedBlock]:
        """Register a full, computed block under its chained key. Returns the entry that now
        names this prefix: the new one, or an equal one another block already holds (then this
        block stays a private duplicate), or None when a different prefix owns the key (a hash
        collision: the block is simply not cached)."""
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are cached: block {block_id} got {len(token_ids)} "
                             f"tokens, block_size is {self.block_size}")
        key = hash_block_tokens(None if parent is None else parent.key, token_ids, cache_salt)
        old = self.pool.get_cached_block(key)
        if old is not None:
            return old if old.matches(token_ids, parent, cache_salt) else None
        entry = CachedBlock(key, tuple(token_ids), parent, cache_salt, block_id)
        self.pool.register(block_id, entry)
        return entry

    def cache_full_blocks(self, seq_id, num_computed_tokens: int,
                          token_ids: Callable[[int, int], list],
                          cache_salt: Optional[str] = None) -> int:
        """After a forward: register seq_id's blocks that are now full and computed.
        token_ids(start, end) returns the sequence's tokens; cache_salt must be the one its
        lookup used. Returns how many blocks were added to the cache."""
        kv, bs = self.manager.kv(seq_id), self.block_size
        chain, table = kv.prefix_chain, kv.block_ids
        full = min(num_computed_tokens, kv.num_tokens) // bs
        added = 0
        while len(chain) < full and not kv.chain_broken:
            i = len(chain)
            parent = chain[-1] if chain else None
            entry = self.cache_block(table[i], token_ids(i * bs, (i + 1) * bs), parent, cache_salt)
            if entry is None:                               # collision: stop caching this one
                kv.chain_broken = True
                break
            chain.append(entry)
            added += entry.block_id == table[i]
        self._clear_pending(seq_id, kv, None if kv.chain_broken else len(chain))
        return added

    # --- the manager's hooks -------------------------------------------------------------------
    def on_allocate(self, kv, cached_blocks) -> None:
        kv.prefix_chain = [self.pool.block_entry[b] for b in cached_blocks]

    def on_free(self, seq_id, kv) -> None:
        self._clear_pending(seq_id, kv)


class PrefixCachingBlockManager(BlockManager):
    """Chapter 03's BlockManager with prefix caching on: `BlockManager(..., enable_caching=True)`
    under the name chapter 06 uses. Same methods, same signatures."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size, enable_caching=True)


class PrefixCachingBlockPool(BlockPool):
    """`BlockPool(..., enable_caching=True)` under the name chapter 06 uses."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size, enable_caching=True)


__all__ = ["hash_block_tokens", "CachedBlock", "PrefixCache", "PrefixCachingBlockManager",
           "PrefixCachingBlockPool", "PrefixCacheStats", "num_cacheable_blocks"]
