"""The executor seam: who runs a step's forward (chapter 04; chapter 10 adds workers).

The engine keeps the scheduler and calls `executor.execute_model(sched)` once per step (vLLM's
shape). `UniProcExecutor`, the default, is one `ModelRunner` in this process: exactly what
`runner.execute(sched)` did before there was a seam. With `tensor_parallel_size > 1` chapter
10's `minillm.parallel.MultiprocExecutor` runs one worker process per extra rank, each holding
a shard of the model and its own slice of the KV pool; rank 0 runs in this process and samples.
With `pipeline_parallel_size > 1` chapter 10's `minillm.parallel.pipeline_executor.PipelineExecutor`
runs stage 0 here and one worker process per later stage, each with the KV pool of its layers.
"""
from __future__ import annotations

from .model_runner import ModelRunner


class UniProcExecutor:
    """One ModelRunner, in this process; nothing to start or stop."""

    world_size = 1

    def __init__(self, model, block_manager, num_blocks: int, block_size: int,
                 num_cpu_blocks: int = 0, **runner_kwargs):
        self.driver_runner = ModelRunner(model, block_manager, num_blocks, block_size,
                                         num_cpu_blocks, **runner_kwargs)

    def execute_model(self, sched):
        return self.driver_runner.execute(sched)

    def shutdown(self) -> None:
        pass


def build_executor(tensor_parallel_size: int, *args, pipeline_parallel_size: int = 1,
                   **kwargs):
    """UniProcExecutor for one rank; chapter 10's MultiprocExecutor (tensor parallel) or
    PipelineExecutor (one process per stage) for more. Neither is imported for one rank."""
    if tensor_parallel_size > 1 and pipeline_parallel_size > 1:
        raise ValueError("tensor_parallel_size > 1 together with pipeline_parallel_size > 1 "
                         "is not built: use one of them (the other = 1)")
    if pipeline_parallel_size > 1:
        from ..parallel.pipeline_executor import PipelineExecutor     # chapter 10, only when asked
        return PipelineExecutor(pipeline_parallel_size, *args, **kwargs)
    if tensor_parallel_size == 1:
        return UniProcExecutor(*args, **kwargs)
    from ..parallel.executor import MultiprocExecutor     # chapter 10, only when asked
    return MultiprocExecutor(tensor_parallel_size, *args, **kwargs)
