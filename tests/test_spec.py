"""Speculative decoding, standalone (chapter 07): the rejection sampler is exact, the greedy path
is exact match, prompt lookup finds the longest latest match, every proposer keeps the one batch
interface (one Draft per request, never more than num_drafts, state handed back), `verify` is
the one verifier, the batch-1 loop reproduces plain decoding, and bad input names its fix.

Exactness is shown two ways: (1) the sampler's output distribution computed by enumeration
(acceptance term + normalised residual, over every draft outcome, across rounds) equals the
target's sequence distribution to 1e-6 -- with random p and q, with q = 0 where p > 0, and with
one-hot drafts; (2) the implementation itself, run with a fixed seed, passes a chi-square test
against the target, and the same test rejects a sampler with a planted bug."""
import random

import pytest
import torch

import minillm
from minillm import SamplingParams, configs, spec
from minillm.loader import random_model
from minillm.spec import theory as th
from minillm.engine.spec_decode import Draft, DraftRequest, NoProposer, build_proposer
from minillm.sampling import make_generator, probs, sample
from minillm.spec.rejection import greedy_accept, rejection_sample, residual, verify

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 64


# --- exactness by enumeration --------------------------------------------------------------------
@pytest.mark.parametrize("V,k,length", [(3, 1, 3), (3, 2, 3), (4, 3, 2), (2, 4, 5)])
@pytest.mark.parametrize("draft", ["random", "zeros", "one_hot"])
def test_enumerated_distribution_equals_target(V, k, length, draft):
    p = th.random_tree(V, seed=1, zeros=0.25)
    q = {"random": th.random_tree(V, seed=2),
         "zeros": th.random_tree(V, seed=3, zeros=0.5),
         "one_hot": th.random_tree(V, seed=4, one_hot=True)}[draft]
    got = th.sequence_distribution(p, q, k, length)
    want = th.target_sequence_distribution(p, V, length)
    assert th.max_abs_difference(got, want) < 1e-6
    assert abs(sum(got.values()) - 1) < 1e-9


def test_zero_draft_mass_where_target_has_mass_is_covered():
    """The case the residual exists for: q(x) = 0 < p(x). x can only come from the residual."""
    p = lambda pre: torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = lambda pre: torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    got = th.round_outcomes(p, q, 1)
    first = {x: sum(v for s, v in got.items() if s[0] == x) for x in range(3)}
    assert first[0] == pytest.approx(0.5, abs=1e-12) and first[1] == pytest.approx(0.3, abs=1e-12)


def test_enumeration_detects_a_biased_rule():
    """The proof can fail: drop the residual's renormalisation and the totals no longer match."""
    p = th.random_tree(3, seed=1)
    q = th.random_tree(3, seed=2)
    good = th.round_outcomes(p, q, 1)
    first = lambda d: [sum(v for s, v in d.items() if s[0] == x) for x in range(3)]
    assert first(good) == pytest.approx(p(()).tolist(), abs=1e-9)
    pt, qt = p(()), q(())
    alpha = th.acceptance_prob(pt, qt)
    # emitting from p instead of the residual at a rejection: min(p, q) + (1 - alpha) p != p
    biased = torch.minimum(pt, qt) + (1 - alpha) * pt
    assert float((biased - pt).abs().max()) > 1e-3


def test_acceptance_is_one_minus_total_variation():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.rand(10, generator=g, dtype=torch.float64).softmax(0)
        q = torch.rand(10, generator=g, dtype=torch.float64).pow(3).softmax(0)
        assert th.acceptance_prob(p, q) == pytest.approx(1 - th.total_variation(p, q), abs=1e-12)


