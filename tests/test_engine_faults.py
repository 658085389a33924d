"""Fault injection: a failure inside one request's step costs that request only.

Each test poisons ONE request (its forward, its sampling, its stop check, its detokenisation,
or Ctrl-C in the middle of a step) through a monkeypatched hook and checks the invariants:
- the poisoned request finishes with reason "error" and says why in `.error`;
- every other request gets exactly the tokens of a clean run of the same batch;
- when the engine is idle no KV block is in use and no request is left behind;
- the same LLM then serves a clean generate() with the clean results.
The pool is small enough that the batch also preempts, so failures meet preempted requests too.
"""
import numpy as np
import pytest
import torch

import minillm
from minillm import SamplingParams, configs
from minillm.engine import LLMEngine, model_runner
from minillm.loader import random_model

VOCAB = 256
NUM_BLOCKS = 24
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    cfg = configs.get("smollm2-135m").with_(
        name="tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=128,
        eos_token_id=None, bos_token_id=None)
    return random_model(cfg, "cpu", torch.float32, seed=0, std=0.3)


PROMPTS = [list(range(3, 20)), [7, 8, 9], list(range(40, 70)), [100, 101, 102, 103, 104],
           list(range(200, 221))]
POISONED = 2                                 # index of the request the faults target
MAX_TOKENS = 12


def params():
    """Greedy everywhere except the poisoned request: seeded sampling (so the sampling hook
    is on its path); greedy tokens do not depend on what else is in the batch."""
    return [SamplingParams(temperature=0.8, seed=666, max_tokens=MAX_TOKENS) if i == POISONED
            else SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
            for i in range(len(PROMPTS))]


