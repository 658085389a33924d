"""Contiguous KV cache (chapter 01): one preallocated max-length slab per sequence.

The cache holds, for every layer, K and V tensors of shape [B, max_len, KVH, D]. Step t writes
its tokens at positions seq_len .. seq_len + T and attends over 0 .. seq_len + T. Memory is
reserved for max_len tokens up front whether or not the sequence ever gets that long: that is
the waste chapter 02 measures and chapter 03's paged blocks remove.

Chapter 02 adds `ContiguousArena`: one KV tensor shared by many requests, each handed one
contiguous max-length `Slab` of it (first-fit or best-fit), with its internal and external
fragmentation measured; `simulate_arena` runs a workload trace through it and
`plot_memory_map` draws the arena over time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..configs import ModelConfig
from ..model import causal_attention


class ContiguousKVCache:
    """Implements the model's KV-cache seam (`attend`, `advance`, `seq_len`)."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        if max_len > cfg.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds {cfg.name}'s context of "
                             f"{cfg.max_position_embeddings} tokens")
        shape = (cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)   # [L, B, max_len, KVH, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.seq_len = 0                                          # tokens already cached

    @property
    def nbytes(self) -> int:
        """Bytes reserved by the cache tensors (used or not)."""
        return self.k.nbytes + self.v.nbytes

    def attend(self, layer: int, q, k, v):
        """q [B, T, H, D], k/v [B, T, KVH, D] -> out [B, T, H, D]."""
        T = q.shape[1]
        start, end = self.seq_len, self.seq_len + T
        if end > self.max_len:
            raise ValueError(f"KV cache is full: {end} tokens needed, {self.max_len} reserved; "
                             "create the cache with a larger max_len")
        self.k[layer, :, start:end] = k                           # write this step's keys
        self.v[layer, :, start:end] = v
        return causal_attention(q, self.k[layer, :, :end], self.v[layer, :, :end], q_start=start)

    def advance(self, num_tokens: int) -> None:
        self.seq_len += num_tokens

    def reset(self) -> None:
        self.seq_len = 0


# ---------------------------------------------------------------------------------------------
# Chapter 02: many requests sharing one contiguous KV arena.
#
# A naive server keeps ONE tensor for the whole KV cache and hands each admitted request one
# contiguous slab of it, sized for the longest the request could ever get (its max_len
# reservation). Two kinds of waste follow:
#   internal fragmentation  reserved for a request but never written (it stopped early);
#   external fragmentation  free, but split into holes too small for the next request's slab.
# ---------------------------------------------------------------------------------------------

POLICIES = ("first_fit", "best_fit")


class Slab:
    """One request's contiguous piece of the arena: tokens [start, start + length).

    It implements the model's KV-cache seam for a batch of one (`attend`, `advance`, `seq_len`),
    so `model(ids [1, T], cache=slab)` runs on arena memory. `write(n)` is the simulation's
    stand-in for a forward pass: it fills n token rows with a marker value.
    """

    def __init__(self, arena: "ContiguousArena", req_id, start: int, length: int):
        self.arena, self.req_id, self.start, self.length = arena, req_id, start, length
        self.k = arena.k[:, start:start + length]             # view [L, length, KVH, D]
        self.v = arena.v[:, start:start + length]
        self.seq_len = 0                                       # tokens written (used)

    def _check_room(self, num_tokens: int) -> None:
        if self.seq_len + num_tokens > self.length:
            raise ValueError(f"request {self.req_id!r}: {self.seq_len + num_tokens} tokens needed but "
                             f"its slab holds {self.length}; reserve a larger max_len for it")

    def attend(self, layer: int, q, k, v):
        """q [1, T, H, D], k/v [1, T, KVH, D] -> [1, T, H, D]."""
        if q.shape[0] != 1:
            raise ValueError(f"a slab holds one sequence; got a batch of {q.shape[0]}")
        if tuple(k.shape[2:]) != tuple(self.k.shape[2:]) or layer >= self.k.shape[0]:
            raise ValueError(f"arena geometry (layers, KVH, D) = ({self.k.shape[0]}, "
                             f"{', '.join(map(str, self.k.shape[2:]))}) does not fit this model; "
                             "build it with ContiguousArena.from_config(model.config, ...)")
        T = q.shape[1]
        self._check_room(T)
        start, end = self.seq_len, self.seq_len + T
        self.k[layer, start:end] = k[0]
        self.v[layer, start:end] = v[0]
        return causal_attention(q, self.k[layer, None, :end], self.v[layer, None, :end], q_start=start)

    def advance(self, num_tokens: int) -> None:
        self.seq_len += num_tokens

    def write(self, num_tokens: int, value: float = 1.0) -> None:
        """Simulation: write num_tokens rows of K and V (every layer) and count them as used."""
        self._check_room(num_tokens)
        self.k[:, self.seq_len:self.seq_len + num_tokens] = value
        self.v[:, self.seq_len:self.seq_len + num_tokens] = value
        self.seq_len += num_tokens


