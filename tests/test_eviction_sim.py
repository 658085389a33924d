"""The eviction-policy replay of chapter 06 (minillm.lab.eviction_sim): plain LRU loses a hot
shared prefix to a burst of one-off prompts larger than the cache, a segmented LRU keeps it;
with room for everything both equal the engine's own block cache."""
import pytest

from minillm.lab.eviction_sim import replay_eviction, scan_trace
from minillm.lab.prefix_sim import replay_hash_chain
from minillm.lab.prefix_workloads import shared_prefix_prompts


def hot_hit_share(result, is_hot, system_len=256):
    hits = [h for h, hot in zip(result.per_prompt_hits, is_hot) if hot]
    return sum(hits) / (len(hits) * system_len)


def test_a_scan_larger_than_the_cache_evicts_the_hot_prefix_under_lru_only():
    prompts, is_hot = scan_trace(rounds=4, hot_per_round=3, scan_per_round=10)
    lru = replay_eviction(prompts, 16, 200, "lru")        # a burst is 10 x 32 = 320 blocks
    slru = replay_eviction(prompts, 16, 200, "slru")
    assert hot_hit_share(lru, is_hot) == pytest.approx(2 / 3)      # every round's first misses
    assert hot_hit_share(slru, is_hot) == pytest.approx(11 / 12)   # only the very first misses
    roomy = [replay_eviction(prompts, 16, 2000, p) for p in ("lru", "slru")]
    assert hot_hit_share(roomy[0], is_hot) == hot_hit_share(roomy[1], is_hot) == \
        pytest.approx(11 / 12)                                      # no pressure: no difference


def test_without_pressure_the_replay_counts_hits_like_the_engine_block_cache():
    prompts = shared_prefix_prompts(3, 4, system_len=40, question_len=9, vocab_size=500, seed=1)
    for policy in ("lru", "slru"):
        assert replay_eviction(prompts, 8, 10_000, policy).hit_tokens == \
            replay_hash_chain(prompts, 8).hit_tokens


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="policy"):
        replay_eviction([[1, 2]], 4, 10, "fifo")
    with pytest.raises(ValueError, match="protected_fraction"):
        replay_eviction([[1, 2]], 4, 10, "slru", protected_fraction=1.0)
