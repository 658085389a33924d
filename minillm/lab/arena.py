"""The contiguous KV arena of chapter 02: many requests sharing one preallocated KV tensor.

    arena = ContiguousArena.from_config(cfg, capacity_tokens=8 * 2048)   # real k/v tensors
    slab = arena.allocate("r0", 2048)  # first-fit (or best-fit) max-length reservation
    model(ids, cache=slab)             # a Slab is a KV cache for one sequence
    arena.stats()                      # reserved / used / free, internal and external fragmentation
    arena.free("r0")

Lab equipment (`minillm.lab`): the engine never uses it. It shows, on real memory, the waste
that chapter 01's `minillm.cache.contiguous.ContiguousKVCache` implies once many requests share
a GPU, and that chapter 03's paged blocks (`minillm.cache.blocks`) remove.
`minillm.lab.memory_sim.simulate_arena` runs a workload through an arena step by step.
"""
from __future__ import annotations

import torch

from ..configs import ModelConfig
from ..model import fused_causal_attention

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
            raise ValueError(f"request {self.req_id!r}: {self.seq_len + num_tokens} tokens needed "
                             f"but its slab holds {self.length}; reserve a larger max_len for it")

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
        return fused_causal_attention(q, self.k[layer, None, :end], self.v[layer, None, :end],
                                      q_start=start)

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
            code = (s.req_id if isinstance(s.req_id, int) and s.req_id >= 0
                    else abs(hash(s.req_id)) % 2**31)
            owner[s.start:s.start + s.length] = code
            written[s.start:s.start + s.seq_len] = True
        return owner, written


__all__ = ["POLICIES", "Slab", "ContiguousArena"]
