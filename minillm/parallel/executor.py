"""MultiprocExecutor: tensor parallelism with one process per rank (chapter 10).

    driver process (rank 0)                      worker process (rank r = 1 .. N-1)
    scheduler, block manager                     ShardRunner on shard r, KV pool of its heads
    TPDriverRunner on shard 0 --- pipe: copies, (input_ids, StepMetadata) --->   forward
            forward  <========= gloo all-reduce x 2 per layer ==========>   forward
            sample                  <--- pipe: ("ok" | "error", ...) ---

The scheduler and the sampling stay in the driver, so the tokens are exactly the single-process
engine's up to the float rounding of summing partial products in another order. Workers are
spawned once per engine (importing torch in a fresh process takes seconds) and reused for
every step.

Failure is bounded: every wait on a worker polls its pipe with a timeout and checks that the
process is alive. A dead rank makes the step raise RuntimeError naming the rank and its exit
code; the driver then stops the other workers, and the engine refuses further steps.
`shutdown()` (also on LLM.shutdown, LLM.__del__ and interpreter exit) stops and joins them all.
"""
from __future__ import annotations

import atexit
import datetime
import pickle
import threading
import time
import weakref

import torch
import torch.multiprocessing as mp

from ..engine.model_runner import ModelRunner
from .comm import CommStats, Communicator, add_all_reduce_hooks
from .sharding import check_tp_size, shard_config, shard_state_dict
from .worker import build_shard, shard_runner, worker_main

STARTUP_TIMEOUT_S = 120.0     # spawn + import torch + build the shard, per engine
REPLY_TIMEOUT_S = 60.0        # one message's answer (gloo's own timeout is the same)
POLL_S = 0.05


class TPDriverRunner(ModelRunner):
    """Rank 0's ModelRunner: before its own block copies and forwards it sends the same work
    to every worker, and it raises when a rank has died instead of blaming the requests."""

    def __init__(self, executor, *args, **kwargs):
        self.executor = executor
        super().__init__(*args, **kwargs)

    def copy_blocks(self, sched) -> None:
        work = (sched.blocks_to_swap_out, sched.blocks_to_swap_in, sched.blocks_to_copy)
        if any(work):
            self.executor.call_workers("copy", work)
        super().copy_blocks(sched)

    def run(self, scheduled):
        step = self.prepare(scheduled)
        self.executor.send_workers("forward", (step.input_ids, step.meta))
        try:
            self.cache.set_step(step.meta)
            logits = self.model(step.input_ids, positions=step.meta.positions[None],
                                cache=self.cache, logits_rows=step.logits_rows)   # [1, S, V]
        except Exception:                   # the workers failed alike: the driver's error wins
            self.executor.collect(strict=False)
            raise
        self.executor.collect()
        return logits[0], step.samplers, step.prompt_rows

    def _forward(self, scheduled, errors: dict):
        """A dead rank fails the engine, not the requests: checked before and after the
        per-request fallback of ModelRunner._forward."""
        self.executor.check_alive()
        result = super()._forward(scheduled, errors)
        self.executor.check_alive()
        return result


