"""Tree drafts in the engine (chapter 07): EAGLE's static trees verified in ONE forward of the
ragged batch, on a tiny random model.

- the paged batched attention with a tree mask equals masked attention over a contiguous copy;
- greedy outputs with tree drafts equal sequential greedy generation token for token, with the
  accepted branch often NOT the first one (its K/V must move: `PagedKVCache.compact`), under
  chunked prefill (the budget cuts trees), preemption (recompute and swap), prefix caching and
  n > 1; the features the proposer gets are the target's own along the kept branch, and each
  token's logprob is its own node's;
- the same through the Triton kernels (the interpreter here), which read the tree as bits;
- sampled requests: the first tokens' joint distribution matches the model's own (chi-square)
  while tree drafts are accepted and rejected;
- bad options raise ValueError naming the fix."""
import random

import pytest
import torch

from minillm import SamplingParams
from minillm.cache.paged import build_step_metadata
from minillm.engine import LLMEngine
from minillm.engine.spec_decode import Draft, DraftRequest, check_drafts
from minillm.kernels import batched
from minillm.spec.proposers import PROPOSERS, EagleProposer
from minillm.spec.tree import masked_attention_reference, tree_mask

from test_eagle import FeatureCheck, random_drafter, small_workload
from test_engine_modes import VOCAB, check_invariants, run_engine, sequential, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def drafter(model):
    return random_drafter(model)


@pytest.fixture(scope="module")
def workload(model):
    return small_workload(model, seed=7)


@pytest.mark.parametrize("context", [0, 5, 11])
def test_batched_attention_with_a_tree_mask_equals_masked_attention(context):
    """Two sequences in one step: a tree of 6 nodes after `context` tokens, and a plain chunk of
    3; keys scattered over shuffled blocks. Each query of the tree sees the context and its own
    ancestors, nothing else."""
    torch.manual_seed(context)
    bs, H, KVH, D = 4, 4, 2, 8
    parents = [-1, 0, 0, 1, 2, 3]
    spans = [(context, len(parents)), (2, 3)]
    k_cache = torch.randn(20, bs, KVH, D)
    v_cache = torch.randn(20, bs, KVH, D)
    blocks = torch.randperm(20).tolist()
    tables = [blocks[:5], blocks[5:10]]
    meta = build_step_metadata(spans, tables, bs)
    q = torch.randn(meta.num_tokens, H, D)
    mask = tree_mask(parents)
    plan = batched.plan_prefill(meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, bs,
                                (mask, None))
    out = batched.run(plan, q, k_cache, v_cache, D ** -0.5)
    flat_k, flat_v = k_cache.view(-1, KVH, D), v_cache.view(-1, KVH, D)
    for b, ((c, n), table) in enumerate(zip(spans, tables)):
        slots = [table[j // bs] * bs + j % bs for j in range(c + n)]
        keys, values = flat_k[slots][None], flat_v[slots][None]      # [1, c + n, KVH, D]
        if b == 0:
            allowed = torch.cat([torch.ones(n, c, dtype=torch.bool), mask], 1)
        else:
            allowed = torch.arange(c + n)[None] <= c + torch.arange(n)[:, None]
        rows = slice(int(meta.cu_seqlens_q[b]), int(meta.cu_seqlens_q[b + 1]))
        want = masked_attention_reference(q[rows][None], keys, values, allowed)[0]
        torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)


class OracleTree(FeatureCheck, EagleProposer):
    """Trees of two branches built from the reference continuation: the right next token sits
    on branch 0 or branch 1 at random (so the kept branch often is not the first and its K/V
    must move), later nodes are right with probability 0.7; every feature is checked."""

    def propose(self, requests):
        self.check_features(requests)
        return [self._oracle_tree(r) for r in requests]

    def _oracle_tree(self, r: DraftRequest) -> Draft:
        ids = list(r.token_ids)
        prompt = next((p for p in self.reference if ids[:len(p)] == list(p)), ())
        ref = self.reference.get(prompt, [])[len(ids) - len(prompt):]
        rng = random.Random(len(ids) * 31 + len(prompt))

        def guess(i, right):
            return ref[i] if right and i < len(ref) else rng.randrange(VOCAB)

        k = r.num_drafts
        side = min(2, k)
        good = rng.randrange(2)                       # which branch holds the right token
        tokens, parents = [], [-1]
        for branch, depth in ((0, k), (1, side)):
            parent, right = 0, branch == good
            for i in range(depth):
                tokens.append(guess(i, right))
                parents.append(parent)
                parent = len(tokens)
                right = right and rng.random() < 0.7
        if r.max_nodes is not None and len(tokens) > r.max_nodes:
            tokens, parents = tokens[:k], parents[:k + 1]          # branch 0 alone
        return Draft(tokens, None, None, parents)


MODES = {
    "continuous": dict(),
    "chunked_small_budget": dict(max_num_batched_tokens=10, max_num_seqs=8),
    "recompute_tiny_pool": dict(num_kv_blocks=26, block_size=4),
    "swap_tiny_pool": dict(num_kv_blocks=26, block_size=4, preemption="swap"),
    "prefix_caching_off": dict(enable_prefix_caching=False),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tree_drafts_equal_sequential(model, drafter, workload, mode, monkeypatch):
    prompts, max_tokens, expected = workload
    OracleTree.start(prompts, expected)
    monkeypatch.setitem(PROPOSERS, "eagle", OracleTree)
    kw = dict(num_kv_blocks=400, block_size=4, max_num_seqs=16, max_num_batched_tokens=64)
    kw.update(MODES[mode])
    cfg = dict(method="eagle", num_speculative_tokens=3, eagle_weights=drafter,
               tree_branches=2)
    engine = LLMEngine(model, None, speculative_config=cfg, **kw)
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=0) for m in max_tokens]
    outs, _ = run_engine(engine, prompts, max_tokens, params=params)
    for i, ref in enumerate(expected):
        assert outs[str(i)].token_ids == ref, f"{mode}: request {i} differs"
        # each token's logprob comes from its own node's row: the full forward's
        full = torch.log_softmax(model(torch.tensor([prompts[i] + ref]))[0].detach().double(), -1)
        got = [d[t].logprob for d, t in zip(outs[str(i)].outputs[0].logprobs, ref)]
        want = [float(full[len(prompts[i]) - 1 + j, t]) for j, t in enumerate(ref)]
        assert got == pytest.approx(want, abs=1e-4), f"{mode}: request {i}'s logprobs"
    check_invariants(engine)
    st = engine.spec_decode_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens     # both accepts and rejects
    assert st.num_side_branch_kept > 0                          # branch 1 kept: its K/V moved
    assert len(st.acceptance_by_position) == 3                  # positions are depths, not nodes
    assert OracleTree.checked[0] > 0 and OracleTree.wrong_features == []   # the target's