class ContiguousArena:
    """A real KV arena: k/v tensors [num_layers, capacity_tokens, KVH, D], carved into slabs.

    The default geometry (1 layer, 1 KV head, head_dim 1) keeps the tensor tiny so notebooks can
    simulate thousands of tokens; `from_config` gives a model's real geometry. `policy` picks
    the free extent a new slab goes into: "first_fit" (lowest address that fits) or
    "best_fit" (the smallest hole that fits).
    """

    def __init__(self, capacity_tokens: int, num_layers: int = 1, num_kv_heads: int = 1,
                 head_dim: int = 1, dtype: torch.dtype = torch.float32, device="cpu",
                 policy: str = "first_fit"):
        if capacity_tokens < 1:
            raise ValueError(f"capacity_tokens must be >= 1, got {capacity_tokens}")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)}")
        shape = (num_layers, capacity_tokens, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, capacity, KVH, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity_tokens
        self.policy = policy
        self.slabs: dict = {}                                     # req_id -> Slab
        self.num_refused = 0             # allocate() found no hole big enough
        self.num_refused_fragmented = 0  # ... although the free tokens in total were enough

    @classmethod
    def from_config(cls, cfg: ModelConfig, capacity_tokens: int, dtype=torch.float32,
                    device="cpu", policy: str = "first_fit") -> "ContiguousArena":
        return cls(capacity_tokens, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype,
                   device, policy)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        L, _, KVH, D = self.k.shape
        return 2 * L * KVH * D * self.k.element_size()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    # -- the allocator ------------------------------------------------------------------------
    def free_extents(self) -> list[tuple[int, int]]:
        """Holes between slabs as (start, length), in address order."""
        holes, pos = [], 0
        for s in sorted(self.slabs.values(), key=lambda s: s.start):
            if s.start > pos:
                holes.append((pos, s.start - pos))
            pos = s.start + s.length
        if pos < self.capacity:
            holes.append((pos, self.capacity - pos))
        return holes

    def find_extent(self, num_tokens: int):
        """Start address of the hole the policy picks for num_tokens, or None."""
        fits = [(start, length) for start, length in self.free_extents() if length >= num_tokens]
        if not fits:
            return None
        if self.policy == "best_fit":
            return min(fits, key=lambda h: (h[1], h[0]))[0]
        return fits[0][0]

    def can_allocate(self, num_tokens: int) -> bool:
        return self.find_extent(num_tokens) is not None

    def allocate(self, req_id, num_tokens: int):
        """Reserve one contiguous slab of num_tokens for req_id; None (and a counted refusal)
        when no hole is big enough."""
        if req_id in self.slabs:
            raise ValueError(f"request {req_id!r} already holds a slab; free it first")
        if not 1 <= num_tokens <= self.capacity:
            raise ValueError(f"a slab needs 1..{self.capacity} tokens (the arena's capacity), "
                             f"got {num_tokens}; make the arena larger or the reservation smaller")
        start = self.find_extent(num_tokens)
        if start is None:
            self.num_refused += 1
            self.num_refused_fragmented += self.free_tokens >= num_tokens
            return None
        slab = Slab(self, req_id, start, num_tokens)
        self.slabs[req_id] = slab
        return slab

    def free(self, req_id) -> None:
        if req_id not in self.slabs:
            raise ValueError(f"request {req_id!r} holds no slab (freed twice?)")
        del self.slabs[req_id]

    # -- what the memory is doing --------------------------------------------------------------
    @property
    def reserved_tokens(self) -> int:
        return sum(s.length for s in self.slabs.values())

    @property
    def used_tokens(self) -> int:
        return sum(s.seq_len for s in self.slabs.values())

    @property
    def free_tokens(self) -> int:
        return self.capacity - self.reserved_tokens

    @property
    def largest_free_extent(self) -> int:
        return max((length for _, length in self.free_extents()), default=0)

    @property
    def internal_fragmentation(self) -> float:
        """Share of reserved tokens not written (yet): (reserved - used) / reserved."""
        reserved = self.reserved_tokens
        return (reserved - self.used_tokens) / reserved if reserved else 0.0

    @property
    def external_fragmentation(self) -> float:
        """1 - largest hole / total free: 0 when the free space is one piece."""
        free = self.free_tokens
        return 1 - self.largest_free_extent / free if free else 0.0

    def stats(self) -> dict:
        reserved, used, free = self.reserved_tokens, self.used_tokens, self.free_tokens
        bpt = self.bytes_per_token
        return {"num_slabs": len(self.slabs), "reserved_tokens": reserved, "used_tokens": used,
                "free_tokens": free, "largest_free_extent": self.largest_free_extent,
                "reserved_bytes": reserved * bpt, "used_bytes": used * bpt,
                "internal_fragmentation": self.internal_fragmentation,
                "external_fragmentation": self.external_fragmentation}

    def owner_map(self):
        """owner [capacity] (request id, -1 free) and written [capacity] (bool) as numpy arrays."""
        import numpy as np
        owner = np.full(self.capacity, -1, dtype=np.int64)
        written = np.zeros(self.capacity, dtype=bool)
        for s in self.slabs.values():
            code = s.req_id if isinstance(s.req_id, int) and s.req_id >= 0 else abs(hash(s.req_id)) % 2**31
            owner[s.start:s.start + s.length] = code
            written[s.start:s.start + s.seq_len] = True
        return owner, written


@dataclass
class MemoryTrace:
    """What a memory simulation saw (`simulate_arena` here, `blocks.simulate_blocks` in ch. 03).

    steps: one dict per busy step; maps: (step, owner, written) snapshots of the token
    addresses sampled every `map_stride` tokens; requests: req_id -> admit/finish step, tokens
    reserved and written at the end of its life."""
    capacity: int
    map_stride: int
    steps: list = field(default_factory=list)
    maps: list = field(default_factory=list)
    requests: dict = field(default_factory=dict)
    num_refused: int = 0
    num_refused_fragmented: int = 0
    num_preempted: int = 0

    def summary(self) -> dict:
        running = [s["running"] for s in self.steps]
        done = [r for r in self.requests.values() if "finish_step" in r]
        written = sum(r["total_len"] for r in done)
        reserved = sum(r["reserved"] for r in done)
        busy = [s for s in self.steps if s["reserved_tokens"]]
        return {
            "steps": len(self.steps), "finished": len(done),
            "peak_concurrency": max(running, default=0),
            "mean_concurrency": sum(running) / len(running) if running else 0.0,
            # per request, at the end of its life: reserved but never written
            "wasted_fraction": 1 - written / reserved if reserved else 0.0,
            # averaged over steps: reserved but not written yet, over reserved
            "mean_internal_fragmentation": (sum(s["internal_fragmentation"] for s in busy) / len(busy)
                                            if busy else 0.0),
            "mean_used_fraction_of_capacity": (sum(s["used_tokens"] for s in self.steps)
                                               / (self.capacity * len(self.steps)) if self.steps else 0.0),
            "steps_blocked_by_fragmentation": sum(s["blocked"] == "fragmented" for s in self.steps),
            "requests_blocked_by_fragmentation": sum(r.get("blocked_fragmented", False)
                                                     for r in self.requests.values()),
            "num_refused": self.num_refused, "num_refused_fragmented": self.num_refused_fragmented,
            "num_preempted": self.num_preempted,
        }


def simulate_arena(requests, arena: ContiguousArena, step_time: float = 0.05,
                   max_steps: int = 1_000_000, map_every: int = 1, map_bins: int = 256) -> MemoryTrace:
    """Run a workload trace (e.g. `minillm.workloads.make_workload(...).requests`) through the arena.

    Each step, in order:
      1. admit arrived requests first-come-first-served while a slab of `max_len_reserved`
         fits; the first that does not fit blocks the queue (no skipping ahead);
      2. a newly admitted request writes its whole prompt (prefill); every request admitted
         earlier writes one token (decode);
      3. record stats (and every `map_every` steps a memory-map snapshot);
      4. a request that has written prompt_len + output_len tokens finishes and frees its slab.
    A request arriving at time t can be admitted at the first step with step * step_time >= t.
    """
    requests = sorted(requests, key=lambda r: (r.arrival_time, r.id))
    for r in requests:
        if r.max_len_reserved > arena.capacity:
            raise ValueError(f"request {r.id} reserves {r.max_len_reserved} tokens but the arena holds "
                             f"{arena.capacity}; make the arena larger or the reservation smaller")
        if r.total_len > r.max_len_reserved:
            raise ValueError(f"request {r.id} needs {r.total_len} tokens but reserves only "
                             f"{r.max_len_reserved}")
    stride = max(1, -(-arena.capacity // map_bins))
    trace = MemoryTrace(capacity=arena.capacity, map_stride=stride)
    refused0, frag0 = arena.num_refused, arena.num_refused_fragmented
    waiting, running = list(requests), {}                       # running: req_id -> (request, slab)
    head, step = 0, 0
    while head < len(waiting) or running:
        if step >= max_steps:
            raise ValueError(f"simulation did not finish in {max_steps} steps; raise max_steps")
        now = step * step_time
        if not running and waiting[head].arrival_time > now:     # idle: jump to the next arrival
            step = max(step + 1, int(-(-waiting[head].arrival_time // step_time)))
            continue
        blocked, admitted = "", []
        while head < len(waiting) and waiting[head].arrival_time <= now:
            r = waiting[head]
            slab = arena.allocate(r.id, r.max_len_reserved)
            if slab is None:
                fragmented = arena.free_tokens >= r.max_len_reserved
                blocked = "fragmented" if fragmented else "no_space"
                info = trace.requests.setdefault(r.id, {})
                info["blocked_fragmented"] = info.get("blocked_fragmented", False) or fragmented
                break
            head += 1
            admitted.append(r.id)
            running[r.id] = (r, slab)
            trace.requests.setdefault(r.id, {}).update(
                admit_step=step, start=slab.start, reserved=r.max_len_reserved, total_len=r.total_len)
        for rid, (r, slab) in running.items():
            slab.write(r.prompt_len if rid in admitted else 1, value=float(rid % 997 + 1))
        stats = arena.stats()
        stats.update(step=step, time=now, running=len(running), waiting=len(waiting) - head,
                     admitted=len(admitted), blocked=blocked)
        trace.steps.append(stats)
        if step % map_every == 0:
            owner, written = arena.owner_map()
            trace.maps.append((step, owner[::stride], written[::stride]))
        for rid in [rid for rid, (r, slab) in running.items() if slab.seq_len >= r.total_len]:
            arena.free(rid)
            del running[rid]
            trace.requests[rid]["finish_step"] = step
        step += 1
    trace.num_refused = arena.num_refused - refused0
    trace.num_refused_fragmented = arena.num_refused_fragmented - frag0
    return trace


def plot_memory_map(trace: MemoryTrace, ax=None, title: str = "KV memory map"):
    """Memory map over time: step on x, token address on y, a colour per request.

    Written tokens are drawn in the request's colour, reserved-but-unwritten tokens in a pale
    tint of it (internal fragmentation), free tokens white. Returns the matplotlib Axes.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    if not trace.maps:
        raise ValueError("the trace has no memory-map snapshots; simulate with map_every >= 1")
    owner = np.stack([m[1] for m in trace.maps], axis=1)        # [bins, snapshots]
    written = np.stack([m[2] for m in trace.maps], axis=1)
    palette = plt.get_cmap("tab20").colors
    rgb = np.array([palette[i % len(palette)] for i in range(len(palette))])[owner % len(palette)]
    pale = 1 - 0.3 * (1 - rgb)                                  # blend 70% towards white
    img = np.where(written[..., None], rgb, pale)
    img[owner < 0] = 1.0                                        # free: white
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 3.5), layout="constrained")
    steps = [m[0] for m in trace.maps]
    ax.imshow(img, aspect="auto", origin="lower", interpolation="nearest",
              extent=(steps[0], steps[-1] + 1, 0, owner.shape[0] * trace.map_stride))
    ax.set_xlabel("step")
    ax.set_ylabel("token address in the arena")
    ax.set_title(title)
    return ax
