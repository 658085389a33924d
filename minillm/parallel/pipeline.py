"""Pipeline parallelism: the layer split, the bubble, and a demonstration on threads (chapter 10).

Each of p stages holds a contiguous range of layers (stage 0 also the embedding, the last
stage the final norm and lm_head). A batch is cut into m micro-batches; stage s runs
micro-batch i as soon as stage s - 1 has sent it the hidden states [1, T, C] (gloo send /
recv), so after a fill of p - 1 slots every stage is busy on a different micro-batch:

    stage 0   [m0][m1][m2][m3]
    stage 1       [m0][m1][m2][m3]          p = 2, m = 4: 5 slots, 8 of 10 busy
                                            bubble = (p - 1) / (m + p - 1) = 1/5

Only the hidden states of one micro-batch cross each stage boundary, once per forward: far
fewer bytes than tensor parallelism's two all-reduces per layer, which is why pipeline stages
can sit on different nodes. The price is the bubble (idle slots while the pipe fills and
drains) and a latency no shorter than the whole model run one stage after another.

`pipeline_forward` runs the stages as threads of this process, each with its own rank in one
gloo group, on prompts without a KV cache, and records when each stage computed each
micro-batch; `bubble_fraction` reads the idle share off that timeline. The engine runs the
same design across processes with a paged KV cache per stage: `LLM(pipeline_parallel_size=p)`
(`pipeline_executor.py`, `pipeline_worker.py`, `stage.py`), whose stages record the same
`Span`s for every step (`executor.timeline`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .comm import Communicator, run_on_threads


def stage_layers(num_layers: int, pp: int) -> list:
    """Contiguous layer ranges, as even as possible (earlier stages take the remainder)."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pipeline_parallel_size must be between 1 and the {num_layers} "
                         f"layers, got {pp}")
    base, extra = divmod(num_layers, pp)
    starts = [s * base + min(s, extra) for s in range(pp + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(pp)]


@dataclass(frozen=True)
class Span:
    stage: int
    micro_batch: int
    start: float
    end: float


def gpipe_timeline(pp: int, num_micro_batches: int, stage_time: float = 1.0) -> list:
    """The ideal schedule: micro-batch i runs on stage s in slot i + s (equal stage times,
    free communication)."""
    return [Span(s, i, (i + s) * stage_time, (i + s + 1) * stage_time)
            for s in range(pp) for i in range(num_micro_batches)]


def bubble_fraction(spans: list, pp: int) -> float:
    """Idle share of the p stages between the first start and the last end:
    1 - busy / (p x makespan). The ideal schedule gives (p - 1) / (m + p - 1)."""
    makespan = max(s.end for s in spans) - min(s.start for s in spans)
    busy = sum(s.end - s.start for s in spans)
    return 1.0 - busy / (pp * makespan)


def _run_stage(model, rank: int, pp: int, comm, micro_batches: list, out: list, spans: list):
    layers = stage_layers(len(model.layers), pp)[rank]
    C = model.config.hidden_size
    for i, ids in enumerate(micro_batches):                 # ids [1, T]
        T = ids.shape[1]
        cos, sin = model.rope(torch.arange(T)[None])
        if rank == 0:
            x = model.embed_tokens(ids)                      # [1, T, C]
        else:
            x = comm.recv(torch.empty(1, T, C, dtype=model.dtype), rank - 1)
        start = time.perf_counter()
        for layer in layers:
            x = model.layers[layer](x, cos, sin)
        if rank == pp - 1:
            out[i] = model.lm_head(model.norm(x))            # [1, T, V]
        end = time.perf_counter()
        spans.append(Span(rank, i, start, end))
        if rank < pp - 1:
            comm.send(x, rank + 1)


def pipeline_forward(model, micro_batches: list, pp: int, timeout_s: float = 120.0):
    """Run `model` as a pp-stage pipeline over the micro-batches ([1, T_i] token ids each).
    Returns ([logits [1, T_i, V]], [Span] compute times, [CommStats] per stage)."""
    stage_layers(len(model.layers), pp)                     # ValueError for a bad pp
    store = torch.distributed.HashStore()
    out, spans, stats = [None] * len(micro_batches), [], [None] * pp

    def stage(rank):
        comm = Communicator(rank, pp, 0, timeout_s, store=store)
        with torch.inference_mode():
            _run_stage(model, rank, pp, comm, micro_batches, out, spans)
        stats[rank] = comm.stats
    run_on_threads(stage, pp, timeout_s, "a pipeline stage")
    return out, sorted(spans, key=lambda s: (s.stage, s.micro_batch)), stats
