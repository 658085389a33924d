"""Triton kernel: y = x @ dequant(W)^T with W stored as int4 nibbles (chapter 09, the GPU path).

Why dequantize inside the kernel. A decode step multiplies a handful of rows (M = batch size)
by every weight matrix once. For M = 1 a layer does 2 * N * K flops and reads N * K weights:
at bf16 that is 1 flop per byte, far below what a GPU can do per byte of memory (an H100 has
roughly 300 flops of bf16 tensor-core work per byte of HBM bandwidth). The step time is the
time to stream the weights. Storing them in 4 bits reads a quarter of the bf16 bytes, but only
if the 4-bit values are what crosses the memory bus. Dequantizing the whole matrix to bf16 in
one kernel and calling a bf16 GEMM in a second would write and read the bf16 copy again: more
traffic than not quantizing at all. So this kernel reads the packed bytes, expands them to
bf16 in registers, and feeds the tensor cores directly. At large M (prefill) the same GEMM is
compute-bound and the 4-bit weights save nothing; there the expansion, repeated by every tile
of rows, is overhead, which is why some int4 libraries (exllamav2, for one) expand the weight
to a bf16 copy once and call an ordinary GEMM when the prompt is long.

The storage is the package's own (minillm/quant/rtn.py), no reshuffling:
    qweight [N, K/2] uint8   column 2j of W in the low nibble of byte j, column 2j + 1 in the high
    scales  [N, K/g] fp32    one per group of g input columns
    zeros   [N, K/g] fp32    integer zero points 0..15:   W[n, k] ~ (q[n, k] - zero) * scale

The tiling. Program (i, j) owns the output tile y[i*BM : (i+1)*BM, j*BN : (j+1)*BN] and walks K
in tiles of BK columns. BK is the group size or a power-of-two divisor of it (at most 64, so the
expanded tile fits in registers), so a whole tile lies inside one group: one scale and one zero
point per output column per step.

    for each K-tile ks (group = ks.start // g):
        x_tile   = x[rows, ks]                       [BM, BK]  activation dtype
        bytes    = qweight[cols, ks // 2]            [BK, BN]  each byte serves 2 columns
        q        = (bytes >> 4 * (k % 2)) & 0xF      [BK, BN]  the nibble of column k
        w        = (q - zero[cols, group])
                   * scale[cols, group]              [BK, BN]  fp32, then the activation dtype
        acc     += x_tile @ w                        [BM, BN]  fp32 accumulator (tensor cores)
    y[rows, cols] = acc                              written in the activation dtype

tl.dot needs at least 16 rows, so a decode tile pads M = 1 to 16 rows of zeros: the padding
costs tensor-core cycles that are idle anyway, never memory traffic (masked loads read nothing).

What a production kernel adds (Marlin in vLLM, torchao's tinygemm, and the kernels behind
GPTQ/AWQ checkpoints), none of it here:
  * a weight layout shuffled offline so that one wide load per thread brings exactly the nibbles
    the tensor-core instruction wants in its registers, and the nibble-to-bf16 conversion done
    with a few bit tricks (or a lookup) instead of shifts, subtractions and multiplies;
  * fp16/bf16 scales and zeros (here fp32: 8 bytes per group, 25% on top of the nibbles at
    g = 64), often with the zero folded in as scale * zero so the inner loop is one FMA;
  * split-K: a decode GEMM on a 576 x 576 layer has only N / BN tiles, fewer than the GPU's
    132 SMs, so production kernels also split K across programs and add the partial sums;
  * asynchronous copies (cp.async / TMA) in a multi-stage pipeline so that the next group's
    bytes arrive while this group is multiplied, and autotuned tile sizes per shape and GPU.

The plain-PyTorch twin is `minillm.quant.linear.int4_linear_ref` (dequantize, then multiply);
tests/test_int4_gemm.py runs this kernel under TRITON_INTERPRET=1 against it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .paged_decode import dot, dot_options, interpreting

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GROUP_SIZES = (32, 64, 128)          # powers of two >= 16 (tl.dot's smallest K-tile)


@triton.jit
def _int4_gemm_kernel(
    x_ptr,                          # [M, K] activations (fp32 / bf16 / fp16)
    qweight_ptr,                    # [N, K/2] uint8: two 4-bit values per byte
    scales_ptr, zeros_ptr,          # [N, K/g] fp32: per-group scale and zero point
    out_ptr,                        # [M, N] output, the activations' dtype
    M, N, K,
    stride_xm, stride_xk,
    stride_qn, stride_qk,
    stride_sn, stride_sg,           # scales and zeros share strides (both contiguous [N, K/g])
    stride_om, stride_on,
    GROUP_SIZE: tl.constexpr,       # g: columns that share one scale / zero point
    BLOCK_K: tl.constexpr,          # the K-tile: g or a power-of-two divisor of it
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,   # see paged_decode.dot
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)            # [BM]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)            # [BN]
    ks = tl.arange(0, BLOCK_K)                                # [BK]
    row_ok = rows < M
    col_ok = cols < N
    shift = (ks % 2) * 4                                      # [BK] low nibble for even k

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(0, K // BLOCK_K):
        k = tile * BLOCK_K + ks                               # [BK] this tile's input columns
        group = (tile * BLOCK_K) // GROUP_SIZE                # one group holds the whole tile
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=row_ok[:, None], other=0.0)          # [BM, BK]
        packed = tl.load(qweight_ptr + cols[None, :] * stride_qn + (k[:, None] // 2) * stride_qk,
                         mask=col_ok[None, :], other=0)       # [BK, BN] uint8
        q = (packed.to(tl.int32) >> shift[:, None]) & 0xF     # [BK, BN] 0..15
        scale = tl.load(scales_ptr + cols * stride_sn + group * stride_sg,
                        mask=col_ok, other=0.0)               # [BN]
        zero = tl.load(zeros_ptr + cols * stride_sn + group * stride_sg,
                       mask=col_ok, other=0.0)                # [BN]
        w = (q.to(tl.float32) - zero[None, :]) * scale[None, :]          # [BK, BN] fp32
        acc += dot(x, w.to(x.dtype), DOT_PRECISION, UPCAST)             # [BM, BN]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def check_int4_gemm(x, qweight, scales, zeros, group_size: int) -> None:
    """ValueError naming the fix for inputs the kernel cannot take."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}: flatten the leading "
                         "dimensions first (x.reshape(-1, K))")
    K = x.shape[1]
    if K % group_size:
        fits = [g for g in GROUP_SIZES if K % g == 0] or "none: pad K with zero columns"
        raise ValueError(f"K = {K} is not a multiple of group_size {group_size}: quantize with a "
                         f"group size that divides K ({fits})")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    N = qweight.shape[0]
    if qweight.dtype != torch.uint8 or tuple(qweight.shape) != (N, K // 2):
        raise ValueError(f"qweight must be uint8 [N, K/2] = [{N}, {K // 2}] (two nibbles per "
                         f"byte, rtn.pack_int4), got {qweight.dtype} {tuple(qweight.shape)}")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.dtype != torch.float32 or tuple(t.shape) != (N, K // group_size):
            raise ValueError(f"{name} must be float32 [N, K/g] = [{N}, {K // group_size}], got "
                             f"{t.dtype} {tuple(t.shape)}")
    if scales.stride() != zeros.stride():
        raise ValueError("scales and zeros must have the same strides: pass .contiguous() ones")
    devices = {t.device for t in (x, qweight, scales, zeros)}
    if len(devices) > 1:
        raise ValueError(f"x, qweight, scales and zeros must be on one device, got {devices}")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(
            "int4_gemm on CPU tensors needs Triton's interpreter: set the environment variable "
            "TRITON_INTERPRET=1 before minillm.kernels first runs a Triton kernel (it is "
            f"{os.environ.get('TRITON_INTERPRET')!r}), or move the tensors to CUDA")


def block_sizes(M: int, group_size: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16 rows (tl.dot's minimum) for decode batches, more for
    prefill; a K-tile of at most 64 columns; smaller tiles for fp32 activations. Each choice
    keeps the tiles in registers (no spills: tests/test_int4_gemm.py compiles them for sm_90)."""
    if dtype == torch.float32:                   # exact fp32 products: no tensor cores, small tiles
        return (16 if M <= 16 else 32), 32, min(group_size, 32)
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    return block_m, 32 if M <= 16 else 64, min(group_size, 64)


def launch(x, qweight, scales, zeros, out, group_size: int):
    """(grid, positional args, keyword args) of the kernel launch (compile_check uses it too)."""
    M, K = x.shape
    N = qweight.shape[0]
    block_m, block_n, block_k = block_sizes(M, group_size, x.dtype)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    args = (x, qweight, scales, zeros, out, M, N, K,
            *x.stride(), *qweight.stride(), *scales.stride(), *out.stride())
    kwargs = dict(GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                  num_warps=4, num_stages=3, **dot_options(x.dtype))
    return grid, args, kwargs


def int4_gemm(x, qweight, scales, zeros, group_size: int):
    """x [M, K] @ dequant(qweight, scales, zeros)^T -> [M, N] in x's dtype (fp32 accumulation).

    qweight [N, K/2] uint8 (rtn.pack_int4's nibble order), scales / zeros [N, K/g] fp32."""
    check_int4_gemm(x, qweight, scales, zeros, group_size)
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype, device=x.device)   # [M, N]
    if out.numel() == 0:
        return out
    grid, args, kwargs = launch(x, qweight, scales, zeros, out, group_size)
    _int4_gemm_kernel[grid](*args, **kwargs)
    return out
