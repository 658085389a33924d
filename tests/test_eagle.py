"""The EAGLE drafter (chapter 07) on a tiny random model: greedy outputs with method "eagle" equal
sequential greedy generation token for token under chunked prefill, preemption (recompute and
swap), prefix caching and n > 1; the features the engine hands the proposer are the target's
own (checked against a no-cache forward); the drafter's cache keeps only true-feature positions;
save/load round-trips; bad weights and options raise ValueError naming the fix."""
import random

import pytest
import torch

from minillm import SamplingParams
from minillm.engine import LLMEngine
from minillm.spec import eagle as eagle_mod
from minillm.spec.eagle import (EagleDrafter, PrefixFeatures, draft_batch, draft_chain,
                                new_state, observe, reserve, true_features)
from minillm.spec.medusa import hidden_states
from minillm.spec.proposers import PROPOSERS, EagleProposer

from test_engine_modes import VOCAB, check_invariants, run_engine, sequential, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def random_drafter(model):
    """A random (untrained) drafter with a reduced head over half the vocabulary."""
    torch.manual_seed(0)
    d = EagleDrafter.for_model(model, torch.arange(0, VOCAB, 2))
    with torch.no_grad():
        d.fc.weight.normal_(0, 0.2)
    return d.eval()


def small_workload(model, seed: int = 5):
    """10 short random prompts, 1-20 tokens each, and their sequential greedy outputs."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))] for _ in range(10)]
    max_tokens = [rng.randint(1, 20) for _ in prompts]
    return prompts, max_tokens, sequential(model, prompts, max_tokens)


@pytest.fixture(scope="module")
def drafter(model):
    return random_drafter(model)


@pytest.fixture(scope="module")
def workload(model):
    return small_workload(model)


class FeatureCheck:
    """For a stand-in proposer: compares every feature the engine hands over with a no-cache
    forward of the target. Mismatches are recorded, not asserted inside propose: the engine
    treats a proposer's exception as "no drafts this step" and would carry on."""
    reference: dict = {}                  # prompt -> its sequential greedy output
    checked = [0]
    wrong_features: list = []

    @classmethod
    def start(cls, prompts, expected) -> None:
        """Before a run: the reference outputs, and no feature checked yet."""
        cls.reference = {tuple(p): r for p, r in zip(prompts, expected)}
        cls.checked[0] = 0
        cls.wrong_features.clear()

    def check_features(self, requests) -> None:
        for r in requests:
            if r.features is not None:
                ids, m = list(r.token_ids), r.features.shape[0]
                want = hidden_states(self.model, torch.tensor([ids[:-1]]))[0, -m:]
                if not torch.allclose(r.features, want, atol=1e-4, rtol=1e-4):
                    self.wrong_features.append(len(ids))
                self.checked[0] += 1


class OracleEagle(FeatureCheck, EagleProposer):
    """The real EagleProposer path (draft_batch over the whole batch, each sequence's cache and
    rollback), but each draft is the reference continuation with probability 0.6 (else a wrong
    token), so steps mix accepted and rejected drafts; every feature is checked."""

    def propose(self, requests):
        self.check_features(requests)
        return super().propose(requests)

    def _draw(self, r):
        ids = list(r.token_ids)
        prompt = next((p for p in self.reference if ids[:len(p)] == list(p)), None)
        ref = self.reference.get(prompt, [])
        rng = random.Random(len(ids))
        at = [len(ids) - len(prompt or ())]                  # index into ref of the next draft

        def draw(logits):
            i, at[0] = at[0], at[0] + 1
            good = i < len(ref) and rng.random() < 0.6
            return [ref[i] if good else int(logits.argmax())], None
        return draw


MODES = {
    "continuous": dict(),
    "chunked_small_budget": dict(max_num_batched_tokens=12, max_num_seqs=8),
    "recompute_tiny_pool": dict(num_kv_blocks=24, block_size=4),
    "swap_tiny_pool": dict(num_kv_blocks=24, block_size=4, preemption="swap"),
    "prefix_caching_off": dict(enable_prefix_caching=False),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_eagle_equals_sequential(model, drafter, workload, mode, monkeypatch):
    prompts, max_tokens, expected = workload
    OracleEagle.start(prompts, expected)
    monkeypatch.setitem(PROPOSERS, "eagle", OracleEagle)
    kw = dict(num_kv_blocks=400, block_size=4, max_num_seqs=16, max_num_batched_tokens=64)
    kw.update(MODES[mode])
    cfg = dict(method="eagle", num_speculative_tokens=3, eagle_weights=drafter)
    engine = LLMEngine(model, None, speculative_config=cfg, **kw)
    outs, _ = run_engine(engine, prompts, max_tokens)
    for i, ref in enumerate(expected):
        assert outs[str(i)].token_ids == ref, f"{mode}: request {i} differs"
    check_invariants(engine)
    st = engine.spec_decode_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens     # both accepts and rejects
    assert OracleEagle.checked[0] > 0 and OracleEagle.wrong_features == []   # the target's


@pytest.mark.parametrize("draft_dtype", [None, "bfloat16"])
def test_prefix_cache_hit_and_n2_with_the_real_drafter(model, drafter, workload, draft_dtype):
    """The plain EagleProposer (its own argmax drafts), with a shared prefix cached between
    requests (the drafter recomputes the features of positions the target did not compute)
    and n = 2 siblings (forked: no features of their own); in the model's dtype and with the
    drafter alone in bf16 (other drafts, the same output)."""
    prompts, _, _ = workload
    shared = prompts[0] * 3
    ps = [shared + [1, 2], shared + [3], prompts[1]]
    ref = sequential(model, ps, [12] * 3)
    engine = LLMEngine(model, None, num_kv_blocks=200, block_size=4,
                       speculative_config=dict(method="eagle", num_speculative_tokens=2,
                                               eagle_weights=drafter, draft_head="full",
                                               draft_dtype=draft_dtype))
    want = torch.bfloat16 if draft_dtype else model.dtype
    assert engine.proposer.drafter.fc.weight.dtype == want
    assert drafter.fc.weight.dtype == model.dtype              # the caller's drafter untouched
    outs, _ = run_engine(engine, ps, None, arrive_at=[0, 3, 3],
                         params=[SamplingParams(temperature=0.0, max_tokens=12, n=2)] * 3)
    for i in range(3):
        assert [c.token_ids for c in outs[str(i)].outputs] == [ref[i], ref[i]]
    assert engine.spec_decode_stats.num_draft_tokens > 0
    check_invariants(engine)


def test_missing_features_are_recomputed_for_the_prefix_only_and_kept(model):
    """A new drafter state with the engine's features of its newest positions only (the rest
    came from the prefix cache): the positions before are recomputed, and together they are
    the target's features; a second sequence with the same prefix reuses the memo's rows; the
    memo drops its oldest prefix past max_tokens."""
    rng = random.Random(11)
    ids = [rng.randrange(VOCAB) for _ in range(14)]
    want = hidden_states(model, torch.tensor([ids[:-1]]))[0]                 # [13, C]
    memo = PrefixFeatures(max_tokens=12)
    start, got = true_features(model, new_state(random_drafter(model), 32), ids,
                               want[-5:], memo)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert start == 0 and (memo.misses, memo.hits) == (1, 0)
    assert [len(k) for k in memo._rows] == [8]                 # the 8 positions it lacked
    other = ids[:8] + [rng.randrange(VOCAB) for _ in range(4)]               # same prefix
    want2 = hidden_states(model, torch.tensor([other[:-1]]))[0]
    _, got2 = true_features(model, new_state(random_drafter(model), 32), other, want2[-3:], memo)
    torch.testing.assert_close(got2, want2, rtol=1e-5, atol=1e-5)
    assert (memo.misses, memo.hits) == (1, 1)
    memo.get(model, other[:6])                                  # 8 + 6 > 12: the oldest goes
    assert [len(k) for k in memo._rows] == [6] and memo.tokens == 6


def test_a_shared_template_is_recomputed_once(model, drafter):
    """Two requests that hit the prefix cache on the same template (two blocks) after a first
    one computed it: the proposer recomputes the template's features once, and the outputs
    are still sequential greedy's."""
    rng = random.Random(12)
    template = [rng.randrange(VOCAB) for _ in range(8)]
    ps = [template + [rng.randrange(VOCAB) for _ in range(3)] for _ in range(3)]
    ref = sequential(model, ps, [10] * 3)
    engine = LLMEngine(model, None, num_kv_blocks=200, block_size=4,
                       speculative_config=dict(method="eagle", num_speculative_tokens=2,
                                               eagle_weights=drafter))
    outs, _ = run_engine(engine, ps, [10] * 3, arrive_at=[0, 3, 3])
    assert [outs[str(i)].token_ids for i in range(3)] == ref
    memo = engine.proposer.prefix_features
    assert (memo.misses, memo.hits) == (1, 1) and [len(k) for k in memo._rows] == [8]
    check_invariants(engine)


def test_drafting_off_above_a_batch_size_keeps_the_drafter_current(model, drafter,
                                                                    monkeypatch):
    """disable_by_batch_size = 1: while two requests run there are no drafts, but the drafter
    is fed every step's features (observe); once one finishes, the other drafts again without
    the proposer recomputing a single feature, and both outputs are sequential greedy's."""
    rng = random.Random(13)
    ps = [[rng.randrange(VOCAB) for _ in range(n)] for n in (6, 7)]
    ref = sequential(model, ps, [6, 24])
    calls = []
    real = eagle_mod.hidden_states
    monkeypatch.setattr(eagle_mod, "hidden_states",
                        lambda *a: (calls.append(a[1].shape), real(*a))[1])
    engine = LLMEngine(model, None, num_kv_blocks=200, block_size=4, enable_prefix_caching=False,
                       speculative_config=dict(method="eagle", num_speculative_tokens=2,
                                               eagle_weights=drafter, disable_by_batch_size=1))
    outs, _ = run_engine(engine, ps, [6, 24])
    assert [outs[str(i)].token_ids for i in range(2)] == ref
    st = engine.spec_decode_stats
    assert st.num_steps_off >= 4 and st.num_drafts >= 3
    assert calls == []                                  # nothing recomputed on resuming
    check_invariants(engine)


def test_observed_features_wait_for_the_next_draft(model, drafter, monkeypatch):
    """Steps without drafts keep their features in the state (eagle.observe); the next drafting
    call gets them with its own and recomputes nothing. A gap between observed steps drops
    what was kept: that call recomputes the positions it lacks, and the rows are still the
    target's."""
    rng = random.Random(14)
    ids = [rng.randrange(VOCAB) for _ in range(12)]
    want = hidden_states(model, torch.tensor([ids[:-1]]))[0]                 # [11, C]
    calls = []
    real = eagle_mod.hidden_states
    monkeypatch.setattr(eagle_mod, "hidden_states",
                        lambda *a: (calls.append(a[1].shape[1]), real(*a))[1])
    st = new_state(drafter, 32)
    observe(st, ids[:6], want[:5])                      # a prefill: positions 0 .. 4
    observe(st, ids[:8], want[5:7])                     # two decoded tokens: 5 .. 6
    start, got = true_features(model, st, ids[:9], want[7:8])
    assert start == 0 and calls == [] and st.pending == []
    torch.testing.assert_close(got, want[:8])
    gap = new_state(drafter, 32)
    observe(gap, ids[:6], want[:5])
    observe(gap, ids[:9], want[7:8])                    # positions 5 .. 6 never observed
    assert gap.pending_end == 8 and len(gap.pending) == 1
    _, got = true_features(model, gap, ids[:10], want[8:9])
    assert calls == [7]                                 # positions 0 .. 6 recomputed
    torch.testing.assert_close(got, want[:9], rtol=1e-5, atol=1e-5)


def test_the_drafter_takes_the_targets_few_row_products(model, monkeypatch):
    """On a CPU the proposer gives the drafter's layer the 1-3 row products chosen for the
    target's weights of the same shapes (tune_skinny's per-shape choices), not the untuned
    defaults."""
    from minillm import model as model_mod
    drafter, choices = random_drafter(model), {}                # untuned: the class defaults
    for m in drafter.layer.modules():
        if isinstance(m, model_mod.Linear):
            key = (tuple(m.weight.shape), m.bias is not None, torch.get_num_threads())
            choices[key] = {"skinny": ("linear", {}), "few": ("linear", {})}
    assert choices and all(m.skinny != "linear" for m in drafter.layer.modules()
                           if isinstance(m, model_mod.Linear))
    monkeypatch.setattr(model_mod, "_SKINNY_CHOICE", choices)
    prop = EagleProposer(model, drafter)
    tuned = [m for m in prop.drafter.layer.modules() if isinstance(m, model_mod.Linear)]
    assert tuned and all(m.skinny == "linear" and m.few == "linear" for m in tuned)


def test_the_cache_keeps_only_true_feature_positions(model, drafter):
    ids = [3, 9, 4, 4, 7, 1]
    feats = hidden_states(model, torch.tensor([ids]))[0]                     # [T, C]
    state = new_state(drafter, 32)
    argmax = lambda lg: (lg.argmax(-1).tolist(), None)                        # noqa: E731
    a, _ = draft_chain(drafter, model, state, ids[:4], feats[:3], 3, argmax)
    assert state.cache.seq_len == 3 and state.token_ids == ids[:4]
    # two more true tokens: only their features are fed, and the drafts match a fresh state's
    b, _ = draft_chain(drafter, model, state, ids, feats[3:5], 3, argmax)
    fresh = new_state(drafter, 32)
    c, _ = draft_chain(drafter, model, fresh, ids, None, 3, argmax)          # recomputes
    assert b == c and state.cache.seq_len == len(ids) - 1
    # a sequence that diverged from the state's tokens starts over
    d, _ = draft_chain(drafter, model, state, [5, 5, 5], None, 3, argmax)
    e, _ = draft_chain(drafter, model, new_state(drafter, 8), [5, 5, 5], None, 3, argmax)
    assert d == e and len(a) == 3


@torch.inference_mode()
def chain_reference(drafter, model, state, ids, features, k, draw):
    """One sequence at a time on its plain contiguous cache (the twin of draft_batch)."""
    N = len(ids)
    start, feats = true_features(model, state, ids, features)
    reserve(drafter, state, N + k)
    state.cache.seq_len = start
    g = drafter(model, feats[None], torch.tensor([ids[start + 1:N]]), state.cache)[:, -1:]
    state.token_ids, drafts = list(ids), []
    for j in range(k):
        drafts += draw(drafter.logits(model, g[0]))[0]
        if j + 1 < k:
            g = drafter(model, g, torch.tensor([drafts[-1:]]), state.cache)
    state.cache.seq_len = N - 1
    return drafts


def test_batched_drafting_equals_one_sequence_at_a_time(model, drafter):
    """draft_batch over sequences of mixed lengths, draft counts and histories (a cache that
    needs one new position, one that needs several, a fresh one that recomputes, one whose
    tokens diverged) gives each the drafts and cache contents it gets alone."""
    rng = random.Random(3)
    seqs = [[rng.randrange(VOCAB) for _ in range(n)] for n in (9, 14, 5, 11)]
    ks = [3, 1, 2, 4]
    logged = {"batch": [], "alone": []}

    def argmax(tag):
        def draw(lg):
            logged[tag].append(lg[0])
            return lg.argmax(-1).tolist(), None
        return draw

    def histories():                      # states that saw a prefix of each sequence earlier
        states = [new_state(drafter, 8) for _ in seqs]
        argmax_ = lambda lg: (lg.argmax(-1).tolist(), None)                   # noqa: E731
        draft_chain(drafter, model, states[0], seqs[0][:8], None, 2, argmax_)
        draft_chain(drafter, model, states[1], seqs[1][:10], None, 2, argmax_)
        draft_chain(drafter, model, states[3], [7, 7, 7, 7], None, 2, argmax_)   # diverged
        return states
    feats = [hidden_states(model, torch.tensor([s]))[0, -2:-1] for s in seqs]   # the newest
    batch_states, alone_states = histories(), histories()
    got = draft_batch(drafter, model, batch_states, seqs, [feats[0], None, None, feats[3]], ks,
                      [argmax("batch")] * 4)
    want = [chain_reference(drafter, model, st, s, f, k, argmax("alone"))
            for st, s, f, k in zip(alone_states, seqs, [feats[0], None, None, feats[3]], ks)]
    assert [d for d, _ in got] == want and [len(d) for d in want] == ks
    order = [(b, j) for j in range(max(ks)) for b in range(4) if j < ks[b]]   # batch: by step
    by_seq = sorted(range(len(order)), key=lambda i: order[i])                 # alone: by seq
    torch.testing.assert_close(torch.stack([logged["batch"][i] for i in by_seq]),
                               torch.stack(logged["alone"]), atol=1e-4, rtol=1e-4)
    for a, b, s in zip(batch_states, alone_states, seqs):
        assert a.cache.seq_len == b.cache.seq_len == len(s) - 1 and a.token_ids == s
        torch.testing.assert_close(a.cache.k[:, :, :len(s) - 1], b.cache.k[:, :, :len(s) - 1],
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="own"):
        draft_batch(drafter, model, [batch_states[0]] * 2, seqs[:2], [None] * 2, [1, 1],
                    [argmax("batch")] * 2)


def test_reduced_head_only_drafts_its_vocabulary(model, drafter):
    g = torch.randn(4, model.config.hidden_size)
    full = drafter.logits(model, g, reduced=False)
    small = drafter.logits(model, g, reduced=True)
    assert full.shape == small.shape == (4, VOCAB)
    inside = torch.isfinite(small[0])
    assert inside.sum() == len(drafter.draft_vocab) and not inside[1::2].any()
    torch.testing.assert_close(small[:, ::2], full[:, ::2])


def test_save_load_roundtrip_and_refusals(model, drafter, tmp_path):
    path = tmp_path / "eagle.safetensors"
    drafter.save(path)
    back = EagleDrafter.load(path, model)
    g = torch.randn(1, 3, model.config.hidden_size)
    nxt = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(back(model, g, nxt), drafter(model, g, nxt), atol=2e-2, rtol=2e-2)
    assert torch.equal(back.draft_vocab, drafter.draft_vocab)
    other = tiny_model(seed=1)                                  # same shape, other weights
    with pytest.raises(ValueError, match="make train-eagle"):
        EagleDrafter.load(path, other)
    with pytest.raises(ValueError, match="make train-eagle"):
        LLMEngine(other, None, speculative_config=dict(method="eagle", num_speculative_tokens=2,
                                                       eagle_weights=str(path)))
    with pytest.raises(ValueError, match="no EAGLE weights"):
        LLMEngine(model, None, speculative_config=dict(method="eagle", num_speculative_tokens=2,
                                                       eagle_weights=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="draft_head"):
        LLMEngine(model, None, speculative_config=dict(method="eagle", num_speculative_tokens=2,
                                                       eagle_weights=drafter, draft_head="big"))
    with pytest.raises(ValueError, match="draft_dtype must be None"):
        LLMEngine(model, None, speculative_config=dict(method="eagle", num_speculative_tokens=2,
                                                       eagle_weights=drafter, draft_dtype="int8"))
    with pytest.raises(ValueError, match="eagle_weights is for method 'eagle'"):
        LLMEngine(model, None, speculative_config=dict(method="medusa", num_speculative_tokens=2,
                                                       eagle_weights=drafter))


def test_default_weights_are_for_the_bundled_model(model):
    """The committed weights refuse a model they were not trained on (the tiny one)."""
    if not eagle_mod.DEFAULT_EAGLE_WEIGHTS.exists():
        pytest.skip("no committed EAGLE weights")
    with pytest.raises(ValueError, match="make train-eagle"):
        LLMEngine(model, None, speculative_config=dict(method="eagle", num_speculative_tokens=2))


def test_training_unroll_sees_what_drafting_sees(model, drafter):
    """train_eagle.unrolled: depth 1 is the teacher-forced drafter; depth e at position p equals
    the drafter run through its cache the way draft step e runs (true-feature positions
    0 .. p - e + 1, then its own outputs fed back one position at a time)."""
    from minillm.cache.contiguous import ContiguousKVCache
    from minillm.spec.train_eagle import unrolled
    import copy
    torch.manual_seed(1)
    drafter = copy.deepcopy(drafter)
    with torch.no_grad():                # the identity start zeroes both output projections
        drafter.layer.self_attn.o_proj.weight.normal_(0, 0.2)
        drafter.layer.mlp.down_proj.weight.normal_(0, 0.2)
    ids = torch.randint(0, VOCAB, (1, 14))
    f = hidden_states(model, ids)                                       # [1, 14, C]
    fin, nxt = f[:, :-1], ids[:, 1:]                                    # (f_p, x_{p+1})
    with torch.no_grad():
        outs = unrolled(drafter, model, fin, nxt, 3)
        torch.testing.assert_close(outs[0], drafter(model, fin, nxt))
        for p in (2, 6, 11):                       # the depth-3 row p: true keys up to p - 2
            cache = ContiguousKVCache(drafter.config, 1, 16)
            drafter(model, fin[:, :p - 1], nxt[:, :p - 1], cache)
            g2 = drafter(model, outs[0][:, p - 2:p - 1], nxt[:, p - 1:p], cache)
            torch.testing.assert_close(g2[0, 0], outs[1][0, p - 1], atol=1e-5, rtol=1e-4)
            g3 = drafter(model, g2, nxt[:, p:p + 1], cache)
            torch.testing.assert_close(g3[0, 0], outs[2][0, p], atol=1e-5, rtol=1e-4)


def test_draft_loss_soft_and_token_labels():
    """train_eagle.draft_loss: the soft cross-entropy is smallest when the drafter's output is
    the target's own next feature (its distribution matched), only answer rows count, and the
    token variant reads the labels; an unknown label kind is a ValueError."""
    from minillm.spec.train_eagle import draft_loss
    torch.manual_seed(0)
    w = torch.randn(11, 8)
    fout = torch.randn(2, 5, 8)
    mask, answer = torch.ones(2, 5), torch.zeros(2, 5)
    answer[:, 2:] = 1
    lab = torch.randint(0, 11, (2, 5))
    reg0, ce0 = draft_loss(fout, fout, lab, mask, answer, w)
    assert reg0 == 0
    off = fout + torch.randn_like(fout)
    reg1, ce1 = draft_loss(off, fout, lab, mask, answer, w)
    assert reg1 > 0 and ce1 > ce0
    prompt_only = fout.clone()
    prompt_only[:, :2] += 5 * torch.randn(2, 2, 8)                   # rows with answer == 0
    assert torch.isclose(draft_loss(prompt_only, fout, lab, mask, answer, w)[1], ce0)
    _, ce_tok = draft_loss(off, fout, lab, mask, answer, w, labels="token")
    want = torch.nn.functional.cross_entropy((off @ w.T)[:, 2:].flatten(0, 1),
                                             lab[:, 2:].flatten())
    torch.testing.assert_close(ce_tok, want)
    torch.testing.assert_close(draft_loss(off, fout, lab, mask, answer, w, labels="argmax")[1],
                               ce_tok)
    with pytest.raises(ValueError, match="soft"):
        draft_loss(off, fout, lab, mask, answer, w, labels="hard")


def test_greedy_labels_are_the_greedy_continuation(model):
    """train_eagle.greedy_labels: on a greedy answer the argmax label after position p + 1 is the
    answer's own token x_{p+2}; computed from the stored features only."""
    from minillm.spec.train_eagle import greedy_labels
    ids = [3, 17, 5, 9]
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    seq = {"ids": torch.tensor(ids), "features": hidden_states(model, torch.tensor([ids]))[0]}
    greedy_labels(model, [seq])
    assert seq["greedy_next"].shape == (len(ids) - 2,)
    assert seq["greedy_next"][4 - 2:].tolist() == ids[4:]