def test_tree_steps_through_the_triton_kernels(model, drafter, workload, monkeypatch):
    """The same engine with every attention call on the Triton kernels (run by the interpreter
    here, compiled on a GPU): tree steps read the ancestor bits, and the tokens are still
    sequential greedy's (three requests, a few tokens each: the interpreter is slow)."""
    prompts, _, _ = workload
    ps, mt = prompts[:3], [6, 4, 5]
    expected = sequential(model, ps, mt)
    OracleTree.start(ps, expected)
    monkeypatch.setitem(PROPOSERS, "eagle", OracleTree)
    engine = LLMEngine(model, None, num_kv_blocks=100, block_size=4,
                       speculative_config=dict(method="eagle", num_speculative_tokens=3,
                                               eagle_weights=drafter, tree_branches=2))
    engine.runner.cache.impl = "triton"
    outs, _ = run_engine(engine, ps, mt)
    assert [outs[str(i)].token_ids for i in range(3)] == expected
    assert engine.spec_decode_stats.num_accepted_tokens > 0


def test_the_real_drafter_trees_with_prefix_hits_and_n2(model, drafter, workload):
    """EagleProposer's own trees (draft_tree over the random drafter), a shared cached prefix
    and n = 2 siblings: the same tokens as sequential greedy."""
    prompts, _, _ = workload
    shared = prompts[0] * 3
    ps = [shared + [1, 2], shared + [3], prompts[1]]
    ref = sequential(model, ps, [12] * 3)
    engine = LLMEngine(model, None, num_kv_blocks=200, block_size=4,
                       speculative_config=dict(method="eagle", num_speculative_tokens=3,
                                               eagle_weights=drafter, tree_branches=3,
                                               tree_side_depth=1))
    outs, _ = run_engine(engine, ps, None, arrive_at=[0, 3, 3],
                         params=[SamplingParams(temperature=0.0, max_tokens=12, n=2)] * 3)
    for i in range(3):
        assert [c.token_ids for c in outs[str(i)].outputs] == [ref[i], ref[i]]
    st = engine.spec_decode_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    check_invariants(engine)


@pytest.mark.parametrize("side_depth", [1, None])
def test_narrow_trees_are_drafted_for_the_batch_at_once(model, drafter, side_depth):
    """Trees whose runner-up branches are one node deep come from shared drafter passes
    (draft_batch): the same nodes and parents as eagle.draft_tree one request at a time, with
    mixed k; with side_depth None that holds at k = 1, and deeper trees go one by one."""
    from minillm.spec.eagle import draft_tree, new_state
    rng = random.Random(11)
    seqs = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 14, 5, 11)]
    ks = [3, 1, 2, 1] if side_depth == 1 else [1, 1, 1, 1]
    prop = EagleProposer(model, drafter, 3, tree_branches=2, tree_side_depth=side_depth)
    asks = [DraftRequest(s, k, SamplingParams(), None) for s, k in zip(seqs, ks)]
    calls = []
    real = prop._tree
    prop._tree = lambda r, st: calls.append(r) or real(r, st)
    got = prop.propose(asks)
    assert calls == []                                        # all in shared passes
    for d, s, k in zip(got, seqs, ks):
        nodes, parents = draft_tree(drafter, model, new_state(drafter, 32), s, None, k, 2,
                                    True, 1)
        assert d.token_ids == nodes[1:] and d.parents == parents and d.probs is None
    near_end = prop.propose([DraftRequest(seqs[0], ks[0], SamplingParams(), None,
                                          max_nodes=ks[0])])[0]        # no room for runner-ups
    assert near_end.token_ids == got[0].token_ids[:ks[0]]
    assert near_end.parents == [-1] + list(range(ks[0]))
    if side_depth is None:                                    # k = 2: a deep side branch
        prop.propose([DraftRequest(seqs[0], 2, SamplingParams(), None)])
        assert len(calls) == 1


