"""An EAGLE-style drafter (chapter 07): one decoder layer that runs on the target's own features.

EAGLE (Li et al. 2024) drafts at the level of features, not tokens. The target's feature f_p is
its hidden state at position p after the final norm: the vector its LM head turns into the
distribution of token p + 1. The drafter is ONE decoder layer of the target's shape, fed at
position p with f_p and the embedding of the token that f_p produced, x_{p+1}:

    g_p = Block(fc([embed(x_{p+1}) ; f_p]))      fc: 2C -> C, Block: the target's layer shape
    g_p ~ f_{p+1}                                the next feature ...
    head(g_p) -> x_{p+2}                         ... and through an LM head, the next token

Drafting k tokens after the target produced x_N (features known up to f_{N-1}):

    step 1: feed the positions whose true features are new (up to N - 1) -> g_{N-1} -> draft d_1
    step j: feed (g, d_{j-1}) at the next position (the drafter's OWN feature, not the target's)
            -> the next g -> draft d_j

Unlike Medusa's heads, each guess sees the guesses before it (through the fed-back token and
feature), so later positions degrade more slowly.

The drafter's KV (`EagleState`, one small contiguous cache per sequence) is CACHED across steps:
positions fed with the target's true features stay; positions fed with the drafter's own guesses
are dropped after every call (the cache's length is set back), so a rejection needs no other
rollback: the next call feeds the accepted tokens' true features at those positions. When the
true features of some positions never reached the proposer (a prompt computed in several chunks,
a prefix-cache hit, a forked sample), it recomputes them with one no-cache target pass over
the positions that lack them; a proposer keeps those rows for the next sequence with the same
prefix (`PrefixFeatures`: a chat template is recomputed once, not once per request).

A batch drafts together (`draft_batch`): one drafter pass takes every sequence's new positions
(rows right-padded to the longest), then each draft step feeds all sequences still drafting at
once, so the layer's and the head's weights are read once per step for the whole batch instead
of once per sequence; attention alone runs row by row, each row on its own cache
(`RaggedCaches`). The drafter can run in a narrower dtype than the target (`draft_dtype`): at
batch 1 its cost is reading its weights and head rows, which bf16 halves.

The head: the target's own LM head (49,152 rows for SmolLM2: 28M multiply-adds per draft token,
about a fifth of the whole 135M-parameter target) or an FR-Spec-style reduced head (Zhao et al.
2025): only the rows of the `draft_vocab` most frequent tokens of the training answers. Drafts
outside it are never proposed; the rejection sampler stays exact because the draft distribution
q is zero there, so the target's own token is sampled whenever it lies outside.

Trained by `python -m minillm.spec.train_eagle` (`make train-eagle`) on the data of
`minillm.spec.eagle_data`.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn

from ..cache.contiguous import ContiguousKVCache
from ..model import Block
from .medusa import WEIGHTS_DIR, hidden_states, model_fingerprint
from .tree import masked_attention

DEFAULT_EAGLE_WEIGHTS = WEIGHTS_DIR / "eagle_smollm2-135m.safetensors"
FIX = ("train a drafter for this model with `make train-eagle` (python -m "
       "minillm.spec.train_eagle) or use method 'ngram'")


class EagleDrafter(nn.Module):
    def __init__(self, cfg, draft_vocab: Optional[torch.Tensor] = None, model_name: str = "",
                 fingerprint: str = ""):
        super().__init__()
        C = cfg.hidden_size
        self.config = dataclasses.replace(cfg, num_layers=1, name=f"{cfg.name}-eagle")
        self.hidden_size, self.vocab_size = C, cfg.vocab_size
        self.model_name, self.fingerprint = model_name, fingerprint
        self.fc = nn.Linear(2 * C, C, bias=True)
        self.layer = Block(self.config, 0)
        ids = torch.arange(0) if draft_vocab is None else draft_vocab.to(torch.long)
        self.register_buffer("draft_vocab", ids)       # [V'] FR-Spec rows; empty: no reduced head
        self.use_reduced = draft_vocab is not None
        self._head = None                              # (weight, source) cache of the head

    @classmethod
    def for_model(cls, model, draft_vocab=None) -> "EagleDrafter":
        d = cls(model.config, draft_vocab, model.config.name, model_fingerprint(model))
        C = model.config.hidden_size
        with torch.no_grad():      # start as the identity g_p = f_p: the target's last layer
            d.layer.load_state_dict(model.layers[-1].state_dict())   # with its two output
            d.layer.self_attn.o_proj.weight.zero_()                  # projections zeroed, and fc
            d.layer.mlp.down_proj.weight.zero_()                     # passing f_p through
            d.fc.weight.zero_()
            d.fc.weight[:, C:] = torch.eye(C)
            d.fc.bias.zero_()
        return d.to(device=model.device, dtype=model.dtype)

    def forward(self, model, features: torch.Tensor, next_ids: torch.Tensor,
                cache: Optional[ContiguousKVCache] = None, start: int = 0) -> torch.Tensor:
        """features [B, T, C] (f_p), next_ids [B, T] (x_{p+1}) -> g [B, T, C] (~ f_{p+1}).
        With a cache the T positions continue it (and advance it); without, they start at
        `start` and attend causally among themselves."""
        B, T = next_ids.shape
        if isinstance(cache, RaggedCaches):                   # each row at its own position
            positions = cache.positions(T, next_ids.device)
        else:
            if cache is not None:
                start = cache.seq_len
            positions = torch.arange(start, start + T, device=next_ids.device).expand(B, T)
        cos, sin = model.rope(positions)
        dt = self.fc.weight.dtype                 # the drafter may run in a narrower dtype
        x = self.fc(torch.cat([model.embed_tokens(next_ids).to(dt), features.to(dt)],
                              dim=-1))                                  # [B, T, C]
        g = self.layer(x, cos, sin, cache)
        if cache is not None:
            cache.advance(T)
        return g

    def head_weight(self, model, reduced: bool = True) -> torch.Tensor:
        """The LM head's rows the drafter scores: [V', C] (FR-Spec) or the full [V, C]."""
        if not (reduced and self.use_reduced):
            return model.lm_head.weight
        if self._head is None or self._head[1] is not model.lm_head.weight or \
                self._head[0].dtype != self.fc.weight.dtype:      # rows in the drafter's dtype
            self._head = (model.lm_head.weight[self.draft_vocab].to(self.fc.weight.dtype)
                          .contiguous(), model.lm_head.weight)
        return self._head[0]

    def logits(self, model, g: torch.Tensor, reduced: bool = True) -> torch.Tensor:
        """g [..., C] -> logits over the full vocabulary [..., V]; with the reduced head, tokens
        outside draft_vocab get -inf (never drafted)."""
        w = self.head_weight(model, reduced)
        small = nn.functional.linear(g.to(w.dtype), w).float()          # [..., V'] or [..., V]
        if w is model.lm_head.weight:
            return small
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.draft_vocab] = small
        return full

    def check_model(self, model) -> None:
        cfg = model.config
        if (cfg.hidden_size, cfg.vocab_size) != (self.hidden_size, self.vocab_size) or \
                (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) != \
                (self.config.num_heads, self.config.num_kv_heads, self.config.intermediate_size):
            raise ValueError(f"this EAGLE drafter was trained for {self.model_name} (hidden size "
                             f"{self.hidden_size}, vocabulary {self.vocab_size}), but the model "
                             f"is {cfg.name} ({cfg.hidden_size}, {cfg.vocab_size}); {FIX}")
        if self.fingerprint and model_fingerprint(model) != self.fingerprint:
            raise ValueError(f"this EAGLE drafter was trained on {self.model_name}'s weights, "
                             f"and this model's weights differ (e.g. random weights); {FIX}")

    # --- files ------------------------------------------------------------------------------
    def save(self, path: Union[str, Path], extra: dict = None) -> None:
        from safetensors.torch import save_file
        meta = {"model_name": self.model_name, "fingerprint": self.fingerprint,
                "config": dataclasses.asdict(self.config), **(extra or {})}
        state = {k: (v.detach().to(torch.float16) if v.is_floating_point() else v.detach())
                 .cpu().contiguous() for k, v in self.state_dict().items()}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(state, str(path), metadata={"minillm": json.dumps(meta)})

    @classmethod
    def load(cls, path: Union[str, Path] = DEFAULT_EAGLE_WEIGHTS, model=None) -> "EagleDrafter":
        """Load a drafter (fp16 on disk). With `model`, check it belongs to it (ValueError if not)
        and move it to the model's device and dtype."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        from ..configs import ModelConfig
        path = Path(path)
        if not path.exists():
            raise ValueError(f"no EAGLE weights at {path}; {FIX}")
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["minillm"])
        state = load_file(str(path))
        vocab = state["draft_vocab"] if state["draft_vocab"].numel() else None
        cfg = ModelConfig(**{k: v for k, v in meta["config"].items()
                             if k in {f.name for f in dataclasses.fields(ModelConfig)}})
        d = cls(cfg, vocab, meta["model_name"], meta["fingerprint"])
        d.meta = meta
        d.load_state_dict({k: (v.float() if v.is_floating_point() else v)
                           for k, v in state.items()})
        if model is not None:
            d.check_model(model)
            d = d.to(device=model.device, dtype=model.dtype)
        return d.eval()


