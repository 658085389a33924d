"""Speculative decoding inside the engine (chapter 07): the one seam the engine talks through.

    llm = minillm.LLM("smollm2-135m", speculative_config={
        "method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_min": 2, "prompt_lookup_max": 4})

The engine (chapter 04's code) sees only what is in this file. Until chapter 07 turns speculation
on, its proposer is a `NoProposer` that proposes nothing, and nothing here imports the spec
package. With a speculative_config, `build_proposer` builds the method's proposer once
(minillm/spec/proposers.py, one class per method):

    method         proposer            what it needs            draft distributions
    "ngram"        NgramProposer       the tokens (prompt lookup)   none (one-hot drafts)
    "medusa"       MedusaProposer      the target's hidden row      the heads' q
    "draft_model"  DraftModelProposer  its own KV cache per seq     the draft model's q
    "eagle"        EagleProposer       the target's features of     the drafter's q
                                       the kept positions, its own
                                       one-layer KV cache per seq

How a step changes (the rest of the engine is chapter 04's):
  1. After a request samples, the engine asks the proposer for its next k tokens, k = `room`:

        engine                                  proposer
        [DraftRequest(token_ids, k, params,  ->  propose(requests)   one call for the batch
                      generator, hidden, state)]
        req.spec_token_ids, draft probs,     <-  [Draft(token_ids, probs, state)], same order
        the proposer's state (kept on the request, handed back next time)

  2. The scheduler gives a decoding request 1 + k tokens instead of 1: its last sampled token
     plus the drafts, within the token budget and only when blocks are free (drafts never cause a
     preemption). They join the same ragged batch as everyone's prefill chunks and decodes.
  3. The model runner computes logits at all 1 + k positions of such a request (the target's
     verification runs through the paged prefill path like any multi-token chunk) and `verify`
     keeps the accepted drafts plus one token (exact match for greedy, the rejection sampler
     otherwise): the runner returns those tokens.
  4. The scheduler's update rolls back: num_computed_tokens forgets the rejected positions and
     blocks that hold only rejected positions go back to the pool.

When the batch leaves no spare compute (section 7 of the chapter: verified positions cost real
work once a step is compute-bound), `disable_by_batch_size` = N turns drafting off in every step
that ends with more than N requests running (vLLM's option of the same name): the engine asks for
no drafts, and a proposer that keeps state (`observe`: EAGLE's drafter cache) is handed the
step's tokens and features anyway, so drafting resumes where it left off when the batch shrinks.

A TREE of drafts (EAGLE with tree_branches > 1; spec/tree.py) travels the same road: the
proposer's Draft carries `parents` (node 0 = the last token), the scheduler gives the request
1 + its nodes like a chain (a budget cut keeps a prefix of the nodes: still a tree), the runner
puts each node at position start + depth with an ancestor mask in StepMetadata.tree_masks
(every attention path reads it; the Triton kernel as bits), walks the tree (`verify_tree`), and
moves the kept branch's K/V to the slots after the context (`PagedKVCache.compact`) before the
same rollback.

Methods (vLLM's names where it has them): "ngram" (prompt lookup), "medusa" (the heads of
minillm/spec/medusa.py, trained by `make train-draft`), "draft_model" (a separate smaller model
with the same tokenizer, run per request with its own small cache; by default the target's own
first layers: an early-exit draft).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..sampling import SamplingParams

MAX_SPECULATIVE_TOKENS = 16
# keys of every method: disable_by_batch_size (vLLM's name) = no drafts in a step while more
# requests than that are running (the batch leaves no spare compute for verification: ch. 07)
SHARED_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size")


@dataclass
class DraftRequest:
    """What a proposer needs of one sequence."""
    token_ids: list                 # prompt + outputs so far (last = newest sampled token)
    num_drafts: int                 # k for this sequence, >= 1
    params: SamplingParams
    generator: Optional[torch.Generator]
    hidden: Optional[torch.Tensor] = None   # [C] target hidden state that produced the last
                                            # token (Medusa)
    state: object = None            # this proposer's per-sequence state from the last call, or None
    features: Optional[torch.Tensor] = None  # [m, C] target features (final-norm output) of the
                                             # m positions before the last token that the last
                                             # step computed and kept (EAGLE), or None
    max_nodes: Optional[int] = None # a tree's draft nodes must fit this many cache slots
                                    # (None: num_drafts); a chain ignores it


@dataclass
class Draft:
    """A proposer's answer for one sequence."""
    token_ids: list                 # 0 .. num_drafts ids
    probs: Optional[torch.Tensor]   # [len(token_ids), V] draft distributions; None: one-hot drafts
    state: object = None            # the caller keeps it and passes it back next time
    parents: Optional[list] = None  # a TREE of drafts (chapter 07, spec/tree.py): node 0 is
                                    # the last token, node i + 1 is token_ids[i], parents[j] < j
                                    # its parent (parents[0] = -1); None: a chain


