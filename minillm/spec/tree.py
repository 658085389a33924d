"""Tree verification (chapter 07): many candidate continuations checked in ONE target forward.

A chain of k drafts dies at its first wrong token. A tree keeps several guesses where the
drafter is unsure (EAGLE-2 keeps the branches its own confidence ranks highest); the target
scores every node in one pass, and the walk keeps the longest branch it agrees with.

    node 0 = the last sampled token (the root), nodes 1 .. n-1 = drafts;
    parents[i] < i is node i's parent (parents[0] = -1)

One forward over all n nodes needs two things a chain does not:

    positions   node i sits at start + depth(i): siblings share a position
    mask        node i sees the whole context and its OWN ancestors (and itself), never a
                sibling's branch: mask[i, j] = j is i or an ancestor of i    (`tree_mask`)

After the walk, the K/V of the accepted branch's nodes are moved to consecutive slots
(`compact`) and everything else is forgotten by the cache's length, as a chain's rollback does.

The walk (`accept_walk`): greedy requests follow the target's argmax from the root while a child
carries it. Sampled requests use multi-candidate rejection sampling (as SpecInfer does): the
children of a node were drawn independently from the draft distribution q of that node; try them
in order, accepting child x with probability min(1, p(x) / q(x)); after a rejection the target
distribution becomes the residual p <- max(p - q, 0) / sum and the next child is tried against
it; when all are rejected, sample from the last residual and stop. Each try is one exact
rejection step, so the emitted token is distributed as p (proved by enumeration in
`tree_round_outcomes`, tests/test_tree.py).

EAGLE's trees are not drawn at random: they are the drafter's top-ranked tokens, a deterministic
function of the context. Each child is then a one-hot draft (draft_probs None): accept it with
the target's probability p(x); on a rejection the residual is p with x removed, renormalised,
and the next sibling is tried against that. Emitting a sibling's token x2 then has probability
(1 - p(x1)) * p(x2) / (1 - p(x1)) = p(x2), and the final draw covers the rest, so this walk is
exact too (`static_tree_outcomes`), with no draft probabilities to carry and no sampling in the
drafter; it accepts x with p(x) where a sampled draft gets min(p, q) summed over x.

Here the tree runs at batch 1 on a contiguous cache (`tree_generate` in loop.py); the engine
runs the same walk for every request of a ragged batch on the paged cache
(speculative_config tree_branches, engine/spec_decode.py): StepMetadata.tree_masks, ANDed into
the batched attention's causal mask (kernels/batched.py), and `PagedKVCache.compact`. The
Triton prefill kernel takes the same mask as one int64 of ancestor bits per query
(`kernels.tree_bits_for`: a tree of at most 64 nodes), ANDed into its causal test
`k_pos <= q_pos` for the keys of the tree's own slots (kernels/paged_prefill.py).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from ..cache.contiguous import ContiguousKVCache
from ..sampling import draw_from
from .rejection import residual


def check_tree(parents: list) -> None:
    if not parents or parents[0] != -1:
        raise ValueError(f"parents[0] must be -1 (node 0 is the root: the last sampled token), "
                         f"got {parents[:1]}")
    for i, p in enumerate(parents[1:], start=1):
        if not (isinstance(p, int) and 0 <= p < i):
            raise ValueError(f"parents[{i}] = {p!r}: every node's parent must be an earlier "
                             "node (list nodes parents first)")


def depths(parents: list) -> list:
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def tree_mask(parents: list) -> torch.Tensor:
    """[n, n] bool: mask[i, j] is True when node j is node i or one of its ancestors."""
    check_tree(parents)
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            m[i, j] = True
            j = parents[j]
    return m


def children_of(parents: list) -> list:
    kids = [[] for _ in parents]
    for i in range(1, len(parents)):
        kids[parents[i]].append(i)
    return kids


class TreeCache:
    """The model's cache seam for one tree forward on a ContiguousKVCache (batch 1): the n tree
    nodes are written at slots start .. start + n - 1, each query sees the context before
    `start` and its ancestors in the tree."""

    def __init__(self, cache: ContiguousKVCache, parents: list):
        self.cache, self.mask = cache, tree_mask(parents)             # [n, n]
        self.seq_len = start = cache.seq_len
        n = len(parents)
        if start + n > cache.max_len:
            raise ValueError(f"the tree needs {start + n} cache slots, the cache has "
                             f"{cache.max_len}; make it larger or the tree smaller")
        # what each node sees, built once for every layer: the context, then its ancestors
        self.allowed = torch.cat([torch.ones(n, start, dtype=torch.bool), self.mask],
                                 dim=1).to(cache.k.device)           # [n, start + n]

    def attend(self, layer: int, q, k, v):                    # q [1, n, H, D], k/v [1, n, KVH, D]
        c, n, start = self.cache, q.shape[1], self.cache.seq_len
        c.k[layer, :, start:start + n], c.v[layer, :, start:start + n] = k, v
        return masked_attention(q, c.k[layer, :, :start + n], c.v[layer, :, :start + n],
                                self.allowed)

    def advance(self, num_tokens: int) -> None:
        self.seq_len += num_tokens


def masked_attention(q, k, v, allowed: torch.Tensor):
    """q [B, Tq, H, D]; k, v [B, Tk, KVH, D]; allowed [Tq, Tk] bool -> [B, Tq, H, D]. PyTorch's
    fused attention with the mask (grouped KV heads shared, not copied)."""
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed,
        enable_gqa=q.shape[2] != k.shape[2])                           # [B, H, Tq, D]
    return o.transpose(1, 2)


def masked_attention_reference(q, k, v, allowed: torch.Tensor):
    """The same, written out in fp32 (the twin tests compare against)."""
    H, D, KVH = q.shape[2], q.shape[3], k.shape[2]
    k = k.repeat_interleave(H // KVH, dim=2)
    v = v.repeat_interleave(H // KVH, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(D)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.float()).to(q.dtype)


@torch.inference_mode()
def tree_forward(model, cache: ContiguousKVCache, tokens: list, parents: list) -> torch.Tensor:
    """ONE target forward over the tree: tokens [n] (node 0 = the last sampled token, at
    position cache.seq_len) -> logits [n, V]: row i is the target's next-token logits after the
    path root .. i. The cache's length is left unchanged (call `compact` after the walk)."""
    start = cache.seq_len
    pos = torch.tensor([[start + d for d in depths(parents)]], device=model.device)   # [1, n]
    x = torch.tensor([tokens], device=model.device)
    return model(x, positions=pos, cache=TreeCache(cache, parents))[0]               # [n, V]


