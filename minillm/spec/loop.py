"""Speculative decoding in a batch-1 loop (chapter 07): draft k, verify k + 1, keep what matches.

The same contiguous-cache loop as chapter 00's `generate`, except that each target forward takes
the last token plus k drafted tokens and returns logits at all k + 1 positions:

    propose   proposer.propose([DraftRequest(tokens, k, ...)])  -> Draft(ids [k'], probs, state)
    score     model([last token] + ids)                          -> logits [1 + k', V]
    verify    rejection.verify (exact match for greedy, the rejection sampler otherwise)
                                                                 -> 1 .. k' + 1 emitted tokens
    roll back cache.seq_len forgets the rejected positions; their slots are overwritten next time

The proposers are the engine's own objects (proposers.py) asked for a batch of one, and the
loop keeps the proposer's per-sequence state (Draft.state) the way the engine keeps it on each
Request. The engine does the same per request inside a ragged batch (minillm/engine/spec_decode.py).
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ..cache.contiguous import ContiguousKVCache
from ..engine.spec_decode import Draft, DraftRequest, check_drafts
from ..generate import _check_room, encode_prompt, eos_token_id, stop_reason
from ..model import capture_features, capture_hidden
from ..sampling import SamplingParams, make_generator, probs, sample
from .rejection import verify
from .stats import SpecStats


@torch.inference_mode()
def speculative_generate(model, tok, prompt, proposer=None, num_speculative_tokens: int = 4,
                         max_new_tokens: int = 32, sampling: Optional[SamplingParams] = None,
                         stats: Optional[SpecStats] = None) -> list:
    """The new token ids, like `minillm.generate`; proposer=None is plain decoding (one token per
    target forward). `proposer` is any of spec/proposers.py (the objects the engine uses), asked
    for a batch of one DraftRequest per round. This call's num_speculative_tokens wins over the
    proposer's own `num_speculative_tokens` (that one is what the engine asks for); a Medusa
    proposer still refuses more drafts than it has heads. Pass `stats` (a SpecStats) to collect
    acceptance counts."""
    sampling = sampling or SamplingParams(temperature=0.0)
    stats = stats if stats is not None else SpecStats()
    t0 = time.perf_counter()
    input_ids = encode_prompt(model, tok, prompt)                  # [1, T]
    T = input_ids.shape[1]
    _check_room(model, T, max_new_tokens)
    k_max = _check_k(num_speculative_tokens) if proposer is not None else 0
    cache = ContiguousKVCache(model.config, 1, min(T + max_new_tokens + k_max,
                                                   model.config.max_position_embeddings),
                              dtype=model.dtype, device=model.device)
    gen, eos = make_generator(sampling.seed, model.device), eos_token_id(tok)
    needs_hidden = proposer is not None and proposer.needs_hidden
    needs_features = proposer is not None and proposer.needs_features        # EAGLE
    with capture_hidden(model, needs_hidden) as cap, \
            capture_features(model, needs_features) as fcap:
        logits = model(input_ids, cache=cache, last_only=True)     # prefill [1, 1, V]
    stats.num_target_forwards += 1
    hidden = cap.value[0, -1] if needs_hidden else None            # [C]
    feats = model.norm(fcap.value[0]) if needs_features else None  # [T, C] every position
    out = [int(sample(logits[:, -1], sampling, gen))]
    tokens = input_ids[0].tolist() + out
    state = None                                  # the proposer's state for this sequence
    while not stop_reason(sampling, out, eos, max_new_tokens):
        k = min(k_max, max_new_tokens - len(out) - 1)
        draft = Draft([], None, state)
        if k > 0:
            td = time.perf_counter()
            ask = [DraftRequest(list(tokens), k, sampling, gen, hidden, state, feats)]
            draft = check_drafts(ask, proposer.propose(ask), proposer)[0]
            state = draft.state
            stats.draft_time += time.perf_counter() - td
        x = torch.tensor([[tokens[-1]] + list(draft.token_ids)], device=model.device)  # [1, 1 + k']
        start = cache.seq_len
        with capture_hidden(model, needs_hidden) as cap, \
                capture_features(model, needs_features) as fcap:
            logits = model(x, cache=cache)[0]                      # [1 + k', V]
        stats.num_target_forwards += 1
        emitted = verify(logits, draft.token_ids, draft.probs, sampling, gen)
        accepted = len(emitted) - 1
        stats.record(len(draft.token_ids), accepted)
        cache.seq_len = start + 1 + accepted                       # roll back rejected positions
        if needs_hidden:
            hidden = cap.value[0, accepted]                        # [C] row of the last emitted
        if needs_features:                                         # the kept positions' features
            feats = model.norm(fcap.value[0, :accepted + 1])       # [accepted + 1, C]
        for t in emitted:
            out.append(t)
            tokens.append(t)
            if stop_reason(sampling, out, eos, max_new_tokens):
                break
    stats.num_emitted_tokens += len(out)
    stats.total_time += time.perf_counter() - t0
    return out


@torch.inference_mode()
def tree_generate(model, tok, prompt, proposer, num_speculative_tokens: int = 4,
                  max_new_tokens: int = 32, branches: int = 2,
                  stats: Optional[SpecStats] = None, side_depth: Optional[int] = None,
                  sampling: Optional[SamplingParams] = None) -> list:
    """Decoding with EAGLE TREE drafts (tree.py), batch 1: the drafter's top `branches` first
    tokens, the first continued to depth k and the others to `side_depth` (default k;
    `eagle.draft_tree`), verified in ONE target forward with the tree mask and per-node
    positions; the longest branch the target accepts is kept (its K/V compacted, the rest
    dropped). Greedy (sampling None or temperature 0): the same new token ids as plain greedy
    decoding. Sampled: the tree is still the drafter's top-ranked tokens, a deterministic
    function of the context, so each child is a one-hot draft: `accept_walk` accepts it with
    the target's probability and otherwise removes it from the target's distribution before the
    next sibling (exact at any temperature: `static_tree_outcomes`)."""
    from .eagle import draft_tree, new_state
    from .tree import accept_walk, compact, tree_forward
    stats = stats if stats is not None else SpecStats()
    t0 = time.perf_counter()
    input_ids = encode_prompt(model, tok, prompt)                  # [1, T]
    T = input_ids.shape[1]
    k = _check_k(num_speculative_tokens)
    _check_room(model, T, max_new_tokens + branches * k)
    cache = ContiguousKVCache(model.config, 1, T + max_new_tokens + branches * k + 1,
                              dtype=model.dtype, device=model.device)
    sampling = sampling or SamplingParams(temperature=0.0)
    eos, gen = eos_token_id(tok), make_generator(sampling.seed, model.device)
    with capture_features(model) as fcap:
        logits = model(input_ids, cache=cache, last_only=True)     # prefill [1, 1, V]
    feats = model.norm(fcap.value[0])                              # [T, C]
    out = [int(sample(logits[:, -1], sampling, gen))]
    tokens = input_ids[0].tolist() + out
    state = new_state(proposer.drafter, T + max_new_tokens + k + 1)
    stats.num_target_forwards += 1
    while not stop_reason(sampling, out, eos, max_new_tokens):
        kk = min(k, max_new_tokens - len(out) - 1)
        td = time.perf_counter()
        if kk > 0:
            nodes, parents = draft_tree(proposer.drafter, model, state, tokens, feats, kk,
                                        branches, proposer.reduced,
                                        None if side_depth is None else min(side_depth, kk))
        else:
            nodes, parents = [tokens[-1]], [-1]
        stats.draft_time += time.perf_counter() - td
        start = cache.seq_len
        with capture_features(model) as fcap:
            logits = tree_forward(model, cache, nodes, parents)     # [n, V]
        stats.num_target_forwards += 1
        if sampling.greedy:
            emitted, path = accept_walk(logits, nodes, parents, greedy=True)
        else:                                                      # one-hot drafts: q None
            emitted, path = accept_walk(probs(logits, sampling), nodes, parents,
                                        generator=gen)
        stats.record(len(nodes) - 1, len(emitted) - 1, depth=kk, path=path)
        compact(cache, start, path)
        feats = model.norm(fcap.value[0, path])                    # [len(path), C]
        for t in emitted:
            out.append(t)
            tokens.append(t)
            if stop_reason(sampling, out, eos, max_new_tokens):
                break
    stats.num_emitted_tokens += len(out)
    stats.total_time += time.perf_counter() - t0
    return out


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_speculative_tokens must be a positive integer, got {k!r}; "
                         "pass proposer=None for plain decoding")
    return k
