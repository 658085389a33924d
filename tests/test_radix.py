"""Radix tree over token ids (chapter 06): match, insert with split, locks, LRU leaf eviction."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.lab.radix import RadixCache


def test_insert_splits_and_match_is_a_prefix_match():
    t = RadixCache()
    assert t.insert([1, 2, 3, 4]) == 0
    assert t.insert([1, 2, 5]) == 2                  # shares [1, 2], splits the edge
    assert t.sequences() == [(1, 2, 3, 4), (1, 2, 5)]
    assert t.total_tokens == 5 and t.num_nodes == 3  # [1,2] -> [3,4] | [5]
    assert t.match_prefix([1, 2, 3, 9])[0] == 3
    assert t.match_prefix([9, 1, 2, 3])[0] == 0      # a later run is not a prefix
    assert t.match_prefix([3, 4])[0] == 0


def test_eviction_takes_lru_unlocked_leaves_first():
    t = RadixCache()
    t.insert([1, 2, 3])                              # oldest
    t.insert([1, 2, 4, 5])
    t.insert([7, 8])
    t.match_prefix([1, 2, 3])                        # touched: now most recent
    assert t.evict(1) == 2                           # [4, 5] is the LRU leaf
    assert t.sequences() == [(1, 2, 3), (7, 8)]
    _, node = t.match_prefix([7, 8])
    t.lock(node)
    assert t.evict(100) == 3                         # [3], then [1, 2]; [7, 8] locked
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


# --- replays: the two indexes on the same traces -----------------------------------------------

def test_radix_hits_equal_hash_chain_at_block_size_1_and_beat_block_16():
    from minillm.lab.prefix_sim import replay_hash_chain, replay_radix
    from minillm.lab.prefix_workloads import ideal_hit_rate, shared_prefix_prompts
    prompts = shared_prefix_prompts(3, 5, system_len=21, question_len=6, vocab_size=50, seed=1)
    radix, bs1, bs16 = (replay_radix(prompts), replay_hash_chain(prompts, 1),
                        replay_hash_chain(prompts, 16))
    assert radix.hit_tokens == bs1.hit_tokens > bs16.hit_tokens > 0
    assert bs16.hit_rate == pytest.approx(ideal_hit_rate(5, 21, 6, 16))
    assert bs16.index_entries < radix.index_entries < bs1.index_entries
    assert radix.index_bytes < bs1.index_bytes


def test_longest_prefix_first_keeps_more_hits_under_memory_pressure():
    from minillm.lab.prefix_sim import replay_radix
    a, b = [1] * 30, [2] * 30
    queue = [a + [i] for i in range(3)] + [b + [i] for i in range(3)]
    queue = [queue[i] for i in (0, 3, 1, 4, 2, 5)]                   # groups alternate
    fcfs = replay_radix(queue, capacity_tokens=40, batch_size=1, policy="fcfs")
    lpm = replay_radix(queue, capacity_tokens=40, batch_size=1, policy="lpm")
    assert lpm.hit_tokens > fcfs.hit_tokens
    with pytest.raises(ValueError, match="policy"):
        replay_radix(queue, policy="random")


def test_match_without_touch_changes_nothing():
    t = RadixCache()
    t.insert([1, 2, 3, 4])
    before = (t.num_nodes, t.root.children[1].last_access)
    assert t.match_prefix([1, 2, 9], touch=False)[0] == 2
    assert (t.num_nodes, t.root.children[1].last_access) == before
