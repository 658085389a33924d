"""The collectives a tensor-parallel rank calls, counted and timed (chapter 10).

`Communicator` wraps one process group (gloo on a CPU, as here; NCCL is the same calls on
GPUs) and records, for every all-reduce: the calls, the payload bytes (the tensor each rank
contributes) and the seconds spent inside the call. A ring all-reduce over N ranks sends
2 (N - 1) / N times the payload out of each rank (N - 1 steps of reduce-scatter, N - 1 of
all-gather, each moving 1/N of the tensor); `wire_bytes` applies that formula to the counted
payload. It is the ring's cost, not a measurement of what gloo chose to do on loopback.

The time inside an all-reduce includes waiting for the slowest rank to arrive, so on a busy
machine it measures skew as well as transfer.
"""
from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass

import torch


@dataclass
class CommStats:
    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0          # payload: what each rank contributed, summed over calls
    all_reduce_seconds: float = 0.0
    send_bytes: int = 0                # point to point (pipeline parallel)
    recv_bytes: int = 0
    p2p_seconds: float = 0.0

    def wire_bytes(self, world_size: int) -> float:
        """Bytes each rank sends for the counted all-reduces if they ran as a ring."""
        return self.all_reduce_bytes * 2 * (world_size - 1) / world_size

    def as_dict(self) -> dict:
        return dict(vars(self))


def ring_all_reduce_bytes(payload_bytes: float, world_size: int) -> float:
    """What each rank sends in a ring all-reduce of `payload_bytes`: 2 (N - 1) / N of it."""
    return payload_bytes * 2 * (world_size - 1) / world_size


class Communicator:
    """rank / world_size of a gloo group built on a TCPStore at 127.0.0.1:port."""

    def __init__(self, rank: int, world_size: int, port: int, timeout_s: float = 60.0,
                 store=None):
        self.rank, self.world_size = rank, world_size
        if store is None:
            store = torch.distributed.TCPStore("127.0.0.1", port, world_size, rank == 0,
                                               timeout=datetime.timedelta(seconds=timeout_s))
        self.store = store
        self.group = torch.distributed.ProcessGroupGloo(
            store, rank, world_size, datetime.timedelta(seconds=timeout_s))
        self.stats = CommStats()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns it."""
        start = time.perf_counter()
        self.group.allreduce([t]).wait()
        self.stats.all_reduce_seconds += time.perf_counter() - start
        self.stats.all_reduce_calls += 1
        self.stats.all_reduce_bytes += t.numel() * t.element_size()
        return t

    def send(self, t: torch.Tensor, dst: int) -> None:
        start = time.perf_counter()
        self.group.send([t.contiguous()], dst, 0).wait()
        self.stats.p2p_seconds += time.perf_counter() - start
        self.stats.send_bytes += t.numel() * t.element_size()

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        start = time.perf_counter()
        self.group.recv([t], src, 0).wait()
        self.stats.p2p_seconds += time.perf_counter() - start
        self.stats.recv_bytes += t.numel() * t.element_size()
        return t

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0) -> "Pending":
        """Start sending `t` to rank `dst` (a pipeline stage's hidden states); `.wait()` later.
        The tensor must not change until then."""
        t = t.contiguous()
        self.stats.send_bytes += t.numel() * t.element_size()
        return Pending(self.stats, self.group.send([t], dst, tag), t)

    def irecv(self, t: torch.Tensor, src: int, tag: int = 0) -> "Pending":
        """Post a receive into `t` from rank `src`; `.wait()` returns the filled `t`."""
        self.stats.recv_bytes += t.numel() * t.element_size()
        return Pending(self.stats, self.group.recv([t], src, tag), t)

    def reset_stats(self) -> CommStats:
        old, self.stats = self.stats, CommStats()
        return old


class Pending:
    """A posted send / receive: `wait()` blocks until it is done (the seconds spent waiting are
    counted as p2p time) and returns its tensor."""

    def __init__(self, stats: CommStats, work, tensor: torch.Tensor):
        self.stats, self.work, self.tensor = stats, work, tensor

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        self.work.wait()
        self.stats.p2p_seconds += time.perf_counter() - start
        return self.tensor


def add_all_reduce_hooks(model, comm: Communicator) -> list:
    """Make a shard tensor-parallel: after every row-parallel product (o_proj, down_proj) the
    partial sums are all-reduced, as a forward hook, so `model.py` is unchanged. Returns the
    hook handles."""
    def reduce(module, inputs, output):
        return comm.all_reduce(output)
    handles = []
    for layer in model.layers:
        handles.append(layer.self_attn.o_proj.register_forward_hook(reduce))
        handles.append(layer.mlp.down_proj.register_forward_hook(reduce))
    return handles


# Public per-direction link bandwidths, bytes/s (an ESTIMATE's inputs, not measurements):
# NVLink 4 gives an H100 900 GB/s in both directions together (18 links x 50 GB/s), so 450 GB/s
# each way; PCIe 5.0 x16 about 64 GB/s each way; one 400 Gb/s InfiniBand NDR port 50 GB/s.
LINKS = {"nvlink4": 450e9, "pcie5_x16": 64e9, "infiniband_400g": 50e9}
LINK_LATENCY_S = {"nvlink4": 2e-6, "pcie5_x16": 5e-6, "infiniband_400g": 5e-6}   # per ring step


def all_reduce_seconds_estimate(payload_bytes: float, world_size: int, link: str) -> float:
    """Ring all-reduce time on `link`: 2 (N - 1) steps, each a latency plus payload / N bytes
    at the link's one-way bandwidth (the alpha-beta model). An estimate, labelled as such."""
    if world_size == 1:
        return 0.0
    steps = 2 * (world_size - 1)
    return steps * (LINK_LATENCY_S[link] + payload_bytes / world_size / LINKS[link])


def tp_all_reduce_bytes_per_token(cfg, dtype_bytes: int) -> int:
    """Payload all-reduced per token by a tensor-parallel forward: 2 per layer of [hidden]."""
    return 2 * cfg.num_layers * cfg.hidden_size * dtype_bytes


def run_on_threads(fn, world_size: int, timeout_s: float, what: str) -> None:
    """fn(rank) for every rank, one thread each (ranks of one process meeting in a gloo group:
    the lectures' demonstrations); each join is bounded, and a rank that raised or hung is a
    RuntimeError naming `what`."""
    errors = []

    def run(rank):
        try:
            fn(rank)
        except Exception as e:                      # noqa: BLE001 - raised below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"{what} failed or hung: {errors}")
