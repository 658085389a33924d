"""Draft proposers (chapter 07): who guesses the next k tokens, and with what distribution.

One class per method, all behind the engine's seam (minillm/engine/spec_decode.py): each has
`needs_hidden`, `num_speculative_tokens` and the batch method

    propose(requests: list[DraftRequest]) -> list[Draft]     one Draft per request, same order

and, for speculative_config, `config_keys` (its own options), `check_config(cfg)` (checks them
before any model is loaded) and `from_config(cfg, model)` (what `build_proposer` calls once).

    NgramProposer       prompt lookup; one-hot drafts (probs None), free to compute
    MedusaProposer      extra decoding heads on the target's last hidden state (medusa.py);
                        one batched head pass for all requests
    DraftModelProposer  a smaller model with the same tokenizer, run autoregressively k times
                        per request on that request's own KV cache (Draft.state)
    EagleProposer       one decoder layer on the target's features (eagle.py), k passes
                        shared by the batch, each request on its own small KV cache
                        (Draft.state); needs the target's features of the positions each
                        step kept (`needs_features`)

The engine builds one of these once (`build_proposer`) and the batch-1 loop (loop.py) calls the
same objects with a batch of one. A proposer keeps no per-sequence data: what it must remember
about a sequence (the draft model's cache and the tokens in it) goes back to the caller in
Draft.state and comes back in DraftRequest.state.

For a greedy request a proposer returns its argmax guesses (and probs None); for a sampled one it
draws each draft from q = its distribution after the request's temperature / top-k / top-p
(`minillm.sampling.probs`), and returns q so the rejection sampler can correct for it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..cache.contiguous import ContiguousKVCache
from ..kernels import MAX_TREE_NODES
from ..engine.spec_decode import Draft, DraftRequest
from ..sampling import SamplingParams, draw_from, probs
from ..model import tune_skinny
from .eagle import (DEFAULT_EAGLE_WEIGHTS, EagleDrafter, EagleState, PrefixFeatures, draft_batch,
                    draft_tree, new_state)
from .eagle import observe as observe_features
from .medusa import DEFAULT_WEIGHTS, MedusaHeads
from .ngram import check_lookup, ngram_propose


def draw(logits: torch.Tensor, params: SamplingParams, generator=None):
    """Draft tokens from draft logits [k, V]: argmax for greedy (probs None), else one sample per
    row from the final distribution. Returns (ids [k], q [k, V] or None)."""
    if params.greedy:
        return logits.argmax(-1).tolist(), None
    q = probs(logits, params)                                 # [k, V]
    ids = draw_from(q, generator).tolist()
    return ids, q


class NgramProposer:
    """Prompt lookup (ngram.py) for every request; one-hot drafts."""
    needs_hidden = needs_features = False
    config_keys = ("prompt_lookup_min", "prompt_lookup_max")     # speculative_config options

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4,
                 num_speculative_tokens: int = 4):
        check_lookup(num_speculative_tokens, prompt_lookup_min, prompt_lookup_max)
        self.prompt_lookup_min, self.prompt_lookup_max = prompt_lookup_min, prompt_lookup_max
        self.num_speculative_tokens = num_speculative_tokens

    @staticmethod
    def check_config(cfg: dict) -> dict:
        cfg.setdefault("prompt_lookup_min", 1)
        cfg.setdefault("prompt_lookup_max", 4)
        check_lookup(cfg["num_speculative_tokens"], cfg["prompt_lookup_min"],
                     cfg["prompt_lookup_max"])
        return cfg

    @classmethod
    def from_config(cls, cfg: dict, model) -> "NgramProposer":
        return cls(cfg["prompt_lookup_min"], cfg["prompt_lookup_max"],
                   cfg["num_speculative_tokens"])

    def propose(self, requests: list) -> list:
        return [Draft(ngram_propose(r.token_ids, r.num_drafts, self.prompt_lookup_min,
                                    self.prompt_lookup_max), None) for r in requests]


class MedusaProposer:
    """Heads on the target's hidden state at the position that produced the last token."""
    needs_hidden, needs_features = True, False
    config_keys = ("weights",)             # a MedusaHeads or a file; default DEFAULT_WEIGHTS

    def __init__(self, model, heads: MedusaHeads, num_speculative_tokens: int = None):
        heads.check_model(model)
        k = heads.num_heads if num_speculative_tokens is None else num_speculative_tokens
        if k > heads.num_heads:
            raise ValueError(f"num_speculative_tokens={k} but the Medusa weights have "
                             f"{heads.num_heads} heads; lower it to <= {heads.num_heads}")
        self.model, self.num_speculative_tokens = model, k
        self.heads = heads.to(device=model.device, dtype=model.dtype).eval()

    @staticmethod
    def check_config(cfg: dict) -> dict:
        return cfg                         # the weights are checked against the model on load

    @classmethod
    def from_config(cls, cfg: dict, model) -> "MedusaProposer":
        heads = cfg.get("weights", DEFAULT_WEIGHTS)        # a MedusaHeads or a file
        if not isinstance(heads, MedusaHeads):
            heads = MedusaHeads.load(heads, model)
        return cls(model, heads, cfg["num_speculative_tokens"])

    @torch.inference_mode()
    def propose(self, requests: list) -> list:
        if any(r.hidden is None for r in requests):
            raise ValueError("MedusaProposer needs each request's target hidden state of the last "
                             "position (DraftRequest.hidden)")
        hidden = torch.stack([r.hidden for r in requests])                # [R, C]
        k = max(r.num_drafts for r in requests)
        logits = self.heads.logits(self.model, hidden, k)                 # [R, k, V]
        return [Draft(*draw(lg[:r.num_drafts], r.params, r.generator))
                for r, lg in zip(requests, logits)]


