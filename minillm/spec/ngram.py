"""N-gram prompt lookup (chapter 07): a draft that costs nothing and has no probabilities.

Take the last n tokens of the sequence (the prompt plus everything generated so far), find the
most recent earlier place where the same n tokens occur, and propose the tokens that followed
them there. Try the longest n first (prompt_lookup_max), down to prompt_lookup_min; the first n
that matches wins. It shines when the output copies from the input (quoting, editing code,
summaries that reuse phrases) and proposes nothing in open-ended chat.

vLLM calls this method "ngram" with the same two knobs (prompt_lookup_min / prompt_lookup_max).
Its proposals are one-hot drafts for the rejection sampler (draft_probs=None).
"""
from __future__ import annotations

from typing import Sequence


def ngram_propose(token_ids: Sequence[int], k: int, prompt_lookup_min: int = 1,
                  prompt_lookup_max: int = 4) -> list:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, for the largest n in [prompt_lookup_min, prompt_lookup_max] that occurs. [] if none."""
    check_lookup(k, prompt_lookup_min, prompt_lookup_max)
    ids = list(token_ids)
    N = len(ids)
    for n in range(min(prompt_lookup_max, N - 1), prompt_lookup_min - 1, -1):
        suffix = ids[N - n:]
        # the match may start anywhere before the suffix itself: start + n <= N - 1
        for start in range(N - n - 1, -1, -1):                # latest occurrence first
            if ids[start:start + n] == suffix:
                follow = ids[start + n:start + n + k]
                if follow:
                    return follow
    return []


def check_lookup(k: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
    if int(k) != k or k < 1:
        raise ValueError(f"num_speculative_tokens must be a positive integer, got {k}")
    if int(prompt_lookup_min) != prompt_lookup_min or prompt_lookup_min < 1:
        raise ValueError(f"prompt_lookup_min must be a positive integer, got {prompt_lookup_min}")
    if prompt_lookup_max < prompt_lookup_min:
        raise ValueError(f"prompt_lookup_min ({prompt_lookup_min}) > prompt_lookup_max "
                         f"({prompt_lookup_max}); set prompt_lookup_min <= prompt_lookup_max")
