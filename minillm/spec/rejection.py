"""The rejection sampler that makes speculative decoding exact (chapter 07).

A draft proposes k tokens d_1 .. d_k, drawing d_i from its distribution q_i. The target model
scores all k + 1 positions in one forward pass and gives its own distributions p_0 .. p_k (p_i is
the target's distribution for the token after the prefix plus d_1 .. d_i; p_k is the "bonus"
position past the last draft). Then, left to right (Leviathan et al. 2023, Chen et al. 2023):

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i))
    at the first rejection, emit a token drawn from the residual  max(0, p_i - q_i) / sum(...)
    and stop; if all k are accepted, emit a bonus token drawn from p_k.

Every emitted token is distributed exactly as the target would have sampled it: the chance of
emitting x at a position is q(x) min(1, p(x)/q(x)) + (1 - alpha) residual(x) = min(p, q)(x) +
max(0, p - q)(x) = p(x), where alpha = sum_x min(p(x), q(x)) is the acceptance probability.
A draft that gives no probabilities (n-gram lookup) is a one-hot q: accept d with probability
p(d), otherwise sample from p with d removed and renormalised.

Greedy requests (temperature 0) take the exact-match path instead: accept while the draft equals
the target's argmax, then emit the argmax at the first mismatch (or the bonus position). The
output is then token for token what plain greedy decoding gives.

`verify` is the one entry point the batch-1 loop (spec/loop.py) and the engine
(engine/spec_decode.py) call: it picks the rule from the request's SamplingParams and turns the
target's logits into final distributions with `minillm.sampling.probs`, the pipeline `sample` uses.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..sampling import SamplingParams, draw_from, probs, sample


def _check(target_probs: torch.Tensor, draft_token_ids, draft_probs) -> tuple:
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 2:
        raise ValueError("target_probs must be a tensor [k + 1, vocab] of probabilities, got "
                         f"{getattr(target_probs, 'shape', type(target_probs).__name__)}")
    ids = [int(t) for t in (draft_token_ids.tolist() if isinstance(draft_token_ids, torch.Tensor)
                            else draft_token_ids)]
    k, V = len(ids), target_probs.shape[1]
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows for {k} draft tokens; "
                         "it needs k + 1 (one per draft position plus the bonus position)")
    if any(not 0 <= t < V for t in ids):
        raise ValueError(f"draft token ids must lie in [0, {V}), got {ids}")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, V):
        raise ValueError(f"draft_probs must be [k, vocab] = [{k}, {V}], got "
                         f"{tuple(draft_probs.shape)}; pass None for a draft without "
                         "probabilities (one-hot, e.g. n-gram lookup)")
    return ids, k


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(0, p - q), normalised: where the target wants more mass than the draft gave. [V]."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    if total <= 0:              # p == q: a rejection has probability 0; any valid dist will do
        return p / p.sum()
    return r / total


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: Sequence[int],
                     draft_probs: Optional[torch.Tensor] = None,
                     generator: Optional[torch.Generator] = None) -> list:
    """One sequence's verification. target_probs [k + 1, V]: the target's final sampling
    distributions (after temperature / top-k / top-p) at the k draft positions and the bonus
    position; draft_token_ids [k]; draft_probs [k, V] or None (a one-hot draft). Returns the
    emitted token ids: the accepted drafts, then one more (a residual sample or the bonus), so
    1 .. k + 1 tokens."""
    ids, k = _check(target_probs, draft_token_ids, draft_probs)
    p_all = target_probs.double()
    device = p_all.device
    emitted = []
    for i, d in enumerate(ids):
        p = p_all[i]                                           # [V]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[d] = 1.0                                         # one-hot draft
        else:
            q = draft_probs[i].to(device=device, dtype=torch.float64)
        u = torch.rand((), generator=generator, device=device, dtype=torch.float64)
        # accept with probability min(1, p/q); u < p/q avoids dividing by q(d) = 0
        if q[d] > 0 and u * q[d] < p[d]:
            emitted.append(d)
            continue
        r = residual(p, q)
        emitted.append(int(draw_from(r[None], generator)))
        return emitted
    emitted.append(int(draw_from(p_all[k][None], generator)))             # bonus
    return emitted


def greedy_accept(target_argmax: Sequence[int], draft_token_ids: Sequence[int]) -> list:
    """The exact-match path for greedy requests. target_argmax [k + 1]: the target's argmax at
    each draft position and the bonus position. Accept drafts while they equal the argmax; then
    emit the argmax where they first differ (or the bonus argmax). Returns 1 .. k + 1 ids."""
    tgt = [int(t) for t in target_argmax]
    drafts = [int(t) for t in draft_token_ids]
    if len(tgt) != len(drafts) + 1:
        raise ValueError(f"target_argmax needs k + 1 = {len(drafts) + 1} entries, got {len(tgt)}")
    emitted = []
    for d, t in zip(drafts, tgt):
        if d != t:
            break
        emitted.append(d)
    emitted.append(tgt[len(emitted)])
    return emitted


def verify(logits: torch.Tensor, draft_token_ids: Sequence[int],
           draft_probs: Optional[torch.Tensor], params: SamplingParams,
           generator: Optional[torch.Generator] = None) -> list:
    """One sequence's verification. logits [1 + k, V]: the target's logits at the last sampled
    token and at the k drafts; draft_token_ids [k]; draft_probs [k, V] or None (one-hot drafts).
    Returns the emitted ids, 1 .. k + 1: exact match for greedy (`greedy_accept`), the rejection
    sampler on `probs(logits, params)` otherwise. With no drafts it is plain `sample`, so a step
    without drafts draws exactly what decoding without speculation draws."""
    if len(draft_token_ids) == 0:
        return [int(sample(logits[-1:], params, generator))]
    if params.greedy:
        return greedy_accept(logits.float().argmax(dim=-1).tolist(), draft_token_ids)
    return rejection_sample(probs(logits, params), draft_token_ids, draft_probs, generator)
