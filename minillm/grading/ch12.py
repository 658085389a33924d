"""Graders for the chapter 12 problem set (solutions/12_engine_overheads.ipynb).

    ch12.check_predict_step(predict_step)      # (a) a decode step's time from bytes, FLOPs and
                                               #     op count
    ch12.check_fuse_linears(fuse_linears)      # (b) several projections of one input as ONE
                                               #     nn.Linear

(a) predict_step(cfg, batch, context, dtype, bandwidth, flops, num_ops, op_seconds) -> dict with
memory_s, compute_s, overhead_s, step_s, limit; reference minillm.lab.profiling.predict_step.
(b) fuse_linears(linears) -> nn.Linear whose output is the given layers' outputs side by side;
the reference is the layers themselves (their outputs concatenated) and minillm.model's
MergedColumnParallelLinear filled through its weight_loader.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .core import Check, Exercise, Problem, expect_value_error
from .hints import one_fit

# ============================================================================ (a) predict_step

KEYS = ("memory_s", "compute_s", "overhead_s", "step_s", "limit")


def reference_predict_step(cfg, batch, context, dtype, bandwidth, flops, num_ops, op_seconds):
    from ..lab.profiling import predict_step
    return predict_step(cfg, batch, context, dtype, bandwidth, flops, num_ops, op_seconds)


def _cases():
    from .. import configs
    small, big = configs.get("smollm2-135m"), configs.get("llama-3-8b")
    cpu = dict(bandwidth=33e9, flops=183e9, num_ops=6226, op_seconds=2e-6)
    gpu = dict(bandwidth=3.35e12, flops=989e12, num_ops=500, op_seconds=5e-6)
    return [
        (small, 1, 64, "float32", cpu), (small, 16, 64, "float32", cpu),
        (small, 64, 512, "bfloat16", cpu), (small, 1, 64, "bfloat16", gpu),
        (big, 1, 1024, "bfloat16", gpu), (big, 256, 1024, "bfloat16", gpu),
        (big, 32, 4096, "float32", dict(cpu, num_ops=0)),
    ]


def _call(fn, case):
    cfg, batch, context, dtype, kw = case
    got = fn(cfg, batch, context, dtype, **kw)
    if not isinstance(got, dict) or set(KEYS) - set(got):
        raise Problem(f"return a dict with keys {list(KEYS)}, got {got!r}")
    return got, reference_predict_step(cfg, batch, context, dtype, **kw)


def _describe(case) -> str:
    cfg, batch, context, dtype, kw = case
    return (f"{cfg.name}, batch {batch}, context {context}, {dtype}, {kw['bandwidth'] / 1e9:g} "
            f"GB/s, {kw['flops'] / 1e12:g} TFLOP/s, {kw['num_ops']} ops x "
            f"{kw['op_seconds'] * 1e6:g} us")


def _close(a, b) -> bool:
    return (isinstance(a, (int, float)) and not isinstance(a, bool)
            and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-15))


def _memory_hint(got, case, want) -> str:
    from ..roofline import bytes_moved, weight_read_params
    from ..kvmath import dtype_bytes
    cfg, batch, context, dtype, kw = case
    bw = kw["bandwidth"]
    weights = weight_read_params(cfg) * dtype_bytes(dtype)
    return one_fit(got, [
        (bytes_moved(cfg, batch, 1, context, "bfloat16") / bw,
         "the bytes are counted in bf16 whatever `dtype` says; pass dtype to bytes_moved"),
        ((bytes_moved(cfg, batch, 1, context, dtype) + (batch - 1) * weights) / bw,
         "the weights are counted once per sequence: a step reads them ONCE for the whole batch"),
        (bytes_moved(cfg, batch, 1, context, dtype) * bw,
         "bytes x bandwidth: divide the bytes by the bandwidth (bytes/s)"),
    ], expected=want, same=_close)


def _terms(fn):
    for case in _cases():
        got, want = _call(fn, case)
        for key in ("memory_s", "compute_s"):
            if not _close(got[key], want[key]):
                hint = _memory_hint(got[key], case, want[key]) if key == "memory_s" else (
                    "FLOPs: roofline.forward_flops(cfg, 1, context, batch), one new token per "
                    "sequence, divided by flops")
                raise Problem(f"{_describe(case)}: {key} = {got[key]!r}, expected "
                              f"{want[key]:.6g}" + (f"; {hint}" if hint else ""))


def _overhead(fn):
    for case in _cases():
        got, want = _call(fn, case)
        if not _close(got["overhead_s"], want["overhead_s"]):
            hint = one_fit(got["overhead_s"], [
                (want["overhead_s"] * 1e6, "op_seconds is already in seconds: do not scale it"),
                (0.0, "the per-op cost is missing"),
            ], expected=want["overhead_s"], same=_close)
            raise Problem(f"{_describe(case)}: overhead_s = {got['overhead_s']!r}, expected "
                          f"num_ops x op_seconds = {want['overhead_s']:.6g}"
                          + (f"; {hint}" if hint else ""))


def _step(fn):
    for case in _cases():
        got, want = _call(fn, case)
        if not _close(got["step_s"], want["step_s"]):
            m, c, o = want["memory_s"], want["compute_s"], want["overhead_s"]
            hint = one_fit(got["step_s"], [
                (m + c + o, "memory and compute are ADDED: a GEMM reads and multiplies at the "
                            "same time, so take their max"),
                (max(m, c), "the per-op overhead is left out of the step"),
                (max(m, c, o), "the overhead is maxed with the others: in an eager engine it is "
                               "paid on top of them, so add it"),
            ], expected=want["step_s"], same=_close)
            raise Problem(f"{_describe(case)}: step_s = {got['step_s']!r}, expected "
                          f"max(memory, compute) + overhead = {want['step_s']:.6g}"
                          + (f"; {hint}" if hint else ""))


def _limit(fn):
    from .. import configs
    cfg = configs.get("smollm2-135m")
    cases = [  # memory-, compute- and overhead-limited in turn
        (cfg, 1, 64, "float32", dict(bandwidth=33e9, flops=183e9, num_ops=100, op_seconds=1e-6)),
        (cfg, 512, 64, "float32", dict(bandwidth=33e9, flops=183e9, num_ops=100,
                                       op_seconds=1e-6)),
        (cfg, 1, 64, "bfloat16", dict(bandwidth=3.35e12, flops=989e12, num_ops=500,
                                      op_seconds=5e-6)),
    ]
    for case in cases:
        got, want = _call(fn, case)
        if got["limit"] != want["limit"]:
            terms = {k: want[k + "_s"] for k in ("memory", "compute", "overhead")}
            shown = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in terms.items())
            raise Problem(f"{_describe(case)}: limit = {got['limit']!r}, expected "
                          f"{want['limit']!r} ({shown}): name the largest of the three terms")


def _predict_errors(fn):
    from .. import configs
    cfg = configs.get("smollm2-135m")
    kw = dict(bandwidth=33e9, flops=183e9, num_ops=10, op_seconds=1e-6)
    expect_value_error(lambda: fn(cfg, 1, 64, "float32", **dict(kw, bandwidth=0)),
                       "bandwidth=0")
    expect_value_error(lambda: fn(cfg, 1, 64, "float32", **dict(kw, flops=-1.0)), "flops=-1")
    expect_value_error(lambda: fn(cfg, 1, 64, "float32", **dict(kw, num_ops=-5)), "num_ops=-5")
    expect_value_error(lambda: fn(cfg, 0, 64, "float32", **kw), "batch=0")


PREDICT_STEP = Exercise("ch12.predict_step", "predict_step", (
    Check("memory_s = bytes / bandwidth and compute_s = FLOPs / flops", _terms),
    Check("overhead_s = num_ops x op_seconds", _overhead),
    Check("step_s = max(memory, compute) + overhead", _step),
    Check("limit names the largest term (memory, compute, overhead)", _limit),
    Check("bad input raises ValueError", _predict_errors),
))


def check_predict_step(predict_step, time_limit: Optional[float] = None):
    """Grade exercise (a): predict_step(cfg, batch, context, dtype, bandwidth, flops, num_ops,
    op_seconds)."""
    return PREDICT_STEP.check(predict_step, time_limit)


# ============================================================================ (b) fuse_linears

def reference_fuse_linears(linears) -> torch.nn.Linear:
    from ..model import MergedColumnParallelLinear
    if not linears:
        raise ValueError("give at least one layer")
    first = linears[0]
    if any(lin.in_features != first.in_features for lin in linears):
        raise ValueError("every layer must read the same input size")
    if len({lin.bias is None for lin in linears}) > 1:
        raise ValueError("either every layer has a bias or none has")
    fused = MergedColumnParallelLinear(first.in_features, [lin.out_features for lin in linears],
                                       bias=first.bias is not None).to(first.weight.dtype)
    with torch.no_grad():
        for i, lin in enumerate(linears):
            fused.weight_loader(fused.weight, lin.weight, i)
            if lin.bias is not None:
                fused.weight_loader(fused.bias, lin.bias, i)
    return fused


def _layers(sizes, in_features=64, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        lin = torch.nn.Linear(in_features, n, bias=bias)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, in_features, generator=g) * 0.1)
            if bias:
                lin.bias.copy_(torch.randn(n, generator=g))
        out.append(lin)
    return out


def _fused_output(fn, layers, x):
    fused = fn(layers)
    if not isinstance(fused, torch.nn.Linear):
        raise Problem(f"return one torch.nn.Linear, got {type(fused).__name__}")
    want_out = sum(lin.out_features for lin in layers)
    if (fused.in_features, fused.out_features) != (layers[0].in_features, want_out):
        raise Problem(f"layers of sizes {[tuple(lin.weight.shape) for lin in layers]} "
                      f"(out, in): the fused layer must be {layers[0].in_features} -> "
                      f"{want_out}, got {fused.in_features} -> {fused.out_features}; stack the "
                      "weights along dim 0 (rows are outputs)")
    with torch.no_grad():
        return fused, fused(x)


def _side_by_side(sizes, bias, batch_shape, seed):
    def check(fn):
        layers = _layers(sizes, bias=bias, seed=seed)
        x = torch.randn(*batch_shape, 64, generator=torch.Generator().manual_seed(seed + 1))
        fused, got = _fused_output(fn, layers, x)
        with torch.no_grad():
            parts = [lin(x) for lin in layers]
            want = torch.cat(parts, dim=-1)
        if got.shape == want.shape and torch.allclose(got, want, atol=1e-5):
            return
        hint = ""
        with torch.no_grad():
            if got.shape == want.shape:
                hint = one_fit(got, [
                    (torch.cat(parts[::-1], dim=-1), "the parts are in reverse order: keep the "
                                                     "order of the list (q, k, v)"),
                    (torch.cat([p - lin.bias for p, lin in zip(parts, layers)], -1) if bias
                     else None, "the biases are missing: stack them like the weights"),
                ], expected=want, same=lambda a, b: a is not None and b is not None
                    and torch.allclose(a, b, atol=1e-5))
        raise Problem(f"layers of output sizes {sizes} (bias={bias}), x of shape "
                      f"{tuple(x.shape)}: the fused layer's output is not the parts side by "
                      f"side (max |diff| "
                      f"{(got - want).abs().max().item() if got.shape == want.shape else 'n/a'})"
                      + (f"; {hint}" if hint else ""))
    return check


def _inputs_unchanged(fn):
    layers = _layers([64, 32, 32], bias=True, seed=5)
    before = [(lin.weight.detach().clone(), lin.bias.detach().clone()) for lin in layers]
    fused = fn(layers)
    for i, (lin, (w, b)) in enumerate(zip(layers, before)):
        if not (torch.equal(lin.weight, w) and torch.equal(lin.bias, b)):
            raise Problem(f"layer {i} was changed by fuse_linears; build a new layer and copy "
                          "into it, leave the given ones as they were")
        if isinstance(fused, torch.nn.Linear) and fused.weight.data_ptr() == lin.weight.data_ptr():
            raise Problem("the fused layer shares its weight with an input layer")


def _fuse_errors(fn):
    expect_value_error(lambda: fn([]), "an empty list")
    expect_value_error(lambda: fn(_layers([8]) + _layers([8], in_features=32)),
                       "layers that read different input sizes (64 and 32)")
    expect_value_error(lambda: fn(_layers([8]) + _layers([8], bias=True)),
                       "one layer with a bias and one without")


FUSE_LINEARS = Exercise("ch12.fuse_linears", "fuse_linears", (
    Check("q, k, v of a GQA layer: the fused output is the parts side by side",
          _side_by_side([64, 32, 32], False, (5,), 0)),
    Check("biases travel with their rows (Qwen2's q/k/v bias)",
          _side_by_side([64, 32, 32], True, (3,), 2)),
    Check("gate and up of an MLP, any batch shape", _side_by_side([96, 96], False, (2, 3), 4)),
    Check("the given layers are left unchanged", _inputs_unchanged),
    Check("bad input raises ValueError", _fuse_errors),
))


def check_fuse_linears(fuse_linears, time_limit: Optional[float] = None):
    """Grade exercise (b): fuse_linears(linears) -> one nn.Linear."""
    return FUSE_LINEARS.check(fuse_linears, time_limit)


EXERCISES = (PREDICT_STEP, FUSE_LINEARS)
