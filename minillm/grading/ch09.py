"""Graders for the chapter 09 problem set (solutions/09_quantization.ipynb).

    ch09.check_quantize_int4(quantize_int4)          # (a) group-wise int4 with zero points,
                                                     #     packed two per byte
    ch09.check_decode_q4_1(decode_q4_1)              # (b) llama.cpp's Q4_1 blocks -> float32
    ch09.check_deployment_estimate(deployment_estimate)  # (c) bytes per decode step and the
                                                     #     memory-bound speedup of a format

References: minillm.quant.rtn (quantize_int4, pack_int4) and minillm.quant.gguf.decode_q4_1;
the deployment estimate is written out here (weights + scale/zero metadata, bytes / bandwidth).
The Q4_1 cases are built by an encoder in this file, so no model or GGUF file is needed.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..quant.gguf import decode_q4_1 as _ref_decode
from ..quant.rtn import pack_int4, quantize_int4 as _ref_quantize
from .core import Check, Exercise, Problem, expect_value_error

# =========================================================================== (a) quantize_int4


def _call_quant(fn, w, g):
    out = fn(w.clone(), g)
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise Problem(f"quantize_int4(w {list(w.shape)}, {g}) returned {type(out).__name__}; "
                      "return (packed, scale, zero)")
    packed, scale, zero = out
    N, K = w.shape
    for name, t, shape in (("packed", packed, (N, K // 2)), ("scale", scale, (N, K // g)),
                           ("zero", zero, (N, K // g))):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            raise Problem(f"w {list(w.shape)}, group {g}: {name} is "
                          f"{list(getattr(t, 'shape', [])) or type(t).__name__}; expected "
                          f"shape {list(shape)}")
    if packed.dtype != torch.uint8:
        raise Problem(f"packed has dtype {packed.dtype}; store two 4-bit codes per torch.uint8")
    return packed, scale.float(), zero.float()


def _want(w, g):
    q, s, z = _ref_quantize(w, g)
    return pack_int4(q), s, z


def _weights(seed, N=8, K=128):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=g) * 0.5 + 0.1


def _qa_shapes(fn):
    _call_quant(fn, _weights(0), 32)


def _qa_scale(fn):
    w = _weights(1)
    _, scale, _ = _call_quant(fn, w, 32)
    _, want, _ = _want(w, 32)
    if not torch.allclose(scale, want, rtol=1e-4, atol=1e-7):
        grp = w.reshape(8, -1, 32)
        hint = ""
        if torch.allclose(scale, grp.amax(-1) / 15, rtol=1e-4):
            hint = " -- that is max / 15: the step spans the group's RANGE, (max - min) / 15"
        elif torch.allclose(scale, grp.abs().amax(-1) / 7.5, rtol=1e-4) or \
                torch.allclose(scale, grp.abs().amax(-1) / 7, rtol=1e-4):
            hint = (" -- that is the symmetric step from max|w|: with a zero point the 16 "
                    "levels cover [min, max], so (max - min) / 15")
        raise Problem(f"group 0 of row 0: scale {float(scale[0, 0]):.5f}, expected "
                      f"{float(want[0, 0]):.5f} = (max - min) / 15 with min <= 0 <= max{hint}")


def _unpack(packed):
    return torch.stack((packed & 15, packed >> 4), -1).reshape(packed.shape[0], -1)


def _qa_rounding(fn):
    w = _weights(2)
    packed, scale, zero = _call_quant(fn, w, 32)
    want_p, want_s, want_z = _want(w, 32)
    if not torch.allclose(scale, want_s, rtol=1e-4):
        raise Problem("the scales are off (see the scale check); fix them first")
    q = _unpack(packed).float()
    swapped = torch.stack((packed >> 4, packed & 15), -1).reshape(8, -1).float()
    want_q = _unpack(want_p).float()
    if torch.equal(q, want_q) or torch.equal(swapped, want_q):
        if not torch.allclose(zero, want_z):
            raise Problem("codes right but zero points differ: zero = round(-min / scale)")
        return
    floor = torch.clamp(torch.floor(w.reshape(8, -1, 32) / want_s[..., None]) + want_z[..., None],
                        0, 15).reshape(8, -1)
    hint = (" -- that is floor (or truncation): round to the NEAREST level, torch.round"
            if torch.equal(q, floor) or torch.equal(swapped, floor) else "")
    bad = int((q != want_q).float().sum())
    raise Problem(f"{bad} of {q.numel()} codes differ from round(w / scale) + zero{hint}")


def _qa_nibbles(fn):
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = -1.5, 1.5                         # codes at the ends of the range
    packed, _, _ = _call_quant(fn, w, 32)
    want, _, _ = _want(w, 32)
    if int(packed[0, 0]) != int(want[0, 0]):
        lo, hi = int(want[0, 0]) & 15, int(want[0, 0]) >> 4
        hint = (" -- the nibbles are swapped: column 2j goes in the LOW 4 bits, 2j + 1 in the "
                "high 4 bits" if int(packed[0, 0]) == (lo << 4 | hi) else "")
        raise Problem(f"w[0, :2] = [-1.5, 1.5] packs to byte {int(packed[0, 0]):#04x}, expected "
                      f"{int(want[0, 0]):#04x} (code {lo} low, code {hi} high){hint}")


def _qa_matches(fn):
    for seed, g in ((3, 32), (4, 64), (5, 128)):
        w = _weights(seed, 6, 256)
        w[2, 7] = 9.0                                     # an outlier
        packed, scale, zero = _call_quant(fn, w, g)
        wp, ws, wz = _want(w, g)
        if not (torch.equal(packed, wp) and torch.allclose(scale, ws, rtol=1e-4)
                and torch.allclose(zero, wz)):
            raise Problem(f"group {g}, w [6, 256] with an outlier: your packed/scale/zero differ "
                          "from minillm.quant's")


def _qa_bad_group(fn):
    expect_value_error(lambda: fn(_weights(11, N=4, K=96), 64),
                       "quantize_int4(w [4, 96], group_size=64) (64 does not divide 96)")


QUANT = Exercise("ch09.quantize_int4", "quantize_int4", (
    Check("returns packed [N, K/2] uint8, scale and zero [N, K/g]", _qa_shapes),
    Check("scale = (max - min) / 15 per group", _qa_scale),
    Check("codes round to the nearest level", _qa_rounding),
    Check("nibble order: column 2j low, 2j + 1 high", _qa_nibbles),
    Check("matches minillm.quant at groups 32, 64, 128", _qa_matches),
    Check("a group size that does not divide K raises ValueError", _qa_bad_group),
))


def check_quantize_int4(quantize_int4, time_limit=None):
    return QUANT.check(quantize_int4, time_limit)


# =========================================================================== (b) decode_q4_1

def encode_q4_1(w: torch.Tensor) -> np.ndarray:
    """W [N, K] -> Q4_1 bytes (blocks of 32: fp16 d, fp16 m, 16 bytes of nibbles)."""
    b = w.float().reshape(-1, 32).numpy()
    m = b.min(1, keepdims=True).astype(np.float16)
    d = ((b.max(1, keepdims=True) - m.astype(np.float32)) / 15).astype(np.float16)
    safe = np.where(d == 0, 1, d).astype(np.float32)
    code = np.clip(np.round((b - m.astype(np.float32)) / safe), 0, 15).astype(np.uint8)
    qs = code[:, :16] | (code[:, 16:] << 4)
    return np.concatenate((d.view(np.uint8), m.view(np.uint8), qs), axis=1).reshape(-1)


def _call_decode(fn, raw, shape):
    out = fn(raw.copy(), shape)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape):
        raise Problem(f"decode_q4_1(raw {raw.nbytes} bytes, {shape}) returned "
                      f"{list(getattr(out, 'shape', [])) or type(out).__name__}; return a "
                      f"float32 tensor of shape {list(shape)}")
    return out.float()


def _one_block():
    codes = np.arange(32, dtype=np.uint8) % 16                 # 0..15, 0..15
    d, m = np.float16(0.25), np.float16(-1.0)
    qs = codes[:16] | (codes[16:] << 4)
    raw = np.concatenate((np.array([d]).view(np.uint8), np.array([m]).view(np.uint8), qs))
    return raw, torch.tensor(codes, dtype=torch.float32) * 0.25 - 1.0


def _qb_shape(fn):
    raw, _ = _one_block()
    got = _call_decode(fn, raw, (1, 32))
    if not bool(torch.isfinite(got).all()):
        raise Problem("the decoded weights hold NaN or inf; a Q4_1 block always decodes to "
                      "finite numbers (d * code + m)")


def _qb_one_block(fn):
    raw, want = _one_block()
    got = _call_decode(fn, raw, (1, 32))[0]
    if torch.allclose(got, want):
        return
    hint = ""
    if torch.allclose(got, want + 1.0):
        hint = " -- the minimum m is missing: weight = d * code + m"
    elif torch.allclose(got, torch.arange(32).float() % 16 * -1.0 + 0.25):
        hint = " -- d and m are swapped: d (the step) comes first, then m"
    raise Problem(f"the block d=0.25, m=-1, codes 0..15, 0..15 decodes to "
                  f"{[round(float(x), 2) for x in got[:4]]}..., expected "
                  f"{[round(float(x), 2) for x in want[:4]]}...{hint}")


def _qb_nibble_order(fn):
    codes = np.zeros(32, dtype=np.uint8)
    codes[1], codes[16] = 15, 7                          # value 1: low nibble of byte 1
    qs = codes[:16] | (codes[16:] << 4)
    raw = np.concatenate((np.array([np.float16(1)]).view(np.uint8),
                          np.array([np.float16(0)]).view(np.uint8), qs))
    got = _call_decode(fn, raw, (1, 32))[0]
    if got[1] == 15 and got[16] == 7 and got.abs().sum() == 22:
        return
    hint = ""
    if got[2] == 15 or got[3] == 15 or got[0] == 7:
        hint = (" -- Q4_1 does not interleave: value i is the low nibble of byte i and value "
                "i + 16 the high nibble of byte i")
    raise Problem(f"codes 15 at value 1 and 7 at value 16 (d=1, m=0) decode to nonzeros at "
                  f"{torch.nonzero(got).flatten().tolist()}, expected [1, 16]{hint}")


def _qb_rows(fn):
    w = torch.randn(3, 96, generator=torch.Generator().manual_seed(9))
    raw = encode_q4_1(w)
    got, want = _call_decode(fn, raw, (3, 96)), _ref_decode(raw, (3, 96))
    if not torch.allclose(got, want, atol=1e-6):
        raise Problem("3 rows of 3 blocks each: values differ from the reference decoder; blocks "
                      "follow each other along a row, then the next row")


def _qb_close_to_source(fn):
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(10))
    got = _call_decode(fn, encode_q4_1(w), (4, 64))
    step = (w.reshape(-1, 32).amax(1) - w.reshape(-1, 32).amin(1)) / 15
    if not ((got - w).reshape(-1, 32).abs() <= step[:, None] * 0.51 + 1e-3).all():
        raise Problem("decoded weights are more than half a step from the weights encoded")


DECODE = Exercise("ch09.decode_q4_1", "decode_q4_1", (
    Check("returns a finite float tensor of the given shape", _qb_shape),
    Check("one block: weight = d * code + m", _qb_one_block),
    Check("nibble order: low nibbles are values 0-15, high 16-31", _qb_nibble_order),
    Check("several blocks and rows in order", _qb_rows),
    Check("within half a step of the encoded weights", _qb_close_to_source),
))


def check_decode_q4_1(decode_q4_1, time_limit=None):
    return DECODE.check(decode_q4_1, time_limit)


# =========================================================================== (c) deployment


def reference_estimate(num_params, bits, group_size, bandwidth, baseline_bits=16,
                       scale_bytes=4):
    """Weights in `bits` plus `scale_bytes` of scale and zero point per group (none without
    groups); a memory-bound decode step reads them all once."""
    if bits not in (4, 8, 16) or num_params <= 0 or bandwidth <= 0:
        raise ValueError("bits must be 4, 8 or 16; num_params and bandwidth positive")
    if group_size is not None and (group_size <= 0 or num_params % group_size):
        raise ValueError("group_size must divide num_params")
    nbytes = num_params * bits / 8 + (num_params // group_size * scale_bytes
                                      if group_size else 0)
    base = num_params * baseline_bits / 8
    return {"weight_bytes": nbytes, "step_seconds": nbytes / bandwidth, "speedup": base / nbytes}


_KEYS = ("weight_bytes", "step_seconds", "speedup")


def _est(fn, *args):
    out = fn(*args)
    if not isinstance(out, dict) or any(k not in out for k in _KEYS):
        raise Problem(f"deployment_estimate{args} returned {type(out).__name__}; return a dict "
                      "with 'weight_bytes', 'step_seconds' and 'speedup'")
    return {k: float(out[k]) for k in _KEYS}


def _est_expect(fn, args, key, why):
    got, want = _est(fn, *args)[key], reference_estimate(*args)[key]
    if math.isclose(got, want, rel_tol=1e-6):
        return
    hints = []
    n, bits, g = args[0], args[1], args[2]
    if key != "speedup" and math.isclose(got, want * 8, rel_tol=1e-6):
        hints.append("that counts bits, not bytes: divide by 8")
    if key == "weight_bytes" and g and math.isclose(got, n * bits / 8, rel_tol=1e-6):
        hints.append("the scales and zero points are missing: scale_bytes per group")
    if key == "speedup" and got and math.isclose(1 / got, want, rel_tol=1e-6):
        hints.append("inverted: the speedup is baseline bytes / quantized bytes")
    if key == "speedup" and g and math.isclose(got, args[4] / bits if len(args) > 4 else 16 / bits,
                                               rel_tol=1e-6):
        hints.append("the metadata bytes count in the quantized step too")
    raise Problem(f"deployment_estimate{args}: {key} = {got:.6g}, expected {want:.6g} ({why})"
                  f"{' -- ' + '; '.join(hints) if hints else ''}")


def _de_baseline(fn):
    _est_expect(fn, (8_000_000_000, 16, None, 3.35e12), "weight_bytes", "bf16: 2 bytes a weight")
    _est_expect(fn, (8_000_000_000, 16, None, 3.35e12), "speedup", "the baseline itself: 1")


def _de_int8(fn):
    _est_expect(fn, (8_000_000_000, 8, None, 3.35e12), "weight_bytes", "int8: 1 byte a weight")


def _de_int4_groups(fn):
    _est_expect(fn, (8_000_000_000, 4, 128, 3.35e12), "weight_bytes",
                "half a byte a weight + 4 bytes per group of 128")


def _de_step(fn):
    _est_expect(fn, (7_000_000_000, 4, 64, 3.35e12), "step_seconds", "bytes / bandwidth")


def _de_speedup(fn):
    _est_expect(fn, (1_000_000_000, 4, 32, 1e11), "speedup",
                "bf16 bytes / int4 bytes with metadata")
    _est_expect(fn, (1_000_000_000, 8, None, 1e11, 32), "speedup", "fp32 baseline: 4x")


def _de_bad(fn):
    expect_value_error(lambda: fn(1_000_000, 3, None, 1e11), "bits=3")
    expect_value_error(lambda: fn(1_000_000, 4, 0, 1e11), "group_size=0")


ESTIMATE = Exercise("ch09.deployment_estimate", "deployment_estimate", (
    Check("bf16 baseline: 2 bytes a weight, speedup 1", _de_baseline),
    Check("int8 without groups: 1 byte a weight", _de_int8),
    Check("int4 with groups counts the scale/zero metadata", _de_int4_groups),
    Check("step time = bytes / bandwidth", _de_step),
    Check("speedup = baseline bytes / quantized bytes", _de_speedup),
    Check("bad bits or group size raises ValueError", _de_bad),
))


def check_deployment_estimate(deployment_estimate, time_limit=None):
    return ESTIMATE.check(deployment_estimate, time_limit)


EXERCISES = (QUANT, DECODE, ESTIMATE)
