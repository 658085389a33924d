"""Speculative decoding in the engine (chapter 07) on a tiny random model: greedy outputs with
speculation equal sequential greedy generation token for token, for every method and under
chunked prefill, preemption (recompute and swap) and n > 1; rejected drafts are rolled back
(no block leaks, num_computed_tokens consistent); a seeded sampled run reproduces; the engine
and the batch-1 loop ask the same proposer classes for the same drafts; bad speculative_config
values raise ValueError naming the fix."""
import random

import pytest
import torch

import minillm
from minillm import SamplingParams, spec
from minillm.engine import LLMEngine
from minillm.engine.spec_decode import build_proposer, parse_speculative_config
from minillm.spec.proposers import PROPOSERS

from test_engine_modes import VOCAB, check_invariants, run_engine, sequential, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def heads(model):
    """Random (untrained) heads: acceptance is low but exactness must not depend on it."""
    h = spec.MedusaHeads.for_model(model, 3)
    g = torch.Generator().manual_seed(0)
    for lin in h.proj:
        lin.weight.data = torch.randn(lin.weight.shape, generator=g) * 0.1
    return h


@pytest.fixture(scope="module")
def workload(model):
    """Prompts that repeat themselves (so prompt lookup finds matches) and random ones."""
    rng = random.Random(3)
    prompts = []
    for i in range(16):
        base = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 10))]
        prompts.append(base * rng.randint(1, 4) if i % 4 else base)
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    return prompts, max_tokens, sequential(model, prompts, max_tokens)


def config(method, heads, k=3):
    return {"ngram": dict(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1,
                          prompt_lookup_max=3),
            "medusa": dict(method="medusa", num_speculative_tokens=k, weights=heads),
            "draft_model": dict(method="draft_model", num_speculative_tokens=k,
                                draft_num_layers=1),
            "self_draft": dict(method="draft_model", num_speculative_tokens=k)}[method]