@dataclass
class EagleState:
    """One sequence's drafter state: its KV cache (positions 0 .. len(token_ids) - 2 hold the
    drafter's K/V computed from the target's TRUE features) and the tokens they were fed with;
    `pending`: the target's features of the positions after those, kept by `observe` in steps
    without drafts (positions pending_end - sum of rows .. pending_end - 1), fed at the next
    drafting call."""
    cache: ContiguousKVCache
    token_ids: list
    pending: list = dataclasses.field(default_factory=list)    # [[m, C], ...] in order
    pending_end: int = 0


MAX_PENDING = 4096      # positions of features an EagleState keeps between drafting calls; past
                        # that they are dropped and the next call recomputes them (a target pass)


def observe(state: EagleState, token_ids: list, features) -> None:
    """A step without drafts (the engine's disable_by_batch_size): keep the target's features
    of this step's positions (`features` [m, C], positions N - 1 - m .. N - 2) for the next
    drafting call instead of running the drafter now. Features that do not follow the kept ones
    (none given, a gap, too many) drop them all: the next call recomputes what it lacks."""
    N, m = len(token_ids), 0 if features is None else features.shape[0]
    kept = sum(f.shape[0] for f in state.pending)
    if not m or (kept and state.pending_end != N - 1 - m) or kept + m > MAX_PENDING:
        state.pending, state.pending_end = [], 0
        if not m or m > MAX_PENDING:
            return
    state.pending.append(features)
    state.pending_end = N - 1