def compact(cache: ContiguousKVCache, start: int, path: list) -> None:
    """Keep the accepted branch: move the K/V of the path's nodes (node indices, root first) to
    slots start, start + 1, ... and set the cache's length past them."""
    src = torch.tensor([start + i for i in path], device=cache.k.device)
    cache.k[:, :, start:start + len(path)] = cache.k[:, :, src]     # [L, 1, len, KVH, D]
    cache.v[:, :, start:start + len(path)] = cache.v[:, :, src]
    cache.seq_len = start + len(path)


def accept_walk(target_probs: torch.Tensor, tokens: list, parents: list,
                draft_probs: Optional[torch.Tensor] = None, greedy: bool = False,
                generator: Optional[torch.Generator] = None) -> tuple:
    """Walk the tree. target_probs [n, V]: the target's final distribution (or logits, for
    greedy) at each node; tokens [n]; draft_probs [n, V]: the draft distribution each node's
    children were drawn from (None: one-hot children, or greedy). Returns (emitted ids: the
    accepted drafts plus one token, path: the node indices kept, root first)."""
    check_tree(parents)
    kids, node, emitted, path = children_of(parents), 0, [], [0]
    while True:
        if greedy:
            want = int(target_probs[node].argmax())
            nxt = next((c for c in kids[node] if tokens[c] == want), None)
            if nxt is None:
                return emitted + [want], path
        else:
            nxt, p = None, target_probs[node].double()
            for c in kids[node]:
                q = _q(draft_probs, node, tokens[c], p)
                u = torch.rand((), generator=generator, dtype=torch.float64)
                if q[tokens[c]] > 0 and u * q[tokens[c]] < p[tokens[c]]:
                    nxt = c
                    break
                p = residual(p, q)
            if nxt is None:
                return emitted + [int(draw_from(p[None], generator))], path
        emitted.append(tokens[nxt])
        path.append(nxt)
        node = nxt