# --- the implementation, sampled ------------------------------------------------------------------
def _chi_square_of(sampler, n=3000, seed=0):
    V, k, length = 3, 2, 2
    p = th.random_tree(V, seed=11, zeros=0.2)
    q = th.random_tree(V, seed=12, zeros=0.3)
    g = torch.Generator().manual_seed(seed)
    counts = {}
    for _ in range(n):
        s = th.run_rounds(p, q, k, length, g, sampler)
        counts[s] = counts.get(s, 0) + 1
    return th.chi_square(counts, th.target_sequence_distribution(p, V, length))


def test_chi_square_of_the_implementation():
    stat, pval = _chi_square_of(rejection_sample)
    assert pval > 1e-3, f"chi-square {stat:.1f}, p-value {pval:.2e}"


def test_chi_square_rejects_a_planted_bug():
    def no_residual(target_probs, ids, draft_probs, generator):   # resample from p on rejection
        out = []
        for i, d in enumerate(ids):
            p, q = target_probs[i], draft_probs[i]
            if float(torch.rand((), generator=generator)) * float(q[d]) < float(p[d]):
                out.append(d)
                continue
            return out + [int(torch.multinomial(p.float(), 1, generator=generator))]
        return out + [int(torch.multinomial(target_probs[-1].float(), 1, generator=generator))]
    stat, pval = _chi_square_of(no_residual)
    assert pval < 1e-6, f"the biased sampler passed: chi-square {stat:.1f}, p {pval:.2e}"


def test_one_hot_draft_first_token_frequencies():
    p = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]], dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    counts = [0, 0, 0]
    n = 6000
    for _ in range(n):
        counts[rejection_sample(p, [1], None, g)[0]] += 1
    stat, pval = th.chi_square({(x,): c for x, c in enumerate(counts)},
                               {(x,): float(p[0, x]) for x in range(3)})
    assert pval > 1e-3


def test_rejection_sample_edges():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert rejection_sample(p, [1], None, g) == [1, 2]          # certain accept, then bonus
    assert rejection_sample(p, [0], None, g) == [1]             # p(d) = 0: always rejected
    q = torch.tensor([[0.5, 0.5, 0.0]])
    assert rejection_sample(p, [0], q, g) == [1]
    assert rejection_sample(p[1:], [], None, g) == [2]          # k = 0: just the bonus
    assert residual(torch.tensor([0.5, 0.5]), torch.tensor([0.5, 0.5])).sum() == pytest.approx(1)


def test_greedy_accept():
    assert greedy_accept([5, 6, 7], [5, 6]) == [5, 6, 7]
    assert greedy_accept([5, 6, 7], [5, 9]) == [5, 6]
    assert greedy_accept([5, 6, 7], [4, 6]) == [5]
    with pytest.raises(ValueError, match="k \\+ 1"):
        greedy_accept([5, 6], [5, 6])


@pytest.mark.parametrize("bad,match", [
    (dict(target_probs=torch.ones(2, 4) / 4, draft_token_ids=[1, 2]), "k \\+ 1"),
    (dict(target_probs=torch.ones(2, 4) / 4, draft_token_ids=[7]), "in \\[0, 4\\)"),
    (dict(target_probs=torch.ones(2, 4) / 4, draft_token_ids=[1],
          draft_probs=torch.ones(1, 5) / 5), "pass None"),
    (dict(target_probs=torch.ones(4) / 4, draft_token_ids=[]), "\\[k \\+ 1, vocab\\]"),
])
def test_rejection_sample_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        rejection_sample(**bad)


# --- formulas -----------------------------------------------------------------------------------
def test_formulas():
    assert th.expected_tokens(0.5, 4) == pytest.approx(1.9375)
    assert th.expected_tokens(1.0, 4) == 5 and th.expected_tokens(0.0, 4) == 1
    assert th.speedup(0.5, 4, 0.05) == pytest.approx(1.9375 / 1.2)
    for k, c, alpha in [(4, 0.05, 0.167), (4, 0.2, 0.455), (4, 0.5, 0.741)]:
        a = th.break_even_alpha(k, c)
        assert a == pytest.approx(alpha, abs=1e-3)
        assert th.speedup(a, k, c) == pytest.approx(1, abs=1e-6)
    assert th.break_even_alpha(4, 0.0) == 0.0


# --- n-gram lookup --------------------------------------------------------------------------------
def test_ngram_longest_latest_match():
    ids = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    # suffix [2, 3]: latest earlier occurrence at index 5 -> proposes 4, 5, 7
    assert spec.ngram_propose(ids, 3, 1, 4) == [4, 5, 7]
    # the longer match wins over a later shorter one
    ids = [1, 2, 3, 8, 8, 5, 2, 3, 6, 1, 2, 3]
    assert spec.ngram_propose(ids, 2, 1, 3) == [8, 8]            # n = 3 matches at 0
    assert spec.ngram_propose(ids, 2, 3, 3) == [8, 8]            # only n = 3: [1, 2, 3] at 0
    assert spec.ngram_propose(ids, 2, 2, 2) == [6, 1]            # n = 2: latest [2, 3] at 6
    assert spec.ngram_propose(ids, 5, 1, 1) == [6, 1, 2, 3]      # capped by the sequence end
    assert spec.ngram_propose([1, 2, 3, 4], 3, 1, 3) == []       # nothing repeats
    assert spec.ngram_propose([7], 3, 1, 3) == []
    assert spec.ngram_propose([7, 7, 7], 4, 1, 2) == [7]         # overlap with the suffix is fine


def test_ngram_matches_a_brute_force_definition():
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        k = rng.randint(1, 5)
        want = []
        for n in range(hi, lo - 1, -1):
            if n >= len(ids):
                continue
            hits = [s for s in range(len(ids) - n) if ids[s:s + n] == ids[-n:]]
            if hits:
                want = ids[max(hits) + n:max(hits) + n + k]
                break
        assert spec.ngram_propose(ids, k, lo, hi) == want, (ids, k, lo, hi)


@pytest.mark.parametrize("k,lo,hi,match", [(0, 1, 2, "num_speculative_tokens"),
                                           (2, 3, 2, "prompt_lookup_min <= prompt_lookup_max"),
                                           (2, 0, 2, "prompt_lookup_min must be")])
def test_ngram_bad_input(k, lo, hi, match):
    with pytest.raises(ValueError, match=match):
        spec.ngram_propose([1, 2, 3], k, lo, hi)


# --- the batch-1 loop on a tiny random model ------------------------------------------------------
def tiny_model(seed=0, layers=2):
    cfg = configs.get("smollm2-135m").with_(
        name="tiny", num_layers=layers, hidden_size=64, intermediate_size=128, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
        eos_token_id=None, bos_token_id=None)
    return random_model(cfg, "cpu", torch.float32, seed=seed, std=0.3)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(layers=3)


def _proposers(model):
    return {"ngram": spec.NgramProposer(1, 3),
            "self": spec.DraftModelProposer(model),                     # accepts everything
            "early_exit": spec.DraftModelProposer(spec.early_exit_model(model, 1)),
            "skip_layer": spec.DraftModelProposer(spec.skip_layer_model(model, [1])),
            "medusa": spec.MedusaProposer(model, spec.MedusaHeads.for_model(model, 3))}


@pytest.mark.parametrize("name", ["ngram", "self", "early_exit", "skip_layer", "medusa"])
def test_loop_greedy_equals_plain_greedy(tiny, name):
    rng = random.Random(1)
    proposer = _proposers(tiny)[name]
    stats = spec.SpecStats()
    for _ in range(4):
        base = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))]
        prompt = base * 3                                               # something to look up
        want = minillm.generate(tiny, None, prompt, max_new_tokens=24)
        got = spec.speculative_generate(tiny, None, prompt, proposer, 3, 24, stats=stats)
        assert got == want
    assert stats.num_draft_tokens > 0
    if name == "self":
        assert stats.acceptance_rate == 1.0 and stats.accepted_per_position[0] == stats.num_drafts
    if name in ("ngram", "early_exit"):
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_loop_sampled_reproduces_and_matches_target_first_token(tiny):
    sp = SamplingParams(temperature=0.8, top_k=20, seed=3)
    prop = spec.DraftModelProposer(spec.early_exit_model(tiny, 1))
    a = spec.speculative_generate(tiny, None, [1, 2, 3, 1, 2], prop, 3, 20, sp)
    b = spec.speculative_generate(tiny, None, [1, 2, 3, 1, 2], prop, 3, 20, sp)
    assert a == b and len(a) == 20


def test_loop_k_wins_over_the_proposers_own(tiny):
    """speculative_generate's num_speculative_tokens decides k; the proposer's is the engine's."""
    prop = spec.NgramProposer(1, 3, num_speculative_tokens=4)
    stats = spec.SpecStats()
    spec.speculative_generate(tiny, None, [1, 2, 3, 4] * 4, prop, 2, 20, stats=stats)
    assert stats.num_draft_tokens > 0 and len(stats.drafted_per_position) == 2
    with pytest.raises(ValueError, match="lower num_speculative_tokens to <= 2"):
        spec.speculative_generate(tiny, None, [1, 2, 3], spec.MedusaProposer(
            tiny, spec.MedusaHeads.for_model(tiny, 2)), 3, 8)
    with pytest.raises(ValueError, match="positive integer"):
        spec.speculative_generate(tiny, None, [1, 2, 3], prop, 0, 8)


def test_loop_refuses_a_proposer_that_breaks_the_contract(tiny):
    class TooMany(spec.NgramProposer):
        def propose(self, requests):
            return [Draft([1] * (r.num_drafts + 1), None) for r in requests]
    with pytest.raises(ValueError, match="propose at most num_drafts"):
        spec.speculative_generate(tiny, None, [1, 2, 3], TooMany(), 2, 8)


def test_early_exit_shares_weights_and_leaves_the_target_alone(tiny):
    d = spec.early_exit_model(tiny, 1)
    assert len(d.layers) == 1 and len(tiny.layers) == 3 and d.config.num_layers == 1
    assert d.lm_head.weight is tiny.lm_head.weight
    with pytest.raises(ValueError, match="num_layers must be in"):
        spec.early_exit_model(tiny, 4)


# --- the proposers' one interface ---------------------------------------------------------------
def _asks(model, k_list, params, seed=0, hidden=True):
    rng = random.Random(seed)
    out = []
    for i, k in enumerate(k_list):
        base = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
        h = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(i))
        out.append(DraftRequest(base * 3, k, params, make_generator(i), h if hidden else None))
    return out


@pytest.mark.parametrize("name", ["ngram", "self", "early_exit", "skip_layer", "medusa"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batch_propose_is_one_draft_per_request_and_never_exceeds_k(tiny, name, temperature):
    """Mixed k in one batch; the batch answer equals asking one request at a time."""
    prop = _proposers(tiny)[name]
    params = SamplingParams(temperature=temperature, top_k=30)
    asks = _asks(tiny, [1, 3, 2, 3], params)
    drafts = prop.propose(asks)
    assert len(drafts) == len(asks) and all(isinstance(d, Draft) for d in drafts)
    for a, d in zip(asks, drafts):
        assert len(d.token_ids) <= a.num_drafts
        if name != "ngram":                            # the models always fill k
            assert len(d.token_ids) == a.num_drafts
        if temperature == 0.0 or name == "ngram":
            assert d.probs is None
        else:                                   # q rows: distributions holding their draft
            assert d.probs.shape == (len(d.token_ids), VOCAB)
            assert torch.allclose(d.probs.sum(-1), torch.ones(len(d.token_ids)))
            assert all(d.probs[i, t] > 0 for i, t in enumerate(d.token_ids))
    alone = [prop.propose([a])[0] for a in _asks(tiny, [1, 3, 2, 3], params)]
    assert [d.token_ids for d in alone] == [d.token_ids for d in drafts]
    assert sum(len(d.token_ids) for d in drafts) > 0


def test_proposers_keep_no_per_sequence_state(tiny):
    """The draft model's cache travels in Draft.state; the proposer object is unchanged."""
    prop = spec.DraftModelProposer(spec.early_exit_model(tiny, 1))
    before = dict(vars(prop))
    a, b = _asks(tiny, [3, 3], SamplingParams(temperature=0.0))
    da, db = prop.propose([a, b])
    assert vars(prop) == before
    assert isinstance(da.state, spec.DraftModelState) and da.state is not db.state
    assert da.state.token_ids == a.token_ids + da.token_ids[:-1]       # fed: tokens + k - 1 drafts
    assert da.state.cache.seq_len == len(da.state.token_ids)


def test_draft_model_rolls_back_to_what_the_target_kept(tiny):
    """Reusing a sequence's state after a rejection gives the drafts a fresh state gives: the
    cache forgets the rejected drafts and keeps the shared prefix."""
    prop = spec.DraftModelProposer(spec.early_exit_model(tiny, 1))
    greedy = SamplingParams(temperature=0.0)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    first = prop.propose([DraftRequest(tokens, 3, greedy, None)])[0]
    kept = tokens + first.token_ids[:1] + [(first.token_ids[1] + 1) % VOCAB]   # 1 kept + 1 new
    again = prop.propose([DraftRequest(kept, 3, greedy, None, state=first.state)])[0]
    fresh = prop.propose([DraftRequest(kept, 3, greedy, None)])[0]
    assert again.token_ids == fresh.token_ids
    assert again.state is first.state                   # the same cache, rolled back and refilled
    assert again.state.token_ids == kept + again.token_ids[:-1]
    # a state that was handed a different sequence entirely still gives the right drafts
    other = prop.propose([DraftRequest([7, 7, 8], 2, greedy, None, state=again.state)])[0]
    assert other.token_ids == prop.propose([DraftRequest([7, 7, 8], 2, greedy, None)])[0].token_ids


def test_draft_model_cache_grows_past_its_first_size(tiny):
    prop = spec.DraftModelProposer(tiny)
    short = SamplingParams(temperature=0.0, max_tokens=1)              # sizes the first cache small
    tokens = [1, 2, 3]
    d = prop.propose([DraftRequest(tokens, 2, short, None)])[0]
    first_size = d.state.cache.max_len
    for _ in range(4):
        tokens = tokens + d.token_ids + [5]
        d = prop.propose([DraftRequest(tokens, 2, short, None, state=d.state)])[0]
    assert d.state.cache.max_len > first_size
    assert d.token_ids == prop.propose([DraftRequest(tokens, 2, short, None)])[0].token_ids


def test_build_proposer_one_class_per_method(tiny):
    assert isinstance(build_proposer(None, tiny), NoProposer)
    nothing = NoProposer().propose(_asks(tiny, [2, 2], SamplingParams()))
    assert [d.token_ids for d in nothing] == [[], []] and NoProposer.num_speculative_tokens == 0
    heads = spec.MedusaHeads.for_model(tiny, 3)
    built = {"ngram": build_proposer(dict(method="ngram", num_speculative_tokens=2), tiny),
             "medusa": build_proposer(dict(method="medusa", num_speculative_tokens=2,
                                           weights=heads), tiny),
             "draft_model": build_proposer(dict(method="draft_model", num_speculative_tokens=3,
                                                draft_num_layers=1), tiny)}
    assert [type(p) for p in built.values()] == [spec.NgramProposer, spec.MedusaProposer,
                                                 spec.DraftModelProposer]
    assert [p.num_speculative_tokens for p in built.values()] == [2, 2, 3]
    assert [p.needs_hidden for p in built.values()] == [False, True, False]
    assert len(built["draft_model"].model.layers) == 1
    with pytest.raises(ValueError, match="lower it to <= 3"):
        build_proposer(dict(method="medusa", num_speculative_tokens=4, weights=heads), tiny)
    with pytest.raises(ValueError, match="unknown speculative method"):
        build_proposer(dict(method="lookahead", num_speculative_tokens=2), tiny)
    with pytest.raises(ValueError, match="hidden state"):
        built["medusa"].propose(_asks(tiny, [2], SamplingParams(), hidden=False))


# --- the one verifier -----------------------------------------------------------------------------
def test_verify_is_greedy_accept_or_rejection_sample_on_probs():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0)) * 2   # [1 + k, V]
    drafts = logits.argmax(-1)[:3].tolist()
    greedy = SamplingParams(temperature=0.0)
    assert verify(logits, drafts, None, greedy) == logits.argmax(-1).tolist()   # all + bonus
    assert verify(logits, [(drafts[0] + 1) % 10] + drafts[1:], None, greedy) == [drafts[0]]
    sp = SamplingParams(temperature=0.8, top_k=5)
    q = torch.rand(3, 10, generator=torch.Generator().manual_seed(1)).softmax(-1)
    for seed in range(10):
        got = verify(logits, drafts, q, sp, make_generator(seed))
        want = rejection_sample(probs(logits, sp), drafts, q, make_generator(seed))
        assert got == want
    # no drafts: exactly plain sampling of the one row
    for seed in range(5):
        assert verify(logits[:1], [], None, sp, make_generator(seed)) == \
            sample(logits[:1], sp, make_generator(seed)).tolist()


