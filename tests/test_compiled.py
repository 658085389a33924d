"""The step compiled on a CPU (minillm.engine.compiled, chapter 12): LLM(enforce_eager=False).

Greedy tokens of the compiled engine equal sequential `minillm.generate` (fp32, a tiny random
model) under chunked prefill, prefix caching and several sequences at once; a chunk that
samples nothing runs eagerly; a compiler failure leaves the engine eager with a note, and a
failure of the forward itself stays the request's error. Inductor's CPU backend needs a C++
compiler: without one the compiling tests are skipped (the fallback test is not).
"""
import logging
import pickle
import shutil
import sys
import threading

import pytest
import torch
from torch._dynamo.utils import counters

import minillm.model
from minillm import SamplingParams
from minillm.engine import compiled
from minillm.engine.compiled import CompiledStep
from minillm.engine.llm_engine import LLMEngine
from minillm.lab.profiling import decode_engine, gemm_calls, time_outside_gemms
from minillm.model import fused_causal_attention, prepack
from minillm.quant import quantize_model
from test_cuda_graphs import counting, run_engine, sequential, tiny, workload

pytestmark = pytest.mark.usefixtures("one_thread")

needs_cxx = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
    reason="torch.compile's CPU backend (Inductor) needs a C++ compiler")


@needs_cxx
def test_compiled_step_equals_sequential_greedy():
    """9 prompts of 1..40 tokens, 16-token chunks, 4 sequences at a time (prefix caching on,
    the engine's default): chunks that sample nothing run eagerly, the rest compiled."""
    model = tiny()
    prompts, max_tokens = workload(9, seed=4)
    prompts[0] = prompts[0] + prompts[1] + prompts[2]       # one prompt of several chunks
    prompts[3] = prompts[1][:8] + prompts[3]                # a shared prefix
    engine = LLMEngine(model, None, num_kv_blocks=200, block_size=4, max_num_seqs=4,
                       max_num_batched_tokens=16, enforce_eager=False)
    assert isinstance(engine.runner.graphs, CompiledStep)
    ran = counting(engine.runner.graphs)
    assert run_engine(engine, prompts, max_tokens) == sequential(model, prompts, max_tokens)
    assert sum(ran) > 0 and not all(ran)                    # compiled, and some chunks eager
    assert engine.runner.graphs.disabled is None
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


@needs_cxx
@pytest.mark.parametrize("kw", [
    dict(speculative_config=dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1,
                                 prompt_lookup_max=3)),
    dict(num_kv_blocks=24, block_size=4, preemption="recompute"),
], ids=["ngram_speculation", "preemption"])
def test_compiled_step_under_speculation_and_preemption(kw):
    """Verification steps (k + 1 rows a sequence) and recomputed sequences go through the
    graph too: the tokens equal sequential greedy generation."""
    model = tiny()
    prompts, max_tokens = workload(8, seed=7)
    prompts = [p * 3 for p in prompts]                     # repeats: prompt lookup finds some
    engine = LLMEngine(model, None, max_num_seqs=4, enforce_eager=False,
                       **{"num_kv_blocks": 200, "block_size": 4, **kw})
    ran = counting(engine.runner.graphs)
    assert run_engine(engine, prompts, max_tokens) == sequential(model, prompts, max_tokens)
    assert sum(ran) > 0
    if "preemption" in kw:
        assert engine.num_preemptions > 0


@needs_cxx
def test_decode_steps_trace_their_attention_and_write_the_real_pool():
    """Decode-only steps run the graph with attention traced (compiled_decode: the pools are
    graph inputs written in place): the same tokens as sequential generation, and the same KV
    in the pools as the eager engine's, block for block. An fp8 pool keeps the opaque op."""
    model = tiny()
    prompts, max_tokens = workload(6, seed=5)
    kw = dict(num_kv_blocks=200, block_size=4, max_num_seqs=4)
    eager = LLMEngine(model, None, **kw)
    engine = LLMEngine(model, None, enforce_eager=False, **kw)
    step = engine.runner.graphs
    assert step.traced_attention
    traced, real = [], step.decode_fn
    step.decode_fn = lambda *a: (traced.append(a[6].shape[0]), real(*a))[1]   # a[6]: slots
    want = sequential(model, prompts, max_tokens)
    assert run_engine(engine, prompts, max_tokens) == want == run_engine(eager, prompts,
                                                                         max_tokens)
    assert max(traced) > 1 and min(traced) == 1          # one and several sequences decoding
    for pool in ("k", "v"):
        torch.testing.assert_close(getattr(engine.runner.cache, pool),
                                   getattr(eager.runner.cache, pool), rtol=1e-4, atol=1e-5)
    fp8 = LLMEngine(model, None, enforce_eager=False, kv_cache_dtype="fp8", **kw)
    assert not fp8.runner.graphs.traced_attention


