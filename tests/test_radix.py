"""Radix tree over token ids (chapter 06): match, insert with split, locks, LRU leaf eviction."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.cache.radix import RadixCache


def test_insert_splits_and_match_is_a_prefix_match():
    t = RadixCache()
    assert t.insert([1, 2, 3, 4]) == 0
    assert t.insert([1, 2, 5]) == 2                                  # shares [1, 2], splits the edge
    assert t.sequences() == [(1, 2, 3, 4), (1, 2, 5)]
    assert t.total_tokens == 5 and t.num_nodes == 3                  # [1,2] -> [3,4] | [5]
    assert t.match_prefix([1, 2, 3, 9])[0] == 3
    assert t.match_prefix([9, 1, 2, 3])[0] == 0                      # a later run is not a prefix
    assert t.match_prefix([3, 4])[0] == 0


def test_eviction_takes_lru_unlocked_leaves_first():
    t = RadixCache()
    t.insert([1, 2, 3])                                              # oldest
    t.insert([1, 2, 4, 5])
    t.insert([7, 8])
    t.match_prefix([1, 2, 3])                                        # touched: now most recent
    assert t.evict(1) == 2                                           # [4, 5] is the LRU leaf
    assert t.sequences() == [(1, 2, 3), (7, 8)]
    _, node = t.match_prefix([7, 8])
    t.lock(node)
    assert t.evict(100) == 3                                         # [3], then [1, 2]; [7, 8] locked
    assert t.sequences() == [(7, 8)] and t.evictable_tokens == 0
    t.unlock(node)
    assert t.evict(100) == 2 and t.total_tokens == 0
    with pytest.raises(ValueError, match="unlock"):
        t.unlock(node)


def test_capacity_evicts_on_insert_but_never_the_inserted_path():
    t = RadixCache(capacity_tokens=6)
    t.insert([1, 2, 3, 4])
    t.insert([1, 2, 5, 6])                                           # 6 tokens: fits
    assert t.total_tokens == 6
    t.insert([1, 2, 5, 7])                                           # needs 1 more: [3, 4] goes
    assert t.total_tokens <= 6 and (1, 2, 5, 7) in t.sequences()
    assert t.match_prefix([1, 2, 3])[0] == 2


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1, max_size=12))
def test_tree_matches_a_brute_force_prefix_set(seqs):
    t = RadixCache()
    for s in seqs:
        expected = max((_common(s, o) for o in t.sequences()), default=0)
        assert t.insert(s) == expected
    for s in seqs:
        assert t.match_prefix(s)[0] == len(s)                        # everything inserted is there
    assert t.total_tokens == sum(len(k) for k in _edges(t))
    probe = [0, 1, 2, 3, 0]
    assert t.match_prefix(probe)[0] == max(_common(probe, s) for s in seqs)


def _common(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _edges(t):
    stack = list(t.root.children.values())
    while stack:
        node = stack.pop()
        yield node.key
        stack.extend(node.children.values())
