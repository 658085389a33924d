"""Paged KV cache (chapter 03): the model's seam over a pool of blocks.

Every layer keeps its keys and values in block tensors [num_blocks, block_size, KVH, D]; all
layers together are k/v [num_layers, num_blocks, block_size, KVH, D]. Which blocks belong to
which sequence is the BlockManager's business (`minillm.cache.blocks`). Each layer's `attend`
does two things with the kernels of `minillm.kernels` (Triton on CUDA, PyTorch twins on CPU):

    store_kv(k, v, k_cache, v_cache, slot_mapping)     this step's K/V into their slots
    paged_decode_attention(...)                        when every sequence brings ONE query
    paged_prefill_attention(...)                       otherwise (ragged, causal)

What a forward's batch looks like is one frozen `StepMetadata`, built by one pure function,
`build_step_metadata`, from each sequence's span (num_computed, num_new) and block table. The
engine's model runner builds it for the ragged batch of a step (ids [1, T_total] with explicit
positions) and hands it to `set_step` before the forward; `prepare_step` does the same from the
cache's own block manager for hand-driven experiments. The cache also copies blocks for
copy-on-write (`copy_blocks`) and swaps blocks to and from a CPU pool.

`SimplePagedKVCache(cfg, num_blocks, block_size, batch_size=B)` is a drop-in for chapter 01's
ContiguousKVCache: B sequences that advance together, no metadata to build by hand.

`kv_cache_dtype="fp8"` (chapter 09; vLLM's name, e4m3) keeps one byte per value: store_kv
divides by a per-tensor scale (k_scale, v_scale, 1.0 by default as in vLLM without calibration)
and the attention kernels multiply back; see `kernels/kv_quant.py`. "auto" keeps the model's
dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import kernels
from ..configs import ModelConfig
from ..kernels.kv_quant import as_bytes
from .blocks import BlockManager

# kv_cache_dtype -> the cache tensors' dtype ("auto": the model's own)
KV_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                   "fp8_e5m2": "float8_e5m2"}


def fp8_supported() -> bool:
    """This torch build has the float8 dtypes the fp8 cache stores."""
    return hasattr(torch, "float8_e4m3fn") and hasattr(torch, "float8_e5m2")


def resolve_kv_cache_dtype(kv_cache_dtype, model_dtype: torch.dtype,
                           device=None) -> torch.dtype:
    """"auto" (or None) -> model_dtype; "fp8" / "fp8_e4m3" / "fp8_e5m2" -> a float8 dtype.
    ValueError naming the fix for anything else, for fp8 where torch has no float8, and for
    e4m3 on a GPU older than compute capability 8.9 (Triton compiles e4m3 for Ada and Hopper
    only; e5m2 also compiles for Ampere)."""
    if kv_cache_dtype in (None, "auto"):
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}: use 'auto' (the model's "
                         f"dtype) or one of {', '.join(map(repr, KV_CACHE_DTYPES))}")
    if not fp8_supported():
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs torch.float8_e4m3fn / "
                         f"float8_e5m2, which this torch build ({torch.__version__}) lacks: "
                         "install torch >= 2.1, or use kv_cache_dtype='auto'")
    dtype = getattr(torch, KV_CACHE_DTYPES[kv_cache_dtype])
    if (dtype == torch.float8_e4m3fn and device is not None
            and torch.device(device).type == "cuda"
            and torch.cuda.get_device_capability(device) < (8, 9)):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} (e4m3) needs a GPU of compute "
                         f"capability >= 8.9 (Ada, Hopper) for the Triton kernels; this one is "
                         f"{torch.cuda.get_device_capability(device)}: use "
                         "kv_cache_dtype='fp8_e5m2' or 'auto'")
    return dtype


@dataclass(frozen=True)
class StepMetadata:
    """One forward's ragged batch of B sequences and T tokens, as attention needs it.

    request       A (decode)   B (prefill chunk of 4)   C (decode)
    positions     [7,           0  1  2  3,              12]        [T]
    slot_mapping  where each token's K/V goes: block * block_size + offset   [T]
    cu_seqlens_q  [0, 1, 5, 6]   sequence b owns query rows cu[b] : cu[b + 1]   [B + 1]
    seq_lens      [8, 4, 13]     keys each sequence attends over, this step's included   [B]
    block_tables  [B, max_blocks] each sequence's blocks, padded with 0
    tree_masks    per sequence, None or the [n, n] ancestor mask of a TREE of n query tokens
                  (chapter 07: speculative tree drafts; positions then hold each node's depth)
    """
    positions: torch.Tensor                 # [T] int64
    cu_seqlens_q: torch.Tensor              # [B + 1] int32
    seq_lens: torch.Tensor                  # [B] int32
    slot_mapping: Optional[torch.Tensor]    # [T] int64 (None: built without block tables)
    block_tables: Optional[torch.Tensor]    # [B, max_blocks] int32
    is_decode_only: bool                    # every sequence brings one token: the decode kernel
    tree_masks: Optional[tuple] = None      # [B] of None | [n, n] bool (chapter 07)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def build_step_metadata(spans, block_tables=None, block_size: Optional[int] = None,
                        device="cpu") -> StepMetadata:
    """spans: [(num_computed, num_new)] per sequence: this step computes positions
    [num_computed, num_computed + num_new). block_tables: each sequence's block ids (covering
    those positions), or None for the query-side fields only. Pure: reads, never mutates."""
    positions, seq_lens, cu = [], [], [0]
    for c, n in spans:
        if c < 0 or n < 1:
            raise ValueError(f"span (num_computed={c}, num_new={n}): num_computed must be >= 0 "
                             "and num_new >= 1")
        positions += range(c, c + n)
        seq_lens.append(c + n)
        cu.append(cu[-1] + n)
    slots = tables = None
    if block_tables is not None:
        bs = block_size
        tables = [list(t[:-(-end // bs)]) for t, end in zip(block_tables, seq_lens)]
        for i, (t, end) in enumerate(zip(tables, seq_lens)):
            if len(t) * bs < end:
                raise ValueError(f"sequence {i}'s block table holds {len(t) * bs} tokens but the "
                                 f"step reaches position {end - 1}; allocate its blocks first")
        slots = [t[p // bs] * bs + p % bs for t, (c, n) in zip(tables, spans)
                 for p in range(c, c + n)]
        width = max((len(t) for t in tables), default=0)
        tables = [t + [0] * (width - len(t)) for t in tables]    # pad; kernels read < seq_len
        slots = torch.tensor(slots, dtype=torch.long, device=device)
        tables = torch.tensor(tables, dtype=torch.int32, device=device).reshape(len(spans), width)
    return StepMetadata(
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=slots, block_tables=tables,
        is_decode_only=all(n == 1 for _, n in spans))


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device="cpu", num_cpu_blocks: int = 0,
                 block_manager: Optional[BlockManager] = None, impl: Optional[str] = None,
                 kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0):
        dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, device)
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)   # [L, num_blocks, bs, KVH, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        if block_manager is None:
            block_manager = BlockManager(num_blocks, block_size)
        if (block_manager.pool.num_blocks, block_manager.block_size) != (num_blocks, block_size):
            raise ValueError("the block manager's num_blocks/block_size differ from the cache's; "
                             "create both with the same numbers")
        self.block_manager = block_manager
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        kernels.checks.check_kv_scales(k_scale, v_scale, self.k)
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)   # fp8: stored = x / scale
        self.impl = impl                                  # None: Triton on CUDA, reference on CPU
        cpu_shape = (cfg.num_layers, num_cpu_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        pin = torch.device(device).type == "cuda"
        self.cpu_k = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)   # swap space
        self.cpu_v = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)
        self._meta: Optional[StepMetadata] = None         # this forward's batch (see set_step)
        self._checked = False                             # first layer checked the tables
        self._plan = None                                 # batched CPU path's gather plan
        self._tree_bits = None

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        """Bytes of the GPU-side block tensors (used or not)."""
        return self.k.nbytes + self.v.nbytes

    # -- the seam ---------------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        raise ValueError("a paged cache holds sequences of different lengths: pass positions= to "
                         "the model (or use SimplePagedKVCache for B rows that advance together)")

    def set_step(self, meta: StepMetadata, check_values: bool = True) -> None:
        """Describe the next forward's ragged batch (built by build_step_metadata).
        check_values=False: trust its tables, no host read (CUDA-graph capture, chapter 12)."""
        if not isinstance(meta, StepMetadata) or meta.slot_mapping is None:
            raise ValueError("set_step takes a StepMetadata with block tables: build it with "
                             "build_step_metadata(spans, block_tables, block_size)")
        self._meta, self._checked, self._plan = meta, not check_values, None
        self._tree_bits = None                            # a tree's masks as the Triton kernel's

    def prepare_step(self, spans) -> torch.Tensor:
        """spans: [(seq_id, start, end)]: this step computes positions [start, end) of each
        sequence, whose blocks the block manager already holds. Calls set_step and returns
        the positions [1, T_total] to pass to the model."""
        bm = self.block_manager
        for seq_id, start, end in spans:
            if not 0 <= start < end:
                raise ValueError(f"sequence {seq_id!r}: span [{start}, {end}) must hold >= 1 token")
        meta = build_step_metadata([(start, end - start) for _, start, end in spans],
                                   [bm.block_table(seq_id) for seq_id, _, _ in spans],
                                   self.block_size, self.device)
        self.set_step(meta)
        return meta.positions[None]

    def attend(self, layer: int, q, k, v):
        """q [1, T, H, D], k/v [1, T, KVH, D] (the step's ragged row) -> [1, T, H, D]."""
        meta = self._meta
        if meta is None:
            raise ValueError("call set_step(build_step_metadata(...)) or prepare_step(...) before "
                             "each forward")
        q_flat = q.reshape(-1, q.shape[2], q.shape[3])            # [num_tokens, H, D]
        k_flat = k.reshape(-1, k.shape[2], k.shape[3])            # [num_tokens, KVH, D]
        v_flat = v.reshape(-1, v.shape[2], v.shape[3])
        if q_flat.shape[0] != meta.num_tokens:
            raise ValueError(f"the forward brings {q_flat.shape[0]} tokens but the step was set "
                             f"up for {meta.num_tokens}")
        k_cache, v_cache = self.k[layer], self.v[layer]           # [num_blocks, bs, KVH, D]
        if self._checked and kernels.choose_impl(self.impl, self.device) == "torch":
            # The first layer checked this step's tensors through the public kernels; the
            # others reuse one plan (store slots, key slots, masks) of the batched CPU path.
            if self._plan is None:
                self._plan = kernels.batched.plan_store(self._make_plan(meta), meta.slot_mapping)
            kv_scales = (self.k_scale, self.v_scale)
            kernels.batched.store_kv(self._plan, k_flat, v_flat, k_cache, v_cache, *kv_scales)
            out = kernels.batched.run(self._plan, q_flat, k_cache, v_cache, self.scale,
                                      *kv_scales)
            return out.view(q.shape)                              # [1, T, H, D]
        check, self._checked = not self._checked, True            # check the tables once per step
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        kernels.store_kv(k_flat, v_flat, k_cache, v_cache, meta.slot_mapping,
                         impl=self.impl, check_values=check, **scales)
        if meta.is_decode_only:
            out = kernels.paged_decode_attention(q_flat, k_cache, v_cache, meta.block_tables,
                                                 meta.seq_lens, self.scale, impl=self.impl,
                                                 check_values=check, **scales)
        else:
            if (meta.tree_masks is not None and self._tree_bits is None      # once per step
                    and kernels.choose_impl(self.impl, self.device) == "triton"):
                self._tree_bits = kernels.tree_bits_for(meta.cu_seqlens_q, meta.tree_masks,
                                                        meta.num_tokens, self.device)
            out = kernels.paged_prefill_attention(q_flat, k_cache, v_cache, meta.cu_seqlens_q,
                                                  meta.seq_lens, meta.block_tables,
                                                  self.scale, impl=self.impl, check_values=check,
                                                  tree_masks=meta.tree_masks,
                                                  tree_bits=self._tree_bits, **scales)
        return out.view(q.shape)                                  # [1, T, H, D]

    def _make_plan(self, meta: StepMetadata):
        if meta.is_decode_only:
            return kernels.batched.plan_decode(meta.block_tables, meta.seq_lens, self.block_size)
        return kernels.batched.plan_prefill(meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                            self.block_size, meta.tree_masks)

    def advance(self, num_tokens: int) -> None:
        self._meta = None                                 # the next forward needs a new step

    def compact(self, block_ids, start: int, path: list) -> None:
        """Keep a verified tree's accepted branch (chapter 07): node path[d], written at index
        start + path[d] of the sequence with block_ids, moves to index start + d in every layer
        (path[d] >= d: nodes come parents first). What lies past it is rolled back as usual."""
        moves = [(start + p, start + d) for d, p in enumerate(path) if p != d]
        if not moves:
            return
        bs = self.block_size
        src, dst = ([block_ids[i // bs] * bs + i % bs for i in idx] for idx in zip(*moves))
        src, dst = (torch.tensor(x, device=self.device) for x in (src, dst))
        for pool in (self.k, self.v):
            flat = as_bytes(pool).view(pool.shape[0], -1, *pool.shape[3:])  # [L, slots, KVH, D]
            flat[:, dst] = flat[:, src]

    # -- block copies ---------------------------------------------------------------------------
    def copy_blocks(self, pairs) -> None:
        """Copy-on-write: for each (src, dst), block dst gets block src's K/V in every layer."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def swap_out(self, block_ids):
        """K/V of these blocks, all layers, as CPU tensors [L, n, block_size, KVH, D]."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        return self.k[:, ids].cpu(), self.v[:, ids].cpu()

    def swap_in(self, block_ids, k_cpu, v_cpu) -> None:
        """Write CPU tensors [L, n, block_size, KVH, D] (from swap_out) into these blocks."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        if k_cpu.shape[1] != len(ids) or v_cpu.shape != k_cpu.shape:
            raise ValueError(f"{len(ids)} blocks to fill but the saved K/V hold {k_cpu.shape[1]}")
        self.k[:, ids] = k_cpu.to(self.device, non_blocking=True)
        self.v[:, ids] = v_cpu.to(self.device, non_blocking=True)

    def swap_out_blocks(self, pairs) -> None:
        """Scheduler pairs (gpu_block, cpu_block): copy into the CPU pool (num_cpu_blocks)."""
        if pairs:
            cpu = torch.tensor([c for _, c in pairs], dtype=torch.long)
            self.cpu_k[:, cpu], self.cpu_v[:, cpu] = self.swap_out([g for g, _ in pairs])

    def swap_in_blocks(self, pairs) -> None:
        """Scheduler pairs (cpu_block, gpu_block): copy back from the CPU pool."""
        if pairs:
            cpu = torch.tensor([c for c, _ in pairs], dtype=torch.long)
            self.swap_in([g for _, g in pairs], self.cpu_k[:, cpu], self.cpu_v[:, cpu])


class SimplePagedKVCache(PagedKVCache):
    """Chapter 03's drop-in for ContiguousKVCache: `model(ids [B, T], cache=cache)` runs B
    sequences that advance together, and the cache grows their block tables as tokens arrive.
    `fork(row)` adds a batch row that shares a row's blocks (parallel sampling); copy-on-write
    happens inside the cache. Each forward builds its StepMetadata like the engine's does."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, batch_size: int,
                 **kwargs):
        super().__init__(cfg, num_blocks, block_size, **kwargs)
        self.batch_size = batch_size
        self.seq_ids = list(range(batch_size))              # batch row i is sequence seq_ids[i]
        self._seq_len = 0

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def attend(self, layer: int, q, k, v):
        """q [B, T, H, D], k/v [B, T, KVH, D] -> [B, T, H, D]: the B rows laid end to end."""
        if self._meta is None:
            self._grow(q.shape[0], q.shape[1])
        B, T = q.shape[:2]
        out = super().attend(layer, q.reshape(1, B * T, *q.shape[2:]),
                             k.reshape(1, B * T, *k.shape[2:]), v.reshape(1, B * T, *v.shape[2:]))
        return out.view(q.shape)

    def advance(self, num_tokens: int) -> None:
        self._seq_len += num_tokens
        super().advance(num_tokens)

    def _grow(self, batch: int, num_tokens: int) -> None:
        """Every row gets num_tokens more; build this forward's step."""
        if batch != len(self.seq_ids):
            raise ValueError(f"the cache holds {len(self.seq_ids)} sequences but the batch has "
                             f"{batch} rows")
        bm, start, end = self.block_manager, self._seq_len, self._seq_len + num_tokens
        need = sum(bm.blocks_needed(s, end) for s in self.seq_ids)
        if need > bm.num_free_blocks:
            raise ValueError(f"out of KV blocks: this step needs {need}, "
                             f"{bm.num_free_blocks} free; create the cache with more blocks")
        for s in self.seq_ids:
            self.copy_blocks(bm.allocate(s, end))
        self.prepare_step([(s, start, end) for s in self.seq_ids])

    def fork(self, row: int) -> int:
        """Add a batch row that shares row's blocks; returns the new row index."""
        child = max(self.seq_ids) + 1
        self.block_manager.fork(self.seq_ids[row], child)
        self.seq_ids.append(child)
        return len(self.seq_ids) - 1

    def reset(self) -> None:
        """Free every sequence and start again with batch_size empty rows."""
        for s in self.seq_ids:
            if self.block_manager.has(s):
                self.block_manager.free(s)
        self.seq_ids = list(range(self.batch_size))
        self._seq_len, self._meta = 0, None