@needs_cxx
def test_a_weight_changed_after_compiling_is_the_one_multiplied():
    """The graphs read each layer's packed copy at every call: a weight updated in place under
    a compiled engine (a load, a fine-tuning step) gets its copy made again before the next
    step, and the engine's tokens follow the new weights, as the eager engine's do."""
    model = tiny()
    prompts, max_tokens = workload(6, seed=3)
    others, other_max = workload(6, seed=4)       # (new prompts: no KV cached from old weights)
    kw = dict(num_kv_blocks=200, block_size=4, max_num_seqs=4)
    engine = LLMEngine(model, None, enforce_eager=False, **kw)
    run_engine(engine, prompts, max_tokens)                          # compiles, every size
    assert engine.runner.graphs.packed and engine.runner.graphs.disabled is None
    unchanged = run_engine(LLMEngine(model, None, **kw), others, other_max)
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.down_proj.weight.mul_(-3.0)
    got = run_engine(engine, others, other_max)
    assert got == run_engine(LLMEngine(model, None, **kw), others, other_max)
    assert got != unchanged                                           # the change mattered
    up = model.layers[0].mlp.gate_up_proj               # a weight replaced by another tensor
    up.weight = torch.nn.Parameter(up.weight.detach() * -2.0, requires_grad=False)
    thirds, third_max = workload(6, seed=5)
    got = run_engine(engine, thirds, third_max)
    assert got == run_engine(LLMEngine(model, None, **kw), thirds, third_max)


@needs_cxx
def test_models_that_trace_differently_get_functions_of_their_own():
    """The graphs skip Dynamo's guards on the model's modules: `model_signature` stands for
    them and picks the compiled function. Engines on models alike share one; a model with int8
    layers, or with another norm eps (a constant of the graph), gets its own, and each engine
    gives its own eager engine's tokens."""
    prompts, max_tokens = workload(6, seed=8)
    other_eps = tiny()
    other_eps.config = other_eps.config.with_(rms_norm_eps=0.5)
    for m in other_eps.modules():
        if isinstance(m, minillm.model.RMSNorm):
            m.eps = 0.5
    models = {"fp32": tiny(), "alike": tiny(), "int8": quantize_model(tiny(), "int8"),
              "eps": other_eps}
    kw = dict(num_kv_blocks=100, block_size=4, max_num_seqs=4)
    steps, tokens = {}, {}
    for name, model in models.items():
        engine = LLMEngine(model, None, enforce_eager=False, **kw)
        steps[name] = engine.runner.graphs
        tokens[name] = run_engine(engine, prompts, max_tokens)
        assert tokens[name] == run_engine(LLMEngine(model, None, **kw), prompts, max_tokens)
        assert engine.runner.graphs.disabled is None
    assert steps["fp32"].decode_fn is steps["alike"].decode_fn
    assert len({id(s.decode_fn) for s in steps.values()}) == 3
    assert tokens["int8"] != tokens["fp32"] != tokens["eps"]          # the differences matter


@needs_cxx
def test_linears_switches_flipped_under_an_engine_take_the_graphs_that_fit(monkeypatch):
    """`Linear.TRACED` off under a running compiled engine (chapter 12's comparison): its next
    steps call every product as the opaque op, from functions of their own, and give the
    eager engine's tokens."""
    model = tiny()
    kw = dict(num_kv_blocks=100, block_size=4, max_num_seqs=4)
    engine = LLMEngine(model, None, enforce_eager=False, **kw)
    run_engine(engine, *workload(4, seed=9))
    traced = engine.runner.graphs.decode_fn
    monkeypatch.setattr(minillm.model.Linear, "TRACED", False)
    prompts, max_tokens = workload(4, seed=10)
    with torch.profiler.profile() as prof:
        got = run_engine(engine, prompts, max_tokens)
    assert got == run_engine(LLMEngine(model, None, **kw), prompts, max_tokens)
    assert engine.runner.graphs.decode_fn is not traced
    assert "minillm::product" in {e.name for e in prof.events()}