def new_state(drafter: EagleDrafter, size: int) -> EagleState:
    """An empty state for `size` positions, in the drafter's own dtype and device."""
    size = min(size, drafter.config.max_position_embeddings)
    w = drafter.fc.weight
    return EagleState(ContiguousKVCache(drafter.config, 1, size, dtype=w.dtype, device=w.device),
                      [])


def reserve(drafter: EagleDrafter, state: EagleState, num_tokens: int) -> None:
    """Grow the state's cache (doubling, up to the context) to hold num_tokens positions."""
    cache = state.cache
    if num_tokens <= cache.max_len:
        return
    size = min(drafter.config.max_position_embeddings, max(num_tokens, 2 * cache.max_len))
    bigger = ContiguousKVCache(drafter.config, 1, size, dtype=cache.k.dtype, device=cache.k.device)
    bigger.k[:, :, :cache.max_len] = cache.k                  # [1, 1, max_len, KVH, D]
    bigger.v[:, :, :cache.max_len] = cache.v
    bigger.seq_len = cache.seq_len
    state.cache = bigger


class PrefixFeatures:
    """The target's features of token prefixes that a proposer had to recompute, kept for the
    next sequence with the same prefix (least recently used dropped past `max_tokens` positions).

    The engine's prefix cache skips the positions a request shares with an earlier one (a chat
    template, a system prompt): their K/V come from the pool, so the target never computes their
    features, and a NEW drafter state must recompute them (a target pass over those positions).
    Every request with the same template would pay that pass again; with this memo only the
    first does. Features depend on the prefix alone (causal attention), so the memo's rows are
    the rows a recompute would give."""

    def __init__(self, max_tokens: int = 8192):
        self.max_tokens, self.tokens, self.hits, self.misses = max_tokens, 0, 0, 0
        self._rows: dict = {}                                  # tuple(ids) -> [len(ids), C]

    def get(self, model, ids: list) -> torch.Tensor:
        """The target's features [len(ids), C] of the prefix ids (recomputed on a miss)."""
        key = tuple(ids)
        rows = self._rows.pop(key, None)
        if rows is None:
            self.misses += 1
            rows = hidden_states(model, torch.tensor([ids], device=model.device))[0]
            self.tokens += len(ids)
        else:
            self.hits += 1
        self._rows[key] = rows                                 # newest last
        while self.tokens > self.max_tokens and len(self._rows) > 1:
            self.tokens -= len(self._rows.pop(next(iter(self._rows))))
        return rows


