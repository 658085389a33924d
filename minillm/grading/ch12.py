"""Graders for the chapter 12 problem set (solutions/12_engine_overheads.ipynb).

    ch12.check_predict_step(predict_step)      # (a) a decode step's time from bytes, FLOPs and
                                               #     op count
    ch12.check_fuse_projections(fuse_projections)   # (b) a checkpoint's q/k/v (or gate/up)
                                                    #     as ONE weight

(a) predict_step(cfg, batch, context, dtype, bandwidth, flops, num_ops, op_seconds) -> dict with
memory_s, compute_s, overhead_s, step_s, limit; reference minillm.lab.profiling.predict_step.
(b) fuse_projections(state_dict, parts) -> (weight, bias or None): the checkpoint's separate
projections as one stacked weight; checked against the parts' own outputs side by side, and
the reference is minillm.model's MergedColumnParallelLinear filled through its weight_loader.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

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


# ======================================================================== (b) fuse_projections

def reference_fuse_projections(state_dict, parts):
    """The loader's job for one fused layer: minillm.model.MergedColumnParallelLinear, each
    part copied into its rows by the layer's own weight_loader."""
    from ..model import MergedColumnParallelLinear
    if not parts:
        raise ValueError("give at least one part")
    missing = [f"{p}.weight" for p in parts if f"{p}.weight" not in state_dict]
    if missing:
        raise ValueError(f"the checkpoint has no {missing}")
    weights = [state_dict[f"{p}.weight"] for p in parts]
    if any(w.shape[1] != weights[0].shape[1] for w in weights):
        raise ValueError("every part must read the same input size")
    has_bias = {f"{p}.bias" in state_dict for p in parts}
    if len(has_bias) > 1:
        raise ValueError("either every part has a bias or none has")
    bias = has_bias.pop()
    fused = MergedColumnParallelLinear(weights[0].shape[1], [w.shape[0] for w in weights],
                                       bias=bias).to(weights[0].dtype)
    with torch.no_grad():
        for i, p in enumerate(parts):
            fused.weight_loader(fused.weight, state_dict[f"{p}.weight"], i)
            if bias:
                fused.weight_loader(fused.bias, state_dict[f"{p}.bias"], i)
    return fused.weight.detach().clone(), (fused.bias.detach().clone() if bias else None)


def _checkpoint(sizes, names, in_features=64, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, n in zip(names, sizes):
        sd[f"{name}.weight"] = torch.randn(n, in_features, generator=g) * 0.1
        if bias:
            sd[f"{name}.bias"] = torch.randn(n, generator=g)
    return sd


def _fused(fn, sd, parts):
    got = fn({k: v.clone() for k, v in sd.items()}, list(parts))
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.Tensor)
            and (got[1] is None or isinstance(got[1], torch.Tensor))):
        raise Problem(f"return (weight tensor, bias tensor or None), got {got!r}")
    weight, bias = got
    rows = sum(sd[f"{p}.weight"].shape[0] for p in parts)
    k = sd[f"{parts[0]}.weight"].shape[1]
    if tuple(weight.shape) != (rows, k):
        raise Problem(f"parts {[(p, tuple(sd[p + '.weight'].shape)) for p in parts]}: the fused "
                      f"weight must be [{rows}, {k}], got {tuple(weight.shape)}; stack along "
                      "dim 0 (rows are outputs)")
    return weight, bias


def _side_by_side(sizes, names, bias, batch_shape, seed):
    def check(fn):
        sd = _checkpoint(sizes, names, bias=bias, seed=seed)
        x = torch.randn(*batch_shape, 64, generator=torch.Generator().manual_seed(seed + 1))
        weight, fbias = _fused(fn, sd, names)
        if bias and fbias is None:
            raise Problem(f"parts {names} have biases ({[n + '.bias' for n in names]}) but you "
                          "returned None: the biases are missing, stack them like the weights")
        got = F.linear(x, weight, fbias)
        parts = [F.linear(x, sd[f"{n}.weight"], sd.get(f"{n}.bias")) for n in names]
        want = torch.cat(parts, dim=-1)
        if torch.allclose(got, want, atol=1e-5):
            return
        hint = one_fit(got, [
            (torch.cat(parts[::-1], dim=-1), "the parts are in reverse order: keep the order "
                                             "of `parts` (q, k, v)"),
            (torch.cat([F.linear(x, sd[f"{n}.weight"]) for n in names], dim=-1) if bias
             else None, "the biases are missing: stack them like the weights"),
        ], expected=want, same=lambda a, b: a is not None and b is not None
            and torch.allclose(a, b, atol=1e-5))
        raise Problem(f"parts {names} of output sizes {sizes} (bias={bias}), x of shape "
                      f"{tuple(x.shape)}: F.linear(x, weight, bias) is not the parts' outputs "
                      f"side by side (max |diff| {(got - want).abs().max().item():.3g})"
                      + (f"; {hint}" if hint else ""))
    return check


def _inputs_unchanged(fn):
    names = ["q_proj", "k_proj", "v_proj"]
    sd = _checkpoint([64, 32, 32], names, bias=True, seed=5)
    before = {k: v.clone() for k, v in sd.items()}
    got = fn(sd, list(names))
    for k, v in before.items():
        if not torch.equal(sd[k], v):
            raise Problem(f"the checkpoint's {k} was changed by fuse_projections; build new "
                          "tensors (torch.cat copies) and leave the checkpoint as it was")
    want = torch.cat([before[f"{n}.weight"] for n in names])
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.Tensor)
            and got[0].shape == want.shape and torch.allclose(got[0], want)):
        raise Problem("with the checkpoint left unchanged, the fused weight must still be the "
                      f"parts stacked in order ({tuple(want.shape)}); got {got!r:.200}")


def _fuse_errors(fn):
    qkv = ["q_proj", "k_proj", "v_proj"]
    sd = _checkpoint([16, 8, 8], qkv)
    expect_value_error(lambda: fn(dict(sd), []), "no parts")
    expect_value_error(lambda: fn(dict(sd), ["q_proj", "o_proj"]),
                       "a part the checkpoint does not have (o_proj)")
    odd = dict(sd, **{"v_proj.weight": torch.zeros(8, 32)})
    expect_value_error(lambda: fn(odd, qkv), "parts that read different input sizes (64, 32)")
    mixed = dict(sd, **{"q_proj.bias": torch.zeros(16)})
    expect_value_error(lambda: fn(mixed, qkv), "q_proj with a bias, k_proj and v_proj without")


FUSE_PROJECTIONS = Exercise("ch12.fuse_projections", "fuse_projections", (
    Check("q, k, v of a GQA layer: the fused product is the parts side by side",
          _side_by_side([64, 32, 32], ["q_proj", "k_proj", "v_proj"], False, (5,), 0)),
    Check("biases travel with their rows (Qwen2's q/k/v bias)",
          _side_by_side([64, 32, 32], ["q_proj", "k_proj", "v_proj"], True, (3,), 2)),
    Check("gate and up of an MLP, any batch shape",
          _side_by_side([96, 96], ["gate_proj", "up_proj"], False, (2, 3), 4)),
    Check("the checkpoint is left unchanged", _inputs_unchanged),
    Check("bad input raises ValueError", _fuse_errors),
))


def check_fuse_projections(fuse_projections, time_limit: Optional[float] = None):
    """Grade exercise (b): fuse_projections(state_dict, parts) -> (weight, bias or None)."""
    return FUSE_PROJECTIONS.check(fuse_projections, time_limit)


EXERCISES = (PREDICT_STEP, FUSE_PROJECTIONS)
