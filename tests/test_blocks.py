"""Block pool and block tables (chapter 03): free list, refcounts, fork, copy-on-write, no leaks."""
import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minillm.cache.blocks import BlockManager, BlockPool
from minillm.lab.memory_sim import simulate_blocks
from minillm.lab.workloads import make_workload


# --- BlockPool ----------------------------------------------------------------------------------

def test_pool_allocates_every_block_once_then_refuses():
    pool = BlockPool(4, block_size=16)
    got = [pool.allocate() for _ in range(4)]
    assert sorted(got) == [0, 1, 2, 3] and pool.num_free_blocks == 0
    assert all(pool.refcount(b) == 1 for b in got)
    with pytest.raises(ValueError, match="out of KV blocks"):
        pool.allocate()


def test_pool_refcounts():
    pool = BlockPool(2, block_size=4)
    b = pool.allocate()
    pool.incref(b)
    pool.decref(b)
    assert pool.refcount(b) == 1 and pool.num_free_blocks == 1       # still held once
    pool.decref(b)
    assert pool.refcount(b) == 0 and pool.num_free_blocks == 2       # back on the free list
    with pytest.raises(ValueError, match="double free"):
        pool.decref(b)
    with pytest.raises(ValueError, match="is free"):
        pool.incref(b)
    with pytest.raises(ValueError, match="out of range"):
        pool.refcount(7)
    with pytest.raises(ValueError, match=">= 1"):
        BlockPool(0, 16)


# --- BlockManager -------------------------------------------------------------------------------

def test_table_grows_only_when_the_last_block_is_full():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.blocks_needed("a", 4) == 1 and bm.blocks_needed("a", 5) == 2
    assert bm.allocate("a", 4) == []
    assert len(bm.block_table("a")) == 1 and bm.num_tokens("a") == 4  # exact multiple: 1 block
    assert bm.blocks_needed("a", 5) == 1
    bm.allocate("a", 5)
    assert len(bm.block_table("a")) == 2
    assert bm.blocks_needed("a", 8) == 0
    bm.allocate("a", 8)
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 6


def test_slot_mapping():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("x", 2)                                              # takes block 0
    bm.allocate("a", 6)                                              # blocks 1, 2
    t = bm.block_table("a")
    assert bm.slot_mapping("a", 0, 6) == [t[0] * 4 + i for i in range(4)] + [t[1] * 4, t[1] * 4 + 1]
    assert bm.slot_mapping("a", 5, 6) == [t[1] * 4 + 1]
    assert bm.slot_mapping("a", 3, 3) == []
    with pytest.raises(ValueError, match="outside"):
        bm.slot_mapping("a", 4, 7)


def test_fork_then_append_into_shared_partial_block_copies_it():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("p", 6)                                              # 1.5 blocks
    bm.fork("p", "c")
    parent = bm.block_table("p")
    assert bm.block_table("c") == parent
    assert all(bm.pool.refcount(b) == 2 for b in parent)
    assert bm.blocks_needed("c", 7) == 1                             # the copy
    copies = bm.allocate("c", 7)                                     # writes into shared block 1
    child = bm.block_table("c")
    assert copies == [(parent[1], child[1])]
    assert child[0] == parent[0] and child[1] != parent[1]           # diverge only in the last
    assert bm.pool.refcount(parent[0]) == 2
    assert bm.pool.refcount(parent[1]) == 1 and bm.pool.refcount(child[1]) == 1
    assert bm.allocate("p", 7) == []                                 # parent is alone in it now
    assert bm.block_table("p") == parent


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("p", 8)
    bm.fork("p", "c")
    assert bm.blocks_needed("c", 9) == 1
    assert bm.allocate("c", 9) == []
    assert bm.block_table("c")[:2] == bm.block_table("p")


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 6)
    bm.fork("a", "b")
    assert not bm.can_allocate("b", 13)                              # copy + 2 new > 1 free
    with pytest.raises(ValueError, match="out of KV blocks"):
        bm.allocate("b", 13)
    assert bm.num_tokens("b") == 6 and bm.block_table("b") == bm.block_table("a")
    assert bm.num_free_blocks == 1


def test_free_returns_only_unshared_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 8)
    bm.fork("a", "b")
    bm.free("a")
    assert bm.num_free_blocks == 2 and not bm.has("a") and bm.has("b")
    bm.free("b")
    assert bm.num_free_blocks == 4


def test_manager_bad_input():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 5)
    with pytest.raises(ValueError, match="only grow"):
        bm.allocate("a", 3)
    with pytest.raises(ValueError, match="no block table"):
        bm.free("zz")
    with pytest.raises(ValueError, match="no block table"):
        bm.fork("zz", "y")
    bm.fork("a", "b")
    with pytest.raises(ValueError, match="already exists"):
        bm.fork("a", "b")


# --- state machine: random allocate / grow / fork / free ------------------------------------------

