"""Contiguous KV cache (chapter 01): one preallocated max-length slab per sequence.

The cache holds, for every layer, K and V tensors of shape [B, max_len, KVH, D]. Step t writes
its tokens at positions seq_len .. seq_len + T and attends over 0 .. seq_len + T. Memory is
reserved for max_len tokens up front whether or not the sequence ever gets that long: that is
the waste chapter 02 measures and chapter 03's paged blocks remove.

Chapter 02 measures that waste with lab equipment beside this cache (the engine never imports
it): `minillm.lab.arena.ContiguousArena` puts many max-length reservations in one KV tensor, and
`minillm.lab.memory_sim` runs a workload through it and draws the memory map.
"""
from __future__ import annotations

import torch

from ..configs import ModelConfig
from ..model import fused_causal_attention


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
        """q [B, T, H, D], k/v [B, T, KVH, D] -> out [B, T, H, D]: query i (at position
        seq_len + i) sees keys 0 .. seq_len + i. Through `model.fused_causal_attention`
        (PyTorch's fused attention, as in the engine's CPU path); `model.causal_attention` is
        its readable twin, which made every batch-1 loop of chapter 07 slower."""
        T = q.shape[1]
        start, end = self.seq_len, self.seq_len + T
        if end > self.max_len:
            raise ValueError(f"KV cache is full: {end} tokens needed, {self.max_len} reserved; "
                             "create the cache with a larger max_len")
        self.k[layer, :, start:end] = k                           # write this step's keys
        self.v[layer, :, start:end] = v
        return fused_causal_attention(q, self.k[layer, :, :end], self.v[layer, :, :end],
                                      q_start=start)

    def advance(self, num_tokens: int) -> None:
        self.seq_len += num_tokens

    def reset(self) -> None:
        self.seq_len = 0
