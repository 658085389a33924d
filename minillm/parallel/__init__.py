"""Chapter 10: parallelism. Tensor and pipeline parallelism across worker processes (gloo on
the CPU), the collectives counted and timed.

- `sharding.py`: which rows / columns of each weight a rank holds, `check_tp_size`;
- `comm.py`: `Communicator` (gloo group, counted all-reduce, send / recv), the all-reduce hooks;
- `worker.py`: a worker process's loop (`ShardRunner`);
- `executor.py`: `MultiprocExecutor`, the engine's executor for `tensor_parallel_size > 1`;
- `pipeline.py`: `stage_layers`, the bubble (`bubble_fraction`), a threaded demonstration;
- `stage.py`, `pipeline_worker.py`, `pipeline_executor.py`: `PipelineExecutor`, the engine's
  executor for `pipeline_parallel_size > 1` (stage 0 in the driver, a process per later stage).
"""
from .comm import CommStats, Communicator, add_all_reduce_hooks, ring_all_reduce_bytes
from .sharding import check_tp_size, kv_head_range, shard_config, shard_state_dict, tp_sizes

__all__ = ["CommStats", "Communicator", "add_all_reduce_hooks", "ring_all_reduce_bytes",
           "check_tp_size", "kv_head_range", "shard_config", "shard_state_dict", "tp_sizes"]
