"""Triton kernel: write this step's keys and values into the paged cache (chapter 03).

Every token gets a slot, block_id * block_size + offset, chosen by the block manager. The
kernel copies token t's K and V (all KV heads at once) to that slot. One program per token.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,                   # [T, KVH, D] this step's keys and values
    k_cache_ptr, v_cache_ptr,       # [num_blocks, block_size, KVH, D] the pool
    slot_mapping_ptr,               # [T] slot of each token, -1 = skip
    block_size,
    stride_k_token, stride_k_head, stride_k_dim,
    stride_v_token, stride_v_head, stride_v_dim,
    stride_cache_block, stride_cache_offset, stride_cache_head, stride_cache_dim,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,   # powers of two >= the real sizes
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
    cache_offsets = (block_id * stride_cache_block + offset * stride_cache_offset
                     + heads[:, None] * stride_cache_head + dims[None, :] * stride_cache_dim)
    tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(k, v, k_cache, v_cache, slot_mapping):
    """Launch one program per token. Shapes are checked by `minillm.kernels.store_kv`."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    # k_cache and v_cache share one set of strides (checked by the caller)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k_cache.shape[1],
        *k.stride(), *v.stride(), *k_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )
