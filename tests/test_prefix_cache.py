"""Prefix caching on the block pool (chapter 06): chained keys, LRU free queue, hit rules, no
leaks."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minillm.cache.prefix import (PrefixCachingBlockManager, PrefixCachingBlockPool,
                                  PrefixCacheStats, hash_block_tokens, num_cacheable_blocks)


def run(bm, seq_id, tokens, salt=None):
    """Admit tokens as a new sequence the way the engine does: lookup, allocate, compute, cache."""
    hits = bm.find_cached_blocks(tokens, salt)
    bm.allocate(seq_id, len(tokens), hits)
    bm.cache_full_blocks(seq_id, len(tokens), lambda s, e: tokens[s:e], salt)
    return hits


# --- keys ----------------------------------------------------------------------------------------

def test_key_chains_the_whole_prefix_and_the_salt():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])                # deterministic, not hash()
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(hash_block_tokens(None, [9, 2, 3, 4]),
                                                              [5, 6])  # same tokens, other prefix
    assert hash_block_tokens(None, [1, 2, 3, 4], "tenant-a") != a
    assert (hash_block_tokens(None, [1, 2, 3, 4], "tenant-a")
            != hash_block_tokens(None, [1, 2, 3, 4], "tenant-b"))
    assert hash_block_tokens(None, [1, 2], None) != hash_block_tokens(None, [2, 1], None)


def test_hit_length_rule():
    assert [num_cacheable_blocks(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]


# --- LRU free queue ------------------------------------------------------------------------------

def test_free_tail_first_then_evict_deepest_first_and_revive_on_hit():
    bm = PrefixCachingBlockManager(num_blocks=6, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]                                   # 3 full blocks + 1 token
    assert run(bm, "a", prompt) == []
    table = bm.block_table("a")
    assert bm.num_cached_blocks == 3
    bm.free("a")
    free = list(bm.pool.free_blocks)
    assert free[0] == table[3]                                      # uncached partial block: first
    assert free[-3:] == [table[2], table[1], table[0]]              # deepest cached evicted first
    assert bm.pool.num_evictable_blocks == 3
    # a hit on the first two blocks takes them out of the queue (revival)
    assert run(bm, "b", [1, 2, 3, 4, 9]) == table[:2]
    assert table[0] not in bm.pool.free_blocks and table[1] not in bm.pool.free_blocks
    assert bm.pool.refcount(table[0]) == 1
    # filling the pool evicts the deepest block (table[2]) before anything else cached
    others = [bm.pool.allocate() for _ in range(bm.num_free_blocks)]
    assert table[2] in others and bm.pool.num_evictions == 1
    assert bm.find_cached_blocks(prompt) == table[:2]               # table[2]'s key is gone


def test_blocks_needed_counts_revived_hits():
    bm = PrefixCachingBlockManager(num_blocks=4, block_size=2)
    run(bm, "a", [1, 2, 3, 4, 5])
    bm.free("a")
    hits = bm.find_cached_blocks([1, 2, 3, 4, 9, 9])
    assert len(hits) == 2
    # 3 blocks for 6 tokens: 2 hit (both free, so they leave the queue) + 1 fresh = 3 taken
    assert bm.blocks_needed("b", 6, hits) == 3
    run(bm, "c", [7, 7])                                            # someone else holds one block
    bm2_free = bm.num_free_blocks
    assert bm2_free == 3 and bm.can_allocate("b", 6, hits)
    run(bm, "b", [1, 2, 3, 4, 9, 9])
    assert bm.num_free_blocks == 0
    with pytest.raises(ValueError, match="at least one token"):
        bm.blocks_needed("d", 4, hits)                              # a hit may not cover it all


def test_collision_never_serves_another_prefix(monkeypatch):
    """Force every key to collide: a hit must still check tokens and parent and miss."""
    import minillm.cache.prefix as prefix
    monkeypatch.setattr(prefix, "hash_block_tokens", lambda parent, tokens, salt=None: 42)
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    run(bm, "a", [1, 2, 3])
    assert bm.find_cached_blocks([1, 2, 3]) == [bm.block_table("a")[0]]   # the true hit
    assert bm.find_cached_blocks([5, 6, 3]) == []                   # same key, other tokens
    assert run(bm, "b", [5, 6, 7, 8, 9]) == []
    assert bm.num_cached_blocks == 1                                # b's blocks not cached
    assert bm.find_cached_blocks([1, 2, 1, 2, 3]) == [bm.block_table("a")[0]]   # parent checked


def test_salt_separates_tenants():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    run(bm, "a", [1, 2, 3, 4, 5], salt="alice")
    assert bm.find_cached_blocks([1, 2, 3, 4, 5], "alice") == bm.block_table("a")[:2]
    assert bm.find_cached_blocks([1, 2, 3, 4, 5], "bob") == []
    assert bm.find_cached_blocks([1, 2, 3, 4, 5]) == []
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        bm.find_cached_blocks([1, 2, 3], cache_salt=7)


def test_reset_prefix_cache_keeps_blocks_in_use():
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    run(bm, "a", [1, 2, 3, 4, 5])
    run(bm, "b", [7, 8, 9])
    bm.free("b")
    assert bm.reset_prefix_cache() == 1                              # b's block, free
    assert bm.find_cached_blocks([1, 2, 3, 4, 5]) == bm.block_table("a")[:2]
    assert bm.find_cached_blocks([7, 8, 9]) == []


def test_stats_count_tokens():
    s = PrefixCacheStats()
    assert s.hit_rate == 0.0
    s.record(100, 64)
    s.record(100, 0)
    assert (s.requests, s.queries, s.hits, s.hit_rate) == (2, 200, 64, 0.32)


# --- named regressions ---------------------------------------------------------------------------

def test_regression_stale_key_dropped_when_block_is_reallocated():
    """A block evicted and rewritten with other tokens must not still answer to its old key."""
    bm = PrefixCachingBlockManager(num_blocks=2, block_size=2)
    run(bm, "a", [1, 2, 3])
    old = bm.block_table("a")[0]
    bm.free("a")
    run(bm, "b", [8, 9, 9, 9])                                      # takes both blocks
    assert old in bm.block_table("b")
    assert bm.find_cached_blocks([1, 2, 3]) == []                   # old key gone
    assert all(e.block_id in bm.block_table("b") for e in bm.pool.cached.values())
    i = bm.block_table("b").index(old)
    assert bm.pool.block_entry[old].token_ids == (8, 9, 9, 9)[2 * i:2 * i + 2]   # its new tokens


def test_regression_fully_cached_prompt_at_exact_block_multiple():
    """Every block of the prompt is cached: the hit stops one block short, the last token
    computes."""
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    run(bm, "a", prompt)
    assert bm.num_cached_blocks == 2
    hits = bm.find_cached_blocks(prompt)
    assert hits == bm.block_table("a")[:1]                          # 4 tokens, not 8
    bm.allocate("b", 8, hits)
    assert bm.num_tokens("b") == 8 and bm.block_table("b")[0] == hits[0]
    assert bm.block_table("b")[1] != bm.block_table("a")[1]         # last block recomputed, own
    assert bm.slot_mapping("b", 4, 8)                               # tokens 4..7 still to compute


def test_regression_same_prefix_twice_in_one_step_stays_correct_and_leaks_nothing():
    """Both lookups happen before either forward: both miss, both compute, one block keeps the
    key."""
    bm = PrefixCachingBlockManager(num_blocks=8, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    ha, hb = bm.find_cached_blocks(prompt), bm.find_cached_blocks(prompt)
    bm.allocate("a", 5, ha)
    bm.allocate("b", 5, hb)
    for seq in ("a", "b"):                                          # after the forward
        bm.cache_full_blocks(seq, 5, lambda s, e: prompt[s:e])
    assert bm.num_cached_blocks == 2                                # no key maps to two blocks
    ta, tb = bm.block_table("a"), bm.block_table("b")
    assert bm.find_cached_blocks(prompt + [6]) == ta[:2]
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8 and bm.pool.num_evictable_blocks == 2
    assert set(list(bm.pool.free_blocks)[:4]) == set(tb) | {ta[2]}  # duplicates reused first


# --- state machine -------------------------------------------------------------------------------

class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admissions (with lookups), appends, forks, frees and resets over a small pool.

    The shadow memory holds, for every slot written, the whole prefix that token ended (its
    K/V depends on all of it). Every sequence must read back its own prefixes through its table,
    hits included, and every cached key must name the tokens its block really holds.
    """

    @initialize(num_blocks=st.integers(2, 16), block_size=st.sampled_from([1, 2, 3, 4]))
    def setup(self, num_blocks, block_size):
        self.bm = PrefixCachingBlockManager(num_blocks, block_size)
        self.num_blocks, self.bs = num_blocks, block_size
        self.tokens = {}                  # seq_id -> token ids it holds
        self.salts = {}                   # seq_id -> cache_salt
        self.memory = {}                  # slot -> tuple(prefix ending at that token)
        self.next_id = 0

    def _write(self, seq_id, start, end):
        toks = self.tokens[seq_id]
        for p, slot in zip(range(start, end), self.bm.slot_mapping(seq_id, start, end)):
            self.memory[slot] = tuple(toks[:p + 1])

    def _copy(self, pairs):
        for src, dst in pairs:
            for off in range(self.bs):
                if src * self.bs + off in self.memory:
                    self.memory[dst * self.bs + off] = self.memory[src * self.bs + off]

    def _cache(self, seq_id):
        toks = self.tokens[seq_id]
        self.bm.cache_full_blocks(seq_id, len(toks), lambda s, e: toks[s:e], self.salts[seq_id])

    @rule(prefix=st.sampled_from([(), (1, 2, 3), (1, 2, 3, 4, 5, 6), (2, 2)]),
          suffix=st.lists(st.integers(0, 2), min_size=1, max_size=8),
          salt=st.sampled_from([None, None, "t1"]))
    def admit(self, prefix, suffix, salt):
        toks = list(prefix) + suffix
        seq_id = self.next_id
        self.next_id += 1
        hits = self.bm.find_cached_blocks(toks, salt)
        assert len(hits) * self.bs < len(toks)                     # last token always computed
        free_before = self.bm.num_free_blocks
        if not self.bm.can_allocate(seq_id, len(toks), hits):
            with pytest.raises(ValueError, match="out of KV blocks"):
                self.bm.allocate(seq_id, len(toks), hits)
            assert self.bm.num_free_blocks == free_before and not self.bm.has(seq_id)
            return
        need = self.bm.blocks_needed(seq_id, len(toks), hits)
        self.bm.allocate(seq_id, len(toks), hits)
        assert free_before - self.bm.num_free_blocks == need
        self.tokens[seq_id] = toks
        self.salts[seq_id] = salt
        start = len(hits) * self.bs
        # the hit blocks already hold exactly this request's prefixes
        assert [self.memory[s] for s in self.bm.slot_mapping(seq_id, 0, start)] == \
            [tuple(toks[:p + 1]) for p in range(start)]
        self._write(seq_id, start, len(toks))
        self._cache(seq_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def append(self, data, extra):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        old = len(self.tokens[seq_id])
        n = old + len(extra)
        if not self.bm.can_allocate(seq_id, n):
            return
        self._copy(self.bm.allocate(seq_id, n))
        self.tokens[seq_id] = self.tokens[seq_id] + extra
        self._write(seq_id, old, n)
        self._cache(seq_id)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.salts[child] = self.salts[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq_id)
        del self.tokens[seq_id]

    @rule()
    def reset(self):
        self.bm.reset_prefix_cache()

    @invariant()
    def pool_accounting(self):
        if not hasattr(self, "bm"):
            return
        pool = self.bm.pool
        holders = {}
        for seq_id in self.tokens:
            for b in self.bm.block_table(seq_id):
                holders[b] = holders.get(b, 0) + 1
        free = list(pool.free_blocks)
        evictable = [b for b in free if pool.block_entry[b] is not None]
        assert len(free) == len(set(free)) and not set(free) & set(holders)
        assert (len(free) - len(evictable)) + len(evictable) + len(holders) == self.num_blocks
        for b in range(self.num_blocks):
            assert pool.refcount(b) == holders.get(b, 0)

    @invariant()
    def cached_keys_name_their_contents(self):
        if not hasattr(self, "bm"):
            return
        pool = self.bm.pool
        seen = set()
        for key, entry in pool.cached.items():
            assert entry.key == key and pool.block_entry[entry.block_id] is entry
            assert entry.block_id not in seen                        # no block under two keys
            seen.add(entry.block_id)
            parent_key = None if entry.parent is None else entry.parent.key
            assert hash_block_tokens(parent_key, entry.token_ids, entry.cache_salt) == key
            chain, e = [], entry
            while e is not None:
                chain = list(e.token_ids) + chain
                e = e.parent
            b = entry.block_id
            assert [self.memory[b * self.bs + j] for j in range(self.bs)] == \
                [tuple(chain[:len(chain) - self.bs + j + 1]) for j in range(self.bs)]
        assert sum(e is not None for e in pool.block_entry) == len(pool.cached)

    @invariant()
    def every_sequence_reads_its_own_prefixes(self):
        if not hasattr(self, "bm"):
            return
        for seq_id, toks in self.tokens.items():
            got = [self.memory[s] for s in self.bm.slot_mapping(seq_id, 0, len(toks))]
            assert got == [tuple(toks[:p + 1]) for p in range(len(toks))]

    def teardown(self):
        if hasattr(self, "bm"):
            for seq_id in list(self.tokens):
                self.bm.free(seq_id)
            assert self.bm.num_free_blocks == self.num_blocks


PrefixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                                deadline=None)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase


def test_pool_is_a_block_pool():
    pool = PrefixCachingBlockPool(3, 2)
    got = [pool.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2]
    with pytest.raises(ValueError, match="out of KV blocks"):
        pool.allocate()
    pool.decref(got[0])
    with pytest.raises(ValueError, match="double free"):
        pool.decref(got[0])
    bm = PrefixCachingBlockManager(3, 2)
    with pytest.raises(ValueError, match="only full blocks"):
        bm.prefix_cache.cache_block(0, [1], None, None)


def test_caching_off_is_the_same_manager_finding_nothing():
    """One manager: with caching off the lookup exists and finds nothing, registration is a
    no-op, and the free queue is a plain FIFO (freed blocks go to the tail)."""
    from minillm.cache.blocks import BlockManager
    bm = BlockManager(4, 2)
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", 4, lambda s, e: [1, 2, 3, 4][s:e])
    assert bm.find_cached_blocks([1, 2, 3, 4, 5]) == [] and bm.num_cached_blocks == 0
    first = bm.block_table("a")
    bm.free("a")
    assert list(bm.pool.free_blocks)[-2:] == first[::-1]
    on = PrefixCachingBlockManager(4, 2)
    on.allocate("a", 4)
    on.cache_full_blocks("a", 4, lambda s, e: [1, 2, 3, 4][s:e])
    before = (dict(on.pool.cached), list(on.pool.free_blocks), list(on.pool.refcounts))
    assert on.find_cached_blocks([1, 2, 3, 4, 5]) == on.block_table("a")
    assert before == (dict(on.pool.cached), list(on.pool.free_blocks), list(on.pool.refcounts))