MODES = {
    "continuous": dict(),
    "chunked_small_budget": dict(max_num_batched_tokens=12, max_num_seqs=8),
    "recompute_tiny_pool": dict(num_kv_blocks=24, block_size=4),
    "swap_tiny_pool": dict(num_kv_blocks=24, block_size=4, preemption="swap"),
    "block_size_1": dict(num_kv_blocks=200, block_size=1, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("method", ["ngram", "medusa", "draft_model"])
def test_greedy_with_speculation_equals_sequential(model, heads, workload, method, mode):
    prompts, max_tokens, expected = workload
    kw = dict(num_kv_blocks=400, block_size=4, max_num_seqs=16, max_num_batched_tokens=64)
    kw.update(MODES[mode])
    engine = LLMEngine(model, None, speculative_config=config(method, heads), **kw)
    outs, _ = run_engine(engine, prompts, max_tokens)
    for i, ref in enumerate(expected):
        assert outs[str(i)].token_ids == ref, f"{method}/{mode}: request {i} differs"
    check_invariants(engine)
    st = engine.spec_decode_stats
    assert st.num_draft_tokens > 0
    drafted = sum(outs[str(i)].metrics.num_draft_tokens for i in range(len(prompts)))
    accepted = sum(outs[str(i)].metrics.num_accepted_tokens for i in range(len(prompts)))
    assert (drafted, accepted) == (st.num_draft_tokens, st.num_accepted_tokens)
    if method == "ngram":
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    if "tiny_pool" in mode:
        assert engine.num_preemptions > 0


def test_a_perfect_draft_saves_steps(model, workload):
    """Drafting with the target itself accepts every draft: fewer engine steps, same tokens."""
    prompts, max_tokens, expected = workload
    kw = dict(num_kv_blocks=400, block_size=4, max_num_seqs=16, max_num_batched_tokens=64)
    plain = LLMEngine(model, None, **kw)
    _, steps_plain = run_engine(plain, prompts, max_tokens)
    engine = LLMEngine(model, None, speculative_config=dict(
        method="draft_model", num_speculative_tokens=3, model=model), **kw)
    outs, steps_spec = run_engine(engine, prompts, max_tokens)
    assert [outs[str(i)].token_ids for i in range(len(prompts))] == expected
    st = engine.spec_decode_stats
    assert st.acceptance_rate == 1.0 and st.acceptance_by_position == [1.0, 1.0, 1.0]
    assert steps_spec < 0.5 * steps_plain
    check_invariants(engine)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_no_drafts_while_the_batch_is_above_disable_by_batch_size(model, heads, workload,
                                                                   method):
    """disable_by_batch_size = 3: steps that end with more than 3 requests running carry no
    drafts (counted), the rest speculate as usual; outputs are sequential greedy's. With the
    threshold at the batch's size speculation is never turned off."""
    prompts, max_tokens, expected = workload
    kw = dict(num_kv_blocks=400, block_size=4, max_num_seqs=16, max_num_batched_tokens=64)
    engine = LLMEngine(model, None, speculative_config=dict(config(method, heads),
                                                            disable_by_batch_size=3), **kw)
    seen = []                                # (running requests, drafts asked) per proposal
    real = engine.proposer.propose
    engine.proposer.propose = lambda asks: (seen.append((len(engine.scheduler.running),
                                                          len(asks))), real(asks))[1]
    outs, steps = run_engine(engine, prompts, max_tokens)
    assert [outs[str(i)].token_ids for i in range(len(prompts))] == expected
    st = engine.spec_decode_stats
    assert st.num_steps_off > 0 and st.num_draft_tokens > 0 and st.num_steps_off < steps
    assert seen and all(running <= 3 for running, _ in seen)       # drafts only at <= 3
    check_invariants(engine)
    always = LLMEngine(model, None, speculative_config=dict(
        config(method, heads), disable_by_batch_size=len(prompts)), **kw)
    run_engine(always, prompts, max_tokens)
    assert always.spec_decode_stats.num_steps_off == 0


def test_rollback_returns_blocks_during_the_run(model):
    """Mid-run, every running request's block table holds exactly its computed tokens."""
    engine = LLMEngine(model, None, num_kv_blocks=100, block_size=2, max_num_seqs=4,
                       max_num_batched_tokens=32,
                       speculative_config=dict(method="ngram", num_speculative_tokens=4))
    for i in range(4):
        engine.add_request(str(i), [1, 2, 3, 4, 5, 6] * 2 + [i], SamplingParams(
            temperature=0.0, max_tokens=20))
    bm = engine.block_manager
    while engine.has_unfinished():
        engine.step()
        for r in engine.scheduler.running:
            assert bm.num_tokens(r.seq_id) == r.num_computed_tokens
            assert len(bm.block_table(r.seq_id)) == -(-r.num_computed_tokens // 2)
    check_invariants(engine)


def test_n_greater_than_one_and_seeded_sampling_reproduce(model, heads):
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 1, 9, 1, 9]]
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=s, n=2)
              for s in (1, 2)]
    runs = []
    for _ in range(2):
        for method in ("ngram", "medusa"):
            engine = LLMEngine(model, None, num_kv_blocks=200, block_size=4,
                               speculative_config=config(method, heads))
            outs, _ = run_engine(engine, prompts, None, params=params)
            runs.append([[c.token_ids for c in outs[str(i)].outputs] for i in range(2)])
            check_invariants(engine)
    assert runs[0] == runs[2] and runs[1] == runs[3]
    assert all(len(t) == 16 for run in runs for o in run for t in o)


def test_greedy_n2_siblings_equal_sequential(model, heads, workload):
    prompts, _, _ = workload
    ref = sequential(model, prompts[:4], [10] * 4)
    engine = LLMEngine(model, None, num_kv_blocks=200, block_size=4,
                       speculative_config=config("ngram", heads))
    outs, _ = run_engine(engine, prompts[:4], None,
                         params=[SamplingParams(temperature=0.0, max_tokens=10, n=2)] * 4)
    for i in range(4):
        assert [c.token_ids for c in outs[str(i)].outputs] == [ref[i], ref[i]]
    check_invariants(engine)


def _recording(cls, log):
    """The method's proposer class, logging (token_ids, num_drafts, drafts) of every propose."""
    class Recording(cls):
        def propose(self, requests):
            drafts = super().propose(requests)
            log.extend((list(r.token_ids), r.num_drafts, list(d.token_ids))
                       for r, d in zip(requests, drafts))
            return drafts
    return Recording


