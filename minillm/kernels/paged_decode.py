"""Triton kernels: paged decode attention (chapter 03).

Decode = one new query token per sequence attending to every key the sequence has so far. The
keys are not contiguous: they sit in fixed-size blocks scattered over a shared pool, and each
sequence's block table says which block holds which part of it:

    key t of sequence b  ->  block  block_tables[b, t // BLOCK_SIZE],  row  t % BLOCK_SIZE

The kernel walks a sequence's keys in tiles of TILE_N positions. For each tile it turns the
logical positions into (physical block, row) through the block table, loads those K rows,
scores them against the query, and folds them into a running softmax (the "online softmax" of
FlashAttention: keep a running max m, a running sum of exponentials l, and a running weighted
sum of values acc; rescale all three whenever the max grows).

Grouped-query attention: one program handles one (sequence, KV head) pair and ALL the query
heads that share that KV head (the "group"), so each K/V byte is read from memory once per group
instead of once per query head. The group (1, 3, 4, 8, ...) is padded with masked rows to a
power of two of at least 16, the smallest matrix `tl.dot` accepts on every GPU.

Two variants:
- single pass:  grid (B, KVH, 1); each program reads the whole context.
- split-KV ("flash decoding"): grid (B, KVH, P); program p reads only keys
  [p * PARTITION_SIZE, (p + 1) * PARTITION_SIZE) and writes a partial result (its output, max
  and sum of exponentials); a second small kernel merges the P partials per query head. This
  keeps the GPU busy when B * KVH programs are too few to fill it (small batch, long context).
  `choose_partition_size` below decides, by a simple rule, which variant to run.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .kv_quant import is_fp8

TILE_N = 64              # keys per loop iteration (any block size: a tile may span blocks);
                         # fp32 uses TILE_N // 2 so its tiles fit in registers
MIN_PARTITION = 128      # split-KV never makes a partition shorter than this many keys
MAX_PARTITIONS = 64      # ... nor more partitions than this per sequence
ASSUMED_SMS = 132        # SM count used off-GPU (an H100 SXM), so the interpreter decides like one


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32: tl.dot, plus one workaround.

    Triton 3.9's interpreter keeps bfloat16 tensors as raw uint16 bits and multiplies the bits,
    so on CPU the launchers set UPCAST for bf16 and the operands go to fp32 first. That gives
    the same numbers a GPU computes (bf16 x bf16 products are exact in fp32); on a GPU UPCAST
    is False and the tensor cores take bf16 directly.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


def interpreting() -> bool:
    """True when Triton defined these kernels for its CPU interpreter (TRITON_INTERPRET=1 was
    set when this module was first imported), False when they compile for a GPU."""
    return type(dot).__name__ == "InterpretedFunction"


def dot_options(dtype: torch.dtype) -> dict:
    """DOT_PRECISION / UPCAST for `dot`: exact fp32 ("ieee", not TF32) for fp32 inputs."""
    upcast = dtype == torch.bfloat16 and interpreting()
    precision = "ieee" if dtype == torch.float32 or upcast else "tf32"
    return dict(DOT_PRECISION=precision, UPCAST=upcast)


@triton.jit
def _paged_decode_kernel(
    out_ptr,                        # [B, H, D] output; or [B, H, P, D] fp32 partials when SPLIT
    part_max_ptr, part_sum_ptr,     # [B, H, P] fp32 partial max / sum of exp (SPLIT only)
    q_ptr,                          # [B, H, D] one query per sequence
    k_cache_ptr, v_cache_ptr,       # [num_blocks, BLOCK_SIZE, KVH, D] the shared pool
    block_tables_ptr,               # [B, max_blocks] int32: physical block of each logical block
    seq_lens_ptr,                   # [B] int32: keys per sequence (the new token included)
    scale,                          # softmax scale, usually 1 / sqrt(D), times k_scale
    v_scale,                        # an fp8 cache's value scale (1.0 otherwise)
    num_heads, num_partitions,
    stride_q_seq, stride_q_head, stride_q_dim,
    stride_out_seq, stride_out_head, stride_out_dim,
    stride_cache_block, stride_cache_offset, stride_cache_head, stride_cache_dim,
    stride_table_seq, stride_table_block,
    GROUP: tl.constexpr,            # query heads per KV head (H // KVH)
    GROUP_PAD: tl.constexpr,        # GROUP padded to a power of two >= 16
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,       # tokens per cache block
    TILE_N: tl.constexpr,           # keys per loop iteration
    PARTITION_SIZE: tl.constexpr,   # keys per program when SPLIT
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,    # "ieee" for fp32 inputs (no TF32 rounding), else unused
    UPCAST: tl.constexpr,           # interpreter-only bf16 workaround, see `dot`
    KV_FP8: tl.constexpr,           # the cache holds fp8 bytes: convert each tile to q's dtype
):
    seq = tl.program_id(0)          # which sequence
    kv_head = tl.program_id(1)      # which KV head (and so which group of query heads)
    partition = tl.program_id(2)    # which slice of the context (always 0 without SPLIT)

    seq_len = tl.load(seq_lens_ptr + seq)
    if SPLIT:
        start = partition * PARTITION_SIZE
        if start >= seq_len:        # the grid is sized for the longest table; this slice is empty
            return
        end = tl.minimum(start + PARTITION_SIZE, seq_len)
    else:
        start = 0
        end = seq_len

    # --- the query rows of this group: heads kv_head * GROUP .. kv_head * GROUP + GROUP - 1 ---
    rows = tl.arange(0, GROUP_PAD)                           # [GROUP_PAD]
    row_is_head = rows < GROUP                               # padded rows are masked off
    heads = kv_head * GROUP + rows                           # [GROUP_PAD] query head index
    dims = tl.arange(0, HEAD_DIM_PAD)                        # [D_PAD]
    dim_is_real = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head
                + dims[None, :] * stride_q_dim,
                mask=row_is_head[:, None] & dim_is_real[None, :], other=0.0)   # [GROUP_PAD, D_PAD]

    # --- running softmax state, one entry per query row, kept in fp32 ---
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)   # running max of scores
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)                 # running sum of exp(score - m)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32) # running sum of exp(...) * V

    table_row = block_tables_ptr + seq * stride_table_seq   # this sequence's block table
    head_offset = kv_head * stride_cache_head

    for tile_start in range(start, end, TILE_N):
        # ---------- the block-table indirection, line by line ----------
        # 1. logical positions of the keys in this tile: tile_start, tile_start + 1, ...
        key_pos = tile_start + tl.arange(0, TILE_N)                        # [TILE_N]
        key_is_real = key_pos < end                                        # last tile is partial
        # 2. which logical block of the sequence each key is in, and its row in that block
        logical_block = key_pos // BLOCK_SIZE                              # [TILE_N]
        row_in_block = key_pos % BLOCK_SIZE                                # [TILE_N]
        # 3. the block table maps logical block -> physical block of the pool (an int32 read
        #    per key; keys of one block read the same entry, which the L1 cache serves)
        physical_block = tl.load(table_row + logical_block * stride_table_block,
                                 mask=key_is_real, other=0).to(tl.int64)   # int64: no overflow
        # 4. address of each key row: block start + row + this KV head; then the D elements
        key_offsets = (physical_block * stride_cache_block + row_in_block * stride_cache_offset
                       + head_offset)                                      # [TILE_N]
        kv_offsets = key_offsets[:, None] + dims[None, :] * stride_cache_dim   # [TILE_N, D_PAD]
        kv_mask = key_is_real[:, None] & dim_is_real[None, :]
        # 5. one gathered load brings TILE_N keys (each a contiguous run of D elements)
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)    # [TILE_N, D_PAD]
        if KV_FP8:                  # one byte per value -> q's dtype (exact); scales folded
            k = k.to(q.dtype)
        # ----------------------------------------------------------------

        # scores of every query row against every key of the tile, accumulated in fp32
        scores = dot(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale  # [GROUP_PAD, TILE_N]
        scores = tl.where(key_is_real[None, :], scores, float("-inf"))

        # online softmax: new max, rescale what we had, add this tile
        m_new = tl.maximum(m, tl.max(scores, axis=1))                      # [GROUP_PAD]
        correction = tl.exp(m - m_new)          # exp(-inf) = 0 on the first tile
        p = tl.exp(scores - m_new[:, None])     # [GROUP_PAD, TILE_N]; masked keys give 0
        l = l * correction + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)    # same addresses as K
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * correction[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m = m_new

    # Every query row saw at least one real key (key `start`), so l > 0 here.
    out = acc / l[:, None] * v_scale                                   # [GROUP_PAD, D_PAD]
    store_mask = row_is_head[:, None] & dim_is_real[None, :]
    if SPLIT:
        # partial result of this slice: normalised output, plus (max, sum) to weight it later
        part = (seq * num_heads + heads) * num_partitions + partition      # [GROUP_PAD]
        tl.store(out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=store_mask)
        tl.store(part_max_ptr + part, m, mask=row_is_head)
        tl.store(part_sum_ptr + part, l, mask=row_is_head)
    else:
        tl.store(out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head
                 + dims[None, :] * stride_out_dim,
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _merge_partitions_kernel(
    out_ptr,                        # [B, H, D]
    part_out_ptr,                   # [B, H, P, D] fp32, each normalised within its slice
    part_max_ptr, part_sum_ptr,     # [B, H, P] fp32
    seq_lens_ptr,
    num_heads, num_partitions,
    stride_out_seq, stride_out_head, stride_out_dim,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr, PARTITIONS_PAD: tl.constexpr,
):
    """Combine the slices of one (sequence, query head).

    Slice p computed out_p = sum_j exp(s_j - m_p) v_j / l_p with l_p = sum_j exp(s_j - m_p).
    With M = max_p m_p, weight_p = l_p * exp(m_p - M) is slice p's share of the full softmax
    denominator, so the full result is sum_p weight_p * out_p / sum_p weight_p.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_used = tl.cdiv(seq_len, PARTITION_SIZE)             # slices that held keys
    parts = tl.arange(0, PARTITIONS_PAD)
    part_is_used = parts < num_used
    base = (seq * num_heads + head) * num_partitions
    part_max = tl.load(part_max_ptr + base + parts, mask=part_is_used, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + base + parts, mask=part_is_used, other=0.0)
    weight = part_sum * tl.exp(part_max - tl.max(part_max, axis=0))      # [PARTITIONS_PAD]
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_is_real = dims < HEAD_DIM
    part_out = tl.load(part_out_ptr + (base + parts[:, None]) * HEAD_DIM + dims[None, :],
                       mask=part_is_used[:, None] & dim_is_real[None, :], other=0.0)
    out = tl.sum(weight[:, None] * part_out, axis=0) / tl.sum(weight, axis=0)   # [D_PAD]
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims * stride_out_dim,
             out.to(out_ptr.dtype.element_ty), mask=dim_is_real)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return ASSUMED_SMS