def make_llm(model):
    return minillm.LLM((model, None), block_size=4, num_kv_blocks=NUM_BLOCKS, max_num_seqs=4,
                       max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def clean(model):
    llm = make_llm(model)
    outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    assert llm.engine.num_preemptions > 0, "the pool was meant to force preemption"
    assert all(o.finish_reason == "length" for o in outs)
    return [o.token_ids for o in outs]


def assert_isolated(llm, outs, clean, match):
    for i, out in enumerate(outs):
        if i == POISONED:
            assert out.finish_reason == "error", out
            assert match in out.error, out.error
        else:
            assert out.error is None and out.finish_reason == "length", out
            assert out.token_ids == clean[i], f"request {i} changed because another one failed"
    assert_idle_and_clean(llm.engine)


def assert_idle_and_clean(engine):
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS, "KV blocks leaked"
    assert not engine.block_manager.tables and not engine.groups


def assert_still_serves(llm, monkeypatch, clean):
    monkeypatch.undo()
    outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    assert [o.token_ids for o in outs] == clean
    assert_idle_and_clean(llm.engine)


def test_failing_sampling_fails_one_request(model, clean, monkeypatch):
    real = model_runner.sample

    def sample(logits, p, generator=None):
        if p.seed == 666:
            raise RuntimeError("injected sampling fault")
        return real(logits, p, generator)

    monkeypatch.setattr(model_runner, "sample", sample)
    llm = make_llm(model)
    outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    assert_isolated(llm, outs, clean, "injected sampling fault")
    assert outs[POISONED].token_ids == []
    assert_still_serves(llm, monkeypatch, clean)


def test_failing_stop_check_fails_one_request_after_some_tokens(model, clean, monkeypatch):
    real = LLMEngine._check_stop

    def stop_reason(self, req):
        if req.prompt_token_ids == PROMPTS[POISONED] and req.num_output_tokens == 4:
            raise TypeError("injected stop-check fault")
        return real(self, req)

    monkeypatch.setattr(LLMEngine, "_check_stop", stop_reason)
    llm = make_llm(model)
    outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    assert_isolated(llm, outs, clean, "injected stop-check fault")
    assert outs[POISONED].token_ids == clean[POISONED][:4]    # what it made before failing
    assert_still_serves(llm, monkeypatch, clean)


def test_failing_forward_at_prefill_fails_one_request(model, clean, monkeypatch):
    """The poisoned prompt makes the model raise: the batch fails, each request is re-run alone,
    only the poisoned one fails again."""
    poison = PROMPTS[POISONED][0]
    others = [t for i, p in enumerate(PROMPTS) if i != POISONED for t in p + clean[i]]
    assert poison not in others          # only the poisoned request ever feeds this token
    real = type(model).forward

    def forward(self, input_ids, *args, **kwargs):
        if (input_ids == poison).any():
            raise RuntimeError("injected forward fault")
        return real(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", forward)
    llm = make_llm(model)
    outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    assert_isolated(llm, outs, clean, "injected forward fault")
    assert_still_serves(llm, monkeypatch, clean)


def test_failing_forward_mid_decode_fails_one_request(model, clean, monkeypatch):
    real = model_runner.ModelRunner.prepare

    def prepare(self, scheduled):
        for req, _ in scheduled:
            if req.prompt_token_ids == PROMPTS[POISONED] and req.num_output_tokens == 5:
                raise ValueError("injected prepare fault")
        return real(self, scheduled)

    monkeypatch.setattr(model_runner.ModelRunner, "prepare", prepare)
    llm = make_llm(model)
    outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    assert_isolated(llm, outs, clean, "injected prepare fault")
    assert outs[POISONED].token_ids == clean[POISONED][:5]
    assert_still_serves(llm, monkeypatch, clean)


def test_failing_detokenisation_fails_one_request(model, clean, monkeypatch):
    real = LLMEngine.decode

    def decode(self, ids):
        if ids[:len(clean[POISONED])] == clean[POISONED] and len(ids) == MAX_TOKENS:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected decode fault")
        return real(self, ids)

    monkeypatch.setattr(LLMEngine, "decode", decode)
    llm = make_llm(model)
    outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    assert_isolated(llm, outs, clean, "injected decode fault")
    assert_still_serves(llm, monkeypatch, clean)


def test_a_model_that_always_fails_fails_every_request_without_leaking(model, clean,
                                                                      monkeypatch):
    def forward(self, *args, **kwargs):
        raise RuntimeError("broken model")

    monkeypatch.setattr(type(model), "forward", forward)
    llm = make_llm(model)
    outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    assert all(o.finish_reason == "error" and "broken model" in o.error for o in outs)
    assert_idle_and_clean(llm.engine)
    assert_still_serves(llm, monkeypatch, clean)


def test_interrupted_generate_aborts_its_requests(model, clean, monkeypatch):
    calls = {"n": 0}
    real = model_runner.ModelRunner._sample

    def sample_tokens(self, *args):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(model_runner.ModelRunner, "_sample", sample_tokens)
    llm = make_llm(model)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, params(), use_tqdm=False)
    assert calls["n"] == 6
    assert_idle_and_clean(llm.engine)
    assert_still_serves(llm, monkeypatch, clean)


def test_interrupted_step_leaves_a_consistent_engine(model, clean, monkeypatch):
    """An exception escaping step() requeues the running requests for recompute: stepping on
    afterwards finishes everything with the clean tokens and frees every block."""
    calls = {"n": 0}
    real = model_runner.ModelRunner.run

    def forward(self, scheduled):
        calls["n"] += 1
        if calls["n"] in (4, 9):
            raise KeyboardInterrupt
        return real(self, scheduled)

    monkeypatch.setattr(model_runner.ModelRunner, "run", forward)
    eng = make_llm(model).engine
    ps = params()
    for i, prompt in enumerate(PROMPTS):
        eng.add_request(str(i), prompt, ps[i])
    outs, interrupts = {}, 0
    while eng.has_unfinished():
        try:
            for o in eng.step():
                outs[o.request_id] = o
        except KeyboardInterrupt:
            interrupts += 1
            assert not eng.scheduler.running and not eng.block_manager.tables
    assert interrupts == 2
    for i in range(len(PROMPTS)):
        if i != POISONED:                 # the sampled one drew extra numbers when re-run
            assert outs[str(i)].token_ids == clean[i]
    assert_idle_and_clean(eng)


def test_add_request_failures_of_any_type_are_that_requests_error(model, clean, monkeypatch):
    real = LLMEngine.encode

    def encode(self, prompt):
        if prompt == PROMPTS[POISONED]:
            raise TypeError("injected encode fault")
        return real(self, prompt)

    monkeypatch.setattr(LLMEngine, "encode", encode)
    llm = make_llm(model)
    outs = llm.generate(PROMPTS, params(), use_tqdm=False)
    assert_isolated(llm, outs, clean, "TypeError: injected encode fault")
    assert_still_serves(llm, monkeypatch, clean)


def test_params_changed_after_construction_are_checked_again(model, clean):
    llm = make_llm(model)
    ps = params()
    ps[POISONED].seed = "abc"
    outs = llm.generate(PROMPTS, ps, use_tqdm=False)
    assert_isolated(llm, outs, clean, "seed must be an integer")


def test_tiny_temperature_is_greedy(model, clean):
    llm = make_llm(model)
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=1e-39, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    assert [o.token_ids for o in outs] == clean[:2]


@pytest.mark.parametrize("as_array", [torch.tensor, np.array, lambda p: [np.int64(t) for t in p]])
def test_a_1d_tensor_or_array_is_one_prompt(model, clean, as_array):
    llm = make_llm(model)
    outs = llm.generate(as_array(PROMPTS[1]), SamplingParams(temperature=0.0,
                                                             max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    assert len(outs) == 1 and outs[0].token_ids == clean[1]
    assert outs[0].token_ids == minillm.generate(model, None, as_array(PROMPTS[1]),
                                                 max_new_tokens=MAX_TOKENS)


def test_a_2d_tensor_is_one_prompt_per_row(model, clean):
    llm = make_llm(model)
    rows = torch.tensor([PROMPTS[1], PROMPTS[1][::-1]])
    outs = llm.generate(rows, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    assert len(outs) == 2 and outs[0].token_ids == clean[1]
    with pytest.raises(ValueError, match="1-D"):
        llm.generate(torch.zeros(1, 2, 3, dtype=torch.long), use_tqdm=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_cpu_blocks=0), "num_cpu_blocks >= 1"),
    (dict(num_cpu_blocks=-1), "num_cpu_blocks must be an integer >= 0"),
    (dict(num_cpu_blocks=2.5), "num_cpu_blocks must be an integer >= 0"),
])
def test_swap_pool_errors_name_num_cpu_blocks(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        minillm.LLM((model, None), num_kv_blocks=8, preemption="swap", **kwargs)
