"""Triton kernel: write this step's keys and values into the paged cache (chapter 03).

Every token gets a slot, block_id * block_size + offset, chosen by the block manager. The
kernel copies token t's K and V (all KV heads at once) to that slot. One program per token.
An fp8 cache (QUANT) gets x / scale, saturated at the format's largest value, in one byte.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def round_to_fp8_grid(x, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """x (fp32, already within the format's range) rounded to the nearest fp8 value, ties to
    even, still as fp32, so the cast that follows is exact. Triton 3.9's interpreter rounds
    fp32 -> fp8 wrongly when rounding up carries into the exponent (31.7 -> 16, not 32), so
    the rounding is done here in fp32 arithmetic: the spacing of fp8 values around x is
    2^(max(exponent of x, MIN_EXP) - MANT_BITS), and adding then subtracting 1.5 * 2^23
    rounds |x| / spacing to an integer, ties to even (the fp32 adder's rounding); the sign
    goes back on afterwards, so -0.0 and tiny negatives keep it, as in torch."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127                     # of |x|; -127 for zero
    exponent = tl.maximum(exponent, MIN_EXP) - MANT_BITS       # subnormals share MIN_EXP
    spacing = ((exponent + 127) << 23).to(tl.float32, bitcast=True)   # 2^exponent, exact
    magic = 12582912.0                                         # 1.5 * 2^23
    rounded = ((tl.abs(x) / spacing + magic) - magic) * spacing
    return tl.where(bits < 0, -rounded, rounded)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,                   # [T, KVH, D] this step's keys and values
    k_cache_ptr, v_cache_ptr,       # [num_blocks, block_size, KVH, D] the pool
    slot_mapping_ptr,               # [T] slot of each token, -1 = skip
    block_size,
    k_scale, v_scale, fp8_max,      # fp8 cache: per-tensor scales, largest finite value
    stride_k_token, stride_k_head, stride_k_dim,
    stride_v_token, stride_v_head, stride_v_dim,
    stride_cache_block, stride_cache_offset, stride_cache_head, stride_cache_dim,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,   # powers of two >= the real sizes
    QUANT: tl.constexpr,            # the cache is fp8: scale and saturate before the cast
    MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,   # fp8 format: 3, -6 (e4m3); 2, -14 (e5m2)
):
    token = tl.program_id(0)
    # int64 so that block_id * stride cannot overflow 32 bits in a large pool
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:                    # a padding token (vLLM convention): nothing to write
        return
    block_id = slot // block_size   # which block of the pool ...
    offset = slot % block_size      # ... and which row inside it

    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)    # [KVH_PAD, D_PAD]

    k = tl.load(k_ptr + token * stride_k_token + heads[:, None] * stride_k_head
                + dims[None, :] * stride_k_dim, mask=mask)                 # [KVH_PAD, D_PAD]
    v = tl.load(v_ptr + token * stride_v_token + heads[:, None] * stride_v_head
                + dims[None, :] * stride_v_dim, mask=mask)
    if QUANT:                       # same arithmetic as kv_quant.quantize: divide, clamp
        k = round_to_fp8_grid(tl.clamp(k.to(tl.float32) / k_scale, -fp8_max, fp8_max),
                              MANT_BITS, MIN_EXP)
        v = round_to_fp8_grid(tl.clamp(v.to(tl.float32) / v_scale, -fp8_max, fp8_max),
                              MANT_BITS, MIN_EXP)
    cache_offsets = (block_id * stride_cache_block + offset * stride_cache_offset
                     + heads[:, None] * stride_cache_head + dims[None, :] * stride_cache_dim)
    tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    """Launch one program per token. Shapes are checked by `minillm.kernels.store_kv`."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    quant = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    # k_cache and v_cache share one set of strides (checked by the caller)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k_cache.shape[1], k_scale, v_scale,
        float(torch.finfo(k_cache.dtype).max) if quant else 0.0,
        *k.stride(), *v.stride(), *k_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), QUANT=quant,
        MANT_BITS=2 if k_cache.dtype == torch.float8_e5m2 else 3,
        MIN_EXP=-14 if k_cache.dtype == torch.float8_e5m2 else -6,
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )
