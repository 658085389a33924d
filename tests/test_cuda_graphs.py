"""enforce_eager / CUDA graphs for decode steps (minillm.engine.cuda_graphs, chapter 12).

On a CPU: the flag is validated and, when False, compiles the step instead (test_compiled.py);
the graph runner's static buffers and padding are checked with an eager stand-in for the capture
(replay = run the recorded forward again into the same output), against sequential
`minillm.generate`. On a GPU
(skipped elsewhere): real CUDA graphs, greedy tokens and logits equal to the eager engine's.
"""
import logging
import random

import pytest
import torch

import minillm
from minillm import SamplingParams, configs
from minillm.engine import cuda_graphs
from minillm.engine.compiled import CompiledStep
from minillm.engine.cuda_graphs import CUDAGraphRunner, NoGraphs, capture_sizes
from minillm.engine.llm_engine import LLMEngine
from minillm.loader import random_model

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 512


def tiny(device="cpu", dtype=torch.float32):
    cfg = configs.get("smollm2-135m").with_(
        name="tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=128,
        eos_token_id=None, bos_token_id=None)
    return random_model(cfg, device, dtype, seed=0, std=0.3)


def workload(n=7, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in range(n)]
    return prompts, [rng.randint(2, 12) for _ in range(n)]


def run_engine(engine, prompts, max_tokens):
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=m))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():                             # the requests finished in this step
            outs[o.request_id] = o.token_ids
    return [outs[str(i)] for i in range(len(prompts))]


def sequential(model, prompts, max_tokens):
    return [minillm.generate(model, None, p, max_new_tokens=m,
                             sampling=SamplingParams(temperature=0.0, max_tokens=m))
            for p, m in zip(prompts, max_tokens)]


def counting(graphs):
    """Wrap graphs.run to record, per step, whether the graph ran it (not None: it did)."""
    ran = []
    real = graphs.run
    graphs.run = lambda step, sched: (lambda out: (ran.append(out is not None), out)[1])(
        real(step, sched))
    return ran


class EagerCapture:
    """Stands in for cuda_graph_capture on a CPU: 'replay' runs the recorded forward again and
    writes into the output tensor captured first, as a graph replay does. Records every replay's
    size."""

    def __init__(self):
        self.replayed = []

    def __call__(self, fn):
        out = fn()

        def replay():
            self.replayed.append(out.shape[0])
            out.copy_(fn())
        return replay, out


def test_capture_sizes_cover_every_batch():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(10_000)[-1] == cuda_graphs.MAX_CAPTURE_SIZE
    for top in (1, 3, 8, 9, 33):
        sizes = capture_sizes(top)
        assert sizes == sorted(set(sizes)) and sizes[-1] == top
        assert all(any(s >= b for s in sizes) for b in range(1, top + 1))
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


@pytest.mark.parametrize("bad", ["no", 0, 1, None, "False"])
def test_bad_enforce_eager_is_a_value_error(bad):
    model = tiny()
    with pytest.raises(ValueError, match="enforce_eager must be True"):
        minillm.LLM((model, None), enforce_eager=bad)
    with pytest.raises(ValueError, match="enforce_eager must be True"):
        LLMEngine(model, None, num_kv_blocks=8, enforce_eager=bad)


def test_enforce_eager_false_on_cpu_compiles_and_a_drafter_keeps_it_eager(caplog):
    """On a CPU enforce_eager=False compiles the step (tests/test_compiled.py checks it); where a
    drafter reads hidden states, neither graphs nor compiling apply: eager, with a note."""
    model = tiny()
    engine = LLMEngine(model, None, num_kv_blocks=64, block_size=4, enforce_eager=False)
    assert isinstance(engine.runner.graphs, CompiledStep)
    with caplog.at_level(logging.WARNING, logger="minillm.engine.cuda_graphs"):
        runner = cuda_graphs.build_graph_runner(model, engine.runner.cache, 4, False,
                                                needs_hidden=True)
    assert isinstance(runner, NoGraphs)
    assert any("hidden states" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="minillm.engine.cuda_graphs"):
        engine = LLMEngine(model, None, num_kv_blocks=64, block_size=4)  # default: eager
    assert isinstance(engine.runner.graphs, NoGraphs) and not caplog.records


