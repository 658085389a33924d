"""Tree verification (chapter 07): the mask and positions give every node exactly the logits a
separate forward over its own branch gives; the accepted branch's K/V, compacted, continue
decoding exactly; the tree walk's output distribution equals the target's, for sampled and for
deterministic (top-ranked, one-hot) children (by enumeration on a tiny vocabulary, and the
sampler agrees with the enumeration); bad trees raise ValueError."""
import pytest
import torch

from minillm.cache.contiguous import ContiguousKVCache
from minillm.spec import theory
from minillm.spec.tree import (accept_walk, compact, depths, masked_attention,
                               masked_attention_reference, static_tree_outcomes, tree_forward,
                               tree_mask, tree_round_outcomes)

from test_engine_modes import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# root 0 -> 1, 2; 1 -> 3, 4; 2 -> 5; 3 -> 6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]
TOKENS = [7, 11, 12, 13, 14, 15, 16]


def test_tree_mask_and_depths():
    m = tree_mask(PARENTS)
    ancestors = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5},
                 6: {0, 1, 3, 6}}
    for i, anc in ancestors.items():
        assert {j for j in range(len(PARENTS)) if m[i, j]} == anc
    assert depths(PARENTS) == [0, 1, 1, 2, 2, 2, 3]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("context,heads", [(0, (4, 4)), (9, (6, 2)), (33, (9, 3))])
def test_masked_attention_matches_its_plain_twin(context, heads, dtype, tol):
    g = torch.Generator().manual_seed(context)
    H, KVH = heads
    n = len(PARENTS)
    q = torch.randn(1, n, H, 16, generator=g).to(dtype)
    k = torch.randn(1, context + n, KVH, 16, generator=g).to(dtype)
    v = torch.randn(1, context + n, KVH, 16, generator=g).to(dtype)
    allowed = torch.cat([torch.ones(n, context, dtype=torch.bool), tree_mask(PARENTS)], dim=1)
    got, want = masked_attention(q, k, v, allowed), masked_attention_reference(q, k, v, allowed)
    assert got.dtype == dtype and got.shape == (1, n, H, 16)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # a key a node may not see changes nothing for it: node 1 never sees node 2's slot
    k2 = k.clone()
    k2[0, context + 2] += 5
    assert torch.equal(masked_attention(q, k2, v, allowed)[0, 1], got[0, 1])


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def branch(parents, tokens, i):
    path = []
    while i != -1:
        path.append(tokens[i])
        i = parents[i]
    return path[::-1]


def test_one_tree_forward_equals_each_branch_alone(model):
    context = [3, 1, 4, 1, 5, 9]
    cache = ContiguousKVCache(model.config, 1, 32)
    model(torch.tensor([context]), cache=cache)
    logits = tree_forward(model, cache, TOKENS, PARENTS)                     # [n, V]
    assert cache.seq_len == len(context)
    for i in range(len(PARENTS)):
        ids = torch.tensor([context + branch(PARENTS, TOKENS, i)])
        ref = model(ids)[0, -1]                                              # no cache
        torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)


def test_compacted_branch_continues_exactly(model):
    context = [2, 7, 1, 8]
    cache = ContiguousKVCache(model.config, 1, 32)
    model(torch.tensor([context]), cache=cache)
    start = cache.seq_len
    tree_forward(model, cache, TOKENS, PARENTS)
    path = [0, 1, 4]                                                         # root, 1, 4
    compact(cache, start, path)
    assert cache.seq_len == start + 3
    nxt = model(torch.tensor([[5]]), cache=cache)[0, -1]
    ref = model(torch.tensor([context + [TOKENS[0], TOKENS[1], TOKENS[4], 5]]))[0, -1]
    torch.testing.assert_close(nxt, ref, atol=1e-4, rtol=1e-4)


def test_greedy_walk_follows_the_argmax():
    V = 20
    target = torch.full((len(PARENTS), V), -1.0)
    target[0, 11] = target[1, 14] = target[4, 3] = 1.0                       # 0 -> 1 -> 4 -> stop
    emitted, path = accept_walk(target, TOKENS, PARENTS, greedy=True)
    assert emitted == [11, 14, 3] and path == [0, 1, 4]
    target[0, 9] = 5.0                                                       # no child has 9
    assert accept_walk(target, TOKENS, PARENTS, greedy=True) == ([9], [0])


