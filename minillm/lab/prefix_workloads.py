"""Seeded shared-prefix traces for chapter 06 (token ids, no tokenizer needed).

Prefix caching pays off when many prompts start with the same tokens. Two shapes cover most
of it in practice:

* `shared_prefix_prompts`: groups of requests that share a system prompt (or few-shot examples,
  or a long document) and differ in a short question. With G groups of P prompts, a system
  prompt of S tokens and questions of Q tokens, the best possible token hit rate is
  (P - 1) * S / (P * (S + Q)): every group's first prompt misses, the others reuse S tokens
  (rounded down to full blocks in a paged cache). `prompts_for_hit_rate` picks S for a target.
* `multi_turn_chat`: conversations whose turn k re-sends turns 1 .. k-1 plus the model's
  answers, so each turn's prompt extends the previous turn's prompt and answer.

Token ids are drawn from [first_id, vocab_size) with a seeded numpy generator, so the same
arguments give the same trace everywhere.
"""
from __future__ import annotations

import numpy as np


def _tokens(rng, n: int, vocab_size: int, first_id: int) -> list:
    return rng.integers(first_id, vocab_size, size=n).tolist()


def shared_prefix_prompts(num_groups: int, prompts_per_group: int, system_len: int,
                          question_len: int, vocab_size: int, seed: int = 0,
                          first_id: int = 10, interleave: bool = True) -> list:
    """num_groups * prompts_per_group prompts; group g's all start with the same system_len
    tokens. interleave=True orders them g0q0, g1q0, ..., g0q1, g1q1, ... (the groups' first
    prompts first); False keeps each group together."""
    if min(num_groups, prompts_per_group, question_len) < 1 or system_len < 0:
        raise ValueError("num_groups, prompts_per_group and question_len must be >= 1 and "
                         "system_len >= 0")
    rng = np.random.default_rng(seed)
    systems = [_tokens(rng, system_len, vocab_size, first_id) for _ in range(num_groups)]
    grid = [[systems[g] + _tokens(rng, question_len, vocab_size, first_id)
             for _ in range(prompts_per_group)] for g in range(num_groups)]
    if interleave:
        return [grid[g][q] for q in range(prompts_per_group) for g in range(num_groups)]
    return [p for group in grid for p in group]


def ideal_hit_rate(prompts_per_group: int, system_len: int, question_len: int,
                   block_size: int = 1) -> float:
    """The token hit rate of shared_prefix_prompts if nothing is evicted: the first prompt of a
    group misses, the others hit the system prompt's full blocks (never the last token)."""
    shared = min(system_len, system_len + question_len - 1) // block_size * block_size
    return (prompts_per_group - 1) * shared / (prompts_per_group * (system_len + question_len))


def system_len_for_hit_rate(hit_rate: float, prompts_per_group: int, question_len: int) -> int:
    """The system prompt length that gives about `hit_rate` with ideal_hit_rate (block size 1)."""
    frac = hit_rate * prompts_per_group / (prompts_per_group - 1) if prompts_per_group > 1 else 0
    if not 0 <= frac < 1:
        raise ValueError(f"hit rate {hit_rate} is out of reach with {prompts_per_group} prompts "
                         f"per group; the most is "
                         f"{(prompts_per_group - 1) / prompts_per_group:.2f}")
    return round(frac * question_len / (1 - frac))


def multi_turn_chat(num_conversations: int, num_turns: int, user_len: int, answer_len: int,
                    vocab_size: int, seed: int = 0, system_len: int = 0, first_id: int = 10):
    """Conversations as [turn][conversation] prompts: turn k's prompt = system + (user_1,
    answer_1, ..., user_k). The answers are fixed tokens here (a replay of a recorded chat), so
    the trace does not depend on a model. Returns (prompts_by_turn, answers_by_turn)."""
    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_len, vocab_size, first_id)
    history = [list(system) for _ in range(num_conversations)]
    prompts, answers = [], []
    for _ in range(num_turns):
        turn_prompts, turn_answers = [], []
        for c in range(num_conversations):
            history[c] += _tokens(rng, user_len, vocab_size, first_id)
            turn_prompts.append(list(history[c]))
            answer = _tokens(rng, answer_len, vocab_size, first_id)
            turn_answers.append(answer)
            history[c] += answer
        prompts.append(turn_prompts)
        answers.append(turn_answers)
    return prompts, answers


__all__ = ["shared_prefix_prompts", "ideal_hit_rate", "system_len_for_hit_rate",
           "multi_turn_chat"]
