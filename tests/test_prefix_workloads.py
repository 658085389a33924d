"""Shared-prefix traces (chapter 06): seeded, shaped as documented, hit rates as predicted."""
import pytest

from minillm.lab.prefix_workloads import (ideal_hit_rate, multi_turn_chat, shared_prefix_prompts,
                                      system_len_for_hit_rate)


def test_shared_prefix_prompts_shape_and_sharing():
    ps = shared_prefix_prompts(3, 4, system_len=10, question_len=5, vocab_size=100, seed=0)
    assert len(ps) == 12 and all(len(p) == 15 for p in ps)
    assert ps == shared_prefix_prompts(3, 4, 10, 5, 100, seed=0)     # seeded
    groups = [ps[i::3] for i in range(3)]                             # interleaved
    for g in groups:
        assert len({tuple(p[:10]) for p in g}) == 1 and len({tuple(p[10:]) for p in g}) == 4
    assert len({tuple(g[0][:10]) for g in groups}) == 3
    together = shared_prefix_prompts(3, 4, 10, 5, 100, seed=0, interleave=False)
    assert sorted(map(tuple, together)) == sorted(map(tuple, ps))
    with pytest.raises(ValueError):
        shared_prefix_prompts(0, 4, 10, 5, 100)


def test_hit_rate_arithmetic():
    assert ideal_hit_rate(4, 12, 4) == pytest.approx(3 * 12 / (4 * 16))
    assert ideal_hit_rate(4, 12, 4, block_size=8) == pytest.approx(3 * 8 / (4 * 16))
    assert ideal_hit_rate(4, 16, 0 + 1, block_size=16) == pytest.approx(3 * 16 / (4 * 17))
    s = system_len_for_hit_rate(0.8, prompts_per_group=10, question_len=20)
    assert ideal_hit_rate(10, s, 20) == pytest.approx(0.8, abs=0.01)
    with pytest.raises(ValueError, match="out of reach"):
        system_len_for_hit_rate(0.95, prompts_per_group=10, question_len=20)


def test_multi_turn_prompts_extend_the_previous_turn():
    prompts, answers = multi_turn_chat(2, 3, user_len=4, answer_len=3, vocab_size=50, seed=0,
                                       system_len=5)
    for c in range(2):
        for t in range(1, 3):
            prev = prompts[t - 1][c] + answers[t - 1][c]
            assert prompts[t][c][:len(prev)] == prev and len(prompts[t][c]) == len(prev) + 4
        assert prompts[0][c][:5] == prompts[0][1 - c][:5]            # shared system prompt