@needs_cxx
def test_the_cpp_wrapper_gives_the_same_tokens(monkeypatch):
    """compiled.CPP_WRAPPER (Inductor's C++ wrapper, off by default): decode steps (traced
    attention) and prefill chunks (the opaque attention op, the packed products' op) run from
    C++ and give sequential greedy generation's tokens."""
    monkeypatch.setattr(compiled, "CPP_WRAPPER", True)
    model = tiny()
    prompts, max_tokens = workload(4, seed=11)
    engine = LLMEngine(model, None, num_kv_blocks=100, block_size=4, max_num_seqs=4,
                       enforce_eager=False)
    step = engine.runner.graphs
    ran = counting(step)
    assert run_engine(engine, prompts, max_tokens) == sequential(model, prompts, max_tokens)
    assert sum(ran) > 0 and step.disabled is None
    assert step.decode_fn is compiled._compiled(compiled._decode, compiled.model_signature(model))
    assert step.switches[-1] is True


@needs_cxx
def test_the_graphs_guard_the_steps_inputs_not_the_models_parameters():
    """Dynamo's guards before each call: on the step's inputs, not on the model's ~5,000
    parameters, attributes and packed copies (the cost this saves: compiled.py, _compile)."""
    engine = decode_engine(tiny(), 2, context=10, max_new_tokens=20, enforce_eager=False)
    engine.step(), engine.step()                                       # compiled
    code = engine.runner.graphs.decode_fn._torchdynamo_orig_callable.__code__
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(code)
    assert entries
    tensor_guards = [line for e in entries for line in str(e.guard_manager).splitlines()
                     if "TENSOR_MATCH" in line]
    assert any("L['input_ids']" in line for line in tensor_guards)
    assert not any("L['model']" in line for line in tensor_guards)


@needs_cxx
@pytest.mark.parametrize("batch", [1, 4])
def test_the_products_clock_sees_a_compiled_steps_products_without_recompiling(batch):
    """gemm_calls(compiled=True) counts every product of a compiled decode step, traced into
    the graph (1-2 rows here: the swapped product) or the packed op (4 rows), once each, and
    entering it recompiles nothing."""
    model = tiny()
    engine = decode_engine(model, batch, context=10, max_new_tokens=40, enforce_eager=False)
    engine.step(), engine.step()                                       # compiled
    graphs = counters["stats"]["unique_graphs"]
    with gemm_calls(compiled=True) as g:
        engine.step()
    assert g.calls == 4 * model.config.num_layers + 1 and g.seconds > 0
    step_ms, outside_ms = time_outside_gemms(engine, steps=3, compiled=True)
    assert 0 < outside_ms < step_ms
    assert counters["stats"]["unique_graphs"] == graphs


@needs_cxx
def test_two_engines_in_two_threads_keep_their_own_caches():
    """The forward context is per thread: two compiled engines stepping at the same time in
    two threads each attend to their own KV cache."""
    model = tiny()
    prompts, max_tokens = workload(8, seed=8)
    want = sequential(model, prompts, max_tokens)
    kw = dict(num_kv_blocks=100, block_size=4, max_num_seqs=4, enforce_eager=False)
    run_engine(LLMEngine(model, None, **kw), prompts[:2], max_tokens[:2])     # compile first
    got = {}

    def serve(i):
        got[i] = run_engine(LLMEngine(model, None, **kw), prompts[i::2], max_tokens[i::2])
    threads = [threading.Thread(target=serve, args=(i,)) for i in (0, 1)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)                 # switch threads often: mid-step, every step
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        sys.setswitchinterval(interval)
    assert got == {0: want[0::2], 1: want[1::2]}