def test_graph_runner_buffers_and_padding_match_sequential():
    """Every pure decode step goes through the static buffers, padded to a captured size
    (7 requests, max_num_seqs 6: sizes 1, 2, 4, 6); tokens equal sequential generation."""
    model = tiny()
    prompts, _ = workload(7, seed=2)
    # request 0 (blocks 0.., so KV slot 0) outlives the batches of 5 and 3 that need padding:
    # a padding row that wrote its K/V anywhere but nowhere (slot -1) would corrupt it
    max_tokens = [14, 3, 4, 5, 6, 7, 3]
    engine = LLMEngine(model, None, num_kv_blocks=200, block_size=4, max_num_seqs=6,
                       max_num_batched_tokens=16)
    fake = EagerCapture()
    engine.runner.graphs = CUDAGraphRunner(model, engine.runner.cache, 6, capture=fake)
    assert sorted(engine.runner.graphs.graphs) == [1, 2, 4, 6]
    fake.replayed.clear()                                   # drop nothing: capture never replays
    assert run_engine(engine, prompts, max_tokens) == sequential(model, prompts, max_tokens)
    decode_steps = [s for s in engine.step_stats if not s.num_prefill_seqs]
    assert len(fake.replayed) == len(decode_steps) > 0
    padded = [s.num_decode_tokens for s in decode_steps
              if s.num_decode_tokens not in (1, 2, 4, 6)]
    assert padded, "the workload was meant to give decode batches that need padding"
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_graph_runner_leaves_other_steps_eager():
    """Prefill chunks and prompt-logprob steps return None (run eagerly), and so does a batch
    larger than the largest graph."""
    model = tiny()
    engine = LLMEngine(model, None, num_kv_blocks=100, block_size=4, max_num_seqs=4)
    fake = EagerCapture()
    runner = engine.runner
    runner.graphs = CUDAGraphRunner(model, runner.cache, 2, capture=fake)
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=3,
                                                             prompt_logprobs=1))
    for i in range(3):
        engine.add_request(f"b{i}", [7 + i, 8], SamplingParams(temperature=0.0, max_tokens=3))
    sizes = []
    real_run = runner.graphs.run
    runner.graphs.run = lambda step, sched: (sizes.append(step.meta.num_seqs),
                                             real_run(step, sched))[1]
    fake.replayed.clear()
    while engine.has_unfinished_requests():
        engine.step()
    assert sizes and max(sizes) == 4 and fake.replayed == []   # 4 decodes > 2: eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_equal_eager_on_gpu(dtype):
    model = tiny("cuda", dtype)
    prompts, max_tokens = workload(11, seed=3)
    kw = dict(num_kv_blocks=300, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    eager = run_engine(LLMEngine(model, None, **kw), prompts, max_tokens)
    engine = LLMEngine(model, None, enforce_eager=False, **kw)
    graphs = engine.runner.graphs
    assert isinstance(graphs, CUDAGraphRunner) and graphs.sizes == [1, 2, 4, 8]
    replays = counting(graphs)
    got = run_engine(engine, prompts, max_tokens)
    assert sum(replays) > 0
    if dtype == torch.float32:      # bf16: a padded GEMM may round differently and flip a tie
        assert got == eager
    # logits of one padded replay (3 sequences -> graph 4) against the eager forward
    cache, b = engine.runner.cache, 3
    bm = engine.block_manager
    for s in range(b):
        bm.allocate(f"x{s}", 5 + s)
    spans = [(4 + s, 1) for s in range(b)]
    tables = [bm.block_table(f"x{s}") for s in range(b)]
    from minillm.cache.paged import build_step_metadata
    from minillm.engine.model_runner import StepInputs
    meta = build_step_metadata(spans, tables, 4, "cuda")
    ids = torch.tensor([[5, 6, 7]], device="cuda")
    step = StepInputs(ids, meta, torch.arange(b, device="cuda"), [], [])

    class Req:
        num_computed_tokens = 4
    with torch.inference_mode():
        replayed = graphs.run(step, [(Req, 1)] * b)
        cache.set_step(meta)
        expected = model(ids, positions=meta.positions[None], cache=cache)[0]      # [B, V]
    atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (1e-1, 5e-2)
    torch.testing.assert_close(replayed, expected, atol=atol, rtol=rtol)
