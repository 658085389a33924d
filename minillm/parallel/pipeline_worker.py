"""A pipeline stage's worker process (chapter 10): stages 1 .. p - 1 of
LLM(pipeline_parallel_size=p).

For each step the driver sends every stage the same list of micro-batches, (num_tokens,
StepMetadata, logits_rows) each. A stage posts one receive per micro-batch up front (so the
previous stage never waits to send), then for micro-batch i: waits for its hidden states,
runs its layers, and sends the result on, to stage s + 1 or, from the last stage, the logits
rows back to the driver (rank 0), which samples. Micro-batch i's tag is i on every link.

If a stage's forward raises, it still sends zeros of the right shape for that micro-batch, so
the stages after it and the driver are not left waiting, and reports the error once the step
is drained (the driver then fails the engine, as it does for tensor parallelism).
"""
from __future__ import annotations

import time

import torch

from .pipeline import Span
from .stage import build_stage
from .worker import ShardRunner


class StageRunner(ShardRunner):
    """What a stage's worker does: block copies (ShardRunner's) and the step's micro-batches."""

    def __init__(self, stage, comm, num_blocks: int, block_size: int, num_cpu_blocks: int):
        super().__init__(stage, comm, num_blocks, block_size, num_cpu_blocks)
        self.stage = stage

    @torch.inference_mode()
    def forward(self, work: list) -> list:
        """work: [(T, meta, logits_rows)] per micro-batch. Returns [Span] of this stage's
        compute (time.perf_counter, which every process on one machine shares)."""
        st, comm = self.stage, self.comm
        C, V = st.model_config.hidden_size, st.model_config.vocab_size
        inbox = [comm.irecv(torch.empty(1, T, C, dtype=st.dtype), st.stage - 1, tag=i)
                 for i, (T, _, _) in enumerate(work)]                 # [1, T, C] each
        sends, spans, error = [], [], None
        for i, ((T, meta, rows), box) in enumerate(zip(work, inbox)):
            x = box.wait()
            start = time.perf_counter()
            try:
                # stage 0 checked these very tables (its first layer): trust them here
                self.cache.set_step(meta, check_values=False)
                y = st(x, meta, self.cache, rows)          # [1, T, C] or last: [1, S, V]
            except Exception as e:                         # noqa: BLE001 - raised once drained
                error = error or e
                y = torch.zeros((1, len(rows), V) if st.is_last else (1, T, C), dtype=st.dtype)
            spans.append(Span(st.stage, i, start, time.perf_counter()))
            if not st.is_last:
                sends.append(comm.isend(y, st.stage + 1, tag=i))
            elif len(rows):
                sends.append(comm.isend(y, 0, tag=i))
        for s in sends:
            s.wait()
        if error is not None:
            raise error
        return spans


def stage_runner(comm, model_config, stage: int, pp: int, state: dict, dtype, num_blocks: int,
                 block_size: int, num_cpu_blocks: int) -> StageRunner:
    """The worker's runner for stage `stage` (worker_main's make_runner)."""
    return StageRunner(build_stage(model_config, stage, pp, state, dtype), comm, num_blocks,
                       block_size, num_cpu_blocks)
