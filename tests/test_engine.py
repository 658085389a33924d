"""minillm.LLM on the bundled SmolLM2-135M (fp32, CPU) against sequential `minillm.generate`.

The reference is the chapter-00 loop: one request at a time, contiguous KV cache, no scheduler.
Every engine mode must give the same greedy tokens for 32 prompts of mixed lengths. The tiny-model
file (test_engine_modes.py) repeats this for every mode with randomised configurations; here the
real model runs the main modes with short outputs to keep CPU time sane.
"""
import random

import pytest

import minillm
from minillm import SamplingParams

TEXT = ("The history of computing is a story of people who wanted to calculate faster. Early "
        "machines used gears and levers; later ones used relays, vacuum tubes and finally "
        "transistors. Each step made machines smaller, cheaper and more reliable. Today a phone "
        "holds more computing power than the rooms full of equipment that guided the first "
        "missions to the Moon. Programming changed too: from wiring panels by hand, to punched "
        "cards, to languages that read almost like English.")
TEXT_PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):",
                "1, 2, 3, 4,"]


# small engine steps: single-threaded (see conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bundled():
    return minillm.load_model("smollm2-135m")


@pytest.fixture(scope="module")
def workload(bundled):
    """32 prompts (28 token-id slices of 3..60 tokens, 4 strings), max_tokens 8..12, and the
    sequential greedy answers."""
    model, tok = bundled
    ids = tok.encode(TEXT)
    rng = random.Random(0)
    prompts = []
    for _ in range(28):
        n = rng.randint(3, 60)
        start = rng.randint(0, len(ids) - n)
        prompts.append(ids[start:start + n])
    prompts += TEXT_PROMPTS
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 12)) for _ in prompts]
    expected = [minillm.generate(model, tok, p, max_new_tokens=sp.max_tokens, sampling=sp)
                for p, sp in zip(prompts, params)]
    return prompts, params, expected


def no_leaks(llm):
    eng = llm.engine
    assert eng.block_manager.num_free_blocks == eng.num_kv_blocks and not eng.block_manager.tables
    assert all(s.num_batched_tokens <= eng.scheduler.max_num_batched_tokens
               for s in eng.step_stats)


def test_continuous_chunked_32_prompts_match_sequential(bundled, workload):
    prompts, params, expected = workload
    llm = minillm.LLM(bundled, num_kv_blocks=200, max_num_seqs=32, max_num_batched_tokens=48)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    no_leaks(llm)
    steps = llm.engine.step_stats
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps), \
        "prefill chunks and decodes should share steps"
    for o in outs:
        m = o.metrics
        assert o.finish_reason in ("length", "stop")
        assert m.ttft > 0 and m.e2e_latency >= m.ttft
        assert len(m.itl) == len(o.token_ids) - 1
        assert m.num_prompt_tokens == len(o.prompt_token_ids) > 0


@pytest.mark.parametrize("kw", [
    dict(scheduling="static", max_num_seqs=4),
    dict(num_kv_blocks=14, block_size=8, preemption="recompute"),
    dict(num_kv_blocks=14, block_size=8, preemption="swap", max_num_batched_tokens=32,
         max_num_seqs=8),
], ids=["static", "recompute", "swap"])
def test_modes_match_sequential(bundled, workload, kw):
    prompts, params, expected = workload
    prompts, params, expected = prompts[:12], params[:12], expected[:12]
    kw = {"num_kv_blocks": 200, **kw}
    llm = minillm.LLM(bundled, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    no_leaks(llm)
    if kw["num_kv_blocks"] < 100:
        assert llm.engine.num_preemptions > 0
    if kw.get("preemption") == "swap":
        assert llm.engine.scheduler.num_swap_outs > 0


def test_seeded_sampling_reproduces(bundled):
    """Each request samples with its own generator seeded from SamplingParams.seed, so the
    draws do not depend on the batch: two engine configurations and the sequential loop agree."""
    model, tok = bundled
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=10, seed=100 + i)
              for i in range(len(TEXT_PROMPTS))]
    a = minillm.LLM(bundled, num_kv_blocks=100, max_num_seqs=8, max_num_batched_tokens=8)
    b = minillm.LLM(bundled, num_kv_blocks=100)
    out_a = a.generate(TEXT_PROMPTS, params, use_tqdm=False)
    out_b = b.generate(TEXT_PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in out_a] == [o.token_ids for o in out_b]
    for p, sp, o in zip(TEXT_PROMPTS, params, out_a):
        assert o.token_ids == minillm.generate(model, tok, p, sp.max_tokens, sp)
    greedy = b.generate(TEXT_PROMPTS, SamplingParams(temperature=0.0, max_tokens=10),
                        use_tqdm=False)
    assert [o.token_ids for o in out_a] != [o.token_ids for o in greedy]


