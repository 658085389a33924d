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

Names follow vLLM v1's block_pool.py and nano-vllm's block_manager.py; the code is our own.
"""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Physical blocks 0 .. num_blocks-1: a free list (deque) and a reference count per block.
    allocate and free are O(1)."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks = deque(range(num_blocks))   # ids of blocks nobody references
        self.refcounts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range 0..{self.num_blocks - 1}")

    def allocate(self) -> int:
        if not self.free_blocks:
            raise ValueError(f"out of KV blocks: all {self.num_blocks} blocks are in use; free or "
                             "preempt a sequence, or create the pool with more blocks")
        block_id = self.free_blocks.popleft()
        self.refcounts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        self._check(block_id)
        if self.refcounts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; allocate it before sharing it")
        self.refcounts[block_id] += 1

    def decref(self, block_id: int) -> None:
        self._check(block_id)
        if self.refcounts[block_id] == 0:
            raise ValueError(f"block {block_id} is already free (double free?)")
        self.refcounts[block_id] -= 1
        if self.refcounts[block_id] == 0:
            self.free_blocks.append(block_id)

    def refcount(self, block_id: int) -> int:
        self._check(block_id)
        return self.refcounts[block_id]


class BlockManager:
    """Block tables for many sequences on top of one BlockPool."""

    def __init__(self, num_blocks: int, block_size: int):
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.tables: dict = {}        # seq_id -> [block ids], in token order
        self.lengths: dict = {}       # seq_id -> tokens the table holds

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def has(self, seq_id) -> bool:
        return seq_id in self.tables

    def block_table(self, seq_id) -> list[int]:
        return list(self._table(seq_id))

    def num_tokens(self, seq_id) -> int:
        self._table(seq_id)
        return self.lengths[seq_id]

    def _table(self, seq_id) -> list[int]:
        if seq_id not in self.tables:
            raise ValueError(f"sequence {seq_id!r} has no block table; allocate it first")
        return self.tables[seq_id]

    def _needs_copy(self, seq_id, num_tokens: int) -> bool:
        """Will growing to num_tokens write into a last block that other tables share?"""
        table, n = self.tables.get(seq_id, []), self.lengths.get(seq_id, 0)
        return (num_tokens > n and n % self.block_size != 0
                and self.pool.refcount(table[-1]) > 1)

    def blocks_needed(self, seq_id, num_tokens: int) -> int:
        """New blocks that growing seq_id to num_tokens tokens in total would take."""
        n = self.lengths.get(seq_id, 0)
        if num_tokens < n:
            raise ValueError(f"sequence {seq_id!r} already holds {n} tokens; tables only grow "
                             f"(asked for {num_tokens}); free the sequence to shrink it")
        have = len(self.tables.get(seq_id, []))
        need = -(-num_tokens // self.block_size)                  # ceil
        return max(0, need - have) + self._needs_copy(seq_id, num_tokens)

    def can_allocate(self, seq_id, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= self.pool.num_free_blocks

    def allocate(self, seq_id, num_tokens: int) -> list[tuple[int, int]]:
        """Grow seq_id's table to hold num_tokens tokens in total (creating it if new).

        Takes a new block only when the last one is full. If the sequence will write into a
        shared last block, that block is replaced by a fresh one first; the (src, dst) pairs
        returned tell the caller which block contents to copy. All or nothing: when the pool
        cannot cover the growth, nothing changes and ValueError is raised.
        """
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self.pool.num_free_blocks:
            raise ValueError(f"out of KV blocks: sequence {seq_id!r} needs {need} more, "
                             f"{self.pool.num_free_blocks} free; check can_allocate first and "
                             "preempt or wait")
        copies = []
        if self._needs_copy(seq_id, num_tokens):
            table = self.tables[seq_id]
            src, dst = table[-1], self.pool.allocate()
            self.pool.decref(src)
            table[-1] = dst
            copies.append((src, dst))
        table = self.tables.setdefault(seq_id, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.pool.allocate())
        self.lengths[seq_id] = num_tokens
        return copies

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Shrink seq_id to its first num_tokens tokens (speculative decoding's rollback of
        rejected drafts, chapter 07): blocks past them go back to the pool."""
        table, n = self._table(seq_id), self.lengths[seq_id]
        if not 0 <= num_tokens <= n:
            raise ValueError(f"sequence {seq_id!r} holds {n} tokens; cannot truncate to {num_tokens}")
        keep = -(-num_tokens // self.block_size)
        while len(table) > keep:
            self.pool.decref(table.pop())
        self.lengths[seq_id] = num_tokens

    def slot_mapping(self, seq_id, start: int, end: int) -> list[int]:
        """Physical slots (block * block_size + offset) of token positions [start, end)."""
        table, n = self._table(seq_id), self.lengths[seq_id]
        if not 0 <= start <= end <= n:
            raise ValueError(f"positions [{start}, {end}) are outside sequence {seq_id!r}'s "
                             f"{n} tokens; allocate them first")
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def fork(self, parent_id, child_id) -> None:
        """child_id starts as a copy of parent_id that shares every block (refcounts bumped)."""
        table = self._table(parent_id)
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id!r} already exists; fork into a new id")
        for block_id in table:
            self.pool.incref(block_id)
        self.tables[child_id] = list(table)
        self.lengths[child_id] = self.lengths[parent_id]

    def free(self, seq_id) -> None:
        """Drop seq_id's table; blocks nobody else references go back to the pool."""
        table = self._table(seq_id)
        for block_id in reversed(table):                     # tail first, as vLLM does
            self.pool.decref(block_id)
        del self.tables[seq_id], self.lengths[seq_id]
