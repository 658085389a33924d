"""Quantized linear layers and their matmuls (chapter 09).

A decode step is memory-bound: every weight is read once per step for a handful of rows. Storing
the weights in 8 or 4 bits reads 4 or 8 times fewer bytes than fp32, IF the matmul reads the
packed weights directly. Dequantizing to fp32 first and calling F.linear would read the fp32
copy anyway (and build it every step): no bandwidth saved. So each layer calls a kernel that
takes the packed weights:

    int8: torch.ops.aten._weight_int8pack_mm(x_bf16 [M, K], q int8 [N, K], scale [N])
    int4: torch.ops.aten._weight_int4pack_mm_for_cpu(x_bf16 [M, K], packed, group_size,
                                                     scales_and_zeros [K/g, N, 2])

Both CPU kernels are fast with bfloat16 activations only (with fp32 activations they fall back
to a slow path, on CPUs with native bf16 and without), so the layer casts its input to bf16 and
its output back: the rest of the model keeps its own dtype. The int4 kernel dequantizes as
(q - 8) * scale + z, so our integer zero point becomes z = (8 - zero) * scale (the same numbers,
another bookkeeping). From a few rows on, int8 expands its weight instead (`Int8Linear`).

On a CUDA device int4 runs the Triton dequant-GEMM of `minillm/kernels/int4_gemm.py`: it reads
the same packed nibbles, scales and zero points the twin reads, expands them in registers and
multiplies in the activations' dtype (bf16 on a GPU) with fp32 accumulation. int8 has no GPU
kernel here yet: on a GPU it runs its twin (correct, but it saves no bandwidth).

Every kernel has a plain-PyTorch twin here (`int8_linear_ref`, `int4_linear_ref`): dequantize to
fp32 and multiply. tests/test_quant.py and tests/test_int4_gemm.py check kernel against twin.

Which matmul runs is the layer's choice, by the input's device (`impl=None`): "packed" on a CPU
(when the layer was built there), "triton" on CUDA for int4, "reference" otherwise. Setting a
layer's `impl` to one of IMPLS forces it (the tests run "triton" on a CPU under Triton's
interpreter; `set_impl(model, ...)` sets every quantized layer of a model).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..loader import cpu_has_native_bf16
from ..model import tensor_version
from . import onednn_order
from .rtn import (check_group_size, dequantize_int4, dequantize_int8, pack_int4, quantize_int4,
                  quantize_int8, unpack_int4)


def int8_linear_ref(x, q, scale, bias=None):
    """The twin: x [..., K] @ (q [N, K] * scale [N])^T in fp32 -> [..., N] (x's dtype)."""
    return F.linear(x.float(), dequantize_int8(q, scale),
                    None if bias is None else bias.float()).to(x.dtype)


def int4_linear_ref(x, q, scale, zero, bias=None):
    """The twin: x [..., K] @ dequantize_int4(q, scale, zero)^T in fp32 -> [..., N]."""
    return F.linear(x.float(), dequantize_int4(q, scale, zero),
                    None if bias is None else bias.float()).to(x.dtype)


IMPLS = (None, "packed", "triton", "reference")


# Asked once, at import: the layers ask on every call, and a compiled step's trace reads a
# constant (Dynamo will not trace torch.cpu's own query: the graph would break there).
_NATIVE_BF16 = cpu_has_native_bf16()


def _native_bf16() -> bool:
    return _NATIVE_BF16


def _packed_kernels_here(device) -> bool:
    return torch.device(device).type == "cpu"


class QuantLinear(nn.Module):
    """Shared by the two formats: bias, shapes, the choice of matmul by device."""

    gpu_impl = "reference"                                   # a format with a GPU kernel says so
    opaque_name = None                                       # what a compiled step calls
                                                             # this layer (engine/compiled.py)
    TRACED = False                                           # a compiled step traces `traced`

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)
        self.use_kernel = _packed_kernels_here(linear.weight.device)   # CPU packed buffers built
        self.impl = None

    def choose_impl(self, device: torch.device) -> str:
        """The matmul for inputs on `device`: "packed" (PyTorch's CPU kernels), "triton" (the
        GPU dequant-GEMM) or "reference" (the twin)."""
        if self.impl == "packed" and not self.use_kernel:
            raise ValueError("impl='packed' needs the CPU packed weights, built when the layer is "
                             "quantized on a CPU: quantize on the CPU, or use impl=None")
        if self.impl is not None:
            return self.impl
        if device.type == "cpu":
            return "packed" if self.use_kernel else "reference"
        return self.gpu_impl if device.type == "cuda" else "reference"

    def forward(self, x):                                    # x [..., K] -> [..., N]
        if torch.compiler.is_compiling() and self.opaque_name is not None:   # a compiled step:
            out = self.traced(x) if self.TRACED else None             # engine/compiled.py
            return torch.ops.minillm.product(x, self.opaque_name) if out is None else out
        flat = x.reshape(-1, self.in_features)               # [M, K]
        impl = self.choose_impl(flat.device)
        if impl == "reference":
            out = self.reference(flat)
        else:
            if impl == "packed":                             # the kernel picks its dtype
                out = self.kernel(flat).to(x.dtype)          # [M, N]
            else:
                out = self.triton_kernel(flat)               # [M, N] in x's dtype
            if self.bias is not None:
                out = out + self.bias.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def traced(self, x):
        """What a compiled step traces instead of the opaque op, or None for the opaque op (the
        layer's eager forward, called from the graph). A format that can be traced says how."""
        return None

    def triton_kernel(self, x):
        raise ValueError(f"{type(self).__name__} has no Triton kernel: use impl='reference' "
                         "or None")

    def weight_bytes(self) -> int:
        """Bytes the matmul reads for the weight (quantized values and their scales)."""
        raise NotImplementedError