@pytest.mark.parametrize("method", ["ngram", "medusa", "draft_model"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_and_batch1_loop_propose_the_same_drafts(model, heads, method, temperature,
                                                        monkeypatch):
    """One seam: the engine builds its proposer with build_proposer, the loop is handed one built
    the same way; for one request they are asked for drafts after the same tokens, with the same
    k, and answer the same (so they emit the same tokens too)."""
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 1, 2]
    sp = SamplingParams(temperature=temperature, top_k=40, max_tokens=20, seed=1)
    logs = {"engine": [], "loop": []}
    cfg = config(method, heads)
    monkeypatch.setitem(PROPOSERS, method, _recording(PROPOSERS[method], logs["engine"]))
    engine = LLMEngine(model, None, num_kv_blocks=100, block_size=4, speculative_config=cfg)
    outs, _ = run_engine(engine, [prompt], None, params=[sp])
    monkeypatch.setitem(PROPOSERS, method, _recording(PROPOSERS[method].__base__, logs["loop"]))
    proposer = build_proposer(cfg, model)              # what the engine built, built again
    got = spec.speculative_generate(model, None, prompt, proposer, cfg["num_speculative_tokens"],
                                    sp.max_tokens, sp)
    assert got == outs["0"].token_ids
    # the engine asked the class build_proposer builds (the log is not empty), with drafts
    assert len(logs["engine"]) > 3 and sum(len(d) for _, _, d in logs["engine"]) > 0
    assert logs["engine"] == logs["loop"]


@pytest.mark.parametrize("cfg,match", [
    (dict(method="ngram", num_speculative_tokens=0), "positive integer"),
    (dict(method="ngram", num_speculative_tokens=-2), "positive integer"),
    (dict(method="ngram", num_speculative_tokens=1000), "too large"),
    (dict(method="ngram"), "positive integer"),
    (dict(method="eagle3", num_speculative_tokens=2), "unknown speculative method"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2),
     "prompt_lookup_min <= prompt_lookup_max"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(method="medusa", num_speculative_tokens=2, prompt_lookup_max=2), "for method 'ngram'"),
    (dict(method="ngram", num_speculative_tokens=2, weights="h.safetensors"),
     "weights is for method 'medusa', not 'ngram'"),
    (dict(method="draft_model", num_speculative_tokens=2, draft_num_layers=0), "draft_num_layers"),
    (dict(method="ngram", num_speculative_tokens=2, lookahead=3), "unknown speculative_config"),
    ("ngram", "must be a dict"),
    (dict(method="ngram", num_speculative_tokens=2, disable_by_batch_size=0), "positive integer"),
    (dict(method="ngram", num_speculative_tokens=2, disable_by_batch_size=True),
     "disable_by_batch_size"),
    (dict(method="ngram", num_speculative_tokens=2, disable_by_batch_size="4"),
     "disable_by_batch_size"),
])
def test_bad_speculative_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        parse_speculative_config(cfg)
    with pytest.raises(ValueError, match=match):      # before any model is loaded
        minillm.LLM("no-such-model", speculative_config=cfg)


def test_learned_draft_for_another_model_is_refused(model, heads):
    with pytest.raises(ValueError, match="make train-draft"):     # committed heads: SmolLM2 shape
        LLMEngine(model, None, num_kv_blocks=50,
                  speculative_config=dict(method="medusa", num_speculative_tokens=2))
    with pytest.raises(ValueError, match="lower it to <= 3"):
        LLMEngine(model, None, num_kv_blocks=50,
                  speculative_config=dict(method="medusa", num_speculative_tokens=4, weights=heads))


@pytest.fixture(scope="module")
def bundled():
    return minillm.load_model("smollm2-135m")


def test_committed_medusa_heads_on_the_bundled_model(bundled):
    """The committed weights load (no training in tests), propose drafts inside the engine, and
    keep greedy output identical; random weights of the same shape are refused."""
    model, tok = bundled
    heads = spec.MedusaHeads.load(spec.DEFAULT_WEIGHTS, model)
    assert heads.num_heads == 4 and heads.meta["training"]["train_positions"] > 0
    prompts = [tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                       add_generation_prompt=True)
               for m in ("Explain why the sky is blue.", "Give three facts about honey bees.")]
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    want = [minillm.generate(model, tok, p, max_new_tokens=12) for p in prompts]
    llm = minillm.LLM((model, tok), num_kv_blocks=64, speculative_config=dict(
        method="medusa", num_speculative_tokens=3))
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    st = llm.engine.spec_decode_stats
    assert st.num_draft_tokens > 0 and len(st.acceptance_by_position) == 3, st.as_dict()
    random_weights, _ = minillm.load_model("smollm2-135m", weights="random")
    with pytest.raises(ValueError, match="weights differ"):
        spec.MedusaHeads.load(spec.DEFAULT_WEIGHTS, random_weights)