def test_compiled_prompt_logprobs_equal_the_eager_engines():
    model = tiny()
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1)
    got = []
    for eager in (True, False):
        engine = LLMEngine(model, None, num_kv_blocks=64, block_size=4, enforce_eager=eager)
        engine.add_request("a", [5, 9, 2, 7, 1, 3, 8, 4], params)
        out = []
        while engine.has_unfinished_requests():
            out += engine.step()
        got.append(out[0])
    assert got[0].token_ids == got[1].token_ids
    lp = [[next(iter(d.values())).logprob if d else None for d in o.prompt_logprobs]
          for o in got]
    assert lp[0][0] is None and len(lp[0]) == len(lp[1]) == 8
    torch.testing.assert_close(torch.tensor(lp[0][1:]), torch.tensor(lp[1][1:]),
                               rtol=1e-4, atol=1e-4)


class PlainAttention:
    """A stand-in cache for the graph alone: causal attention over the step's own tokens."""

    def attend(self, layer, q, k, v):
        return fused_causal_attention(q, k, v)


@needs_cxx
def test_compiled_graph_logits_equal_the_eager_forward():
    """The compiled graph against Transformer.forward without a cache, at the rows asked for
    (the fused glue rounds like the eager ops up to float rounding), with attention left
    opaque and the packed products one library op each, and shared by a second model of the
    same shapes, whose own packed weights it reads (inputs of the graph, not constants)."""
    model = tiny()
    ids = torch.tensor([[5, 9, 2, 7, 1, 3, 8]])
    rows = torch.tensor([2, 6])
    compiled.compiled_products(model)
    prepack(model)
    with torch.inference_mode(), compiled.forward_context(model, PlainAttention()):
        fn = compiled.compiled_forward(model)
        fn(model, ids, torch.arange(7)[None], rows)                     # compiles
        with torch.profiler.profile() as prof:
            got = fn(model, ids, torch.arange(7)[None], rows)
        want = model(ids)[0, rows]                                  # [2, V]
    assert compiled._STEP.cache is None and compiled._STEP.model is None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    calls = [e.name for e in prof.events()]
    # attention ran as the opaque op, once per layer; the products of 7 rows on the packed
    # copies as ONE op each; the lm_head's 2 rows took its skinny product, traced into the graph
    assert model.lm_head.skinny != "packed"
    assert calls.count("minillm::packed_product") == 2 * 4
    assert calls.count("minillm::product") == 0
    assert calls.count("minillm::attention") == 2
    # another model of the same architecture reuses the graph: no compile per model (which
    # would also run into torch.compile's limit of graphs per function, then silently eager)
    other = tiny()
    with torch.no_grad():                                  # other weights, the same shapes
        for p in other.parameters():
            p.mul_(torch.rand(p.shape, generator=torch.Generator().manual_seed(1)) + 0.5)
    compiled.compiled_products(other)
    prepack(other)
    assert compiled.compiled_forward(other) is fn          # one function per signature
    graphs = counters["stats"]["unique_graphs"]
    with torch.inference_mode(), compiled.forward_context(other, PlainAttention()):
        got = fn(other, ids, torch.arange(7)[None], rows)
        want = other(ids)[0, rows]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(want, model(ids)[0, rows], atol=1e-2)    # they differ indeed
    assert counters["stats"]["unique_graphs"] == graphs


@needs_cxx
@pytest.mark.skipif(not minillm.model.mkl_packs_here(), reason="this torch has no MKL")
def test_products_packed_for_mkl_run_in_the_graph_too(monkeypatch):
    """Weights packed for MKL's sgemm (the default on Intel CPUs) through the same op: the
    compiled step's tokens equal the eager engine's."""
    monkeypatch.setattr(minillm.model.Linear, "MKL", True)
    model = tiny()
    prompts, max_tokens = workload(5, seed=7)
    kw = dict(num_kv_blocks=100, block_size=4, max_num_seqs=4)
    engine = LLMEngine(model, None, enforce_eager=False, **kw)
    assert {m._packed_for for m in engine.runner.graphs.packed} == {"mkl"}
    ran = counting(engine.runner.graphs)
    eager = run_engine(LLMEngine(model, None, **kw), prompts, max_tokens)
    assert run_engine(engine, prompts, max_tokens) == eager and sum(ran) > 0
    assert engine.runner.graphs.disabled is None


