"""Draft proposers (chapter 07): who guesses the next k tokens, and with what distribution.

Every proposer answers `propose(token_ids, k, params, generator, hidden=None)` with
(draft_token_ids [k'], draft_probs [k', V] or None), k' <= k:

    NgramProposer       prompt lookup; one-hot drafts (None), free to compute
    MedusaProposer      extra decoding heads on the target's last hidden state (medusa.py)
    DraftModelProposer  a smaller model with the same tokenizer, run autoregressively k times

For a greedy request a proposer returns its argmax guesses (and None); for a sampled one it draws
each draft from q = its distribution after the request's temperature / top-k / top-p, and returns
q so the rejection sampler can correct for it.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..sampling import SamplingParams, top_k_filter, top_p_filter
from .ngram import check_lookup, ngram_propose


def final_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [R, V] -> the distributions sampling would draw from (temperature, top-k, top-p),
    the same pipeline as `minillm.sampling.sample`. [R, V] float32."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    return logits.softmax(dim=-1)


def draw(logits: torch.Tensor, params: SamplingParams, generator=None):
    """Draft tokens from draft logits [k, V]: argmax for greedy (probs None), else one sample per
    row from the final distribution. Returns (ids, probs or None)."""
    if params.greedy:
        return logits.argmax(-1).tolist(), None
    q = final_probs(logits, params)                           # [k, V]
    ids = torch.multinomial(q, 1, generator=generator).squeeze(-1).tolist()
    return ids, q


class NgramProposer:
    needs_hidden = False

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        check_lookup(1, prompt_lookup_min, prompt_lookup_max)
        self.prompt_lookup_min, self.prompt_lookup_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids, k: int, params=None, generator=None, hidden=None):
        return ngram_propose(token_ids, k, self.prompt_lookup_min, self.prompt_lookup_max), None


class MedusaProposer:
    """Heads on the target's hidden state at the position that produced the last token."""
    needs_hidden = True

    def __init__(self, model, heads):
        heads.check_model(model)
        self.model, self.heads = model, heads

    @torch.inference_mode()
    def propose(self, token_ids, k: int, params=None, generator=None, hidden=None):
        if hidden is None:
            raise ValueError("MedusaProposer needs the target's hidden state of the last position")
        logits = self.heads.logits(self.model, hidden.reshape(1, -1), k)[0]   # [k, V]
        return draw(logits, params or SamplingParams(temperature=0.0), generator)


class DraftModelProposer:
    """A separate draft model with its own contiguous KV cache (batch 1). It remembers which
    tokens its cache holds and rolls back to the longest prefix the target agreed with."""
    needs_hidden = False

    def __init__(self, draft_model, max_len: Optional[int] = None):
        from ..cache.contiguous import ContiguousKVCache
        self.model = draft_model
        cfg = draft_model.config
        self.cache = ContiguousKVCache(cfg, 1, max_len or cfg.max_position_embeddings,
                                       dtype=draft_model.dtype, device=draft_model.device)
        self.fed: list = []                                   # tokens whose K/V the cache holds

    def reset(self) -> None:
        self.cache.reset()
        self.fed = []

    @torch.inference_mode()
    def propose(self, token_ids, k: int, params=None, generator=None, hidden=None):
        params = params or SamplingParams(temperature=0.0)
        ids = list(token_ids)
        keep = 0                                              # longest common prefix
        for a, b in zip(self.fed, ids):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)                        # re-feed at least the last token
        self.cache.seq_len, self.fed = keep, ids[:keep]
        drafts, probs = [], []
        new = ids[keep:]
        dev = self.model.device
        for _ in range(k):
            logits = self.model(torch.tensor([new], device=dev), cache=self.cache,
                                last_only=True)[0]            # [1, V]
            self.fed += new
            d, q = draw(logits, params, generator)
            drafts += d
            if q is not None:
                probs.append(q[0])
            new = d
        return drafts, (torch.stack(probs) if probs else None)


def early_exit_model(model, num_layers: int):
    """A cheaper variant of `model` that shares its weights: only the first num_layers decoder
    layers, then the model's own final norm and lm_head (early exit, as in LayerSkip). Costs about
    num_layers / L of a target pass per token."""
    L = model.config.num_layers
    if not 1 <= num_layers <= L:
        raise ValueError(f"num_layers must be in [1, {L}], got {num_layers}")
    return layer_subset_model(model, list(range(num_layers)), f"exit{num_layers}")


def skip_layer_model(model, skip):
    """The target with the decoder layers in `skip` left out (self-speculative decoding by layer
    skipping, Zhang et al. 2023): same weights, same final norm and lm_head."""
    L = model.config.num_layers
    skip = set(skip)
    if not skip <= set(range(L)) or len(skip) >= L:
        raise ValueError(f"skip must be a proper subset of layers 0..{L - 1}, got {sorted(skip)}")
    return layer_subset_model(model, [i for i in range(L) if i not in skip], f"skip{len(skip)}")


def layer_subset_model(model, keep: list, tag: str = "subset"):
    import copy
    import dataclasses
    draft = copy.copy(model)
    draft._modules = dict(model._modules)                      # do not touch the target's
    draft._parameters, draft._buffers = dict(model._parameters), dict(model._buffers)
    draft.layers = torch.nn.ModuleList(model.layers[i] for i in keep)
    # layers keep their index into the KV cache, so a cache for this draft needs max(keep) + 1
    # layers (skipped ones stay empty); for early exit that is exactly the layers it runs
    draft.config = dataclasses.replace(model.config, num_layers=max(keep) + 1,
                                       name=f"{model.config.name}-{tag}")
    draft.layer_ids = list(keep)
    return draft


def check_speculative_tokens(k) -> int:
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"num_speculative_tokens must be a positive integer, got {k!r}")
    return int(k)


__all__ = ["NgramProposer", "MedusaProposer", "DraftModelProposer", "early_exit_model",
           "skip_layer_model",
           "final_probs", "draw", "check_lookup"]
