"""CUDA graphs for decode steps (chapter 12): `LLM(enforce_eager=False)`, vLLM's name.

At batch 1 a small model's decode step on a GPU is launch-bound: each of the step's few hundred
kernels (30 layers x ~15 ops) costs the CPU a few microseconds of Python and driver work to
launch, often more than the GPU needs to run it. A CUDA graph records every launch of one
forward once and replays the whole list with ONE call; the CPU cost per step then no longer
grows with the number of ops.

A graph replays exactly what it recorded: the same kernels, the same shapes, the same memory
addresses. So:

- one graph per batch size in `capture_sizes(max_num_seqs)` (1, 2, 4, 8, 16, 24, ...); a step
  of B sequences runs the graph of the smallest size >= B, its extra rows padding;
- the inputs live in static buffers the graphs read (`input_ids`, `positions`, `slot_mapping`,
  `seq_lens`, `block_tables`, sized for the largest graph); each step copies its tensors in
  and fills the padding rows with values that change nothing: slot -1 (store_kv skips the row),
  seq_len 1 over block 0 (attention reads one real key; the row's output is dropped);
- nothing in the recorded forward may read a tensor back to the host (a host sync is not
  allowed while capturing): the cache trusts its tables (`set_step(meta, check_values=False)`),
  the position check of `Transformer.forward` is done on the host before the replay, and the
  block tables are as wide as the longest context, so the Triton decode kernel's launch choice
  (split-KV or not) depends only on the batch size.

Only pure decode steps replay (every sequence brings one token and samples it); prefill chunks,
speculative verification, prompt logprobs and models whose hidden states a drafter reads run
eagerly, as does a batch larger than the largest graph. Sampling stays outside the graph.

`build_graph_runner` is the seam the model runner holds: `NoGraphs` (does nothing) with
enforce_eager=True or when hidden states are needed; `CUDAGraphRunner` on a GPU. On a CPU there
are no kernel launches to record, but there is a per-op cost of the same kind (Python and
dispatch for every small op): there enforce_eager=False compiles the step instead
(`compiled.py::CompiledStep`).
Measured on one H100 (2026-11-25, benchmarks/README.md): greedy tokens equal to the eager step's
in fp32, and decode steps 10x faster for SmolLM2-135M at batch 1 (21.3 -> 2.1 ms), 3.5-4.8x for
Llama-3.2-1B. minillm's default stays enforce_eager=True (vLLM's is False): CI has no GPU, so
nothing would keep this path tested on every change.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import torch

from ..cache.paged import StepMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512          # larger decode batches run eagerly (their launches amortise)


def check_enforce_eager(value) -> bool:
    """enforce_eager must be True or False (ValueError otherwise, before anything loads)."""
    if not isinstance(value, bool):
        raise ValueError(f"enforce_eager must be True (always eager) or False (CUDA graphs for "
                         f"decode steps on a GPU), got {value!r}")
    return value


def capture_sizes(max_num_seqs: int) -> list:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8 below max_num_seqs, and
    max_num_seqs itself (capped at MAX_CAPTURE_SIZE), so every decode batch has a graph."""
    top = min(int(max_num_seqs), MAX_CAPTURE_SIZE)
    if top < 1:
        raise ValueError(f"max_num_seqs must be >= 1 to capture graphs, got {max_num_seqs}")
    base = [1, 2, 4] + list(range(8, top, 8))
    return [s for s in base if s < top] + [top]


class NoGraphs:
    """The seam when graphs are off: every step runs eagerly."""

    sizes: list = []

    def run(self, step, scheduled) -> Optional[torch.Tensor]:
        return None


def decode_forward(model, input_ids, positions, cache, logits_rows=None) -> torch.Tensor:
    """`Transformer.forward` for one ragged row of T tokens without its host-side position
    check (done by the caller): input_ids [1, T], positions [1, T] -> logits [T, V], or [S, V]
    for the S rows in logits_rows. The recorded forward of a CUDA graph, and the traced one of
    the compiled step (compiled.py)."""
    cos, sin = model.rope(positions)                       # [1, T, 1, D] each
    x = model.embed_tokens(input_ids)                      # [1, T, C]
    for layer in model.layers:
        x = layer(x, cos, sin, cache)
    cache.advance(input_ids.shape[1])
    if logits_rows is not None:
        x = x[:, logits_rows]                              # [1, S, C]
    return model.lm_head(model.norm(x))[0]                 # [T or S, V]


