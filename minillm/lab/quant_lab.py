"""Number formats, scale granularity, activation outliers: the measurements of lecture 09.

    format_values(name)             every finite value a float8 format can hold
    round_trip(x, name)             x through a format and back (fp8 / int8 / int4 with a
                                    per-tensor scale; bf16 / fp16 as they are)
    granularity_errors(w)           int4 error with one scale per tensor, per row, per group
    q4_1_round_trip(w)              llama.cpp's Q4_1 rule: blocks of 32, fp16 step and minimum
    input_stats(model, ids, name)   per-channel max |x| of the inputs of one kind of linear
    w8a8_error(x, w, alpha)         int8 activations x int8 weights, with SmoothQuant's
                                    per-channel migration (alpha) or without (alpha=None)
"""
from __future__ import annotations

import torch

from ..quant.rtn import dequantize_int4, quantize_int4

FLOAT8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def format_values(name: str) -> torch.Tensor:
    """Sorted finite values of a float8 format (all 256 bit patterns decoded)."""
    v = torch.arange(256, dtype=torch.uint8).view(FLOAT8[name]).float()
    return v[torch.isfinite(v)].unique()


def round_trip(x: torch.Tensor, name: str) -> torch.Tensor:
    """x (float32) stored in `name` and read back. fp8 and the integer formats get one scale for
    the whole tensor that maps max|x| onto the format's largest value."""
    x = x.float()
    if name in ("bf16", "fp16"):
        return x.to(torch.bfloat16 if name == "bf16" else torch.float16).float()
    if name in FLOAT8:
        top = torch.finfo(FLOAT8[name]).max
        s = x.abs().max() / top
        return (x / s).to(FLOAT8[name]).float() * s
    levels = {"int8": 127, "int4": 7}[name]
    s = x.abs().max() / levels
    return torch.clamp(torch.round(x / s), -levels, levels) * s


def rel_error(x: torch.Tensor, y: torch.Tensor) -> float:
    """RMS error relative to the RMS of x."""
    return float((x.float() - y.float()).pow(2).mean().sqrt() / x.float().pow(2).mean().sqrt())


def granularity_errors(w: torch.Tensor, groups=(128, 64, 32)) -> dict:
    """Relative RMS error of asymmetric int4 with one scale per tensor, per output row, per
    group of input columns."""
    N, K = w.shape
    flat = w.reshape(1, -1)                        # per tensor: one group holding everything
    out = {"per-tensor": rel_error(w, _int4_one_group(flat).reshape(N, K)),
           "per-channel": rel_error(w, _int4_one_group(w))}
    for g in groups:
        if K % g == 0 and g in (32, 64, 128):
            out[f"group {g}"] = rel_error(w, dequantize_int4(*quantize_int4(w, g)))
    return out


def _int4_one_group(rows: torch.Tensor) -> torch.Tensor:
    """Asymmetric int4 with one scale/zero per row of `rows` [R, K]."""
    lo, hi = rows.amin(1, keepdim=True).clamp(max=0), rows.amax(1, keepdim=True).clamp(min=0)
    s = ((hi - lo) / 15).clamp(min=1e-8)
    z = torch.round(-lo / s)
    return (torch.clamp(torch.round(rows / s) + z, 0, 15) - z) * s


def q4_1_round_trip(w: torch.Tensor) -> torch.Tensor:
    """Q4_1's rule on W [N, K]: each block of 32 weights of a row gets d = (max - min) / 15 and
    m = min, both stored in float16; code = round((w - m) / d)."""
    N, K = w.shape
    b = w.float().reshape(N, K // 32, 32)
    m = b.amin(-1, keepdim=True).half().float()
    d = ((b.amax(-1, keepdim=True) - m) / 15).half().float().clamp(min=1e-12)
    code = torch.clamp(torch.round((b - m) / d), 0, 15)
    return (d * code + m).reshape(N, K)


@torch.no_grad()
def input_stats(model, ids: torch.Tensor, name: str = "qkv_proj"):
    """Per-channel max |input| of every layer's linear called `name`, and the inputs of layer 0's
    (for experiments): ([L, K] maxima, [rows, K] layer-0 inputs)."""
    maxima, first = [], []

    def hook(mod, inp, out):
        x = inp[0].reshape(-1, inp[0].shape[-1]).float()
        maxima.append(x.abs().amax(0))
        if not first:
            first.append(x)

    handles = [getattr_path(layer, name).register_forward_hook(hook) for layer in model.layers]
    try:
        for row in ids:
            model(row[None])
    finally:
        for h in handles:
            h.remove()
    L = len(model.layers)
    stacked = torch.stack(maxima).view(len(ids), L, -1).amax(0)          # [L, K]
    return stacked, first[0]


def getattr_path(module, name: str):
    for m_name, m in module.named_modules():
        if m_name.split(".")[-1] == name:
            return m
    raise ValueError(f"no module called {name!r} in {type(module).__name__}")


def w8a8_error(x: torch.Tensor, w: torch.Tensor, alpha=None) -> float:
    """Relative error of x @ w.T when x is int8 per tensor and w int8 per output channel.
    alpha: SmoothQuant's migration strength (x / s, w * s with s_j = max|x_j|^a / max|w_j|^(1-a)),
    None for no smoothing."""
    ref = x @ w.t()
    if alpha is not None:
        s = (x.abs().amax(0).clamp(min=1e-5) ** alpha
             / w.abs().amax(0).clamp(min=1e-5) ** (1 - alpha))             # [K]
        x, w = x / s, w * s
    xs = x.abs().max() / 127
    xq = torch.clamp(torch.round(x / xs), -127, 127) * xs
    ws = w.abs().amax(1, keepdim=True) / 127
    wq = torch.clamp(torch.round(w / ws), -127, 127) * ws
    return rel_error(ref, xq @ wq.t())