def test_engine_seam_reexports_the_one_verifier():
    from minillm.engine import spec_decode
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    sp = SamplingParams(temperature=1.0)
    assert spec_decode.verify(logits, [1, 2], None, sp, make_generator(3)) == \
        verify(logits, [1, 2], None, sp, make_generator(3))


# --- the learned draft's weights -----------------------------------------------------------------
def test_medusa_heads_roundtrip_and_refuse_another_model(tmp_path, tiny):
    heads = spec.MedusaHeads.for_model(tiny, 2)
    torch.nn.init.normal_(heads.proj[0].weight, std=0.1)
    path = tmp_path / "h.safetensors"
    heads.save(path)
    back = spec.MedusaHeads.load(path, tiny)
    h = torch.randn(3, 64)
    assert torch.allclose(back(h), heads(h).float(), atol=1e-2)
    with pytest.raises(ValueError, match="make train-draft"):
        spec.MedusaHeads.load(path, tiny_model(seed=5, layers=3))  # same shape, other weights
    other = random_model(tiny.config.with_(hidden_size=32, head_dim=8), "cpu", torch.float32)
    with pytest.raises(ValueError, match="hidden size 64"):
        spec.MedusaHeads.load(path, other)
    with pytest.raises(ValueError, match="at most 2"):
        heads(h, 3)
    with pytest.raises(ValueError, match="make train-draft"):
        spec.MedusaHeads.load(tmp_path / "missing.safetensors")


def test_medusa_training_holds_out_whole_topics():
    """Held-out accuracy must measure new subjects: no held-out topic appears in training."""
    from minillm.loader import _bundled_tokenizer
    from minillm.spec.train_medusa import TASKS, TOPICS, make_prompts
    tok = _bundled_tokenizer()
    train, held = make_prompts(tok, 176, 16)
    assert len(train) == 176 and len(held) == 16 and len(set(train)) == 176
    held_topics = {t for t in TOPICS if any(t in p for p in held)}
    assert len(held_topics) == 2
    assert not any(t in p for t in held_topics for p in train)
    with pytest.raises(ValueError, match="ask for fewer"):
        make_prompts(tok, (len(TOPICS) - 1) * len(TASKS) + 1, 8)