@pytest.mark.parametrize("branching", [(2,), (2, 1), (3, 2), (1, 1)])
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_rejection_sampling_is_exact_by_enumeration(branching, seed):
    V, length = 3, 3
    p = theory.random_tree(V, seed, zeros=0.2)
    q = theory.random_tree(V, seed + 100, zeros=0.2)
    out = theory.rounds_distribution(lambda pre: tree_round_outcomes(p, q, branching, pre), length)
    want = theory.target_sequence_distribution(p, V, length)
    assert theory.max_abs_difference(out, want) < 1e-9


def test_sampler_agrees_with_the_enumeration():
    """accept_walk run many times on a 2-branch tree matches tree_round_outcomes."""
    V = 3
    p = theory.random_tree(V, 4)
    q = theory.random_tree(V, 5)
    g = torch.Generator().manual_seed(0)
    want = tree_round_outcomes(p, q, (2, 1))
    counts: dict = {}
    n = 6000
    for _ in range(n):
        a, b = (int(torch.multinomial(q(()).float(), 1, generator=g)) for _ in range(2))
        ca = int(torch.multinomial(q((a,)).float(), 1, generator=g))
        cb = int(torch.multinomial(q((b,)).float(), 1, generator=g))
        tokens, parents = [0, a, b, ca, cb], [-1, 0, 0, 1, 2]
        tp = torch.stack([p(()), p((a,)), p((b,)), p((a, ca)), p((b, cb))])
        dp = torch.stack([q(()), q((a,)), q((b,)), q((a, ca)), q((b, cb))])
        emitted, _ = accept_walk(tp, tokens, parents, dp, generator=g)
        counts[tuple(emitted)] = counts.get(tuple(emitted), 0) + 1
    for key, pr in want.items():
        sd = (pr * (1 - pr) / n) ** 0.5
        assert abs(counts.get(key, 0) / n - pr) < 5 * sd + 1e-3, key
    assert set(counts) <= set(want)


def _ranked_tree(scores, branches, depth, side, root=0):
    """A deterministic tree as EAGLE drafts it, from scores(prefix) -> [V]: the top `branches`
    tokens at the root, the first continued by argmax to `depth`, the others to `side`.
    Returns draft(prefix) -> (tokens, parents), node 0 the root (token `root`)."""
    def draft(prefix):
        tokens, parents = [root], [-1]
        for i, t in enumerate(scores(prefix).topk(branches).indices.tolist()):
            parent, pre = 0, prefix
            for _d in range(depth if i == 0 else side):
                tokens.append(t)
                parents.append(parent)
                parent, pre = len(tokens) - 1, pre + (t,)
                t = int(scores(pre).argmax())
        return tokens, parents
    return draft


