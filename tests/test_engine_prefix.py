"""Prefix caching in the engine (chapter 06), on the tiny random model of test_engine_modes.

Greedy outputs with caching on must equal outputs with it off and sequential generation, token
for token, for prompts that share system prompts and multi-turn histories, in every scheduling
mode; the cache must actually hit, count its hits in tokens, leak nothing and never let two
tenants with different cache_salt share.
"""
import random

import pytest
from test_engine_modes import VOCAB, check_invariants, run_engine, sequential, tiny_model

import minillm
from minillm import SamplingParams
from minillm.engine import LLMEngine
from minillm.lab.prefix_workloads import shared_prefix_prompts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def chat_prompts(model, num_convs=4, turns=3, seed=3):
    """Multi-turn histories: turn k+1 = turn k's prompt + the model's greedy answer + a new user
    message. Built with sequential generation, so the reference answers come for free."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(13)]
    prompts, history = [], [system + [rng.randrange(VOCAB) for _ in range(5)]
                            for _ in range(num_convs)]
    for _ in range(turns):
        answers = sequential(model, history, [6] * num_convs)
        prompts += [list(h) for h in history]
        history = [h + a + [rng.randrange(VOCAB) for _ in range(rng.randint(2, 6))]
                   for h, a in zip(history, answers)]
    return prompts


@pytest.fixture(scope="module")
def workload(model):
    """32 prompts: 16 in 4 system-prompt groups (interleaved) + 12 multi-turn chat prompts + 4
    prompts that share nothing; max_tokens 6; sequential greedy answers."""
    shared = shared_prefix_prompts(4, 4, system_len=17, question_len=5, vocab_size=VOCAB, seed=2)
    chats = chat_prompts(model)
    rng = random.Random(4)
    lonely = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    prompts = shared + chats + lonely
    max_tokens = [6] * len(prompts)
    return prompts, max_tokens, sequential(model, prompts, max_tokens)


MODES = {
    "continuous": dict(),
    "chunked_small_budget": dict(max_num_batched_tokens=12, max_num_seqs=8),
    "no_chunking": dict(enable_chunked_prefill=False, max_num_batched_tokens=64),
    "static": dict(scheduling="static", max_num_seqs=6),
    "recompute_tiny_pool": dict(num_kv_blocks=20, block_size=4),
    "swap_tiny_pool": dict(num_kv_blocks=20, block_size=4, preemption="swap"),
    "block_size_1": dict(block_size=1, num_kv_blocks=120, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_caching_on_equals_off_equals_sequential(model, workload, mode):
    prompts, max_tokens, expected = workload
    kw = dict(num_kv_blocks=400, block_size=4, max_num_seqs=16, max_num_batched_tokens=64)
    kw.update(MODES[mode])
    outs = {}
    for caching in (False, True):
        engine = LLMEngine(model, None, enable_prefix_caching=caching, **kw)
        outs[caching], _ = run_engine(engine, prompts, max_tokens)
        check_invariants(engine)
        if "tiny_pool" in mode:
            assert engine.num_preemptions > 0, "the tiny pool was meant to force preemption"
    for i, ref in enumerate(expected):
        assert outs[True][str(i)].token_ids == outs[False][str(i)].token_ids == ref, \
            f"{mode}: request {i} differs with prefix caching on"
    stats = engine.prefix_cache_stats
    cached = [outs[True][str(i)].num_cached_tokens for i in range(len(prompts))]
    assert stats.hits == sum(cached) > 0 and stats.queries == sum(map(len, prompts))
    assert 0 < stats.hit_rate < 1
    assert all(outs[False][str(i)].num_cached_tokens == 0 for i in range(len(prompts)))
    assert all(c < len(p) for c, p in zip(cached, prompts))       # the last token always computed


def test_parallel_samples_with_prefix_hits(model, workload):
    prompts, max_tokens, expected = workload
    engine = LLMEngine(model, None, num_kv_blocks=60, block_size=4, max_num_seqs=12)
    params = [SamplingParams(temperature=0.0, max_tokens=m, n=3) for m in max_tokens[:16]]
    outs, _ = run_engine(engine, prompts[:16], max_tokens[:16], params=params)
    for i, ref in enumerate(expected[:16]):
        assert [c.token_ids for c in outs[str(i)].outputs] == [ref] * 3
    assert engine.prefix_cache_stats.hits > 0
    check_invariants(engine)


def test_sampled_forks_unchanged_by_prefix_caching(model, workload):
    prompts, max_tokens, _ = workload
    params = [SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=i) for i in range(12)]
    got = []
    for caching in (False, True):
        engine = LLMEngine(model, None, num_kv_blocks=30, block_size=4, max_num_seqs=8,
                           enable_prefix_caching=caching)
        outs, _ = run_engine(engine, prompts[:12], max_tokens[:12], params=params)
        got.append([[c.token_ids for c in outs[str(i)].outputs] for i in range(12)])
        check_invariants(engine)
    assert got[0] == got[1]


def test_multi_turn_hits_cover_previous_answers(model):
    """A turn's prompt = the previous prompt + its answer + a new message: the hit covers the
    earlier answer's full blocks too (output blocks are cached as they fill)."""
    llm = minillm.LLM((model, None), num_kv_blocks=100, block_size=4)
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(10)]
    out1 = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=9), use_tqdm=False)[0]
    turn2 = prompt + out1.token_ids + [rng.randrange(VOCAB) for _ in range(3)]
    out2 = llm.generate([turn2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    # 10 + 9 tokens, of which the last answer token was never computed: 18 -> 4 full blocks
    assert out2.num_cached_tokens == 16
    assert out2.token_ids == sequential(model, [turn2], [4])[0]


def test_regression_exact_block_multiple_fully_cached(model):
    """A prompt of exactly 3 blocks, seen before: 2 blocks hit, the last block is computed (the
    request needs its last token's logits), and the answer is unchanged."""
    llm = minillm.LLM((model, None), num_kv_blocks=50, block_size=4)
    prompt = list(range(20, 32))
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    first = llm.generate([prompt], sp, use_tqdm=False)[0]
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 8)
    assert first.token_ids == again.token_ids == sequential(model, [prompt], [5])[0]
    check_invariants(llm.engine)


def test_regression_same_prefix_in_the_same_step(model):
    """Two requests with one prefix arrive together: the second waits while the first computes
    the shared blocks, then hits them; no key ends up on two blocks, nothing leaks."""
    engine = LLMEngine(model, None, num_kv_blocks=50, block_size=4, max_num_batched_tokens=64)
    system = list(range(40, 56))                                    # 4 full blocks
    prompts = [system + [1, 2, 3], system + [7, 8]]
    outs, _ = run_engine(engine, prompts, [5, 5])
    assert [outs[str(i)].token_ids for i in range(2)] == sequential(model, prompts, [5, 5])
    assert [outs[str(i)].num_cached_tokens for i in range(2)] == [0, 16]
    first_steps = list(engine.step_stats)[:2]
    assert first_steps[0].num_seqs == 1                              # the second waited a step
    pool = engine.block_manager.pool
    assert len({e.block_id for e in pool.cached.values()}) == len(pool.cached)
    check_invariants(engine)


def test_same_step_duplicates_stay_correct_without_the_wait(model, monkeypatch):
    """Even if both compute the prefix (the wait switched off), outputs stay right, the cache
    keeps one block per key and the duplicate is freed."""
    engine = LLMEngine(model, None, num_kv_blocks=50, block_size=4)
    monkeypatch.setattr(engine.block_manager, "is_computing", lambda *a, **k: False)
    system = list(range(40, 56))
    prompts = [system + [1, 2, 3], system + [7, 8]]
    outs, _ = run_engine(engine, prompts, [5, 5])
    assert [outs[str(i)].token_ids for i in range(2)] == sequential(model, prompts, [5, 5])
    assert [outs[str(i)].num_cached_tokens for i in range(2)] == [0, 0]
    pool = engine.block_manager.pool
    assert len({e.block_id for e in pool.cached.values()}) == len(pool.cached)
    check_invariants(engine)


def test_cache_salt_separates_tenants(model):
    llm = minillm.LLM((model, None), num_kv_blocks=50, block_size=4)
    prompt = list(range(60, 80))
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    run = lambda salt: llm.generate([{"prompt_token_ids": prompt, "cache_salt": salt}], sp,
                                    use_tqdm=False)[0]
    assert run("alice").num_cached_tokens == 0
    assert run("bob").num_cached_tokens == 0                         # other tenant: no hit
    assert llm.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens == 0   # no salt
    hit = run("alice")
    assert hit.num_cached_tokens == 16 and hit.token_ids == run("bob").token_ids
    assert llm.reset_prefix_cache() > 0 and run("alice").num_cached_tokens == 0


def test_bad_input_fails_alone(model):
    llm = minillm.LLM((model, None), num_kv_blocks=6, block_size=4)
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    good = list(range(5, 15))
    outs = llm.generate([{"prompt_token_ids": good, "cache_salt": 7}, good,
                         {"prompt_token_ids": good, "cache_salt": ""},
                         {"prompt": good, "salt": "x"}, list(range(30))], sp, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["error", "length", "error", "error", "error"]
    assert "cache_salt must be a non-empty string" in outs[0].error
    assert "cache_salt" in outs[2].error and "prompt_token_ids" in outs[3].error
    assert "raise num_kv_blocks" in outs[4].error                  # 33 tokens > 6 blocks of 4
    assert outs[1].token_ids == sequential(model, [good], [3])[0]
    check_invariants(llm.engine)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.engine.add_request("x", good, sp, cache_salt=b"tenant")


def test_prefix_caching_is_the_default_and_can_be_switched_off(model):
    assert LLMEngine(model, None, num_kv_blocks=8).enable_prefix_caching
    off = minillm.LLM((model, None), num_kv_blocks=8, enable_prefix_caching=False)
    assert not off.engine.block_manager.enable_caching
    assert off.engine.block_manager.find_cached_blocks(list(range(40))) == []
    assert off.reset_prefix_cache() == 0 and off.engine.prefix_cache_stats.hit_rate == 0.0


def test_a_failed_forward_caches_nothing(model, monkeypatch):
    """A's forward fails while it computes a system prompt that B waits for: A errors, nothing
    of its failed step is cached, B computes the prefix itself and gets the right tokens."""
    system = list(range(40, 56))                                    # 4 full blocks of 4
    poison = 250
    prompts = [system + [poison, 1, 2], system + [7, 8]]
    real = type(model).forward

    def forward(self, input_ids, *args, **kwargs):
        if (input_ids == poison).any():
            raise RuntimeError("injected forward fault")
        return real(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", forward)
    engine = LLMEngine(model, None, num_kv_blocks=50, block_size=4)
    outs, _ = run_engine(engine, prompts, [5, 5])
    monkeypatch.undo()
    assert outs["0"].finish_reason == "error" and "injected forward fault" in outs["0"].error
    assert outs["1"].token_ids == sequential(model, prompts[1:], [5])[0]
    assert outs["1"].num_cached_tokens == 0
    check_invariants(engine)


def test_reset_prefix_cache_after_a_weight_swap_matches_a_cold_engine(model):
    """A cached block holds K/V of the weights that computed it; its key names only tokens. After
    new weights are loaded, a hit serves stale K/V until the cache is flushed."""
    import torch
    prompt, follow = list(range(40, 72)), list(range(40, 64)) + [7, 8, 9]   # share 24 tokens
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
    llm = minillm.LLM((model, None), num_kv_blocks=40, block_size=4)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        llm.generate([prompt], sp, use_tqdm=False)                   # cached under the old weights
        with torch.no_grad():                                         # "load a new checkpoint"
            g = torch.Generator().manual_seed(0)
            for p in model.parameters():
                p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
        cold = minillm.LLM((model, None), num_kv_blocks=40, block_size=4)
        ref = cold.generate([follow], sp, use_tqdm=False)[0]
        stale = llm.generate([follow], sp, use_tqdm=False)[0]
        assert stale.num_cached_tokens == 24                          # the bug a flush prevents
        assert abs(stale.outputs[0].cumulative_logprob - ref.outputs[0].cumulative_logprob) > 1e-3
        llm.generate([prompt], sp, use_tqdm=False)                    # stale blocks touched again
        assert llm.reset_prefix_cache() > 0
        assert llm.engine.block_manager.num_cached_blocks == 0       # emptied, not only free ones
        fresh = llm.generate([follow], sp, use_tqdm=False)[0]
        assert fresh.num_cached_tokens == 0 and fresh.token_ids == ref.token_ids
        assert fresh.outputs[0].cumulative_logprob == pytest.approx(
            ref.outputs[0].cumulative_logprob, abs=1e-5)
    finally:
        model.load_state_dict(saved)


def test_reset_prefix_cache_is_refused_while_requests_run(model):
    llm = minillm.LLM((model, None), num_kv_blocks=40, block_size=4)
    llm.engine.add_request("r", list(range(30, 50)), SamplingParams(max_tokens=4))
    llm.engine.step()
    with pytest.raises(ValueError, match="finish them"):
        llm.reset_prefix_cache()
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.reset_prefix_cache() > 0 and llm.engine.block_manager.num_cached_blocks == 0
