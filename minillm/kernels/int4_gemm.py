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

The tiling. Program (i, j, s) owns the output tile y[i*BM : (i+1)*BM, j*BN : (j+1)*BN] over
the s-th of SPLIT_K equal slices of K, and walks its slice in tiles of BK columns. BK is the
group size or a power-of-two divisor of it (at most 64, so the expanded tiles fit in registers),
so a whole tile lies inside one group: one scale and one zero point per output column per step.

    for each K-tile ks of this program's slice (group = ks.start // g):
        bytes    = qweight[cols, ks.start/2 : ks.stop/2]   [BN, BK/2]  contiguous along K
        lo, hi   = bytes & 0xF, bytes >> 4                 [BN, BK/2]  columns 2j and 2j + 1
        w_lo     = (lo - zero[cols, group]) * scale[cols, group]      fp32, then activation dtype
        w_hi     = (hi - zero[cols, group]) * scale[cols, group]
        acc     += x[rows, even columns of ks] @ w_lo^T    [BM, BN]  fp32 accumulator
                 + x[rows, odd columns of ks]  @ w_hi^T               (tensor cores)
    y[rows, cols] = acc   (SPLIT_K = 1: in the activation dtype; else fp32 partials, summed after)

Two choices decide the speed on a GPU, both measured on an H100 (benchmarks/README.md):
  * each program reads its weight tile row by row, BK/2 consecutive bytes per output column,
    and splits every byte into its two nibbles once. (The first version of this kernel loaded a
    [BK, BN] tile whose neighbouring elements lay K/2 bytes apart, and loaded each byte twice,
    once per nibble: scattered reads that left most of each memory transaction unused.)
  * split-K: a decode product on a 2048 x 2048 layer has only N / BN = 32 column tiles, too few
    programs to keep 132 SMs streaming. `launch` cuts K into SPLIT_K slices so that there are
    about two programs per SM; each slice writes an fp32 partial [M, N] and one `sum` adds them
    (deterministic, unlike atomic adds, so a CUDA graph and the eager step give the same bits).

tl.dot needs at least 16 rows, so a tile of 2 to 16 rows is padded to 16 with zeros: the padding
costs tensor-core cycles that are idle anyway, never memory traffic (masked loads read nothing).
One row (batch-1 decode) skips the tensor cores: BLOCK_M = 1 multiplies the fp32 weights by the
row and sums along K, which avoids moving the weight tile into the tensor-core operand layout.

Measured (H100, 2026-11-25, benchmarks/README.md): the first version of this kernel ran the
Llama-3.2-1B engine at batch 1 at 5.1 ms per step against bf16's 2.2 ms; this one at 2.5-2.7
ms. It still reads its int4 bytes at 0.3-0.8 TB/s where cuBLAS streams bf16 at 1.3-2.6, so it
stays slower than bf16 (0.68-0.97x per product at one row): quantization pays on a GPU only
with a kernel that keeps the memory system as busy as a bf16 GEMM does (Marlin-class).