@needs_cxx
def test_compiled_step_with_int8_products_equals_its_eager_engine():
    """Quantized layers (quant.QuantLinear) stay opaque too: the same tokens as the eager
    engine on the same int8 model."""
    model = quantize_model(tiny(), "int8")
    prompts, max_tokens = workload(5, seed=6)
    kw = dict(num_kv_blocks=100, block_size=4, max_num_seqs=4)
    eager = run_engine(LLMEngine(model, None, **kw), prompts, max_tokens)
    engine = LLMEngine(model, None, enforce_eager=False, **kw)
    ran = counting(engine.runner.graphs)
    assert run_engine(engine, prompts, max_tokens) == eager and sum(ran) > 0


class Boom(torch._dynamo.exc.TorchDynamoException):
    pass


def test_compiler_failure_falls_back_to_eager_with_a_note(caplog, monkeypatch):
    model = tiny()
    prompts, max_tokens = workload(4, seed=5)
    engine = LLMEngine(model, None, num_kv_blocks=64, block_size=4, enforce_eager=False)
    graphs = engine.runner.graphs

    def broken(*args):
        raise Boom("no C++ compiler here")
    monkeypatch.setattr(graphs, "fn", broken)
    with caplog.at_level(logging.WARNING, logger="minillm.engine.compiled"):
        assert run_engine(engine, prompts, max_tokens) == sequential(model, prompts, max_tokens)
    assert "no C++ compiler here" in graphs.disabled
    assert sum("steps run eagerly" in r.getMessage() for r in caplog.records) == 1


def test_a_failing_forward_is_the_requests_error_not_a_fallback(monkeypatch):
    model = tiny()
    engine = LLMEngine(model, None, num_kv_blocks=64, block_size=4, enforce_eager=False)
    graphs = engine.runner.graphs

    def broken(*args):
        raise RuntimeError("bad forward")
    monkeypatch.setattr(graphs, "fn", broken)
    engine.add_request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2))
    out = []
    while engine.has_unfinished_requests():
        out += engine.step()
    assert out[0].finish_reason == "error" and "bad forward" in out[0].error
    assert graphs.disabled is None


def test_products_are_named_by_place_and_the_model_still_pickles():
    model = tiny()
    assert compiled.compiled_products(model) == 2 * 4 + 1          # 2 layers x 4, lm_head
    names = {name: m.opaque_name for name, m in model.named_modules()
             if getattr(m, "opaque_name", None) is not None}
    assert len(names) == 9 and all(k == v for k, v in names.items())
    copy = pickle.loads(pickle.dumps(model))            # torch.save, worker processes
    assert copy.layers[1].mlp.down_proj.opaque_name == "layers.1.mlp.down_proj"


@needs_cxx
@pytest.mark.parametrize("traced", [True, False])
def test_compiled_step_with_int4_products_equals_its_eager_engine(monkeypatch, traced):
    """int4 layers: the packed kernel called from the graph (`Int4Linear.TRACED`, the default)
    or the opaque op; either way the eager engine's tokens on the same int4 model, and the
    profile shows which (the opaque op is never called for a traced decode step)."""
    from minillm.quant import Int4Linear
    monkeypatch.setattr(Int4Linear, "TRACED", traced)
    model = quantize_model(tiny(), "int4")
    prompts, max_tokens = workload(5, seed=6)
    kw = dict(num_kv_blocks=100, block_size=4, max_num_seqs=4)
    eager = run_engine(LLMEngine(model, None, **kw), prompts, max_tokens)
    engine = LLMEngine(model, None, enforce_eager=False, **kw)
    ran = counting(engine.runner.graphs)
    assert run_engine(engine, prompts, max_tokens) == eager and sum(ran) > 0
    assert engine.runner.graphs.disabled is None
    decode = decode_engine(model, 2, 6, max_new_tokens=8, enforce_eager=False)
    decode.step()                                                     # compiles
    with torch.profiler.profile() as prof:
        decode.step()
    names = {e.name for e in prof.events()}
    assert "aten::_weight_int4pack_mm_for_cpu" in names
    assert ("minillm::product" in names) != traced
