"""Round-to-nearest (RTN) weight quantization (chapter 09): the formats, in plain PyTorch.

Two weight-only formats, the ones vLLM and llama.cpp serve most:

int8, symmetric, one scale per output channel (row of W [N, K]):
    scale[n] = max_k |W[n, k]| / 127          q = clamp(round(W / scale), -127, 127)
    W ~ q * scale

int4, asymmetric, one scale and one zero point per group of `group_size` input columns:
    lo, hi = min and max of the group (lo <= 0 <= hi: zero stays exactly representable)
    scale = (hi - lo) / 15                    zero = round(-lo / scale)      (0 .. 15)
    q = clamp(round(W / scale) + zero, 0, 15) W ~ (q - zero) * scale

A group's range (hi - lo), not its largest magnitude, sets the step: an asymmetric group spends
all 16 levels between its own min and max. One outlier widens only its own group's step.

Two 4-bit values share a byte: `pack_int4` puts column 2j in the LOW nibble and 2j + 1 in the
HIGH nibble. Other formats choose otherwise: a GGUF Q4_0/Q4_1 block of 32 puts value i in the
low nibble of byte i and value i + 16 in its high nibble (see gguf.py). Reading one layout
with the other's order scrambles every block without any error message.
"""
from __future__ import annotations

import torch

INT4_GROUP_SIZES = (32, 64, 128)


def check_group_size(group_size: int, in_features: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES} (int4 group-wise), got "
                         f"{group_size!r}")
    if in_features % group_size:
        fits = [g for g in INT4_GROUP_SIZES if in_features % g == 0] or "none fits"
        raise ValueError(f"group_size {group_size} does not divide the layer's {in_features} "
                         f"input features; pick a group size that divides it ({fits})")


def quantize_int8(w: torch.Tensor):
    """W [N, K] -> (q int8 [N, K], scale float32 [N]): symmetric, per output channel."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127                  # [N]
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]                           # [N, K]


def int4_params(w: torch.Tensor):
    """Scale and zero point of each group. w [N, G, g] -> (scale [N, G], zero [N, G] int)."""
    lo = w.amin(dim=-1).clamp(max=0.0)                                  # [N, G]
    hi = w.amax(dim=-1).clamp(min=0.0)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = torch.clamp(torch.round(-lo / scale), 0, 15)
    return scale, zero


def quantize_int4(w: torch.Tensor, group_size: int = 64):
    """W [N, K] -> (q uint8 [N, K] in 0..15, scale float32 [N, K/g], zero float32 [N, K/g])."""
    N, K = w.shape
    check_group_size(group_size, K)
    g = w.float().reshape(N, K // group_size, group_size)               # [N, G, g]
    scale, zero = int4_params(g)
    q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 15)
    return q.reshape(N, K).to(torch.uint8), scale, zero


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(q [N, K], scale/zero [N, K/g]) -> W [N, K] float32."""
    N, K = q.shape
    g = K // scale.shape[1]
    qg = q.float().reshape(N, -1, g)                                    # [N, G, g]
    return ((qg - zero[..., None]) * scale[..., None]).reshape(N, K)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] values 0..15 -> [N, K/2] uint8: column 2j low nibble, 2j + 1 high nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> q [N, K] uint8 (pack_int4's inverse)."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], -1)