What a production kernel adds (Marlin in vLLM, torchao's tinygemm, and the kernels behind
GPTQ/AWQ checkpoints), none of it here:
  * a weight layout shuffled offline so that one wide load per thread brings exactly the nibbles
    the tensor-core instruction wants in its registers, and the nibble-to-bf16 conversion done
    with a few bit tricks (or a lookup) instead of shifts, subtractions and multiplies;
  * fp16/bf16 scales and zeros (here fp32: 8 bytes per group, 25% on top of the nibbles at
    g = 64), often with the zero folded in as scale * zero so the inner loop is one FMA;
  * split-K reduced in the same kernel (a semaphore or a "stream-K" schedule) instead of a
    second one, and autotuned tile sizes per shape and GPU.

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
    out_ptr,                        # [M, N] output (activations' dtype), or [SPLIT_K, M, N] fp32
    M, N, K_PER_SPLIT,              # K_PER_SPLIT: the K-slice of one program, a multiple of BK
    stride_xm, stride_xk,
    stride_qn, stride_qk,
    stride_sn, stride_sg,           # scales and zeros share strides (both contiguous [N, K/g])
    stride_os, stride_om, stride_on,
    GROUP_SIZE: tl.constexpr,       # g: columns that share one scale / zero point
    BLOCK_K: tl.constexpr,          # the K-tile: g or a power-of-two divisor of it
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,   # see paged_decode.dot
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)            # [BM]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)            # [BN]
    half = tl.arange(0, BLOCK_K // 2)                         # [BK/2] byte j holds columns 2j, 2j+1
    row_ok = rows < M
    col_ok = cols < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(0, K_PER_SPLIT // BLOCK_K):
        k0 = pid_s * K_PER_SPLIT + tile * BLOCK_K             # this tile's first input column
        group = k0 // GROUP_SIZE                              # one group holds the whole tile
        packed = tl.load(qweight_ptr + cols[:, None] * stride_qn
                         + (k0 // 2 + half)[None, :] * stride_qk,
                         mask=col_ok[:, None], other=0).to(tl.int32)     # [BN, BK/2]
        scale = tl.load(scales_ptr + cols * stride_sn + group * stride_sg,
                        mask=col_ok, other=0.0)[:, None]                  # [BN, 1]
        zero = tl.load(zeros_ptr + cols * stride_sn + group * stride_sg,
                       mask=col_ok, other=0.0)[:, None]                   # [BN, 1]
        x_even = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + 2 * half)[None, :] * stride_xk,
                         mask=row_ok[:, None], other=0.0)                 # [BM, BK/2]
        x_odd = tl.load(x_ptr + rows[:, None] * stride_xm
                        + (k0 + 2 * half + 1)[None, :] * stride_xk,
                        mask=row_ok[:, None], other=0.0)                  # [BM, BK/2]
        w_lo = ((packed & 0xF).to(tl.float32) - zero) * scale             # [BN, BK/2] fp32
        w_hi = ((packed >> 4).to(tl.float32) - zero) * scale
        if BLOCK_M == 1:            # one row (batch-1 decode): multiply and add, no tensor core
            acc += tl.sum(w_lo * x_even.to(tl.float32) + w_hi * x_odd.to(tl.float32),
                          axis=1)[None, :]                                # [1, BN]
        else:
            acc += dot(x_even, tl.trans(w_lo.to(x_even.dtype)), DOT_PRECISION, UPCAST)  # [BM, BN]
            acc += dot(x_odd, tl.trans(w_hi.to(x_odd.dtype)), DOT_PRECISION, UPCAST)
    tl.store(out_ptr + pid_s * stride_os + rows[:, None] * stride_om + cols[None, :] * stride_on,
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
    """(BLOCK_M, BLOCK_N, BLOCK_K): 1 row for one row (no tensor cores), 16 rows (tl.dot's
    minimum) for 2-16, more for prefill; a K-tile of at most 64 columns; smaller tiles for fp32
    activations. Each choice keeps the tiles in registers (no spills: tests/test_int4_gemm.py
    compiles them for sm_90)."""
    if M == 1:                                   # one row: a dot product per column, in fp32
        return 1, 128, min(group_size, 64)       # (128 x 8 warps: the H100 sweep's fastest)
    if dtype == torch.float32:                   # exact fp32 products: no tensor cores, small tiles
        return (16 if M <= 16 else 32), 32, min(group_size, 32)
    block_m = 16 if M <= 16 else (32 if M <= 32 else 64)
    return block_m, 64, min(group_size, 64)


SM_COUNT = {}                       # device index -> multiprocessors (asked once)
OVERRIDE = {}                       # a benchmark's choice of block_n / num_warps / num_stages /
                                    # split_k for every call (empty: the defaults here)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 132 (an H100) elsewhere, so the interpreter and
    ahead-of-time compiles see the split an H100 would get."""
    if device.type != "cuda":
        return 132
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in SM_COUNT:
        SM_COUNT[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return SM_COUNT[i]


def split_k_for(tiles: int, k_tiles: int, sms: int) -> int:
    """How many K-slices: enough programs for about two per SM, each slice a whole number of
    K-tiles (the largest divisor of k_tiles not above what is wanted)."""
    want = max(1, -(-2 * sms // tiles))
    return max(d for d in range(1, min(want, k_tiles) + 1) if k_tiles % d == 0)


def launch(x, qweight, scales, zeros, out, group_size: int, split_k=None, block_n=None,
           num_warps=None, num_stages=3):
    """(grid, positional args, keyword args) of the kernel launch (compile_check uses it too).
    out is [M, N] when split_k is 1, else [split_k, M, N] fp32; `plan` picks split_k."""
    M, K = x.shape
    N = qweight.shape[0]
    block_m, bn, block_k = block_sizes(M, group_size, x.dtype)
    block_n = block_n or bn
    split_k = split_k or (out.shape[0] if out.dim() == 3 else 1)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split_k)
    o = out if out.dim() == 3 else out[None]
    args = (x, qweight, scales, zeros, out, M, N, K // split_k,
            *x.stride(), *qweight.stride(), *scales.stride(), *o.stride())
    kwargs = dict(GROUP_SIZE=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                  num_warps=num_warps or 8, num_stages=num_stages, **dot_options(x.dtype))
    return grid, args, kwargs


def plan(x, qweight, group_size: int, split_k=None, block_n=None) -> int:
    """split_k for this product: given, or enough K-slices for about two programs per SM."""
    if split_k is not None:
        return split_k
    M, K = x.shape
    block_m, bn, block_k = block_sizes(M, group_size, x.dtype)
    tiles = triton.cdiv(M, block_m) * triton.cdiv(qweight.shape[0], block_n or bn)
    return split_k_for(tiles, K // block_k, num_sms(x.device))


def int4_gemm(x, qweight, scales, zeros, group_size: int, split_k=None, **config):
    """x [M, K] @ dequant(qweight, scales, zeros)^T -> [M, N] in x's dtype (fp32 accumulation).

    qweight [N, K/2] uint8 (rtn.pack_int4's nibble order), scales / zeros [N, K/g] fp32.
    split_k: K-slices (None: enough for about two programs per SM); config: block_n, num_warps,
    num_stages (benchmarks/bench_int4_gemm.py --sweep tries them)."""
    check_int4_gemm(x, qweight, scales, zeros, group_size)
    if OVERRIDE:
        config = {**OVERRIDE, **config}
    chosen = config.pop("split_k", None)
    split_k = chosen if split_k is None else split_k
    M, N = x.shape[0], qweight.shape[0]
    if M == 0 or N == 0:
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    split_k = plan(x, qweight, group_size, split_k, config.get("block_n"))
    block_k = block_sizes(M, group_size, x.dtype)[2]
    if (x.shape[1] // block_k) % split_k:
        raise ValueError(f"split_k={split_k} must divide the {x.shape[1] // block_k} K-tiles")
    if split_k == 1:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)                     # [M, N]
    else:
        out = torch.empty(split_k, M, N, dtype=torch.float32, device=x.device)      # partials
    grid, args, kwargs = launch(x, qweight, scales, zeros, out, group_size, split_k, **config)
    _int4_gemm_kernel[grid](*args, **kwargs)
    return out if split_k == 1 else out.sum(0).to(x.dtype)
