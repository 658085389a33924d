"""Triton kernel: paged prefill attention for ragged, causal query chunks (chapter 05).

A prefill step carries a different number of new tokens for each sequence, packed back to back
into q [T, H, D]; sequence b owns rows cu_seqlens_q[b] : cu_seqlens_q[b + 1]. Those q_len tokens
are the LAST tokens of the sequence: their K/V were already written by store_kv, and the
sequence has seq_len keys in all. So query i of sequence b sits at position
seq_len - q_len + i, and sees every key up to and including that position. The same kernel
serves a whole prompt (q_len == seq_len), the next chunk of a long prompt (chunked prefill:
earlier chunks are context) and a single decode token (q_len == 1).

Grid: (query tiles, sequences, KV heads). A program takes BLOCK_Q consecutive query tokens of one
sequence and all GROUP query heads that share one KV head, as BLOCK_Q * GROUP_PAD rows of one
matrix (row r = token r // GROUP_PAD, head r % GROUP_PAD), so each K/V tile it loads serves every
query head of the group. It then walks the keys in tiles of TILE_N with the same block-table
gather and online softmax as the decode kernel (see paged_decode.py for the line-by-line
version), adding the causal mask: key position <= query position.

Tree verification (chapter 07, speculative tree drafts): when a sequence's q_len queries are
the nodes of a tree, query i may see, of those last q_len slots, only its ancestors. The mask
comes in as one int64 per query row (`tree_bits`: bit j set = the query sees the tree's node j,
so a tree has at most 64 nodes; -1 for every query that is not a tree node: all bits set) and
is ANDed into the causal test for the keys at or past context_len. Every node sees the root
(node 0) and the context before it, so no row is fully masked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import is_fp8
from .paged_decode import dot, dot_options

TILE_N = 64              # keys per loop iteration
ROWS = 64                # query rows per program (BLOCK_Q tokens x GROUP_PAD heads)
# fp32 tiles are twice as large in registers, so fp32 uses half of each


@triton.jit
def _paged_prefill_kernel(
    out_ptr,                        # [T, H, D]
    q_ptr,                          # [T, H, D] ragged queries, sequences back to back
    k_cache_ptr, v_cache_ptr,       # [num_blocks, BLOCK_SIZE, KVH, D]
    cu_seqlens_q_ptr,               # [B + 1] int32: sequence b owns q rows cu[b] : cu[b + 1]
    seq_lens_ptr,                   # [B] int32: keys per sequence, these queries included
    block_tables_ptr,               # [B, max_blocks] int32
    tree_bits_ptr,                  # [T] int64 ancestor bits per query (if HAS_TREE)
    scale,                          # softmax scale times k_scale (fp8 cache)
    v_scale,                        # an fp8 cache's value scale (1.0 otherwise)
    stride_q_token, stride_q_head, stride_q_dim,
    stride_out_token, stride_out_head, stride_out_dim,
    stride_cache_block, stride_cache_offset, stride_cache_head, stride_cache_dim,
    stride_table_seq, stride_table_block,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,   # query heads per KV head, padded to 2^k
    BLOCK_Q: tl.constexpr,                          # query tokens per program
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,      # see paged_decode.dot
    KV_FP8: tl.constexpr,           # the cache holds fp8 bytes: convert each tile to q's dtype
    HAS_TREE: tl.constexpr,         # some sequences' queries are trees (tree_bits_ptr)
):
    q_tile = tl.program_id(0)       # which BLOCK_Q tokens of the sequence's new queries
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_begin = tl.load(cu_seqlens_q_ptr + seq)               # first row of this sequence in q
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    if q_tile * BLOCK_Q >= q_len:   # the grid is sized for the longest chunk; nothing here
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len   # keys that came before these queries (earlier chunks)

    # rows of the query matrix: BLOCK_Q tokens x GROUP_PAD heads
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD            # index among this sequence's queries
    head_in_group = rows % GROUP_PAD
    row_is_real = (token < q_len) & (head_in_group < GROUP)
    heads = kv_head * GROUP + head_in_group                 # query head of each row
    q_pos = context_len + token                             # position of each row's query
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_is_real = dims < HEAD_DIM
    q_row_offsets = (q_begin + token).to(tl.int64) * stride_q_token + heads * stride_q_head
    q = tl.load(q_ptr + q_row_offsets[:, None] + dims[None, :] * stride_q_dim,
                mask=row_is_real[:, None] & dim_is_real[None, :], other=0.0)   # [ROWS, D_PAD]

    if HAS_TREE:                    # [ROWS] int64: which of the last q_len slots each row sees
        bits = tl.load(tree_bits_ptr + q_begin + token, mask=row_is_real, other=-1)
    m = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    # Causality: the last query of this tile sits at context_len + (q_tile + 1) * BLOCK_Q - 1,
    # so no row of the tile needs a key at or beyond kv_end.
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
    table_row = block_tables_ptr + seq * stride_table_seq
    head_offset = kv_head * stride_cache_head
    for tile_start in range(0, kv_end, TILE_N):
        # block-table gather, as in the decode kernel:
        key_pos = tile_start + tl.arange(0, TILE_N)                          # logical positions
        key_is_real = key_pos < kv_end
        physical_block = tl.load(table_row + (key_pos // BLOCK_SIZE) * stride_table_block,
                                 mask=key_is_real, other=0).to(tl.int64)     # table lookup
        key_offsets = (physical_block * stride_cache_block
                       + (key_pos % BLOCK_SIZE) * stride_cache_offset + head_offset)
        kv_offsets = key_offsets[:, None] + dims[None, :] * stride_cache_dim  # [TILE_N, D_PAD]
        kv_mask = key_is_real[:, None] & dim_is_real[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)      # [TILE_N, D_PAD]
        if KV_FP8:                  # one byte per value -> q's dtype (exact); scales folded
            k = k.to(q.dtype)

        scores = dot(q, tl.trans(k), DOT_PRECISION, UPCAST) * scale   # [ROWS, TILE_N]
        # causal mask: a query sees keys at its own position and before
        visible = key_is_real[None, :] & (key_pos[None, :] <= q_pos[:, None])
        if HAS_TREE:                # of the tree's own slots, only the row's ancestors
            node = tl.minimum(tl.maximum(key_pos - context_len, 0), 63).to(tl.int64)
            seen = ((bits[:, None] >> node[None, :]) & 1) != 0
            visible = visible & ((key_pos[None, :] < context_len) | seen)
        scores = tl.where(visible, scores, float("-inf"))

        # online softmax. Key 0 (first tile) is visible to every row, so m is finite from the
        # first tile on and a later fully-masked tile only adds exp(-inf) = 0.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        correction = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * correction + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * correction[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m = m_new

    out = acc / l[:, None] * v_scale
    out_row_offsets = (q_begin + token).to(tl.int64) * stride_out_token + heads * stride_out_head
    tl.store(out_ptr + out_row_offsets[:, None] + dims[None, :] * stride_out_dim,
             out.to(out_ptr.dtype.element_ty), mask=row_is_real[:, None] & dim_is_real[None, :])


def paged_prefill_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                         max_query_len: int | None = None, k_scale: float = 1.0,
                         v_scale: float = 1.0, tree_bits=None):
    """Launch the prefill kernel.

    max_query_len (the longest q_len in the batch, which a scheduler knows on the host) sizes
    the grid; without it the grid assumes one sequence might own all T queries, and the extra
    programs exit at once. Reading it from cu_seqlens_q here would cost a GPU sync.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0 or batch == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    halve = 2 if q.dtype == torch.float32 else 1
    rows = max(ROWS // halve, group_pad)        # at least one token per program
    block_q = rows // group_pad
    longest = num_tokens if max_query_len is None else max(1, min(max_query_len, num_tokens))
    grid = (triton.cdiv(longest, block_q), batch, num_kv_heads)
    _paged_prefill_kernel[grid](
        out, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
        seq_lens if tree_bits is None else tree_bits, scale * k_scale,
        float(v_scale),
        *q.stride(), *out.stride(), *k_cache.stride(), *block_tables.stride(),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, TILE_N=TILE_N // halve,
        num_warps=4, num_stages=2, KV_FP8=is_fp8(k_cache), HAS_TREE=tree_bits is not None,
        **dot_options(q.dtype),
    )
    return out
