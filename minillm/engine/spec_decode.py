"""Speculative decoding inside the engine (chapter 07).

    llm = minillm.LLM("smollm2-135m", speculative_config={
        "method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_min": 2, "prompt_lookup_max": 4})

How a step changes (the rest of the engine is chapter 04's):
  1. After a request samples, the proposer guesses its next k tokens (`req.spec_token_ids`).
  2. The scheduler gives a decoding request 1 + k tokens instead of 1: its last sampled token
     plus the drafts, within the token budget and only when blocks are free (drafts never cause a
     preemption). They join the same ragged batch as everyone's prefill chunks and decodes.
  3. The model runner returns logits at all 1 + k positions of such a request; the target's
     verification runs through the paged prefill path like any multi-token chunk.
  4. `verify` keeps the accepted drafts plus one token (exact match for greedy, the rejection
     sampler otherwise), then rolls back: num_computed_tokens forgets the rejected positions and
     blocks that hold only rejected positions go back to the pool.

Methods (vLLM's names where it has them): "ngram" (prompt lookup), "medusa" (the heads of
minillm/spec/medusa.py, trained by `make train-draft`), "draft_model" (a separate smaller model
with the same tokenizer, run per request with its own small cache; by default the target's own
first layers: an early-exit draft).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..spec.loop import SpecStats
from ..spec.medusa import DEFAULT_WEIGHTS, MedusaHeads, capture_hidden
from ..spec.ngram import check_lookup, ngram_propose
from ..spec.proposers import DraftModelProposer, draw, early_exit_model, final_probs
from ..spec.rejection import greedy_accept, rejection_sample

METHODS = ("ngram", "medusa", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
        "draft_num_layers", "weights"}


def parse_speculative_config(config) -> dict:
    """Validate a speculative_config dict (before any model is loaded). ValueError names the fix."""
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                         f"'num_speculative_tokens': 4}}, got {type(config).__name__}")
    unknown = set(config) - KEYS
    if unknown:
        raise ValueError(f"unknown speculative_config keys {sorted(unknown)}; known: {sorted(KEYS)}")
    method = config.get("method")
    if method not in METHODS:
        raise ValueError(f"unknown speculative method {method!r}; use one of {METHODS}")
    k = config.get("num_speculative_tokens")
    if k is None or isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_speculative_tokens must be a positive integer, got {k!r}")
    if k > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens={k} is too large: at most "
                         f"{MAX_SPECULATIVE_TOKENS} (acceptance falls geometrically with the "
                         "draft position, so long drafts only waste verification work; 2-8 is usual)")
    out = dict(config, num_speculative_tokens=k)
    if method == "ngram":
        lo, hi = config.get("prompt_lookup_min", 1), config.get("prompt_lookup_max", 4)
        check_lookup(k, lo, hi)
        out.update(prompt_lookup_min=lo, prompt_lookup_max=hi)
    elif "prompt_lookup_min" in config or "prompt_lookup_max" in config:
        raise ValueError(f"prompt_lookup_min / prompt_lookup_max are for method 'ngram', not "
                         f"{method!r}; remove them")
    return out


class SpecDecoder:
    """The engine's speculative-decoding state: the proposer, verification, acceptance counts."""

    def __init__(self, config: dict, model):
        cfg = parse_speculative_config(config)
        self.config, self.model = cfg, model
        self.method, self.k = cfg["method"], cfg["num_speculative_tokens"]
        self.stats = SpecStats()
        self.heads = None
        self.draft = None
        self.draft_proposers: dict = {}            # seq_id -> DraftModelProposer (draft_model)
        if self.method == "medusa":
            heads = cfg.get("weights", DEFAULT_WEIGHTS)
            if not isinstance(heads, MedusaHeads):
                heads = MedusaHeads.load(heads, model)
            heads.check_model(model)
            if self.k > heads.num_heads:
                raise ValueError(f"num_speculative_tokens={self.k} but the Medusa weights have "
                                 f"{heads.num_heads} heads; lower it to <= {heads.num_heads}")
            self.heads = heads.to(device=model.device, dtype=model.dtype).eval()
        elif self.method == "draft_model":
            draft = cfg.get("model")
            if draft is None:
                draft = early_exit_model(model, cfg.get("draft_num_layers",
                                                        max(1, model.config.num_layers // 2)))
            elif isinstance(draft, (str, bytes)) or hasattr(draft, "__fspath__"):
                from ..loader import load_model
                draft, _ = load_model(draft, device=model.device, dtype=model.dtype)
            if draft.config.vocab_size != model.config.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({draft.config.vocab_size}) differs "
                                 f"from the target's ({model.config.vocab_size}); a draft must "
                                 "share the target's tokenizer")
            self.draft = draft.eval()

    @property
    def needs_hidden(self) -> bool:
        return self.method == "medusa"

    def capture(self):
        return capture_hidden(self.model, self.needs_hidden)

    # --- proposing ------------------------------------------------------------------------------
    def room(self, req) -> int:
        """Drafts this request may carry: verifying k drafts can emit k + 1 tokens."""
        left = req.params.max_tokens - req.num_output_tokens - 1
        ctx = self.model.config.max_position_embeddings - req.num_tokens - 1
        return max(0, min(self.k, left, ctx))

    @torch.inference_mode()
    def propose(self, items) -> None:
        """items: [(request, hidden row [C] or None)] of requests about to decode. Sets each
        request's spec_token_ids (maybe []) and spec_draft_probs ([k, V] or None)."""
        todo = []
        for req, hidden in items:
            req.spec_token_ids, req.spec_draft_probs = [], None
            k = self.room(req)
            if k > 0:
                todo.append((req, hidden, k))
        if not todo:
            return
        if self.method == "ngram":
            lo, hi = self.config["prompt_lookup_min"], self.config["prompt_lookup_max"]
            for req, _, k in todo:
                req.spec_token_ids = ngram_propose(req.prompt_token_ids + req.output_token_ids,
                                                   k, lo, hi)
        elif self.method == "medusa":
            hidden = torch.stack([h for _, h, _ in todo])                   # [R, C]
            logits = self.heads.logits(self.model, hidden, self.k)           # [R, K, V]
            for (req, _, k), lg in zip(todo, logits):
                req.spec_token_ids, req.spec_draft_probs = draw(lg[:k], req.params, req.generator)
        else:
            for req, _, k in todo:
                prop = self.draft_proposers.get(req.seq_id)
                if prop is None:
                    max_len = req.num_prompt_tokens + req.params.max_tokens + self.k + 1
                    prop = DraftModelProposer(self.draft, max_len=max_len)
                    self.draft_proposers[req.seq_id] = prop
                req.spec_token_ids, req.spec_draft_probs = prop.propose(
                    req.prompt_token_ids + req.output_token_ids, k, req.params, req.generator)

    def release(self, req) -> None:
        """A finished request drops its draft state."""
        self.draft_proposers.pop(req.seq_id, None)
        req.spec_token_ids, req.spec_draft_probs = [], None

    # --- verifying ------------------------------------------------------------------------------
    def verify(self, req, logits: torch.Tensor, num_spec: int) -> list:
        """logits [1 + num_spec, V] at the last token and the drafts -> the emitted tokens."""
        drafts = req.spec_token_ids[:num_spec]
        if req.params.greedy:
            emitted = greedy_accept(logits.argmax(-1).tolist(), drafts)
        else:
            q = req.spec_draft_probs
            q = q[:num_spec] if q is not None else None
            emitted = rejection_sample(final_probs(logits, req.params), drafts, q, req.generator)
        accepted = len(emitted) - 1
        self.stats.record(num_spec, accepted)
        req.metrics.num_draft_tokens += num_spec
        req.metrics.num_accepted_tokens += accepted
        req.spec_token_ids, req.spec_draft_probs = [], None
        return emitted