@pytest.mark.parametrize("branches,depth,side", [(2, 1, 1), (2, 2, 1), (3, 2, 2), (1, 2, 2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_deterministic_tree_walk_is_exact_by_enumeration(branches, depth, side, seed):
    """Top-ranked children verified as one-hot drafts (what tree_generate does when sampling):
    the sequences emitted over rounds have the target's distribution, also when the drafter
    ranks a token the target gives zero probability, and with a repeated sibling."""
    V, length = 4, 3
    p = theory.random_tree(V, seed, zeros=0.3)
    q = theory.random_tree(V, seed + 100)
    drafts = [_ranked_tree(q, branches, depth, side),
              lambda prefix: ([0, 2, 2, 1], [-1, 0, 0, 2])]                # token 2 twice
    want = theory.target_sequence_distribution(p, V, length)
    for draft in drafts:
        out = theory.rounds_distribution(lambda pre: static_tree_outcomes(p, draft, pre), length)
        assert theory.max_abs_difference(out, want) < 1e-9


def test_deterministic_enumeration_can_fail():
    """The enumeration above notices a walk that forgets to remove a rejected token: with the
    rejected sibling left in the target's distribution, the outcome is no longer the target's."""
    V = 3
    p = theory.random_tree(V, 3)
    want = theory.target_sequence_distribution(p, V, 1)
    draft = lambda prefix: ([0, 0, 1], [-1, 0, 0])                          # noqa: E731
    right = {e[:1]: 0.0 for e in static_tree_outcomes(p, draft)}
    for e, pr in static_tree_outcomes(p, draft).items():
        right[e[:1]] += pr
    assert theory.max_abs_difference(right, want) < 1e-12
    p0 = p(()).double()                                                      # the planted bug:
    wrong = {(x,): p0[0] * (x == 0) + (1 - p0[0]) * p0[1] * (x == 1)         # no removal
             + (1 - p0[0]) * (1 - p0[1]) * p0[x] for x in range(V)}
    assert theory.max_abs_difference({k: float(v) for k, v in wrong.items()}, want) > 1e-3


def test_sampler_agrees_with_the_deterministic_enumeration():
    """accept_walk with one-hot children (draft_probs None), run many times, matches
    static_tree_outcomes."""
    V = 4
    p = theory.random_tree(V, 6)
    q = theory.random_tree(V, 7)
    draft = _ranked_tree(q, 2, 2, 1)
    tokens, parents = draft(())
    want = static_tree_outcomes(p, draft)
    pre = [()]
    for i in range(1, len(tokens)):
        pre.append(pre[parents[i]] + (tokens[i],))
    tp = torch.stack([p(x) for x in pre])
    g = torch.Generator().manual_seed(0)
    counts: dict = {}
    n = 6000
    for _ in range(n):
        emitted, _ = accept_walk(tp, tokens, parents, generator=g)
        counts[tuple(emitted)] = counts.get(tuple(emitted), 0) + 1
    for key, pr in want.items():
        sd = (pr * (1 - pr) / n) ** 0.5
        assert abs(counts.get(key, 0) / n - pr) < 5 * sd + 1e-3, key
    assert set(counts) <= set(want)


@pytest.mark.parametrize("parents,match", [([0, 0], "parents\\[0\\] must be -1"),
                                           ([-1, 1], "earlier node"),
                                           ([-1, 0, 3, 1], "earlier node")])
def test_bad_trees(parents, match):
    with pytest.raises(ValueError, match=match):
        tree_mask(parents)


def test_tree_larger_than_the_cache_is_refused(model):
    cache = ContiguousKVCache(model.config, 1, 8)
    model(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache)
    with pytest.raises(ValueError, match="tree smaller"):
        tree_forward(model, cache, TOKENS, PARENTS)


@pytest.mark.parametrize("branches,k,side", [(2, 3, None), (3, 1, None), (1, 4, None),
                                             (2, 4, 1), (3, 3, 2)])
def test_eagle_tree_decoding_equals_plain_greedy(model, branches, k, side):
    """tree_generate (EAGLE tree drafts, one tree forward per step, compaction) gives the same
    tokens as greedy decoding, with full and shortened runner-up branches; a random drafter,
    so most branches are rejected."""
    import minillm
    from minillm import SamplingParams
    from minillm.spec import EagleDrafter, EagleProposer, SpecStats
    from minillm.spec.loop import tree_generate
    torch.manual_seed(1)
    proposer = EagleProposer(model, EagleDrafter.for_model(model), k)
    for prompt in ([5, 9, 2], [1, 1, 1, 1, 1, 1, 7]):
        ref = minillm.generate(model, None, prompt, max_new_tokens=20,
                               sampling=SamplingParams(temperature=0.0, max_tokens=20))
        st = SpecStats()
        out = tree_generate(model, None, prompt, proposer, k, 20, branches, stats=st,
                            side_depth=side)
        assert out == ref
        assert st.num_target_forwards <= 21


def test_runner_up_branches_cut_to_side_depth(model):
    """draft_tree's shape: the first branch k deep, every runner-up side_depth deep, all from
    the root; a side_depth outside 1..k is refused."""
    from minillm.spec import EagleDrafter
    from minillm.spec.eagle import draft_tree, new_state
    from minillm.spec.medusa import hidden_states
    torch.manual_seed(2)
    drafter = EagleDrafter.for_model(model)
    ids = [3, 8, 1, 9, 4]
    feats = hidden_states(model, torch.tensor([ids]))[0, :-1]
    for side, want in ((None, [4, 4, 4]), (1, [4, 1, 1]), (2, [4, 2, 2])):
        tokens, parents = draft_tree(drafter, model, new_state(drafter, 32), ids, feats, 4, 3,
                                     side_depth=side)
        assert len(tokens) == 1 + sum(want) and tokens[0] == ids[-1]
        roots = [i for i, p in enumerate(parents) if p == 0]             # each branch's start
        d = depths(parents)
        assert [max(d[j] for j in range(r, (roots + [len(parents)])[n + 1]))
                for n, r in enumerate(roots)] == want
        full = draft_tree(drafter, model, new_state(drafter, 32), ids, feats, 4, 3)[0]
        assert tokens[1:1 + 4] == full[1:1 + 4]                         # the chain is the same
    for bad in (0, 5, 1.0, True):
        with pytest.raises(ValueError, match="side_depth"):
            draft_tree(drafter, model, new_state(drafter, 32), ids, feats, 4, 2, side_depth=bad)


def _oracle_tree(model):
    """draft_tree's stand-in for the sampled tests: the target's own top tokens (from a full
    forward), so most branches are accepted and the accept path runs, not only rejections."""
    def draft(drafter, m, state, token_ids, features, k, branches, reduced, side_depth):
        nxt = lambda pre: model(torch.tensor([list(token_ids) + list(pre)]))[0, -1]  # noqa: E731
        return _ranked_tree(nxt, branches, k, k if side_depth is None else side_depth,
                            root=token_ids[-1])(())
    return draft


def test_sampled_tree_decoding_with_top_k_1_equals_greedy(model):
    """temperature 1 with top_k 1 is greedy through the SAMPLED walk (target probabilities,
    one-hot children, the generator): the same tokens as plain greedy decoding."""
    import minillm
    from minillm import SamplingParams
    from minillm.spec import EagleDrafter, EagleProposer
    from minillm.spec.loop import tree_generate
    torch.manual_seed(1)
    proposer = EagleProposer(model, EagleDrafter.for_model(model), 3)
    for prompt in ([5, 9, 2], [1, 1, 1, 1, 1, 1, 7]):
        ref = minillm.generate(model, None, prompt, max_new_tokens=16,
                               sampling=SamplingParams(temperature=0.0, max_tokens=16))
        sp = SamplingParams(temperature=1.0, top_k=1, max_tokens=16, seed=3)
        assert tree_generate(model, None, prompt, proposer, 3, 16, 2, sampling=sp) == ref


@pytest.mark.parametrize("drafter,k", [("random", 1), ("oracle", 1), ("oracle", 2)])
def test_sampled_tree_decoding_has_the_targets_distribution(model, drafter, k, monkeypatch):
    """The first three tokens of tree_generate at temperature 1 (top_k 3: 27 outcomes), over
    1200 seeds, against their exact probabilities from the target (chi-square p > 1e-3), with
    a random drafter (mostly rejections) and one that ranks by the target (mostly accepts);
    k = 2: the second and third tokens come from one round two deep."""
    from minillm import SamplingParams
    from minillm.spec import EagleDrafter, EagleProposer, SpecStats
    from minillm.spec import eagle as eagle_mod
    from minillm.spec.loop import tree_generate
    from minillm.sampling import probs
    torch.manual_seed(1)
    proposer = EagleProposer(model, EagleDrafter.for_model(model), k)
    if drafter == "oracle":
        monkeypatch.setattr(eagle_mod, "draft_tree", _oracle_tree(model))
    prompt, n = [5, 9, 2, 4], 1200
    sp = dict(temperature=1.0, top_k=3, max_tokens=3)
    pr = lambda ctx: probs(model(torch.tensor([prompt + list(ctx)]))[0, -1:],   # noqa: E731
                           SamplingParams(**sp))[0].double().detach()
    want = {}
    p0 = pr(())
    for a in p0.nonzero().flatten().tolist():
        p1 = pr((a,))
        for b in p1.nonzero().flatten().tolist():
            p2 = pr((a, b))
            for c in p2.nonzero().flatten().tolist():
                want[(a, b, c)] = float(p0[a] * p1[b] * p2[c])
    counts, st = {}, SpecStats()
    for seed in range(n):
        out = tree_generate(model, None, prompt, proposer, k, 3 + k - 1, 2, stats=st,
                            sampling=SamplingParams(**sp, seed=seed))[:3]
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    stat, pval = theory.chi_square(counts, want)
    assert pval > 1e-3, (stat, pval)
    assert len(st.acceptance_by_position) == k              # rounds k deep did run
    if drafter == "oracle":
        assert min(st.acceptance_by_position) > 0.3         # the accept path did run