def true_features(model, state: EagleState, token_ids: list, features,
                  memo: Optional[PrefixFeatures] = None) -> tuple:
    """(first position to feed, the target's features [n, C] of positions start .. N - 2).
    `features` [m, C] are the newest positions' features (N - 1 - m .. N - 2) from the engine,
    or None; the positions before those that the state lacks are recomputed (one target pass
    over the prefix that lacks features; through `memo` when given)."""
    N = len(token_ids)
    known = len(state.token_ids) - 1 if state.token_ids == token_ids[:len(state.token_ids)] else 0
    start = max(0, min(known, N - 2))                          # feed at least one position
    m = 0 if features is None else features.shape[0]
    if state.pending and state.pending_end == N - 1 - m:       # kept by observe: they come
        features = torch.cat(state.pending + ([features] if m else []))   # right before these
        m = features.shape[0]
    state.pending, state.pending_end = [], 0
    if m and N - 1 - m <= start:
        return start, features[start - (N - 1 - m):]
    missing = token_ids[:N - 1 - m]                            # positions 0 .. N - 2 - m
    rows = (memo.get(model, missing) if memo is not None else
            hidden_states(model, torch.tensor([missing], device=model.device))[0])
    if m:
        rows = torch.cat((rows, features.to(rows.dtype)))      # [N - 1, C]
    return start, rows[start:]                                 # [N - 1 - start, C]


class RaggedCaches:
    """The model's cache seam for ONE drafter pass over several sequences, each on its own
    EagleState cache: row b's first lengths[b] positions continue caches[b] (from its seq_len);
    the rest of the row is padding, computed but never written or attended to. The drafter has
    one layer, so attention runs row by row (each row's keys are its own cache); every matrix
    product of the pass is shared by the batch."""

    def __init__(self, caches: list, lengths: list):
        self.caches, self.lengths = caches, lengths

    def positions(self, T: int, device) -> torch.Tensor:          # [B, T]; padding repeats
        return torch.tensor([[c.seq_len + min(i, t - 1) for i in range(T)]   # the last position
                             for c, t in zip(self.caches, self.lengths)], device=device)

    def attend(self, layer: int, q, k, v):            # q [B, T, H, D], k/v [B, T, KVH, D]
        out = torch.zeros_like(q)
        for b, (c, t) in enumerate(zip(self.caches, self.lengths)):
            s = c.seq_len
            c.k[layer, 0, s:s + t], c.v[layer, 0, s:s + t] = k[b, :t], v[b, :t]
            # causal among the row's new positions (only the last one's output is drafted
            # from, and with one layer the K/V do not depend on attention, but every output
            # row means what it says)
            seen = None if t == 1 else (torch.arange(s + t, device=q.device)[None]
                                        <= s + torch.arange(t, device=q.device)[:, None])
            out[b, :t] = masked_attention(q[b:b + 1, :t], c.k[layer, :, :s + t],
                                          c.v[layer, :, :s + t], seen)[0]   # [t, H, D]
        return out

    def advance(self, num_tokens: int) -> None:
        for c, t in zip(self.caches, self.lengths):
            c.seq_len += t