def _q(draft_probs, node: int, token: int, like: torch.Tensor) -> torch.Tensor:
    if draft_probs is not None:
        return draft_probs[node].to(like)
    q = torch.zeros_like(like)
    q[token] = 1.0
    return q


# --- the exact output distribution of one tree round, by enumeration -------------------------
Dist = Callable[[tuple], torch.Tensor]        # prefix -> probabilities [V]


def tree_round_outcomes(p: Dist, q: Dist, branching: tuple, prefix: tuple = ()) -> dict:
    """{emitted tokens: probability} of one tree round, from the formulas: a node at depth d
    gets branching[d] children drawn independently from q(prefix to the node); the walk above.
    Enumerates every draw and every accept / reject outcome (tiny vocabularies only)."""
    out: dict = {}

    def node(pre: tuple, emitted: tuple, depth: int, prob: float):
        pt = p(pre).double()
        if depth == len(branching):                           # a leaf: the bonus token
            for x in range(len(pt)):
                if pt[x] > 0:
                    out[emitted + (x,)] = out.get(emitted + (x,), 0.0) + prob * float(pt[x])
            return
        tries(pre, emitted, depth, prob, pt, q(pre).double(), branching[depth])

    def tries(pre, emitted, depth, prob, pt, qt, left):
        if left == 0:                                         # all children rejected
            for x in range(len(pt)):
                if pt[x] > 0:
                    out[emitted + (x,)] = out.get(emitted + (x,), 0.0) + prob * float(pt[x])
            return
        for d in range(len(qt)):                              # this child's draw
            if qt[d] <= 0:
                continue
            acc = min(1.0, float(pt[d] / qt[d]))
            if acc > 0:
                node(pre + (d,), emitted + (d,), depth + 1, prob * float(qt[d]) * acc)
            if acc < 1:
                tries(pre, emitted, depth, prob * float(qt[d]) * (1 - acc),
                      residual(pt, qt), qt, left - 1)

    node(tuple(prefix), (), 0, 1.0)
    return out


def static_tree_outcomes(p: Dist, draft: Callable, prefix: tuple = ()) -> dict:
    """{emitted tokens: probability} of one round whose tree is a deterministic function of the
    context, draft(prefix) -> (tokens, parents) (node 0 the root; its token is not used), each
    child a one-hot draft: tried in order, accepted with the current target probability of its
    token, which is otherwise removed from the target's distribution (renormalised); when no
    child is accepted, one token is drawn from what is left. Enumerated from these formulas."""
    tokens, parents = draft(tuple(prefix))
    check_tree(parents)
    kids, out = children_of(parents), {}

    def node(i: int, pre: tuple, emitted: tuple, prob: float):
        pt = p(pre).double()
        for c in kids[i]:
            x = tokens[c]
            acc = float(pt[x])
            if acc > 0:
                node(c, pre + (x,), emitted + (x,), prob * acc)
            if acc >= 1:
                return                                        # no mass left to reject into
            prob *= 1 - acc
            pt = pt.clone()
            pt[x] = 0
            pt = pt / pt.sum()
        for x in range(len(pt)):
            if pt[x] > 0:
                out[emitted + (x,)] = out.get(emitted + (x,), 0.0) + prob * float(pt[x])

    node(0, tuple(prefix), (), 1.0)
    return out


__all__ = ["tree_mask", "depths", "children_of", "TreeCache", "tree_forward", "compact",
           "accept_walk", "tree_round_outcomes", "static_tree_outcomes", "masked_attention",
           "masked_attention_reference", "check_tree"]