def set_impl(model, impl) -> None:
    """Force one matmul (an entry of IMPLS; None: by device) on every quantized layer of model."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.impl = impl


class Int8Linear(QuantLinear):
    """Weight-only int8, one scale per output channel."""

    def __init__(self, linear: nn.Linear, qweight=None, scale=None):
        super().__init__(linear)
        if qweight is None:
            qweight, scale = quantize_int8(linear.weight.detach())
        dev = linear.weight.device
        self.register_buffer("qweight", qweight.to(dev))                 # [N, K] int8
        self.register_buffer("scale", scale.float().to(dev))            # [N]
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16).to(dev))

    # aten's int8 kernel dequantizes the weight again for every row it multiplies: its time
    # grows with the rows (30 gate_up layers on a 2-core Xeon: 2.3 ms at 1 row, 12.8 at 16,
    # 24.0 at 32). Expanding the weight once and running one GEMM costs about the same at any
    # row count (8.9 / 10.2 / 11.5 ms in bf16 there), so from a crossover row count on (batched
    # decode, prefill) the layer does that; it reads more bytes than the int8 kernel, which only
    # pays below. Into which dtype depends on the CPU (`expansion`):
    # - with native bf16 (AVX512_BF16 or AMX), bf16. Where oneDNN can take it (`onednn_order`),
    #   the expansion writes into a weight already in oneDNN's packed layout (a copy of the int8
    #   values kept in that order, made at the first such call): the bf16 product on a packed
    #   weight is the fast one at these row counts. The crossover on the course's AMD EPYC
    #   (all 30 layers' products, 2 threads, scratch microbenchmark, medians of 11): aten's
    #   kernel 12.9 ms at 4 rows, 29.5 at 6; the expansion 17.8 and 18.3: DEQUANT_ROWS.
    # - without it (an AVX2-only CPU, as most laptops are), torch emulates bf16, several times
    #   slower than fp32, so the layer expands into fp32 and multiplies there. Writing 4 bytes
    #   per weight makes that expansion dear: on an AMD EPYC without AVX-512 (`bench_quant.py
    #   int8_rows`, all 30 layers, 2 threads, medians of 7) it beat aten's kernel (whose bf16
    #   activations cost nothing there: it widens them itself) from 32 rows on only (113.5 vs
    #   115.2 ms; 167 vs 247 at 64, 86 vs 79 at 24; the bf16 expansion took 426, 816 and 301):
    #   DEQUANT_ROWS_FP32.
    DEQUANT_ROWS = 5
    DEQUANT_ROWS_FP32 = 32
    EXPAND_DTYPE = None                      # None: by the CPU (above); or a dtype, forced
    PACKED_ORDER = True                      # False: expand to a plain [N, K] bf16 matrix

    @classmethod
    def expansion(cls) -> tuple:
        """(dtype the weight expands into, rows from which it does) on this CPU."""
        dtype = cls.EXPAND_DTYPE or (torch.bfloat16 if _native_bf16() else torch.float32)
        return dtype, cls.DEQUANT_ROWS if dtype == torch.bfloat16 else cls.DEQUANT_ROWS_FP32

    _PACKED_STATE = ("_packed_q", "_packed_key")

    def __getstate__(self):
        """Copies and pickles leave the packed-order copy behind (remade on first use)."""
        state = dict(super().__getstate__())
        for k in self._PACKED_STATE:
            state.pop(k, None)
        return state

    def packed_order(self):
        """qweight's values in oneDNN's packed order (remade when qweight changes), or None
        where that path is not available here."""
        if not (self.PACKED_ORDER and onednn_order.available()):
            return None
        q = self.qweight
        key = (q.data_ptr(), tensor_version(q), tuple(q.shape))
        if self.__dict__.get("_packed_key") != key:
            self.__dict__["_packed_key"] = key
            self.__dict__["_packed_q"] = onednn_order.pack_int8(q)
        return self.__dict__["_packed_q"]

    def kernel(self, x):                                     # x [M, K] -> [M, N]
        dtype, rows = self.expansion()
        if x.shape[0] < rows:                                # bf16 in, bf16 out
            return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight,
                                                      self.scale_bf16)
        return self.expanded_product(x, dtype)

    def expanded_product(self, x, dtype):                    # x [M, K] -> [M, N] bf16
        """The weight expanded into `dtype` (bf16 or fp32) and one product."""
        if dtype == torch.float32:                           # no native bf16 (see above):
            x = x.to(torch.bfloat16).float()                 # the kernel's numbers (bf16 in,
            out = F.linear(x, self.qweight.float()) * self.scale_bf16.float()   # bf16 scales,
            return out.to(torch.bfloat16)                    # bf16 out), so that a batch and
                                                             # a single row agree
        x = x.to(dtype)
        packed_q = None if torch.compiler.is_compiling() else self.packed_order()
        if packed_q is not None:                             # (a trace takes the plain path:
                                                             # the scratch is raw memory)
            out = onednn_order.product(x, packed_q, self.out_features, self.in_features)
        else:
            out = F.linear(x, self.qweight.to(dtype))
        return out * self.scale_bf16

    def reference(self, x):
        return int8_linear_ref(x, self.qweight, self.scale, self.bias)

    def dequantized_weight(self):
        return dequantize_int8(self.qweight, self.scale)

    def weight_bytes(self) -> int:
        return self.qweight.nbytes + self.scale_bf16.nbytes

    def extra_repr(self):
        return f"{self.in_features} -> {self.out_features}, int8 per-channel"


class Int4Linear(QuantLinear):
    """Weight-only int4, asymmetric, one scale and zero point per group of input columns."""

    gpu_impl = "triton"

    def __init__(self, linear: nn.Linear, group_size: int = 64, q=None, scale=None, zero=None):
        super().__init__(linear)
        check_group_size(group_size, linear.in_features)
        if q is None:
            q, scale, zero = quantize_int4(linear.weight.detach(), group_size)
        self.group_size = group_size
        dev = linear.weight.device
        self.register_buffer("qweight", pack_int4(q).to(dev))           # [N, K/2] nibbles
        self.register_buffer("qscale", scale.float().to(dev))           # [N, K/g]
        self.register_buffer("zero", zero.float().to(dev))              # [N, K/g]
        if self.use_kernel:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).cpu(), 1)
            z = (8 - zero) * scale                                       # kernel's float zero
            sz = torch.stack((scale, z), dim=-1).transpose(0, 1)        # [K/g, N, 2]
            self.register_buffer("packed", packed)
            self.register_buffer("scales_and_zeros", sz.contiguous().to(torch.bfloat16))

    # aten's int4 kernel, like the int8 one, unpacks the weight again for every row it
    # multiplies. On a CPU without native bf16 (an AMD EPYC with AVX2 only, 2 threads, all 30
    # layers' products, medians of 5: `bench_quant.py int8_rows`' int4 columns, record
    # quant_int4_rows_cpu_amd_avx2_20261207.json) it was level with fp32 at 16 rows (48.7 vs
    # 52.5 ms) and behind it from 32 (116 vs 77); expanding the weight into fp32 once (unpack,
    # scale, zero: about 100 ms for the whole model, four bytes written per weight) and running
    # one fp32 product beat it from 128 rows (422 vs 483 ms; 725 vs 1158 at 256; 339 vs 230 at
    # 64), as in a run minutes before: long prefills, never decodes. So from `DEQUANT_ROWS_FP32`
    # rows on, where bf16 is emulated, the layer expands. With native bf16 the kernel was not
    # measured against an expansion: it keeps the kernel (`EXPAND` forces either way).
    DEQUANT_ROWS_FP32 = 128
    EXPAND = None                            # None: by the CPU (above); True / False: forced

    def expands(self, rows: int) -> bool:
        """Whether a product of `rows` rows expands the weight into fp32 (else the kernel)."""
        on = (not _native_bf16()) if self.EXPAND is None else self.EXPAND
        return on and rows >= self.DEQUANT_ROWS_FP32

    def kernel(self, x):                                     # x [M, K] -> [M, N] bf16
        if self.expands(x.shape[0]):
            return self.expanded_product(x)
        return self.packed_product(x)

    # A compiled step (engine/compiled.py) calls aten's int4 kernel from its graph, the casts
    # to bf16 and back fused into the ops around it, instead of the opaque op whose eager body
    # dispatches reshape, casts and the call one by one for each of the 121 products of a step.
    TRACED = True

    def traced(self, x):                                     # x [..., K] -> [..., N]
        """The packed kernel's call for a compiled step; None (the opaque op: the eager
        numbers of the expansion) where the layer would expand, or has no packed weight."""
        flat = x.reshape(-1, self.in_features)
        if self.choose_impl(flat.device) != "packed" or self.expands(flat.shape[0]):
            return None
        out = self.packed_product(flat).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def packed_product(self, x):                             # x [M, K] -> [M, N] bf16
        """aten's int4 CPU kernel on the packed weight (bf16 activations)."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed,
                                                          self.group_size,
                                                          self.scales_and_zeros)

    def expanded_product(self, x):                           # x [M, K] -> [M, N] bf16
        """The weight expanded into fp32 and one product, with the kernel's numbers: its bf16
        scales and zeros, bf16 activations, bf16 out (a batch and a single row agree)."""
        N, K, g = self.out_features, self.in_features, self.group_size
        sz = self.scales_and_zeros.float()                  # [K/g, N, 2] the kernel's scale
        scale = sz[..., 0].t().contiguous()[..., None]      # [N, K/g, 1]       and float zero
        zero = sz[..., 1].t().contiguous()[..., None]
        w = unpack_int4(self.qweight).to(torch.float32).view(N, K // g, g)   # q in 0..15
        w = w.sub_(8).mul_(scale).add_(zero).view(N, K)     # the kernel's (q - 8) * s + z
        return F.linear(x.to(torch.bfloat16).float(), w).to(torch.bfloat16)

    def triton_kernel(self, x):                              # x [M, K] -> [M, N], x's dtype
        from ..kernels.int4_gemm import int4_gemm            # Triton: imported only when used
        return int4_gemm(x, self.qweight, self.qscale, self.zero, self.group_size)

    def reference(self, x):
        return int4_linear_ref(x, unpack_int4(self.qweight), self.qscale, self.zero, self.bias)

    def dequantized_weight(self):
        return dequantize_int4(unpack_int4(self.qweight), self.qscale, self.zero)

    def weight_bytes(self) -> int:
        """What the kernel reads: packed nibbles and the bf16 scales/zeros."""
        if self.use_kernel:
            return self.packed.nbytes + self.scales_and_zeros.nbytes
        return self.qweight.nbytes + self.qscale.nbytes + self.zero.nbytes

    def extra_repr(self):
        return f"{self.in_features} -> {self.out_features}, int4 group {self.group_size}"
