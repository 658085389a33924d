"""Paged KV memory (chapter 03): a pool of fixed-size blocks and per-sequence block tables.

Instead of one max-length slab per request, KV memory is cut into blocks of `block_size`
tokens. A sequence owns a *block table*: the list of physical blocks that hold its tokens in
order, so token position p lives in block table[p // block_size] at offset p % block_size, i.e.
at *slot* table[p // block_size] * block_size + p % block_size. A block is taken only when the
previous one is full, so a sequence wastes at most block_size - 1 slots, and any free block
serves any sequence: no external fragmentation.

Blocks carry reference counts so sequences can share them. `fork` gives a child the parent's
whole table (parallel sampling, beam search) at the cost of a few refcount bumps. When a
sequence is about to write into a shared, partly filled last block, it gets a fresh copy first
(copy-on-write) and the caller copies the KV contents.

Prefix caching (chapter 06) is a flag on the same two classes, off by default. Off, the manager's
`prefix_cache` is a `NoPrefixCache` whose lookup finds nothing, so the scheduler's admission
code is the same with caching on or off:

    hits = bm.find_cached_blocks(token_ids, cache_salt)     # [] until chapter 06 turns it on
    if bm.can_allocate(seq_id, num_tokens, hits):
        bm.allocate(seq_id, num_tokens, hits)                # the table starts on the hit blocks

Names follow vLLM v1's block_pool.py / kv_cache_manager.py and nano-vllm's block_manager.py;
the code is our own.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional


class BlockPool:
    """Physical blocks 0 .. num_blocks-1: a reference count per block and ONE free queue.

    free_blocks is an OrderedDict used as an O(1) queue (head = next to be taken); every block
    with refcount 0 is in it exactly once. With caching off it is a plain FIFO. With caching on
    (chapter 06) a freed block keeps its contents and its cache entry: blocks that hold a cached
    prefix go to the tail (least recently used first out), blocks worth nothing to the head, a
    prefix hit takes a free cached block back out (`touch`), and `allocate` evicts the entry of
    the block it hands out.

        cached       key -> entry of a block that holds a cached prefix (chapter 06)
        block_entry  block id -> that entry, or None
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1, got "
                             f"{num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.free_blocks = OrderedDict((b, None) for b in range(num_blocks))
        self.refcounts = [0] * num_blocks
        self.cached: dict = {}
        self.block_entry: list = [None] * num_blocks
        self.num_evictions = 0
        self.evict_listeners: list = []     # chapter 11: f(block_id, entry) before eviction

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range 0..{self.num_blocks - 1}")

    def allocate(self) -> int:
        """Take the head of the free queue; if it held a cached prefix, forget it (eviction)."""
        if not self.free_blocks:
            raise ValueError(f"out of KV blocks: all {self.num_blocks} blocks are in use; free or "
                             "preempt a sequence, or create the pool with more blocks")
        block_id, _ = self.free_blocks.popitem(last=False)
        if self.block_entry[block_id] is not None:
            for listener in self.evict_listeners:     # a KV tier saves it (chapter 11)
                listener(block_id, self.block_entry[block_id])
            self._forget(block_id)
            self.num_evictions += 1
        self.refcounts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        """One more table shares this (held) block: fork."""
        self._check(block_id)
        if self.refcounts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; allocate it before sharing it")
        self.refcounts[block_id] += 1

    def touch(self, block_id: int) -> None:
        """A prefix hit takes a reference: a free cached block comes back out of the queue."""
        self._check(block_id)
        if self.refcounts[block_id] == 0:
            del self.free_blocks[block_id]              # O(1)
        self.refcounts[block_id] += 1

    def decref(self, block_id: int) -> None:
        self._check(block_id)
        if self.refcounts[block_id] == 0:
            raise ValueError(f"block {block_id} is already free (double free?)")
        self.refcounts[block_id] -= 1
        if self.refcounts[block_id] == 0:
            self.free_blocks[block_id] = None           # tail: most recently used
            if self.enable_caching and self.block_entry[block_id] is None:
                self.free_blocks.move_to_end(block_id, last=False)   # worth nothing: reuse first

    def refcount(self, block_id: int) -> int:
        self._check(block_id)
        return self.refcounts[block_id]

    # --- the cache's index (chapter 06) --------------------------------------------------------
    def register(self, block_id: int, entry) -> None:
        """Name a computed full block's contents by entry.key, so later sequences can share it."""
        self._check(block_id)
        if not self.enable_caching:
            raise ValueError("this pool was built with enable_caching=False; build it with "
                             "enable_caching=True to cache blocks")
        if self.block_entry[block_id] is not None:
            raise ValueError(f"block {block_id} already holds a cached prefix; a full block is "
                             "cached once")
        self.cached[entry.key] = entry
        self.block_entry[block_id] = entry

    def get_cached_block(self, key: int):
        return self.cached.get(key)

    def _forget(self, block_id: int) -> None:
        del self.cached[self.block_entry[block_id].key]
        self.block_entry[block_id] = None

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def num_evictable_blocks(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return sum(self.block_entry[b] is not None for b in self.free_blocks)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix held by a free block (in-use blocks keep theirs: their
        sequences still read them). Returns how many were dropped."""
        dropped = [b for b in self.free_blocks if self.block_entry[b] is not None]
        for b in dropped:
            self._forget(b)
            self.free_blocks.move_to_end(b, last=False)
        return len(dropped)


@dataclass(eq=False)
class KVBlocks:
    """One sequence's KV memory: its block table and what the prefix cache knows of it. The
    BlockManager indexes these records by seq_id; the engine's Request holds its own (req.kv)."""
    block_ids: list = field(default_factory=list)      # physical blocks, in token order
    num_tokens: int = 0                                # tokens the table holds
    prefix_chain: list = field(default_factory=list)   # chapter 06: entries of its full blocks
    chain_broken: bool = False                         # chapter 06: a collision stopped caching
    pending: list = field(default_factory=list)        # chapter 06: (index, key) to compute


class NoPrefixCache:
    """Prefix caching off (chapters 03-05): every lookup finds nothing, nothing is registered.
    Chapter 06's `minillm.cache.prefix.PrefixCache` answers the same calls for real."""

    def find_cached_blocks(self, token_ids, cache_salt: Optional[str] = None) -> list:
        return []

    def is_computing(self, token_ids, hits, cache_salt: Optional[str] = None) -> bool:
        return False

    def mark_pending(self, seq_id, token_ids, cache_salt: Optional[str] = None) -> None:
        pass

    def cache_full_blocks(self, seq_id, num_computed_tokens: int, token_ids,
                          cache_salt: Optional[str] = None) -> int:
        return 0

    def on_allocate(self, kv: KVBlocks, cached_blocks) -> None:
        pass

    def on_free(self, seq_id, kv: KVBlocks) -> None:
        pass


class NoKVConnector:
    """No KV from outside the pool (chapters 03-10): nothing past the pool's prefix hits is
    found, nothing is sent anywhere when a request finishes. Chapter 11 plugs in a disk tier
    (`minillm.cache.tier.DiskKVTier`) and the prefill/decode hand-off (`minillm.serve.disagg`),
    which answer the same two calls (vLLM calls this seam a KV connector)."""

    def lookup(self, req, token_ids, num_hit_blocks: int) -> tuple:
        """(tokens found, [(k, v)] per block) for the blocks after the pool's hits."""
        return 0, []

    def request_finished(self, req) -> None:
        """Called before a finished request's blocks are freed (req.kv still holds them)."""

    def clear(self) -> int:
        return 0


class BlockManager:
    """Block tables for many sequences on top of one BlockPool. Sequences are named by any
    hashable id (the engine uses Request.seq_id).

    enable_caching=True (chapter 06) turns on prefix caching: the pool keeps freed blocks'
    contents and `prefix_cache` becomes a real `PrefixCache`; every method keeps its signature.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        self.pool = BlockPool(num_blocks, block_size, enable_caching)
        self.block_size = block_size
        self.seqs: dict = {}          # seq_id -> KVBlocks
        if enable_caching:
            from .prefix import PrefixCache     # chapter 06: the seam turned on
            self.prefix_cache = PrefixCache(self)
        else:
            self.prefix_cache = NoPrefixCache()

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    def has(self, seq_id) -> bool:
        return seq_id in self.seqs

    def kv(self, seq_id) -> KVBlocks:
        """seq_id's record (the engine keeps it on its Request as req.kv)."""
        if seq_id not in self.seqs:
            raise ValueError(f"sequence {seq_id!r} has no block table; allocate it first")
        return self.seqs[seq_id]

    def block_table(self, seq_id) -> list[int]:
        return list(self.kv(seq_id).block_ids)

    def num_tokens(self, seq_id) -> int:
        return self.kv(seq_id).num_tokens

    @property
    def tables(self) -> dict:
        """seq_id -> block ids, for reading (lectures, tests)."""
        return {s: kv.block_ids for s, kv in self.seqs.items()}

    @property
    def lengths(self) -> dict:
        """seq_id -> tokens held, for reading."""
        return {s: kv.num_tokens for s, kv in self.seqs.items()}

    # --- prefix caching (chapter 06; finds nothing while it is off) ------------------------------
    def find_cached_blocks(self, token_ids, cache_salt: Optional[str] = None) -> list[int]:
        """Block ids of the longest cached prefix of token_ids ([] with caching off). Pure:
        takes no reference and changes nothing; pass the hits to can_allocate / allocate."""
        return self.prefix_cache.find_cached_blocks(token_ids, cache_salt)

    def is_computing(self, token_ids, hits, cache_salt: Optional[str] = None) -> bool:
        return self.prefix_cache.is_computing(token_ids, hits, cache_salt)

    def mark_pending(self, seq_id, token_ids, cache_salt: Optional[str] = None) -> None:
        self.prefix_cache.mark_pending(seq_id, token_ids, cache_salt)

    def cache_full_blocks(self, seq_id, num_computed_tokens: int, token_ids,
                          cache_salt: Optional[str] = None) -> int:
        """After a forward: register seq_id's full, computed blocks (0 with caching off)."""
        return self.prefix_cache.cache_full_blocks(seq_id, num_computed_tokens, token_ids,
                                                   cache_salt)

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()

    # --- allocation ------------------------------------------------------------------------------
    def _needs_copy(self, seq_id, num_tokens: int) -> bool:
        """Will growing to num_tokens write into a last block that other tables share?"""
        kv = self.seqs.get(seq_id) or KVBlocks()
        table, n = kv.block_ids, kv.num_tokens
        return (num_tokens > n and n % self.block_size != 0
                and self.pool.refcount(table[-1]) > 1)

    def blocks_needed(self, seq_id, num_tokens: int, cached_blocks=()) -> int:
        """Free-queue blocks that growing seq_id to num_tokens tokens in total would take. A new
        sequence that starts on cached_blocks (prefix hits) needs fresh blocks only after them,
        but each hit block that sits in the free queue leaves it too."""
        if cached_blocks:
            self._check_hits(seq_id, num_tokens, cached_blocks)
            fresh = max(0, -(-num_tokens // self.block_size) - len(cached_blocks))
            return fresh + sum(self.pool.refcount(b) == 0 for b in cached_blocks)
        kv = self.seqs.get(seq_id) or KVBlocks()
        n = kv.num_tokens
        if num_tokens < n:
            raise ValueError(f"sequence {seq_id!r} already holds {n} tokens; tables only grow "
                             f"(asked for {num_tokens}); free the sequence to shrink it")
        have = len(kv.block_ids)
        need = -(-num_tokens // self.block_size)                  # ceil
        return max(0, need - have) + self._needs_copy(seq_id, num_tokens)

    def _check_hits(self, seq_id, num_tokens: int, cached_blocks) -> None:
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} already has a block table; prefix hits are for "
                             "a new sequence")
        if len(cached_blocks) * self.block_size >= num_tokens:
            raise ValueError(f"{len(cached_blocks)} cached blocks already hold {num_tokens} "
                             "tokens; a hit leaves at least one token to compute "
                             "(see find_cached_blocks)")

    def can_allocate(self, seq_id, num_tokens: int, cached_blocks=()) -> bool:
        return self.blocks_needed(seq_id, num_tokens, cached_blocks) <= self.pool.num_free_blocks

    def allocate(self, seq_id, num_tokens: int, cached_blocks=()) -> list[tuple[int, int]]:
        """Grow seq_id's table to hold num_tokens tokens in total (creating it if new; a new one
        may start on cached_blocks from find_cached_blocks: shared by reference, never written).

        Takes a new block only when the last one is full. If the sequence will write into a
        shared last block, that block is replaced by a fresh one first; the (src, dst) pairs
        returned tell the caller which block contents to copy. All or nothing: when the pool
        cannot cover the growth, nothing changes and ValueError is raised.
        """
        need = self.blocks_needed(seq_id, num_tokens, cached_blocks)
        if need > self.pool.num_free_blocks:
            raise ValueError(f"out of KV blocks: sequence {seq_id!r} needs {need} more, "
                             f"{self.pool.num_free_blocks} free; check can_allocate first and "
                             "preempt or wait")
        if cached_blocks:
            for b in cached_blocks:
                self.pool.touch(b)
            self.seqs[seq_id] = KVBlocks(list(cached_blocks), len(cached_blocks) * self.block_size)
            self.prefix_cache.on_allocate(self.seqs[seq_id], cached_blocks)
        copies = []
        if self._needs_copy(seq_id, num_tokens):
            table = self.seqs[seq_id].block_ids
            src, dst = table[-1], self.pool.allocate()
            self.pool.decref(src)
            table[-1] = dst
            copies.append((src, dst))
        kv = self.seqs.setdefault(seq_id, KVBlocks())
        while len(kv.block_ids) * self.block_size < num_tokens:
            kv.block_ids.append(self.pool.allocate())
        kv.num_tokens = num_tokens
        return copies

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Shrink seq_id to its first num_tokens tokens (speculative decoding's rollback of
        rejected drafts, chapter 07): blocks past them go back to the pool."""
        kv = self.kv(seq_id)
        if not 0 <= num_tokens <= kv.num_tokens:
            raise ValueError(f"sequence {seq_id!r} holds {kv.num_tokens} tokens; "
                             f"cannot truncate to {num_tokens}")
        keep = -(-num_tokens // self.block_size)
        while len(kv.block_ids) > keep:
            self.pool.decref(kv.block_ids.pop())
        kv.num_tokens = num_tokens

    def slot_mapping(self, seq_id, start: int, end: int) -> list[int]:
        """Physical slots (block * block_size + offset) of token positions [start, end)."""
        kv = self.kv(seq_id)
        table, n = kv.block_ids, kv.num_tokens
        if not 0 <= start <= end <= n:
            raise ValueError(f"positions [{start}, {end}) are outside sequence {seq_id!r}'s "
                             f"{n} tokens; allocate them first")
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def fork(self, parent_id, child_id) -> None:
        """child_id starts as a copy of parent_id that shares every block (refcounts bumped)."""
        parent = self.kv(parent_id)
        if child_id in self.seqs:
            raise ValueError(f"sequence {child_id!r} already exists; fork into a new id")
        for block_id in parent.block_ids:
            self.pool.incref(block_id)
        self.seqs[child_id] = KVBlocks(list(parent.block_ids), parent.num_tokens,
                                       list(parent.prefix_chain), parent.chain_broken)

    def free(self, seq_id) -> None:
        """Drop seq_id's table; blocks nobody else references go back to the pool (tail first,
        as vLLM does: with caching on, a sequence's deepest blocks are evicted first)."""
        kv = self.kv(seq_id)
        for block_id in reversed(kv.block_ids):
            self.pool.decref(block_id)
        del self.seqs[seq_id]
        self.prefix_cache.on_free(seq_id, kv)
