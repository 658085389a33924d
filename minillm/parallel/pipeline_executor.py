"""PipelineExecutor: LLM(pipeline_parallel_size=p), one process per stage (chapter 10).

    driver process = stage 0                     worker process = stage s (1 .. p - 1)
    scheduler, block manager, sampling           its layers, a KV pool of its layers only
    embed + layers[0:a] on micro-batch i --- gloo send [1, T, C] ---> layers ... ---> ...
    ... <--- gloo send logits [1, S, V] from the last stage (norm + lm_head) ---
    sample

The driver is stage 0 rather than a scheduler beside p stage processes: on a machine with few
cores an idle extra process is pure cost, and tensor parallelism's executor has the same shape
(rank 0 in the driver). The block manager allocates block ids once, in the driver; every stage
gets the same StepMetadata, so the same block tables index each stage's own pool.

Micro-batches: a step's scheduled requests are cut into m groups of about equal tokens
(`stage.split_micro_batches`). The driver runs stage 0 on group 0, sends it on and goes on to
group 1 while stage 1 works on group 0, so the stages overlap; the bubble of a step is read off
the compute spans every stage records (`executor.timeline`, `pipeline.bubble_fraction`) and
compared with (p - 1) / (m + p - 1). Each group is its own small forward, so the tokens are the
single-process engine's up to float rounding (GEMMs of other shapes). m defaults to p; set
`executor.num_micro_batches`.

What is not built with pp > 1: tensor parallelism at the same time, speculative decoding,
quantization, KV transfer, an fp8 KV cache, a GPU (each a ValueError naming what works).
Swap preemption works: every stage applies the same block copies to its own layers.
"""
from __future__ import annotations

import collections
import time

import torch

from .executor import (REPLY_TIMEOUT_S, STARTUP_TIMEOUT_S, MultiprocExecutor,
                       TPDriverRunner)
from .pipeline import Span, stage_layers
from .pipeline_worker import stage_runner
from .stage import PipelineStage, split_micro_batches, stage_state_dict


class PPDriverRunner(TPDriverRunner):
    """Stage 0's ModelRunner: the block copies go to every stage first (TPDriverRunner's), a
    dead stage fails the engine, and `run` drives the micro-batches through the pipe."""

    def run(self, scheduled):
        parts = split_micro_batches(scheduled, self.executor.num_micro_batches)
        steps = [self.prepare(part) for part in parts]
        self._check_positions(steps)
        work = [(s.input_ids.shape[1], s.meta, s.logits_rows) for s in steps]
        self.executor.send_workers("forward", (work,))
        try:
            parts, spans = self._first_stage(steps)
        except Exception:                   # the stages were drained: the driver's error wins
            self.executor.collect(strict=False)
            raise
        for theirs in self.executor.collect():
            spans += theirs
        self.executor.timeline.append(spans)
        samplers, prompt_rows, offset = [], [], 0
        for step, part in zip(steps, parts):
            samplers += [(r, row + offset, k) for r, row, k in step.samplers]
            prompt_rows += [(r, row + offset, p, c) for r, row, p, c in step.prompt_rows]
            offset += len(part)
        return torch.cat(parts), samplers, prompt_rows                  # [S, V]

    def _check_positions(self, steps) -> None:
        limit = self.model.model_config.max_position_embeddings
        for s in steps:
            if s.meta.num_tokens and int(s.meta.positions.max()) >= limit:
                raise ValueError(f"position {int(s.meta.positions.max())} is beyond the model's "
                                 f"context of {limit} tokens")

    @torch.inference_mode()
    def _first_stage(self, steps):
        """Post a receive for each micro-batch's logits, then run stage 0 on each micro-batch
        and send it on. Returns ([logits [S_i, V]], [Span] of stage 0)."""
        stage, comm, last = self.model, self.executor.comm, self.executor.world_size - 1
        C, V = stage.model_config.hidden_size, stage.model_config.vocab_size
        inbox = [comm.irecv(torch.empty(1, len(s.logits_rows), V, dtype=stage.dtype), last, i)
                 if len(s.logits_rows) else None for i, s in enumerate(steps)]
        sends, spans, error = [], [], None
        for i, s in enumerate(steps):
            start = time.perf_counter()
            try:
                self.cache.set_step(s.meta)
                x = stage(s.input_ids, s.meta, self.cache)                     # [1, T, C]
            except Exception as e:          # noqa: BLE001 - raised once the pipe is drained
                error = error or e
                x = torch.zeros(1, s.input_ids.shape[1], C, dtype=stage.dtype)
            spans.append(Span(0, i, start, time.perf_counter()))
            sends.append(comm.isend(x, 1, i))
        self.executor.wait_all(sends + [box for box in inbox if box is not None])
        logits = [box.tensor[0] if box is not None else torch.empty(0, V, dtype=stage.dtype)
                  for box in inbox]                                              # [S_i, V]
        if error is not None:
            raise error
        return logits, spans