class MultiprocExecutor:
    kind = "tensor-parallel"          # in every message; chapter 10's PipelineExecutor: "pipeline"
    def __init__(self, tensor_parallel_size: int, model, block_manager, num_blocks: int,
                 block_size: int, num_cpu_blocks: int = 0, needs_hidden: bool = False,
                 num_threads: int = 1, needs_features: bool = False,
                 kv_cache_dtype: str = "auto", enforce_eager: bool = True,
                 max_num_seqs: int = 64):
        cfg, tp = model.config, tensor_parallel_size
        check_tp_size(cfg, tp)
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not built for "
                             "tensor_parallel_size > 1 (the workers keep the model's dtype): "
                             "pass kv_cache_dtype='auto' or tensor_parallel_size=1")
        # needs_features (an EAGLE drafter) cannot occur: speculation is refused with tp > 1;
        # enforce_eager and max_num_seqs only matter for CUDA graphs, and the workers are CPU-only
        if model.device.type != "cpu":
            raise ValueError("minillm's tensor parallelism runs gloo on the CPU; pass "
                             "device='cpu' (NCCL on GPUs is the same design, not built here)")
        self.world_size = tp
        self.workers, self.conns, self._error = [], [], None
        try:
            self._start(model, block_manager, num_blocks, block_size, num_cpu_blocks,
                        needs_hidden, num_threads)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, model, block_manager, num_blocks, block_size, num_cpu_blocks,
               needs_hidden, num_threads) -> None:
        cfg, tp = model.config, self.world_size
        local = shard_config(cfg, tp)
        full = model.state_dict()
        store = self._new_store()
        for rank in range(1, tp):
            self._spawn(store, rank, shard_runner, (local, shard_state_dict(full, cfg, rank, tp),
                                                    model.dtype, num_blocks, block_size,
                                                    num_cpu_blocks), num_threads)
        self.comm = self._join_group(store)
        shard = build_shard(local, shard_state_dict(full, cfg, 0, tp), model.dtype)
        add_all_reduce_hooks(shard, self.comm)
        self.collect(timeout=STARTUP_TIMEOUT_S)                       # every worker is ready
        self.driver_runner = TPDriverRunner(self, shard, block_manager, num_blocks, block_size,
                                            num_cpu_blocks, needs_hidden=needs_hidden)

    def _new_store(self):
        """The rendezvous the ranks' gloo group forms on (rank 0 hosts it, on a free port)."""
        return torch.distributed.TCPStore("127.0.0.1", 0, self.world_size, True,
                                          wait_for_workers=False,
                                          timeout=datetime.timedelta(seconds=REPLY_TIMEOUT_S))

    def _spawn(self, store, rank: int, make_runner, make_args: tuple, num_threads: int) -> None:
        """Start rank `rank`'s process (worker_main builds make_runner(comm, *make_args))."""
        parent, child = mp.get_context("spawn").Pipe()
        p = mp.get_context("spawn").Process(
            target=worker_main, daemon=True, name=f"minillm-{self.kind}{rank}",
            args=(rank, self.world_size, store.port, make_runner, make_args, child, num_threads))
        p.start()
        child.close()
        self.workers.append(p)
        self.conns.append(parent)
        _LIVE.add(self)

    def _join_group(self, store) -> Communicator:
        """Rank 0 joins the gloo group, which waits for every rank, while watching that the
        workers are alive (a worker that crashes while starting must not leave us waiting)."""
        try:
            return self._watched(
                lambda: Communicator(0, self.world_size, store.port, REPLY_TIMEOUT_S, store=store),
                STARTUP_TIMEOUT_S, f"the {self.kind} group did not form within "
                                   f"{STARTUP_TIMEOUT_S:.0f} s")
        except Exception as e:                  # noqa: BLE001 - gloo's own error, reworded
            if self._error is not None:         # a dead worker or the deadline: already failed
                raise
            self._fail(f"the {self.kind} group failed to form: {e}")

    def _watched(self, fn, timeout_s: float, timeout_message: str):
        """fn() on a helper thread while this one checks every POLL_S that every worker is
        alive (a blocking gloo call whose peer died would otherwise wait for gloo's own
        timeout). Returns fn's result; raises what fn raised, after the liveness check."""
        box = {}

        def call():
            try:
                box["result"] = fn()
            except Exception as e:              # noqa: BLE001 - re-raised below
                box["error"] = e
        t = threading.Thread(target=call, daemon=True)
        t.start()
        deadline = time.monotonic() + timeout_s
        while t.is_alive():
            t.join(POLL_S)
            self.check_alive()
            if time.monotonic() > deadline:
                self._fail(timeout_message)
        if "error" in box:
            self.check_alive()
            raise box["error"]
        return box["result"]

    # --- talking to the workers ----------------------------------------------------------------
    def send_workers(self, method: str, args=()) -> None:
        self.check_alive()
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(pickle.dumps((method, args)))   # plain bytes: no shm
            except (BrokenPipeError, OSError):
                self._worker_gone(rank, "stopped listening")

    def collect(self, timeout: float = REPLY_TIMEOUT_S, strict: bool = True) -> list:
        """One reply per worker, each within `timeout` seconds, checking they are alive. A
        worker's error fails the executor when `strict` (the driver succeeded where it did not)."""
        replies = []
        for rank, (p, conn) in enumerate(zip(self.workers, self.conns), start=1):
            deadline = time.monotonic() + timeout
            while not conn.poll(POLL_S):
                self.check_alive()
                if time.monotonic() > deadline:
                    self._fail(f"{self.kind} worker rank {rank} (pid {p.pid}) did not "
                               f"answer within {timeout:.0f} s")
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                self._worker_gone(rank, "closed its pipe")
            if status != "ok" and strict:
                self._fail(f"{self.kind} worker rank {rank} failed: {value}")
            replies.append(value)
        return replies

    def call_workers(self, method: str, args=()) -> list:
        self.send_workers(method, args)
        return self.collect()

    def check_alive(self) -> None:
        """RuntimeError (after stopping the others) if a worker has exited or failed before."""
        if self._error is not None:
            raise RuntimeError(self._error)
        for rank, p in enumerate(self.workers, start=1):
            if not p.is_alive():
                self._fail(f"{self.kind} worker rank {rank} (pid {p.pid}) died with exit "
                           f"code {p.exitcode}")

    def _worker_gone(self, rank: int, what: str):
        """A worker's pipe broke: give the process a moment to be reaped, then name its exit
        code (a pipe closes a little before the process is seen as dead)."""
        p = self.workers[rank - 1]
        p.join(5)
        if p.exitcode is not None:
            self._fail(f"{self.kind} worker rank {rank} (pid {p.pid}) died with exit code "
                       f"{p.exitcode}")
        self._fail(f"{self.kind} worker rank {rank} (pid {p.pid}) {what}")

    def _fail(self, message: str):
        self._error = message + "; the other workers were stopped, build a new LLM"
        self.shutdown()
        raise RuntimeError(self._error)

    # --- the executor interface ----------------------------------------------------------------
    def execute_model(self, sched):
        return self.driver_runner.execute(sched)

    def comm_stats(self, reset: bool = False) -> list:
        """[CommStats] of every rank, rank 0 first (reset=True also zeroes them)."""
        own = self.comm.reset_stats() if reset else self.comm.stats
        theirs = self.call_workers("reset_stats" if reset else "stats")
        return [own] + [CommStats(**d) for d in theirs]

    def shutdown(self) -> None:
        """Stop and join every worker (idempotent). A worker that does not stop in 5 s is
        terminated, then killed."""
        _LIVE.discard(self)
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("stop", ())))
            except (BrokenPipeError, OSError):
                pass
        for p in self.workers:
            p.join(5)
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        self.workers, self.conns = [], []
        if self._error is None:
            self._error = f"this {self.kind} executor was shut down; build a new LLM"


_LIVE: "weakref.WeakSet[MultiprocExecutor]" = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for ex in list(_LIVE):
        ex.shutdown()