@dataclass
class DraftModelState:
    """One sequence's draft-model state: its own contiguous KV cache (batch 1) and the tokens
    whose K/V that cache holds (the cache's first len(token_ids) positions)."""
    cache: ContiguousKVCache
    token_ids: list


class DraftModelProposer:
    """A separate draft model, run per request on that request's cache (DraftModelState). Each
    call rolls the cache back to the longest prefix it shares with the request's tokens (the
    target rejected the rest), feeds the new tokens, then drafts k tokens one at a time."""
    needs_hidden = needs_features = False
    config_keys = ("model", "draft_num_layers")   # a model or checkpoint; else the first layers

    def __init__(self, draft_model, num_speculative_tokens: int = 4):
        self.model, self.num_speculative_tokens = draft_model.eval(), num_speculative_tokens

    @staticmethod
    def check_config(cfg: dict) -> dict:
        n = cfg.get("draft_num_layers")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"draft_num_layers must be a positive integer (the target's first "
                             f"layers that draft), got {n!r}")
        return cfg

    @classmethod
    def from_config(cls, cfg: dict, model) -> "DraftModelProposer":
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
        return cls(draft, cfg["num_speculative_tokens"])

    @torch.inference_mode()
    def propose(self, requests: list) -> list:
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, r: DraftRequest) -> Draft:
        ids = list(r.token_ids)
        state = r.state if r.state is not None else self._new_state(r)
        keep = 0                                              # longest common prefix
        for a, b in zip(state.token_ids, ids):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)                        # re-feed at least the last token
        # the K/V of the tokens fed, plus k - 1 drafts fed back in
        self._reserve(state, len(ids) + r.num_drafts - 1)
        state.cache.seq_len, state.token_ids = keep, ids[:keep]
        drafts, qs, new = [], [], ids[keep:]
        for _ in range(r.num_drafts):
            logits = self.model(torch.tensor([new], device=self.model.device),
                                cache=state.cache, last_only=True)[0]     # [1, V]
            state.token_ids += new
            d, q = draw(logits, r.params, r.generator)
            drafts += d
            if q is not None:
                qs.append(q[0])                                # [V]
            new = d
        return Draft(drafts, torch.stack(qs) if qs else None, state)

    def _new_state(self, r: DraftRequest) -> DraftModelState:
        cfg = self.model.config
        size = min(cfg.max_position_embeddings,
                   len(r.token_ids) + r.params.max_tokens + r.num_drafts)
        return DraftModelState(ContiguousKVCache(cfg, 1, size, dtype=self.model.dtype,
                                                 device=self.model.device), [])

    def _reserve(self, state: DraftModelState, num_tokens: int) -> None:
        """Grow the state's cache (doubling, up to the context) to hold num_tokens positions."""
        cache, cfg = state.cache, self.model.config
        if num_tokens <= cache.max_len:
            return
        size = min(cfg.max_position_embeddings, max(num_tokens, 2 * cache.max_len))
        bigger = ContiguousKVCache(cfg, 1, size, dtype=cache.k.dtype, device=cache.k.device)
        bigger.k[:, :, :cache.max_len] = cache.k              # [L, 1, max_len, KVH, D]
        bigger.v[:, :, :cache.max_len] = cache.v
        bigger.seq_len = cache.seq_len
        state.cache = bigger