def cuda_graph_capture(fn: Callable[[], torch.Tensor], pool) -> tuple:
    """Run fn once on a side stream (compiles the Triton kernels, settles the allocator), then
    record it into a CUDA graph. Returns (replay, output tensor the replay rewrites)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out


class CUDAGraphRunner:
    """One captured decode forward per batch size, replayed over static input buffers.

    capture(fn) -> (replay, out) records fn; the default records a CUDA graph. The tests pass an
    eager stand-in (replay = run fn again into out) to check the buffers and the padding on a CPU.
    """

    def __init__(self, model, cache, max_num_seqs: int, capture: Optional[Callable] = None):
        self.model, self.cache = model, cache
        self.sizes = capture_sizes(max_num_seqs)
        self.limit = model.config.max_position_embeddings
        n, dev = self.sizes[-1], model.device
        width = math.ceil(self.limit / cache.block_size)   # blocks of the longest context
        self.input_ids = torch.zeros(1, n, dtype=torch.long, device=dev)          # [1, n]
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)             # [n]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)    # [n]
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)              # [n]
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=dev)  # [n, width]
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)    # [n + 1]
        if capture is None:
            pool = torch.cuda.graph_pool_handle()
            capture = lambda fn: cuda_graph_capture(fn, pool)   # noqa: E731
        self.graphs = {}                                   # size -> (replay, logits [size, V])
        with torch.inference_mode():
            for size in reversed(self.sizes):              # largest first, as vLLM does
                self.graphs[size] = capture(lambda size=size: self._forward(size))

    def _forward(self, size: int) -> torch.Tensor:
        """The recorded forward: the first `size` rows of the static buffers."""
        meta = StepMetadata(positions=self.positions[:size],
                            cu_seqlens_q=self.cu_seqlens_q[:size + 1],
                            seq_lens=self.seq_lens[:size], slot_mapping=self.slot_mapping[:size],
                            block_tables=self.block_tables[:size], is_decode_only=True)
        self.cache.set_step(meta, check_values=False)
        return decode_forward(self.model, self.input_ids[:, :size], meta.positions[None],
                              self.cache)

    def run(self, step, scheduled) -> Optional[torch.Tensor]:
        """Replay the graph for this step and return logits [B, V] (a copy), or None when the
        step must run eagerly (not a pure decode, too large, or a position past the context:
        the eager forward raises its usual error)."""
        meta, num_seqs = step.meta, step.meta.num_seqs
        if (not meta.is_decode_only or step.prompt_rows or len(step.logits_rows) != num_seqs
                or num_seqs > self.sizes[-1]
                or meta.block_tables.shape[1] > self.block_tables.shape[1]
                or max(req.num_computed_tokens for req, _ in scheduled) >= self.limit):
            return None
        size = next(s for s in self.sizes if s >= num_seqs)
        self._fill(step, num_seqs, size)
        replay, logits = self.graphs[size]
        replay()
        return logits[:num_seqs].clone()   # the next replay rewrites the graph's output

    def _fill(self, step, num_seqs: int, size: int) -> None:
        """Copy the step into the static buffers; rows num_seqs..size-1 become padding."""
        meta, b = step.meta, num_seqs
        self.input_ids[:, :b].copy_(step.input_ids)
        self.positions[:b].copy_(meta.positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.block_tables[:size].zero_()
        self.block_tables[:b, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.input_ids[:, b:size].zero_()
        self.positions[b:size].zero_()
        self.slot_mapping[b:size].fill_(-1)                # store_kv skips padding rows
        self.seq_lens[b:size].fill_(1)                     # one real key: block 0, row 0


def build_graph_runner(model, cache, max_num_seqs: int, enforce_eager: bool,
                       needs_hidden: bool = False):
    """The model runner's seam, with enforce_eager=False: CUDAGraphRunner on a GPU, the step
    compiled by torch.compile on a CPU (compiled.py); else NoGraphs (with a logged note where
    enforce_eager=False was asked for but cannot apply)."""
    if check_enforce_eager(enforce_eager):
        return NoGraphs()
    if needs_hidden:
        logger.warning("enforce_eager=False is ignored: the drafter reads hidden states, which "
                       "neither a replayed nor a compiled graph reports; steps run eagerly")
        return NoGraphs()
    if model.device.type == "cpu":
        from .compiled import CompiledStep
        return CompiledStep(model, cache)
    if model.device.type != "cuda":
        logger.warning("enforce_eager=False is ignored on %s: CUDA graphs need a GPU; decode "
                       "steps run eagerly", model.device.type)
        return NoGraphs()
    return CUDAGraphRunner(model, cache, max_num_seqs)