class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a BlockManager at random and keeps a shadow copy of what each sequence wrote.

    Each token a sequence writes gets a unique value, stored at its slot in `memory` (the
    "KV contents"); copy-on-write pairs are applied to `memory` the way the cache would. Every
    sequence must always read back exactly its own tokens through its block table.
    """

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 3, 4, 16]))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.num_blocks, self.bs = num_blocks, block_size
        self.tokens = {}                  # seq_id -> values it wrote, in order
        self.memory = {}                  # slot -> value
        self.next_id, self.next_value = 0, 0

    def _write(self, seq_id, start, end):
        for slot in self.bm.slot_mapping(seq_id, start, end):
            self.memory[slot] = self.next_value
            self.tokens[seq_id].append(self.next_value)
            self.next_value += 1

    def _copy(self, pairs):
        for src, dst in pairs:
            for off in range(self.bs):
                if src * self.bs + off in self.memory:
                    self.memory[dst * self.bs + off] = self.memory[src * self.bs + off]

    def _grow(self, seq_id, num_tokens):
        old = self.bm.num_tokens(seq_id) if self.bm.has(seq_id) else 0
        free_before = self.bm.num_free_blocks
        need = self.bm.blocks_needed(seq_id, num_tokens)
        if not self.bm.can_allocate(seq_id, num_tokens):
            assert need > free_before
            table = self.bm.block_table(seq_id) if self.bm.has(seq_id) else None
            with pytest.raises(ValueError, match="out of KV blocks"):
                self.bm.allocate(seq_id, num_tokens)
            assert self.bm.num_free_blocks == free_before            # nothing changed
            assert (self.bm.block_table(seq_id) if self.bm.has(seq_id) else None) == table
            return
        copies = self.bm.allocate(seq_id, num_tokens)
        assert free_before - self.bm.num_free_blocks <= need        # copies may free nothing
        assert len(copies) <= 1
        self.tokens.setdefault(seq_id, [])
        self._copy(copies)
        self._write(seq_id, old, num_tokens)

    @rule(num_tokens=st.integers(1, 40))
    def new_sequence(self, num_tokens):
        seq_id = self.next_id
        self.next_id += 1
        self._grow(seq_id, num_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(0, 20))
    def grow(self, data, extra):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self._grow(seq_id, self.bm.num_tokens(seq_id) + extra)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq_id)
        del self.tokens[seq_id]
        if not self.tokens:                                          # everything freed: pool full
            assert self.bm.num_free_blocks == self.num_blocks

    @invariant()
    def refcounts_match_tables_and_nothing_leaks(self):
        if not hasattr(self, "bm"):
            return
        holders = {}
        for seq_id in self.tokens:
            for b in self.bm.block_table(seq_id):
                holders[b] = holders.get(b, 0) + 1
        free = list(self.bm.pool.free_blocks)
        assert len(free) == len(set(free))                          # no block freed twice
        assert not set(free) & set(holders)                         # never free and referenced
        assert len(free) + len(holders) == self.num_blocks          # no leak
        for b in range(self.num_blocks):
            assert self.bm.pool.refcount(b) == holders.get(b, 0)

    @invariant()
    def tables_have_the_right_size_and_contents(self):
        if not hasattr(self, "bm"):
            return
        for seq_id, values in self.tokens.items():
            n = self.bm.num_tokens(seq_id)
            assert n == len(values)
            assert len(self.bm.block_table(seq_id)) == math.ceil(n / self.bs)
            read = [self.memory[s] for s in self.bm.slot_mapping(seq_id, 0, n)]
            assert read == values                                    # own tokens, nobody else's

    def teardown(self):
        if hasattr(self, "bm"):
            for seq_id in list(self.tokens):
                self.bm.free(seq_id)
            assert self.bm.num_free_blocks == self.num_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                                 deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# --- the chapter-02 workload on blocks ----------------------------------------------------------

def test_paged_simulation_wastes_under_four_percent():
    w = make_workload("sharegpt", 120, seed=0, rate=50.0)
    bs = 16
    trace = simulate_blocks(w.requests, num_blocks=8 * 2048 // bs, block_size=bs, map_every=20)
    s = trace.summary()
    assert s["finished"] == len(w)
    padded = sum(math.ceil(r.total_len / bs) * bs for r in w)
    expected = 1 - sum(r.total_len for r in w) / padded
    assert s["wasted_fraction"] == pytest.approx(expected)
    assert s["wasted_fraction"] < 0.04
    for step in trace.steps:
        assert step["reserved_tokens"] + step["free_tokens"] == 8 * 2048
        assert step["used_tokens"] <= step["reserved_tokens"]
        assert step["reserved_tokens"] - step["used_tokens"] < bs * max(1, step["running"])


def test_paged_simulation_preempts_instead_of_failing():
    w = make_workload("sharegpt", 40, seed=1)                        # all arrive at once
    trace = simulate_blocks(w.requests, num_blocks=100, block_size=16, map_every=50)
    assert trace.summary()["finished"] == 40
    assert trace.num_preempted > 0
