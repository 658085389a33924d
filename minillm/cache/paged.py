"""Paged KV cache (chapter 03): the model's seam over a pool of blocks.

Every layer keeps its keys and values in block tensors [num_blocks, block_size, KVH, D]; all
layers together are k/v [num_layers, num_blocks, block_size, KVH, D]. Which blocks belong to
which sequence is the BlockManager's business (`minillm.cache.blocks`). Each layer's `attend`
does two things with the kernels of `minillm.kernels` (Triton on CUDA, PyTorch twins on CPU):

    store_kv(k, v, k_cache, v_cache, slot_mapping)     this step's K/V into their slots
    paged_decode_attention(...)                        when every sequence brings ONE query
    paged_prefill_attention(...)                       otherwise (ragged, causal)

Two ways to drive it:

(a) simple mode, `PagedKVCache(cfg, num_blocks, block_size, batch_size=B)`: a drop-in for
    ContiguousKVCache. `model(ids [B, T], cache=cache)` runs B sequences that advance together;
    the cache grows their block tables as tokens arrive. `fork(row)` adds a batch row that
    shares a row's blocks (parallel sampling); copy-on-write happens inside the cache.

(b) engine mode, `PagedKVCache(cfg, num_blocks, block_size)`: the engine's model runner flattens
    a step into ONE ragged batch, ids [1, T_total] with explicit positions, and describes it
    with `set_step(...)` (or `prepare_step(spans)`, which builds those tensors from the block
    manager) before the forward. It copies blocks for copy-on-write (`copy_blocks`) and swaps
    blocks to and from a CPU pool (`swap_out_blocks` / `swap_in_blocks`) as the scheduler asks.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import kernels
from ..configs import ModelConfig
from .blocks import BlockManager


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 batch_size: Optional[int] = None, dtype: torch.dtype = torch.float32,
                 device="cpu", num_cpu_blocks: int = 0,
                 block_manager: Optional[BlockManager] = None, impl: Optional[str] = None):
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
        self.impl = impl                                  # None: Triton on CUDA, reference on CPU
        cpu_shape = (cfg.num_layers, num_cpu_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        pin = torch.device(device).type == "cuda"
        self.cpu_k = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)   # swap space
        self.cpu_v = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin)
        # simple mode: batch row i is sequence self.seq_ids[i]; None means engine mode
        self.batch_size = batch_size
        self.seq_ids = list(range(batch_size)) if batch_size is not None else None
        self._seq_len = 0
        self._step = None                                 # this forward's tensors (see set_step)

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
        if self.seq_ids is None:
            raise ValueError("engine mode has no single seq_len: pass positions= to the model "
                             "(or build the cache with batch_size=B for simple mode)")
        return self._seq_len

    def attend(self, layer: int, q, k, v):
        """q [B, T, H, D], k/v [B, T, KVH, D] -> [B, T, H, D] (engine mode: B == 1, ragged T)."""
        if self._step is None:
            if self.seq_ids is None:
                raise ValueError("engine mode: call set_step(...) or prepare_step(...) before "
                                 "each forward")
            self._grow(q.shape[0], q.shape[1])
        step = self._step
        q_flat = q.reshape(-1, q.shape[2], q.shape[3])            # [num_tokens, H, D]
        k_flat = k.reshape(-1, k.shape[2], k.shape[3])            # [num_tokens, KVH, D]
        v_flat = v.reshape(-1, v.shape[2], v.shape[3])
        if q_flat.shape[0] != step["slot_mapping"].shape[0]:
            raise ValueError(f"the forward brings {q_flat.shape[0]} tokens but the step was set "
                             f"up for {step['slot_mapping'].shape[0]}")
        check = not step["checked"]                               # check the tables once per step
        step["checked"] = True
        k_cache, v_cache = self.k[layer], self.v[layer]           # [num_blocks, bs, KVH, D]
        if not check and kernels.choose_impl(self.impl, self.device) == "torch":
            # The first layer checked this step's tensors through the public kernels; the
            # others reuse one plan (gather rows, masks) of the batched CPU path.
            if "plan" not in step:
                step["plan"] = self._plan(step)
            kernels.reference.store_kv(k_flat, v_flat, k_cache, v_cache, step["slot_mapping"])
            out = kernels.batched.run(step["plan"], q_flat, k_cache, v_cache, self.scale)
            return out.view(q.shape)                              # [B, T, H, D]
        kernels.store_kv(k_flat, v_flat, k_cache, v_cache, step["slot_mapping"],
                         impl=self.impl, check_values=check)
        if step["is_decode_only"]:
            out = kernels.paged_decode_attention(q_flat, k_cache, v_cache, step["block_tables"],
                                                 step["seq_lens"], self.scale, impl=self.impl,
                                                 check_values=check)
        else:
            out = kernels.paged_prefill_attention(q_flat, k_cache, v_cache, step["cu_seqlens_q"],
                                                  step["seq_lens"], step["block_tables"],
                                                  self.scale, impl=self.impl, check_values=check)
        return out.view(q.shape)                                  # [B, T, H, D]

    def _plan(self, step):
        if step["is_decode_only"]:
            return kernels.batched.plan_decode(step["block_tables"], step["seq_lens"],
                                               self.block_size)
        return kernels.batched.plan_prefill(step["cu_seqlens_q"], step["seq_lens"],
                                            step["block_tables"], self.block_size)

    def advance(self, num_tokens: int) -> None:
        if self.seq_ids is not None:
            self._seq_len += num_tokens
        self._step = None                                         # the next forward needs a new step

    # -- engine mode --------------------------------------------------------------------------
    def set_step(self, slot_mapping, block_tables, seq_lens, cu_seqlens_q, is_decode_only: bool):
        """Describe the next forward's ragged batch of num_seqs sequences and T_total tokens.

        slot_mapping [T_total]: where each token's K/V goes; block_tables [num_seqs, max_blocks];
        seq_lens [num_seqs]: each sequence's tokens including this step's; cu_seqlens_q
        [num_seqs + 1]: sequence b owns tokens cu[b]:cu[b + 1], its LAST ones; is_decode_only:
        every sequence brings exactly one token (the decode kernel runs).
        """
        dev = self.device
        step = {"slot_mapping": torch.as_tensor(slot_mapping, dtype=torch.long, device=dev),
                "block_tables": torch.as_tensor(block_tables, dtype=torch.int32, device=dev),
                "seq_lens": torch.as_tensor(seq_lens, dtype=torch.int32, device=dev),
                "cu_seqlens_q": torch.as_tensor(cu_seqlens_q, dtype=torch.int32, device=dev),
                "is_decode_only": bool(is_decode_only), "checked": False}
        num_seqs, num_tokens = step["seq_lens"].shape[0], step["slot_mapping"].shape[0]
        if is_decode_only and num_tokens != num_seqs:
            raise ValueError(f"is_decode_only needs one token per sequence, got {num_tokens} tokens "
                             f"for {num_seqs} sequences; pass is_decode_only=False")
        self._step = step

    def prepare_step(self, spans) -> torch.Tensor:
        """spans: [(seq_id, start, end)]: this step computes positions [start, end) of each
        sequence, whose blocks the block manager already holds. Calls set_step and returns
        the positions [1, T_total] to pass to the model."""
        bm = self.block_manager
        slots, tables, seq_lens, cu, positions = [], [], [], [0], []
        for seq_id, start, end in spans:
            if not 0 <= start < end:
                raise ValueError(f"sequence {seq_id!r}: span [{start}, {end}) must hold >= 1 token")
            slots += bm.slot_mapping(seq_id, start, end)
            tables.append(bm.block_table(seq_id)[:-(-end // self.block_size)])
            seq_lens.append(end)
            cu.append(cu[-1] + end - start)
            positions += range(start, end)
        width = max(len(t) for t in tables)
        tables = [t + [0] * (width - len(t)) for t in tables]    # pad; kernels read < seq_len
        self.set_step(slots, tables, seq_lens, cu, all(e - s == 1 for _, s, e in spans))
        return torch.tensor([positions], dtype=torch.long, device=self.device)

    # -- simple mode --------------------------------------------------------------------------
    def _grow(self, batch: int, num_tokens: int) -> None:
        """Simple mode: every row gets num_tokens more; build this forward's step."""
        if batch != len(self.seq_ids):
            raise ValueError(f"the cache holds {len(self.seq_ids)} sequences but the batch has "
                             f"{batch} rows")
        bm, start, end = self.block_manager, self._seq_len, self._seq_len + num_tokens
        need = sum(bm.blocks_needed(s, end) for s in self.seq_ids)
        if need > bm.num_free_blocks:
            raise ValueError(f"out of KV blocks: this step needs {need}, {bm.num_free_blocks} free; "
                             "create the cache with more blocks")
        for s in self.seq_ids:
            self.copy_blocks(bm.allocate(s, end))
        self.prepare_step([(s, start, end) for s in self.seq_ids])

    def fork(self, row: int) -> int:
        """Simple mode: add a batch row that shares row's blocks; returns the new row index."""
        if self.seq_ids is None:
            raise ValueError("fork(row) is for simple mode; in engine mode use block_manager.fork")
        child = max(self.seq_ids) + 1
        self.block_manager.fork(self.seq_ids[row], child)
        self.seq_ids.append(child)
        return len(self.seq_ids) - 1

    def reset(self) -> None:
        """Simple mode: free every sequence and start again with batch_size empty rows."""
        for s in self.seq_ids or []:
            if self.block_manager.has(s):
                self.block_manager.free(s)
        self.seq_ids = list(range(self.batch_size)) if self.batch_size is not None else None
        self._seq_len, self._step = 0, None

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