class EagleProposer:
    """The EAGLE drafter (eagle.py) for every request, one chain of k drafts each, on the
    request's own drafter cache (EagleState, kept across steps in Draft.state). With
    tree_branches = b > 1, each request gets eagle.draft_tree's static tree instead: the
    drafter's top b first tokens, the first continued to depth k and the others to
    tree_side_depth (default k), verified in one forward by the engine (tree.py)."""
    needs_hidden, needs_features = False, True
    # eagle_weights: a file or an EagleDrafter; draft_head: "reduced" | "full"; draft_dtype:
    # None (the model's) or a narrower float dtype for the drafter alone; tree_branches (1: a
    # chain) and tree_side_depth (None: k) shape a tree
    config_keys = ("eagle_weights", "draft_head", "draft_dtype", "tree_branches",
                   "tree_side_depth")
    DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    MAX_TREE_BRANCHES = 8

    def __init__(self, model, drafter: EagleDrafter, num_speculative_tokens: int = 4,
                 draft_head: str = "reduced", draft_dtype=None, tree_branches: int = 1,
                 tree_side_depth=None):
        drafter.check_model(model)
        self.tree_branches, self.tree_side_depth = tree_branches, tree_side_depth
        self.model, self.num_speculative_tokens = model, num_speculative_tokens
        # the drafter reads its own weights and its reduced head's rows every draft: at batch 1
        # that is memory-bound, so bf16 halves its cost (the drafts change a little; exactness
        # does not, the rejection sampler uses the q it drew from)
        dtype = (self.DTYPES[draft_dtype] if isinstance(draft_dtype, str) else draft_dtype) \
            or model.dtype
        w = drafter.fc.weight
        if (w.device, w.dtype) != (model.device, dtype):      # a converted copy: the caller's
            drafter = copy.deepcopy(drafter).to(device=model.device, dtype=dtype)   # stays as is
        self.drafter = drafter.eval()
        if w.device.type == "cpu":       # the drafter's layer has the target's shapes: the same
            tune_skinny(self.drafter)    # 1-3 row products the loader chose for the target
        self.reduced = draft_head == "reduced"
        self.prefix_features = PrefixFeatures()     # prompts' features the engine skipped

    @classmethod
    def check_config(cls, cfg: dict) -> dict:
        cfg.setdefault("draft_head", "reduced")
        cfg.setdefault("draft_dtype", None)
        if cfg["draft_head"] not in ("reduced", "full"):
            raise ValueError(f"draft_head must be 'reduced' (the FR-Spec head over the most "
                             f"frequent tokens) or 'full' (the target's LM head), got "
                             f"{cfg['draft_head']!r}")
        dt = cfg["draft_dtype"]
        if not (dt is None or dt in cls.DTYPES or dt in cls.DTYPES.values()):
            raise ValueError(f"draft_dtype must be None (the model's dtype) or one of "
                             f"{sorted(cls.DTYPES)}, got {dt!r}")
        b = cfg.setdefault("tree_branches", 1)
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= cls.MAX_TREE_BRANCHES:
            raise ValueError(f"tree_branches must be an integer in 1..{cls.MAX_TREE_BRANCHES} "
                             f"(1: a chain; 2-3 is usual), got {b!r}")
        d, k = cfg.setdefault("tree_side_depth", None), cfg["num_speculative_tokens"]
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= k):
            raise ValueError(f"tree_side_depth must be None (every branch k deep) or an integer "
                             f"in 1..num_speculative_tokens={k}, got {d!r}")
        if d is not None and b == 1:
            raise ValueError("tree_side_depth shapes the runner-up branches of a tree: set "
                             "tree_branches >= 2 too, or remove it")
        nodes = 1 + k + (b - 1) * (k if d is None else d)
        if nodes > MAX_TREE_NODES:
            raise ValueError(f"a tree of {nodes} nodes (the root, k = {k}, {b - 1} runner-up "
                             f"branches of {k if d is None else d}) is too large: at most "
                             f"{MAX_TREE_NODES}, one int64 of ancestor bits per query in the "
                             "Triton kernel; lower num_speculative_tokens, tree_branches or "
                             "tree_side_depth")
        return cfg

    @classmethod
    def from_config(cls, cfg: dict, model) -> "EagleProposer":
        drafter = cfg.get("eagle_weights", DEFAULT_EAGLE_WEIGHTS)    # an EagleDrafter or a file
        if not isinstance(drafter, EagleDrafter):
            drafter = EagleDrafter.load(drafter, model)
        return cls(model, drafter, cfg["num_speculative_tokens"], cfg["draft_head"],
                   cfg["draft_dtype"], cfg["tree_branches"], cfg["tree_side_depth"])

    @torch.inference_mode()
    def propose(self, requests: list) -> list:
        """Every request's chain in the same drafter passes (draft_batch); a tree whose
        runner-up branches are one node deep the same way (the runner-ups are the first
        pass's next-ranked tokens); deeper trees one request at a time (draft_tree)."""
        if not requests:
            return []
        states = self._states(requests)
        trees = self.tree_branches > 1
        if trees and any(self._side_depth(r) > 1 for r in requests):     # deep side branches:
            return [self._tree(r, st) for r, st in zip(requests, states)]  # one by one
        # a chain, or a tree whose runner-up branches are one node deep: both are the drafter's
        # chain for every request in shared passes, plus (trees) the runner-up first tokens
        side = [[] for _ in requests]
        draws = [self._ranked(self.tree_branches, sd) if trees else self._draw(r)
                 for r, sd in zip(requests, side)]
        out = draft_batch(self.drafter, self.model, states, [list(r.token_ids) for r in requests],
                          [r.features for r in requests], [r.num_drafts for r in requests],
                          draws, self.reduced, self.prefix_features)
        if not trees:
            return [Draft(ids, torch.stack(qs) if qs else None, st)
                    for (ids, qs), st in zip(out, states)]
        drafts = []
        for (ids, _), sd, st, r in zip(out, side, states, requests):
            if r.max_nodes is not None and len(ids) + len(sd) > r.max_nodes:
                sd = []                                      # near the context's end: the chain
            drafts.append(Draft(ids + sd, None, st, [-1] + list(range(len(ids))) + [0] * len(sd)))
        return drafts

    def observe(self, requests: list) -> list:
        """A step the engine takes without drafts (its batch is above disable_by_batch_size):
        keep every request's new true features in its state (eagle.observe) for the next
        drafting call, which feeds them all in its one first drafter pass, so that drafting
        resumes without recomputing the target's features of the positions in between; no
        drafter pass now. Returns each request's state."""
        states = self._states(requests)
        for r, st in zip(requests, states):
            observe_features(st, list(r.token_ids), r.features)
        return states

    def _states(self, requests: list) -> list:
        """Each request's drafter state: the one it carries, or a new one sized for the whole
        request."""
        return [r.state if isinstance(r.state, EagleState) else
                new_state(self.drafter, len(r.token_ids) + r.params.max_tokens
                          + max(r.num_drafts, 1))
                for r in requests]

    def _tree(self, r: DraftRequest, state: EagleState) -> Draft:
        """One request's static tree (draft_tree, this sequence alone): one-hot ranked drafts,
        exact at any temperature through the tree walk. Where the tree would not fit the
        context's last slots (max_nodes), the chain of the drafter's argmax tokens."""
        k, b, d = r.num_drafts, self.tree_branches, self._side_depth(r)
        if r.max_nodes is not None and k + (b - 1) * d > r.max_nodes:
            b = 1
        nodes, parents = draft_tree(self.drafter, self.model, state, list(r.token_ids),
                                    r.features, k, b, self.reduced, d, self.prefix_features)
        return Draft(nodes[1:], None, state, parents)

    def _side_depth(self, r: DraftRequest) -> int:
        """How deep request r's runner-up branches go (tree_side_depth, default k, within k)."""
        return min(self.tree_side_depth or r.num_drafts, r.num_drafts)

    @staticmethod
    def _ranked(branches: int, side: list):
        """draft_tree's choices inside draft_batch: the drafter's argmax at every depth (the
        tree's first branch), and at the first depth its next branches - 1 tokens into `side`
        (the runner-up branches, one node each)."""
        first = [True]

        def pick(logits):                                    # [1, V] -> ([id], None)
            top = logits[0].topk(branches if first[0] else 1).indices.tolist()
            first[0] = False
            side.extend(top[1:])
            return top[:1], None
        return pick

    def _draw(self, r: DraftRequest):
        """How request r picks its drafts from the drafter's logits [1, V]."""
        return lambda logits: draw(logits, r.params, r.generator)


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
    return draft


PROPOSERS = {"ngram": NgramProposer, "medusa": MedusaProposer, "draft_model": DraftModelProposer,
             "eagle": EagleProposer}

__all__ = ["NgramProposer", "MedusaProposer", "DraftModelProposer", "DraftModelState",
           "EagleProposer", "PROPOSERS",
           "early_exit_model", "skip_layer_model", "draw"]