@torch.inference_mode()
def draft_batch(drafter: EagleDrafter, model, states: list, token_lists: list, features: list,
                ks: list, draws: list, reduced: bool = True,
                memo: Optional[PrefixFeatures] = None) -> list:
    """ks[b] drafts after token_lists[b] for every sequence b of a batch, each drafter pass and
    head product shared by the sequences still drafting. `draws[b](logits [1, V]) -> (ids, q or
    None)` picks row b's drafts; `memo` keeps recomputed prefix features (PrefixFeatures).
    Returns [(draft ids, [q rows] or [])] per sequence."""
    B, dev = len(states), model.device
    if len({id(st) for st in states}) < B:
        raise ValueError("two sequences share one EagleState: each needs its own (new_state)")
    rows = []
    for st, ids, f, k in zip(states, token_lists, features, ks):
        N = len(ids)
        start, feats = true_features(model, st, ids, f, memo)        # [N - 1 - start, C]
        reserve(drafter, st, N + k)
        st.cache.seq_len = start
        rows.append((feats, ids[start + 1:N]))                       # fed at start .. N - 2
        st.token_ids = list(ids)                                     # true features to N - 2
    lengths = [len(n) for _, n in rows]
    T = max(lengths)
    feats = rows[0][0].new_zeros(B, T, rows[0][0].shape[-1])         # [B, T, C], right-padded
    nxt = torch.zeros(B, T, dtype=torch.long, device=dev)
    for b, (f, n) in enumerate(rows):
        feats[b, :len(n)] = f
        nxt[b, :len(n)] = torch.tensor(n, device=dev)
    g = drafter(model, feats, nxt, RaggedCaches([st.cache for st in states], lengths))
    g = g[torch.arange(B, device=dev), torch.tensor(lengths, device=dev) - 1]   # [B, C]
    drafts, qs, live = [[] for _ in range(B)], [[] for _ in range(B)], list(range(B))
    for j in range(max(ks)):
        logits = drafter.logits(model, g, reduced)                   # [len(live), V]
        for r, b in enumerate(live):
            ids, q = draws[b](logits[r:r + 1])
            drafts[b] += ids
            if q is not None:
                qs[b].append(q[0])
        keep = [r for r, b in enumerate(live) if j + 1 < ks[b]]
        if not keep:
            break
        live = [live[r] for r in keep]                   # the drafter's own g and guess, fed
        g = drafter(model, g[keep][:, None],             # at each row's next position
                    torch.tensor([[drafts[b][-1]] for b in live], device=dev),
                    RaggedCaches([states[b].cache for b in live], [1] * len(live)))[:, 0]
    for st, ids in zip(states, token_lists):
        st.cache.seq_len = len(ids) - 1                              # forget guessed positions
    return list(zip(drafts, qs))


def draft_chain(drafter: EagleDrafter, model, state: EagleState, token_ids: list, features,
                k: int, draw, reduced: bool = True) -> tuple:
    """k drafts after token_ids (the chain): draft_batch for one sequence. Returns (draft ids,
    [q rows] or [])."""
    return draft_batch(drafter, model, [state], [token_ids], [features], [k], [draw],
                       reduced)[0]


@torch.inference_mode()
def draft_tree(drafter: EagleDrafter, model, state: EagleState, token_ids: list, features,
               k: int, branches: int = 2, reduced: bool = True,
               side_depth: Optional[int] = None, memo: Optional[PrefixFeatures] = None) -> tuple:
    """A static tree for greedy verification (tree.py): the drafter's top `branches` tokens at
    depth 1; the first continued greedily to depth k, the others to `side_depth` (default k).
    Returns (tokens [n], parents [n]) with node 0 the last token (the root): with d = side_depth,
    n = 1 + k + (branches - 1) * d nodes and k + (branches - 1) * (d - 1) drafter passes. A
    drafter whose hits sit at the first position gains most from the runner-ups themselves:
    side_depth=1 adds one node per runner-up and no drafter pass to the chain of k."""
    d = k if side_depth is None else side_depth
    if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= k:
        raise ValueError(f"side_depth must be an integer in 1..k={k}, got {side_depth!r}")
    N = len(token_ids)
    start, feats = true_features(model, state, token_ids, features, memo)
    reserve(drafter, state, N + k)
    state.cache.seq_len = start
    nxt = torch.tensor([token_ids[start + 1:N]], device=model.device)
    g0 = drafter(model, feats[None], nxt, state.cache)[:, -1:]               # [1, 1, C]
    state.token_ids = list(token_ids)
    first = drafter.logits(model, g0[0], reduced)[0].topk(branches).indices.tolist()
    tokens, parents = [token_ids[-1]], [-1]
    for i, t in enumerate(first):
        state.cache.seq_len = N - 1                            # each branch from the root
        g, parent, depth_i = g0, 0, k if i == 0 else d
        for depth in range(depth_i):
            tokens.append(t)
            parents.append(parent)
            parent = len(tokens) - 1
            if depth + 1 < depth_i:
                g = drafter(model, g, torch.tensor([[t]], device=model.device), state.cache)
                t = int(drafter.logits(model, g[0], reduced)[0].argmax())
    state.cache.seq_len = N - 1
    return tokens, parents


__all__ = ["EagleDrafter", "EagleState", "DEFAULT_EAGLE_WEIGHTS", "draft_chain", "draft_batch",
           "draft_tree", "new_state", "observe", "RaggedCaches", "PrefixFeatures"]