def choose_partition_size(batch: int, num_kv_heads: int, context_capacity: int,
                          sm_count: int) -> int | None:
    """The split-KV rule. Returns keys per partition, or None for the single-pass kernel.

    - The single-pass kernel runs batch * num_kv_heads programs. When that fills the GPU
      (>= one program per SM), splitting only adds a merge step: don't.
    - Otherwise split the context so that about two programs per SM run: ask for
      ceil(2 * SMs / programs) partitions (at most MAX_PARTITIONS), each a power of two of at
      least MIN_PARTITION keys. A context that would give a single partition is not split.

    `context_capacity` is block_tables.shape[1] * block_size, the longest context the tables can
    describe. It is known on the host, so the choice needs no GPU sync (reading seq_lens.max()
    would). An engine that sizes its tables to the batch's longest sequence gets a tight bound.
    """
    programs = batch * num_kv_heads
    if programs >= sm_count or context_capacity < 2 * MIN_PARTITION:
        return None
    wanted = min(MAX_PARTITIONS, triton.cdiv(2 * sm_count, programs))
    size = max(MIN_PARTITION, triton.next_power_of_2(triton.cdiv(context_capacity, wanted)))
    return size if size < context_capacity else None


def paged_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale,
                        split_kv: bool | None = None, partition_size: int | None = None,
                        k_scale: float = 1.0, v_scale: float = 1.0):
    """Launch the decode kernel (and, when splitting, the merge kernel).

    split_kv None: split when a partition_size is given, else as `choose_partition_size` says;
    True / False forces it on / off. partition_size (a multiple of TILE_N) overrides the
    rule's size.
    """
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    capacity = block_tables.shape[1] * block_size

    if split_kv is False:
        partition_size = None
    elif partition_size is None:
        partition_size = choose_partition_size(batch, num_kv_heads, capacity, num_sms(q.device))
        if partition_size is None and split_kv:          # forced on where the rule says no
            partition_size = max(TILE_N, triton.next_power_of_2(triton.cdiv(capacity, 2)))
    split = partition_size is not None
    if split and (partition_size <= 0 or partition_size % TILE_N):
        raise ValueError(f"partition_size must be a positive multiple of {TILE_N}, "
                         f"got {partition_size}")
    num_partitions = triton.cdiv(capacity, partition_size) if split else 1

    common = dict(
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, TILE_N=TILE_N if q.dtype != torch.float32 else TILE_N // 2,
        num_warps=4, num_stages=2, KV_FP8=is_fp8(k_cache), **dot_options(q.dtype),
    )
    scale, v_scale = scale * k_scale, float(v_scale)     # fp8 scales folded (kv_quant.py)
    cache_strides = k_cache.stride()        # v_cache has the same strides (checked)
    if not split:
        _paged_decode_kernel[(batch, num_kv_heads, 1)](
            out, out, out, q, k_cache, v_cache, block_tables, seq_lens, scale, v_scale,
            num_heads, 1, *q.stride(), *out.stride(), *cache_strides, *block_tables.stride(),
            PARTITION_SIZE=TILE_N, SPLIT=False, **common)
        return out

    part_out = torch.empty(batch, num_heads, num_partitions, head_dim,
                           dtype=torch.float32, device=q.device)        # [B, H, P, D]
    part_max = torch.empty(batch, num_heads, num_partitions, dtype=torch.float32,
                           device=q.device)                             # [B, H, P]
    part_sum = torch.empty_like(part_max)
    _paged_decode_kernel[(batch, num_kv_heads, num_partitions)](
        part_out, part_max, part_sum, q, k_cache, v_cache, block_tables, seq_lens, scale,
        v_scale, num_heads, num_partitions, *q.stride(), *out.stride(), *cache_strides,
        *block_tables.stride(), PARTITION_SIZE=partition_size, SPLIT=True, **common)
    _merge_partitions_kernel[(batch, num_heads)](
        out, part_out, part_max, part_sum, seq_lens, num_heads, num_partitions, *out.stride(),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=common["HEAD_DIM_PAD"], PARTITION_SIZE=partition_size,
        PARTITIONS_PAD=triton.next_power_of_2(num_partitions), num_warps=4)
    return out
