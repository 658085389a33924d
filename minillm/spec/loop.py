"""Speculative decoding in a batch-1 loop (chapter 07): draft k, verify k + 1, keep what matches.

The same contiguous-cache loop as chapter 00's `generate`, except that each target forward takes
the last token plus k drafted tokens and returns logits at all k + 1 positions. The rejection
sampler (or, for greedy, the exact-match rule) decides how many drafts survive; the cache simply
forgets the rejected positions (`cache.seq_len` moves back), and their slots are overwritten
next time. The engine does the same per request inside a ragged batch (minillm/engine/spec_decode.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..cache.contiguous import ContiguousKVCache
from ..generate import _check_room, encode_prompt, eos_token_id, stop_reason
from ..sampling import SamplingParams, make_generator, sample
from .medusa import capture_hidden
from .proposers import final_probs
from .rejection import greedy_accept, rejection_sample


@dataclass
class SpecStats:
    """Counts of one or many speculative runs (vLLM's names where it has them)."""
    num_drafts: int = 0                       # verification passes that carried >= 1 draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_target_forwards: int = 0              # prefill + plain decodes + verifications
    num_emitted_tokens: int = 0
    accepted_per_position: list = field(default_factory=list)   # position i: accepted drafts
    drafted_per_position: list = field(default_factory=list)    # position i: proposed drafts
    draft_time: float = 0.0
    total_time: float = 0.0

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for lst in (self.drafted_per_position, self.accepted_per_position):
            lst.extend([0] * (num_drafted - len(lst)))        # one entry per draft position
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification pass that carried drafts: accepted + 1 (the bonus or
        the correction)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_by_position(self) -> list:
        """P(draft i accepted | draft i proposed), i = 0 .. k-1."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position,
                                                    self.drafted_per_position)]

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length,
                "acceptance_by_position": self.acceptance_by_position,
                "num_target_forwards": self.num_target_forwards,
                "num_emitted_tokens": self.num_emitted_tokens}


@torch.inference_mode()
def speculative_generate(model, tok, prompt, proposer=None, num_speculative_tokens: int = 4,
                         max_new_tokens: int = 32, sampling: Optional[SamplingParams] = None,
                         stats: Optional[SpecStats] = None) -> list:
    """The new token ids, like `minillm.generate`; proposer=None is plain decoding (one token per
    target forward). Pass `stats` (a SpecStats) to collect acceptance counts."""
    sampling = sampling or SamplingParams(temperature=0.0)
    stats = stats if stats is not None else SpecStats()
    t0 = time.perf_counter()
    input_ids = encode_prompt(model, tok, prompt)                  # [1, T]
    T = input_ids.shape[1]
    _check_room(model, T, max_new_tokens)
    k_max = num_speculative_tokens if proposer is not None else 0
    cache = ContiguousKVCache(model.config, 1, min(T + max_new_tokens + k_max,
                                                   model.config.max_position_embeddings),
                              dtype=model.dtype, device=model.device)
    gen = make_generator(sampling.seed, model.device)
    eos = eos_token_id(tok)
    if hasattr(proposer, "reset"):
        proposer.reset()
    needs_hidden = getattr(proposer, "needs_hidden", False)
    with capture_hidden(model, needs_hidden) as cap:
        logits = model(input_ids, cache=cache, last_only=True)     # prefill [1, 1, V]
    stats.num_target_forwards += 1
    hidden = cap.value[0, -1] if needs_hidden else None            # [C]
    out = [int(sample(logits[:, -1], sampling, gen))]
    tokens = input_ids[0].tolist() + out
    while not stop_reason(sampling, out, eos, max_new_tokens):
        k = min(k_max, max_new_tokens - len(out) - 1)
        drafts, q = [], None
        if k > 0:
            td = time.perf_counter()
            drafts, q = proposer.propose(tokens, k, sampling, gen, hidden=hidden)
            stats.draft_time += time.perf_counter() - td
        x = torch.tensor([[tokens[-1]] + list(drafts)], device=model.device)   # [1, 1 + k']
        start = cache.seq_len
        with capture_hidden(model, needs_hidden) as cap:
            logits = model(x, cache=cache)[0]                      # [1 + k', V]
        stats.num_target_forwards += 1
        if not drafts:
            emitted = [int(sample(logits[-1:], sampling, gen))]
        elif sampling.greedy:
            emitted = greedy_accept(logits.argmax(-1).tolist(), drafts)
        else:
            emitted = rejection_sample(final_probs(logits, sampling), drafts, q, gen)
        accepted = len(emitted) - 1
        stats.record(len(drafts), accepted)
        cache.seq_len = start + 1 + accepted                       # roll back rejected positions
        if needs_hidden:
            hidden = cap.value[0, accepted]
        for t in emitted:
            out.append(t)
            tokens.append(t)
            if stop_reason(sampling, out, eos, max_new_tokens):
                break
    stats.num_emitted_tokens += len(out)
    stats.total_time += time.perf_counter() - t0
    return out