class NoProposer:
    """Speculation off: proposes nothing (the null object chapter 04's engine runs with)."""
    needs_hidden = needs_features = False
    num_speculative_tokens = 0

    def propose(self, requests: list) -> list:
        return [Draft([], None) for _ in requests]


def parse_speculative_config(config) -> dict:
    """Validate a speculative_config dict (before any model is loaded): the keys every method
    shares here, the method's own keys by its proposer class (`config_keys`, `check_config`).
    Returns the config with defaults filled in. ValueError names the fix."""
    if not isinstance(config, dict):
        raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                         f"'num_speculative_tokens': 4}}, got {type(config).__name__}")
    from ..spec.proposers import PROPOSERS       # chapter 07: only with a real config
    owners = {key: m for m, cls in PROPOSERS.items() for key in cls.config_keys}
    unknown = set(config) - set(SHARED_KEYS) - set(owners)
    if unknown:
        raise ValueError(f"unknown speculative_config keys {sorted(unknown)}; known: "
                         f"{sorted(set(SHARED_KEYS) | set(owners))}")
    method = config.get("method")
    if method not in PROPOSERS:
        raise ValueError(f"unknown speculative method {method!r}; use one of {tuple(PROPOSERS)}")
    k = config.get("num_speculative_tokens")
    if k is None or isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_speculative_tokens must be a positive integer, got {k!r}")
    if k > MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens={k} is too large: at most "
                         f"{MAX_SPECULATIVE_TOKENS} (acceptance falls geometrically with the "
                         "draft position, so long drafts only waste verification work; "
                         "2-8 is usual)")
    off = config.get("disable_by_batch_size")
    if off is not None and (isinstance(off, bool) or not isinstance(off, int) or off < 1):
        raise ValueError(f"disable_by_batch_size must be None (speculate at every batch size) "
                         f"or a positive integer (no drafts while more requests than that are "
                         f"running), got {off!r}")
    for key in sorted(set(config) & set(owners)):
        if owners[key] != method:
            raise ValueError(f"{key} is for method {owners[key]!r}, not {method!r}; remove it")
    cfg = PROPOSERS[method].check_config(dict(config))
    cfg.setdefault("disable_by_batch_size", None)
    return cfg


def build_proposer(speculative_config: Optional[dict], model):
    """The engine's proposer, built once: NoProposer() for None, else the method's proposer
    (this loads the Medusa weights or the draft model). ValueError names the fix."""
    if speculative_config is None:
        return NoProposer()
    cfg = parse_speculative_config(speculative_config)
    from ..spec.proposers import PROPOSERS       # chapter 07, imported only when it is used
    return PROPOSERS[cfg["method"]].from_config(cfg, model)


