"""Logprobs in the two OpenAI wire shapes (chapter 08).

The engine reports, per token, {token id: Logprob(logprob, rank, decoded_token)}: the token
itself and the k most likely tokens of the raw model distribution (SamplingParams.logprobs = k).
The two endpoints lay that out differently:

    /v1/completions (legacy):  {"tokens": [str], "token_logprobs": [float | None],
                                "top_logprobs": [{str: float} | None], "text_offset": [int]}
        with echo the prompt's tokens come first, the very first with None (nothing predicts
        it); top_logprobs holds the k best and the chosen token (vLLM's layout), so a scorer
        can test "was the continuation greedy?" by comparing with max(top.values()).
    /v1/chat/completions:      {"content": [{"token", "logprob", "bytes",
                                             "top_logprobs": [{"token", "logprob", "bytes"}]}]}
        top_logprobs holds exactly the k best, most likely first.
"""
from __future__ import annotations

from typing import Callable, Optional


def completion_logprobs(entries: list, token_ids: list, offset: int,
                        decode_token: Callable[[int], str]) -> dict:
    """entries[i] is {id: Logprob} for token_ids[i], or None (the first prompt token);
    `offset` is the character position of the first token in the choice's text."""
    tokens, lps, tops, offsets = [], [], [], []
    for entry, t in zip(entries, token_ids):
        text = entry[t].decoded_token if entry else decode_token(t)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        lps.append(entry[t].logprob if entry else None)
        tops.append({lp.decoded_token: lp.logprob for lp in entry.values()} if entry else None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def _token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list, token_ids: list, k: int) -> Optional[dict]:
    """The chat shape for these tokens; k = top_logprobs."""
    content = []
    for entry, t in zip(entries, token_ids):
        best = sorted((lp for lp in entry.values() if lp.rank <= k), key=lambda lp: lp.rank)
        content.append({**_token(entry[t].decoded_token, entry[t].logprob),
                        "top_logprobs": [_token(lp.decoded_token, lp.logprob)
                                         for lp in best[:k]]})
    return {"content": content}


__all__ = ["completion_logprobs", "chat_logprobs"]
