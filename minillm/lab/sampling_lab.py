"""Lab equipment for chapter 08 section 8 (logprobs, sampling parameters, grammars).

    choice_scores(llm, question, choices)     log P(choice | question) per choice, from the
                                              engine's prompt logprobs (what lm-eval computes)
    kept_by_setting(logits, settings)         how many tokens each sampling setting leaves
    TimedGrammar(grammar)                     wraps a request's grammar: the time of each mask
                                              and how many tokens it allowed
"""
from __future__ import annotations

import time

import torch

from ..sampling import SamplingParams, apply_penalties, min_p_filter, top_k_filter, top_p_filter


def choice_scores(llm, context: str, choices: list) -> list:
    """Sum of the log-probabilities of each choice's tokens after `context`, read from the
    engine's prompt logprobs of context + choice (one request per choice, one batch)."""
    tok = llm.tokenizer
    ctx = tok.encode(context, add_special_tokens=False)
    prompts = [ctx + tok.encode(c, add_special_tokens=False) for c in choices]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    return [sum(d[t].logprob for d, t in zip(o.prompt_logprobs[len(ctx):],
                                             o.prompt_token_ids[len(ctx):]))
            for o in outs]


def kept_by_setting(logits: torch.Tensor, settings: dict, prompt_ids=(), output_ids=()) -> dict:
    """{name: number of tokens with nonzero probability} for each SamplingParams in settings,
    on one row of raw logits [V] (penalties, temperature, min-p, top-k, top-p: sampling.py's
    order)."""
    out = {}
    for name, p in settings.items():
        x = apply_penalties(logits[None].clone().float(), p, list(prompt_ids), list(output_ids))
        x = x / max(p.temperature, 1e-5)
        x = top_p_filter(top_k_filter(min_p_filter(x, p.min_p), p.top_k), p.top_p)
        out[name] = int(torch.isfinite(x).sum())
    return out


class TimedGrammar:
    """A request's grammar with the time of every mask computation recorded (seconds)."""

    def __init__(self, grammar):
        self.grammar, self.times, self.allowed_counts = grammar, [], []
        self.active = True

    def allowed(self, vocab_size: int):
        t = time.perf_counter()
        mask = self.grammar.allowed(vocab_size)
        self.times.append(time.perf_counter() - t)
        self.allowed_counts.append(int(mask.sum()))
        return mask

    def accept(self, token: int) -> None:
        self.grammar.accept(token)

    def fork(self):
        return TimedGrammar(self.grammar.fork())
