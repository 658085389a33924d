"""A worker process: one rank's shard (or pipeline stage), its KV pool, and a loop that runs
what the driver sends (chapter 10).

The driver (rank 0, in the engine's process) keeps the scheduler and samples. For every step it
sends each worker the same block copies and the same flattened batch (`input_ids` and the
`StepMetadata`) it runs itself; each rank runs the forward on its shard, and the forwards meet
in the all-reduces after o_proj and down_proj. A worker computes no logits and samples nothing.
Every message gets one reply, ("ok", value) or ("error", text), so the driver notices a rank
that failed or died. A worker exits on "stop" or when the driver's end of the pipe closes.
"""
from __future__ import annotations

import os
import pickle
import traceback

import torch


class ShardRunner:
    """What a worker rank does: block copies and forwards on its shard, no sampling."""

    def __init__(self, model, comm, num_blocks: int, block_size: int, num_cpu_blocks: int):
        from ..cache.paged import PagedKVCache
        self.model, self.comm = model, comm
        self.cache = PagedKVCache(model.config, num_blocks, block_size, dtype=model.dtype,
                                  device=model.device, num_cpu_blocks=num_cpu_blocks)
        self.no_rows = torch.empty(0, dtype=torch.long, device=model.device)

    def copy(self, swap_out, swap_in, copies) -> None:
        self.cache.swap_out_blocks(swap_out)
        self.cache.swap_in_blocks(swap_in)
        self.cache.copy_blocks(copies)

    @torch.inference_mode()
    def forward(self, input_ids, meta) -> None:                # input_ids [1, T]
        self.cache.set_step(meta)
        self.model(input_ids, positions=meta.positions[None], cache=self.cache,
                   logits_rows=self.no_rows)                   # the all-reduces meet the driver's

    def stats(self) -> dict:
        return self.comm.stats.as_dict()

    def reset_stats(self) -> dict:
        return self.comm.reset_stats().as_dict()


def build_shard(cfg, state: dict, dtype):
    """An ordinary Transformer with the shard's numbers, holding the shard's weights."""
    from ..model import Transformer
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    model.load_state_dict(state, strict=True)
    model.init_rope()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def shard_runner(comm, cfg, state: dict, dtype, num_blocks: int, block_size: int,
                 num_cpu_blocks: int) -> ShardRunner:
    """A tensor-parallel rank's runner: its shard, made parallel by the all-reduce hooks."""
    from .comm import add_all_reduce_hooks
    model = build_shard(cfg, state, dtype)
    add_all_reduce_hooks(model, comm)
    return ShardRunner(model, comm, num_blocks, block_size, num_cpu_blocks)


def worker_main(rank: int, world_size: int, port: int, make_runner, make_args: tuple, conn,
                num_threads: int) -> None:
    """The process body: join the group, build the runner (`make_runner(comm, *make_args)`:
    `shard_runner` for tensor parallelism, chapter 10's `pipeline_worker.stage_runner` for a
    pipeline stage), then serve messages until stopped."""
    torch.set_num_threads(num_threads)
    try:
        from .comm import Communicator
        comm = Communicator(rank, world_size, port)
        runner = make_runner(comm, *make_args)
        del make_args
        conn.send(("ok", os.getpid()))
    except Exception:                          # noqa: BLE001 - reported to the driver
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):            # the driver is gone: nothing left to serve
            return
        if method == "stop":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(runner, method)(*args)))
        except Exception as e:                 # noqa: BLE001 - the driver decides
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}"))