class PipelineExecutor(MultiprocExecutor):
    kind = "pipeline"

    def __init__(self, pipeline_parallel_size: int, model, block_manager, num_blocks: int,
                 block_size: int, num_cpu_blocks: int = 0, needs_hidden: bool = False,
                 num_threads: int = 1, needs_features: bool = False,
                 kv_cache_dtype: str = "auto", enforce_eager: bool = True,
                 max_num_seqs: int = 64):
        pp = pipeline_parallel_size
        stage_layers(len(model.layers), pp)                 # ValueError: more stages than layers
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not built for "
                             "pipeline_parallel_size > 1: pass kv_cache_dtype='auto' or "
                             "pipeline_parallel_size=1")
        if needs_hidden or needs_features:                  # speculation is refused before this
            raise ValueError("a drafter that reads hidden states needs pipeline_parallel_size=1")
        if model.device.type != "cpu":
            raise ValueError("minillm's pipeline parallelism runs gloo on the CPU; pass "
                             "device='cpu' (NCCL on GPUs is the same design, not built here)")
        self.world_size = pp
        self.num_micro_batches = pp
        self.timeline = collections.deque(maxlen=10_000)    # per step: [Span] of every stage
        self.workers, self.conns, self._error = [], [], None
        try:
            self._start(model, block_manager, num_blocks, block_size, num_cpu_blocks, num_threads)
        except BaseException:
            self.shutdown()
            raise

    def wait_all(self, pending: list) -> None:
        """Wait for the driver's sends and receives, watching the stages (`_watched`: a stage
        that dies mid-step can leave the others waiting for it until gloo's own timeout)."""
        def wait():
            for p in pending:
                p.wait()
        self._watched(wait, REPLY_TIMEOUT_S,
                      f"the pipeline did not deliver a step within {REPLY_TIMEOUT_S:.0f} s")

    @property
    def num_micro_batches(self) -> int:
        """m: how many groups each step's requests are cut into (at most one per request)."""
        return self._m

    @num_micro_batches.setter
    def num_micro_batches(self, m: int) -> None:
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"num_micro_batches must be a positive integer, got {m!r}")
        self._m = m

    def _start(self, model, block_manager, num_blocks, block_size, num_cpu_blocks,
               num_threads) -> None:
        pp, cfg = self.world_size, model.config
        store = self._new_store()
        for stage in range(1, pp):
            self._spawn(store, stage, stage_runner,
                        (cfg, stage, pp, stage_state_dict(model, stage, pp), model.dtype,
                         num_blocks, block_size, num_cpu_blocks), num_threads)
        self.comm = self._join_group(store)
        self.collect(timeout=STARTUP_TIMEOUT_S)                       # every stage is ready
        self.driver_runner = PPDriverRunner(self, PipelineStage(model, 0, pp), block_manager,
                                            num_blocks, block_size, num_cpu_blocks)
