"""Bad input and cancellation: an error belongs to ONE request, never to its neighbours.

Mechanism (documented in minillm.engine): `LLMEngine.add_request` raises ValueError naming the
fix and adds nothing; `LLM.generate` turns that into an output with finish_reason "error" and
the message in `.error`, and serves every other prompt of the call normally.
"""
import pytest
import torch

import minillm
from minillm import SamplingParams, configs
from minillm.engine import LLMEngine
from minillm.loader import random_model

CTX = 128


@pytest.fixture(scope="module")
def model():
    cfg = configs.get("smollm2-135m").with_(
        name="tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=CTX,
        eos_token_id=None, bos_token_id=None)
    return random_model(cfg, "cpu", torch.float32, seed=0, std=0.3)   # output depends on context


def greedy(m):
    return SamplingParams(temperature=0.0, max_tokens=m)


def reference(model, prompt, m):
    return minillm.generate(model, None, prompt, max_new_tokens=m, sampling=greedy(m))


def test_bad_requests_get_an_error_output_and_the_rest_are_served(model):
    llm = minillm.LLM((model, None), num_kv_blocks=10, block_size=4, max_num_seqs=4,
                      max_num_batched_tokens=32)
    good1, good2 = [1, 2, 3, 4, 5], list(range(10, 30))
    cases = [
        (good1, greedy(6), None),
        ([], greedy(4), "empty"),                                   # empty prompt
        ("hello", greedy(4), "tokenizer"),                          # text without a tokenizer
        ([7] * CTX, greedy(4), "context"),                          # prompt as long as context
        ([7] * 100, greedy(40), "max_tokens"),                      # prompt + max_tokens > ctx
        ([7] * 30, greedy(20), "never run"),                        # 49 tokens > 10 blocks of 4
        ([3, 999], greedy(4), "token ids"),                         # outside the vocabulary
        ([3, 4], SamplingParams(max_tokens=4, n=5), "max_num_seqs"),   # n > max_num_seqs
        ([3, 4], SamplingParams(max_tokens=4, stop=["x"]), "tokenizer"),  # stop text, no tok
        (good2, greedy(8), None),
    ]
    outs = llm.generate([c[0] for c in cases], [c[1] for c in cases], use_tqdm=False)
    for (prompt, sp, msg), out in zip(cases, outs):
        if msg is None:
            assert out.finish_reason == "length" and out.error is None
            assert out.token_ids == reference(model, prompt, sp.max_tokens)
        else:
            assert out.finish_reason == "error" and out.token_ids == [] and out.text == ""
            assert msg in out.error, (msg, out.error)
    eng = llm.engine
    assert eng.block_manager.num_free_blocks == 10 and not eng.has_unfinished()


def test_add_request_raises_and_leaves_the_engine_usable(model):
    eng = LLMEngine(model, None, num_kv_blocks=10, block_size=4, max_num_seqs=4,
                    max_num_batched_tokens=16, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("a", [], greedy(4))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        eng.add_request("b", [1] * 17, greedy(4))                  # no chunking: > budget
    with pytest.raises(ValueError, match="SamplingParams"):
        eng.add_request("c", [1, 2], {"max_tokens": 4})
    eng.add_request("d", [1, 2, 3], greedy(5))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("d", [4, 5], greedy(5))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o.request_id for o in outs] == ["d"]
    assert outs[0].token_ids == reference(model, [1, 2, 3], 5)


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_max_tokens_must_be_positive(bad):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=bad)


def test_engine_arguments_are_checked(model):
    with pytest.raises(ValueError, match="scheduling"):
        LLMEngine(model, None, num_kv_blocks=8, scheduling="round-robin")
    with pytest.raises(ValueError, match="preemption"):
        LLMEngine(model, None, num_kv_blocks=8, preemption="drop")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLMEngine(model, None, num_kv_blocks=8, max_num_seqs=64, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLMEngine(model, None, num_kv_blocks=0)
    llm = minillm.LLM((model, None), num_kv_blocks=8)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([[1], [2]], [greedy(2)] * 3, use_tqdm=False)


def test_kv_pool_sized_from_memory_on_cpu(model):
    from minillm.engine.model_runner import CPU_KV_BYTES
    from minillm.kvmath import kv_bytes_per_token
    eng = LLMEngine(model, None, block_size=16, max_num_seqs=4)
    per_block = kv_bytes_per_token(model.config, dtype=model.dtype) * 16
    full_contexts = 4 * CTX // 16          # never more than max_num_seqs full contexts
    assert eng.num_kv_blocks == min(CPU_KV_BYTES // per_block, full_contexts)
    assert eng.runner.cache.k.shape[1] == eng.num_kv_blocks


def test_abort(model):
    eng = LLMEngine(model, None, num_kv_blocks=40, block_size=4, max_num_seqs=3,
                    max_num_batched_tokens=32)
    prompts = {str(i): list(range(i + 1, i + 8)) for i in range(4)}
    for rid, p in prompts.items():
        n = 3 if rid == "2" else 1
        eng.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=10, n=n))
    outs = {}
    for _ in range(3):
        for o in eng.step():
            outs[o.request_id] = o
    assert eng.abort_request("0")          # running
    assert eng.abort_request("2")          # still waiting: n = 3 needs 3 free slots
    assert not eng.abort_request("0")      # already aborted
    assert not eng.abort_request("nope")
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs["0"].finish_reason == "abort" and 0 < len(outs["0"].token_ids) < 10
    assert outs["0"].token_ids == reference(model, prompts["0"], 10)[:len(outs["0"].token_ids)]
    assert outs["2"].finish_reason == "abort" and outs["2"].token_ids == []
    for rid in ("1", "3"):
        assert outs[rid].finish_reason == "length"
        assert outs[rid].token_ids == reference(model, prompts[rid], 10)
    assert eng.block_manager.num_free_blocks == 40 and not eng.block_manager.tables


def test_abort_a_forked_request_frees_shared_blocks(model):
    eng = LLMEngine(model, None, num_kv_blocks=40, block_size=4)
    eng.add_request("f", list(range(1, 11)), SamplingParams(temperature=1.0, seed=0,
                                                            max_tokens=10, n=4))
    eng.step()
    eng.step()
    assert len(eng.get_request("f")) == 4
    assert eng.block_manager.num_free_blocks < 40
    assert eng.abort_request("f")
    out = eng.step()[0]
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 4
    assert all(len(c.token_ids) == 2 for c in out.outputs)
    assert eng.block_manager.num_free_blocks == 40 and not eng.has_unfinished()


def test_eos_stops_unless_ignored(model):
    prompt = [5, 6, 7, 8]
    ref = reference(model, prompt, 12)
    eos = ref[4]
    tok = type("Tok", (), {"eos_token_id": eos, "decode": lambda self, ids, **kw: ""})()
    first = ref.index(eos)
    for ignore, expect in ((False, ref[:first + 1]), (True, ref)):
        eng = LLMEngine(model, tok, num_kv_blocks=20, block_size=4)
        eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                    ignore_eos=ignore))
        out = []
        while eng.has_unfinished():
            out += eng.step()
        assert out[0].token_ids == expect
        assert out[0].finish_reason == ("length" if ignore else "stop")