class TopTree(EagleProposer):
    """Depth-1 trees of two of the TARGET's top-3 next tokens (in a random order), so that
    sampled drafts are accepted often and rejected often."""

    def propose(self, requests):
        out = []
        for r in requests:
            logits = self.model(torch.tensor([list(r.token_ids)]))[0, -1]
            top = logits.topk(3).indices.tolist()
            random.Random(len(r.token_ids) + top[0]).shuffle(top)
            out.append(Draft(top[:2], None, None, [-1, 0, 0]))
        return out


def test_sampled_tree_drafts_keep_the_models_distribution(model, drafter, monkeypatch):
    """600 seeded requests of the same prompt, top_k=3, temperature 1, 3 tokens each: the
    first token comes from the prefill, tokens 2 and 3 from a verified tree. The 27 outcomes'
    counts against the model's own joint probabilities (chi-square, 26 degrees of freedom;
    p < 0.001 fails). A walk that skipped the residual would overweight the drafted tokens."""
    monkeypatch.setitem(PROPOSERS, "eagle", TopTree)
    prompt = [5, 17, 42, 99]
    engine = LLMEngine(model, None, num_kv_blocks=800, block_size=4, max_num_seqs=64,
                       speculative_config=dict(method="eagle", num_speculative_tokens=1,
                                               eagle_weights=drafter, tree_branches=2))
    n = 600
    params = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, seed=s) for s in range(n)]
    outs, _ = run_engine(engine, [prompt] * n, None, params=params)
    counts = {}
    for o in outs.values():
        key = tuple(o.token_ids)
        counts[key] = counts.get(key, 0) + 1
    st = engine.spec_decode_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens

    def dist(ids):                                    # top-3, temperature 1, renormalised
        logits = model(torch.tensor([prompt + list(ids)]))[0, -1].double()
        top = logits.topk(3)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, 0).tolist()))

    chi2, cells = 0.0, 0
    for t1, p1 in dist(()).items():
        for t2, p2 in dist((t1,)).items():
            for t3, p3 in dist((t1, t2)).items():
                want = n * p1 * p2 * p3
                chi2 += (counts.get((t1, t2, t3), 0) - want) ** 2 / want
                cells += 1
    assert cells == 27 and sum(counts.values()) == n
    assert chi2 < 54.05, f"chi-square {chi2:.1f} over 26 degrees of freedom"   # p = 0.001


def test_bad_tree_options_and_drafts(model, drafter):
    base = dict(method="eagle", num_speculative_tokens=3, eagle_weights=drafter)
    for bad, match in [(dict(tree_branches=0), "tree_branches must be"),
                       (dict(tree_branches=True), "tree_branches must be"),
                       (dict(tree_branches=9), "tree_branches must be"),
                       (dict(tree_branches=2, tree_side_depth=4), "tree_side_depth must be"),
                       (dict(tree_side_depth=1), "set tree_branches >= 2"),
                       (dict(num_speculative_tokens=16, tree_branches=5), "81 nodes")]:
        with pytest.raises(ValueError, match=match):
            LLMEngine(model, None, num_kv_blocks=50, block_size=4,
                      speculative_config={**base, **bad})
    with pytest.raises(ValueError, match="is for method 'eagle'"):
        LLMEngine(model, None, num_kv_blocks=50, block_size=4,
                  speculative_config=dict(method="ngram", num_speculative_tokens=2,
                                          tree_branches=2))
    ask = DraftRequest([1, 2, 3], 2, SamplingParams(), None, max_nodes=3)
    prop = EagleProposer(model, drafter, 2)
    for d, match in [(Draft([4, 5], None, None, [-1, 0]), "parents for 2 drafts"),
                     (Draft([4, 5], None, None, [-1, 1, 0]), "must be an earlier node"),
                     (Draft([4, 5, 6], None, None, [-1, 0, 1, 2]), "3 drafts deep"),
                     (Draft([4, 5, 6, 7], None, None, [-1, 0, 0, 1, 2]), "max_nodes is 3"),
                     (Draft([4, 5], torch.ones(2, VOCAB), None, [-1, 0, 0]), "probs=None")]:
        with pytest.raises(ValueError, match=match):
            check_drafts([ask], [d], prop)