def room(req, num_speculative_tokens: int, max_model_len: int) -> int:
    """Drafts this request may carry this step: verifying k drafts can emit k + 1 tokens, so
    k <= max_tokens left - 1, and the k + 1 positions must fit the context."""
    left = req.params.max_tokens - req.num_output_tokens - 1
    ctx = max_model_len - req.num_tokens - 1
    return max(0, min(num_speculative_tokens, left, ctx))


def check_drafts(requests: list, drafts: list, proposer) -> list:
    """A proposer's answer keeps the contract: one Draft per request, at most num_drafts ids,
    probs [len(ids), V] or None. Returns drafts; ValueError names the proposer and the fix."""
    name = type(proposer).__name__
    if len(drafts) != len(requests):
        raise ValueError(f"{name}.propose returned {len(drafts)} drafts for {len(requests)} "
                         "requests; return one Draft per DraftRequest, in the same order")
    for r, d in zip(requests, drafts):
        if d.parents is not None:
            _check_tree_draft(name, r, d)
        elif len(d.token_ids) > r.num_drafts:
            raise ValueError(f"{name} proposed {len(d.token_ids)} tokens where num_drafts is "
                             f"{r.num_drafts}; propose at most num_drafts")
        if d.probs is not None and d.probs.shape[0] != len(d.token_ids):
            raise ValueError(f"{name}'s draft probs have {d.probs.shape[0]} rows for "
                             f"{len(d.token_ids)} drafts; give one row per draft token or None")
    return drafts


def _check_tree_draft(name: str, r: DraftRequest, d: Draft) -> None:
    """A tree: one parent per node (the root's -1 first), parents before children, no branch
    deeper than num_drafts (k + 1 tokens emitted at most) and no more nodes than max_nodes."""
    from ..spec.tree import check_tree
    if len(d.parents) != len(d.token_ids) + 1:
        raise ValueError(f"{name}'s tree has {len(d.parents)} parents for {len(d.token_ids)} "
                         "drafts; give one parent per node, the root's (-1) first")
    check_tree(list(d.parents))
    deepest = tree_depth(d.parents)
    if deepest > r.num_drafts:
        raise ValueError(f"{name}'s tree is {deepest} drafts deep where num_drafts is "
                         f"{r.num_drafts}; keep every branch within num_drafts")
    cap = r.num_drafts if r.max_nodes is None else r.max_nodes
    if len(d.token_ids) > cap:
        raise ValueError(f"{name}'s tree has {len(d.token_ids)} draft nodes where max_nodes is "
                         f"{cap}; propose a smaller tree (or a chain) near the context's end")
    if d.probs is not None:
        raise ValueError(f"{name} gave draft probs with a tree: a tree's children are the "
                         "drafter's ranked tokens, one-hot drafts; give probs=None")


def verify(logits: torch.Tensor, draft_token_ids, draft_probs: Optional[torch.Tensor],
           params: SamplingParams, generator: Optional[torch.Generator] = None) -> list:
    """The one verifier, `minillm.spec.rejection.verify` (imported here on first use, so the
    engine does not load chapter 07 until drafts exist): logits [1 + k, V] -> 1 .. k + 1 ids."""
    from ..spec.rejection import verify as verify_drafts
    return verify_drafts(logits, draft_token_ids, draft_probs, params, generator)


def tree_depth(parents: list) -> int:
    """How many drafts deep a tree goes (its longest branch, root excluded)."""
    from ..spec.tree import depths
    return max(depths(list(parents)))


def verify_tree(logits: torch.Tensor, tokens: list, parents: list, params: SamplingParams,
                generator: Optional[torch.Generator] = None) -> tuple:
    """A tree's walk (`minillm.spec.tree.accept_walk`, imported on first use): logits [n, V] at
    the n nodes (node 0 = the last token), one-hot drafts -> (emitted ids, kept node indices)."""
    from ..sampling import probs
    from ..spec.tree import accept_walk
    if params.greedy:
        return accept_walk(logits, tokens, parents, greedy=True)
    return accept_walk(probs(logits, params), tokens, parents, generator=generator)