def test_parallel_samples_share_prompt_blocks(bundled):
    model, tok = bundled
    llm = minillm.LLM(bundled, num_kv_blocks=100)
    eng = llm.engine
    prompt = tok.encode(TEXT)[:40]                 # 2 full blocks of 16 + a partial one
    eng.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6))
    eng.step()                                     # prefill, fork, first token of each sample
    seqs = eng.get_request("r")
    assert [s.sample_index for s in seqs] == [0, 1, 2]
    tables = [eng.block_manager.block_table(s.seq_id) for s in seqs]
    assert tables[0] == tables[1] == tables[2]     # nothing copied yet
    assert [eng.block_manager.pool.refcount(b) for b in tables[0]] == [3, 3, 3]
    assert eng.block_manager.num_free_blocks == 100 - 3
    eng.step()                                     # copy-on-write of the partial last block
    tables = [eng.block_manager.block_table(s.seq_id) for s in seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({t[2] for t in tables}) == 3
    while eng.has_unfinished():
        done = eng.step()
    out = done[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # sample 0 uses `seed` itself: it equals the n = 1 request with the same seed
    single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=5, max_tokens=6),
                          use_tqdm=False)[0]
    assert out.outputs[0].token_ids == single.token_ids
    assert out.text == out.outputs[0].text
    no_leaks(llm)


def test_greedy_parallel_samples_equal_sequential(bundled, workload):
    prompts, params, expected = workload
    llm = minillm.LLM(bundled, num_kv_blocks=100)
    sp = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, n=2) for p in params[:4]]
    outs = llm.generate(prompts[:4], sp, use_tqdm=False)
    for o, ref in zip(outs, expected[:4]):
        assert [c.token_ids for c in o.outputs] == [ref, ref]
    no_leaks(llm)


def test_stop_strings_and_stop_tokens(bundled, workload):
    model, tok = bundled
    prompts, params, expected = workload
    llm = minillm.LLM(bundled, num_kv_blocks=100)
    i = next(k for k, ref in enumerate(expected) if len(tok.decode(ref).strip()) >= 12)
    ref_ids, ref_text = expected[i], tok.decode(expected[i], skip_special_tokens=True)
    stop = ref_text.strip()[4:8]                    # a piece from the middle of the answer
    cut = ref_text.find(stop)
    out = llm.generate([prompts[i]], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == ref_text[:cut]               # the stop string itself is not returned
    assert out.token_ids == ref_ids[:len(out.token_ids)]
    assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])

    stop_id = ref_ids[3]
    first = ref_ids.index(stop_id)
    out = llm.generate([prompts[i]], SamplingParams(temperature=0.0, max_tokens=12,
                                                    stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == ref_ids[:first + 1]
    no_leaks(llm)


def test_text_prompts_single_params_and_order(bundled):
    model, tok = bundled
    llm = minillm.LLM(bundled, num_kv_blocks=100)
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    outs = llm.generate(TEXT_PROMPTS[::-1], sp, use_tqdm=False)
    for p, o in zip(TEXT_PROMPTS[::-1], outs):
        ref = minillm.generate(model, tok, p, max_new_tokens=6, sampling=sp)
        assert o.prompt == p and o.prompt_token_ids == tok.encode(p)
        assert o.token_ids == ref and o.text == tok.decode(ref, skip_special_tokens=True)
    one = llm.generate(TEXT_PROMPTS[0], sp, use_tqdm=False)   # a bare string is one prompt
    assert len(one) == 1 and one[0].token_ids == outs[-1].token_ids


def test_bad_prompts_fail_alone_on_the_bundled_model(bundled, workload):
    prompts, params, expected = workload
    llm = minillm.LLM(bundled, num_kv_blocks=100)
    too_long = [5] * llm.model.config.max_position_embeddings
    batch = [prompts[0], "", too_long, prompts[1]]
    sps = [params[0], SamplingParams(), SamplingParams(), params[1]]
    outs = llm.generate(batch, sps, use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "empty" in outs[1].error and "context" in outs[2].error
    assert outs[0].token_ids == expected[0] and outs[3].token_ids == expected[1]
    no_leaks(llm)
