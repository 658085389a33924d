"""An fp8 KV cache's two conversions, shared by the twins and the Triton launchers (chapter 09).

A cache tensor of dtype float8_e4m3fn (or float8_e5m2) holds one byte per value. Writing
divides by a per-tensor scale and saturates at the format's largest value; reading multiplies
back:

    stored  = fp8( clamp(x / scale, -FP8_MAX, FP8_MAX) )      store_kv
    x_hat   = float(stored) * scale                            attention

The scale of keys is folded into the softmax scale (q . k_hat = scale_k * (q . stored)) and the
scale of values into the output (sum p v_hat = scale_v * sum p stored), so the attention loops
only convert bytes to floats. One scale per tensor (k_scale, v_scale), as vLLM keeps them: for a
floating-point format the scale only moves the range; every value in the normal range keeps 3
mantissa bits (e4m3) whatever the scale, so a finer (per-head) scale buys precision only for
values that would otherwise fall below the smallest normal (2^-6 for e4m3) or above the largest.
A cache of float32/bfloat16/float16 passes through: scales must then be 1.0.
"""
from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)          # 448 for e4m3fn, 57344 for e5m2


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x (any float dtype) -> the cache's dtype; fp8: divide by scale, saturate, round to
    nearest even. Other dtypes: a plain cast."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    m = fp8_max(dtype)
    return (x.float() / scale).clamp(-m, m).to(dtype)


def dequantize(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Stored values -> float32 (times scale for fp8)."""
    x = x.float()
    return x * scale if scale != 1.0 else x


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (the same bytes): PyTorch's CPU index_copy_ has no fp8 kernel."""
    return t.view(torch.uint8) if is_fp8(t) else t
