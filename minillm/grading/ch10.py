"""Graders for the chapter 10 problem set (solutions/10_parallelism.ipynb).

    ch10.check_parallel_linear(parallel_linear)        # (a) column- and row-parallel linear
                                                       #     on simulated ranks, recombined
    ch10.check_all_reduce_cost(all_reduce_cost)        # (b) tensor parallelism's all-reduce
                                                       #     bytes and time for a deployment
    ch10.check_pipeline_bubble(pipeline_bubble)        # (c) the bubble of p stages, m micro-batches
    ch10.check_choose_parallelism(choose_parallelism)  # (d) TP and PP degrees for a cluster

References: F.linear on the unsplit weight (a); minillm.parallel.comm's ring formula (b);
minillm.parallel.pipeline.bubble_fraction on the ideal schedule (c); the rule written out here
for (d): tensor parallelism inside a node, pipeline stages across nodes.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..parallel.comm import ring_all_reduce_bytes
from ..parallel.pipeline import bubble_fraction, gpipe_timeline
from .core import Check, Exercise, Problem, expect_value_error

# =========================================================================== (a) parallel_linear


def _case(seed, M=3, K=8, N=12, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    return x, w, b


def _call_pl(fn, x, w, b, world, mode):
    out = fn(x.clone(), w.clone(), None if b is None else b.clone(), world, mode)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise Problem(f"parallel_linear(..., {world}, {mode!r}) returned {type(out).__name__}; "
                      "return (partials, y): one tensor per rank and the recombined output")
    parts, y = out
    if not isinstance(parts, (tuple, list)) or len(parts) != world:
        raise Problem(f"{mode}, world_size {world}: partials has "
                      f"{len(parts) if isinstance(parts, (tuple, list)) else type(parts).__name__}"
                      f" entries; return one tensor per rank")
    parts, y = [p.float() for p in parts], y.float()
    if not all(torch.isfinite(t).all() for t in (*parts, y)):
        raise Problem(f"{mode}, world_size {world}: the partials or y contain NaN or inf; every "
                      "value is a sum of finite products")
    return parts, y


def _pl_column_shapes(fn):
    x, w, b = _case(0)
    parts, y = _call_pl(fn, x, w, b, 3, "column")
    for r, p in enumerate(parts):
        if tuple(p.shape) != (3, 4):
            hint = (" -- that splits the INPUT dimension K: column parallel splits the OUTPUT "
                    "rows of w [N, K], so each rank produces N / world_size outputs"
                    if tuple(p.shape) == (3, 12) else "")
            raise Problem(f"x [3, 8], w [12, 8], world_size 3: rank {r}'s output is "
                          f"{list(p.shape)}, expected [3, 4]{hint}")


def _pl_column_values(fn):
    for seed, world, bias in ((1, 2, True), (2, 4, True), (3, 3, False)):
        x, w, b = _case(seed, bias=bias)
        parts, y = _call_pl(fn, x, w, b, world, "column")
        n = 12 // world
        for r, p in enumerate(parts):
            want = F.linear(x, w[r * n:(r + 1) * n], None if b is None else b[r * n:(r + 1) * n])
            if not torch.allclose(p, want, atol=1e-5):
                raise Problem(f"column, world_size {world}: rank {r} should compute x @ "
                              f"w[{r * n}:{(r + 1) * n}].T (+ its bias slice); it differs")
        if not torch.allclose(y, F.linear(x, w, b), atol=1e-5):
            raise Problem(f"column, world_size {world}: y is not F.linear(x, w, b); the ranks' "
                          "outputs concatenate along the last dimension (an all-gather)")


def _pl_row_partials(fn):
    x, w, b = _case(4)
    parts, _ = _call_pl(fn, x, w, b, 2, "row")
    for r, p in enumerate(parts):
        want = F.linear(x[:, r * 4:(r + 1) * 4], w[:, r * 4:(r + 1) * 4])
        if tuple(p.shape) != (3, 12):
            raise Problem(f"row, world_size 2: rank {r}'s partial is {list(p.shape)}, expected "
                          "[3, 12]: row parallel splits the INPUT dimension, each rank gives a "
                          "partial sum of the whole output")
        if torch.allclose(p, want + b, atol=1e-5):
            raise Problem("row, world_size 2: each rank's partial already holds the bias -- bias "
                          "added on every rank is summed world_size times by the all-reduce; "
                          "add it once, after")
        if not torch.allclose(p, want, atol=1e-5):
            raise Problem(f"row, world_size 2: rank {r}'s partial should be x[:, {r * 4}:"
                          f"{(r + 1) * 4}] @ w[:, {r * 4}:{(r + 1) * 4}].T; it differs")


def _pl_row_values(fn):
    for seed, world in ((5, 2), (6, 4), (7, 8)):
        x, w, b = _case(seed)
        parts, y = _call_pl(fn, x, w, b, world, "row")
        want = F.linear(x, w, b)
        if torch.allclose(y, want, atol=1e-5):
            continue
        k = 8 // world
        hint = ""
        if torch.allclose(y, F.linear(x[:, :k], w[:, :k]) + b, atol=1e-5):
            hint = (" -- that is rank 0's partial alone: the all-reduce (the sum over ranks) "
                    "is missing")
        elif torch.allclose(y, F.linear(x, w) + world * b, atol=1e-5):
            hint = " -- the bias is counted world_size times: add it once, after the all-reduce"
        raise Problem(f"row, world_size {world}: y is not F.linear(x, w, b){hint}")


def _pl_bad(fn):
    x, w, b = _case(8)
    expect_value_error(lambda: fn(x, w, b, 5, "column"), "world_size 5 for N = 12")
    expect_value_error(lambda: fn(x, w, b, 3, "row"), "world_size 3 for K = 8")
    expect_value_error(lambda: fn(x, w, b, 2, "diagonal"), "mode 'diagonal'")


LINEAR = Exercise("ch10.parallel_linear", "parallel_linear", (
    Check("column parallel: each rank gets N / world_size output columns", _pl_column_shapes),
    Check("column parallel: rank outputs and their concatenation", _pl_column_values),
    Check("row parallel: each rank's partial sum, bias not on every rank", _pl_row_partials),
    Check("row parallel: the all-reduce recombines, bias once", _pl_row_values),
    Check("a size that does not divide, or an unknown mode, raises ValueError", _pl_bad),
))


def check_parallel_linear(parallel_linear, time_limit=None):
    return LINEAR.check(parallel_linear, time_limit)

# =========================================================================== (b) all_reduce_cost


def reference_all_reduce_cost(hidden, num_layers, tokens, dtype_bytes, tp, bandwidth):
    if min(hidden, num_layers, tokens, dtype_bytes, tp) < 1 or bandwidth <= 0:
        raise ValueError("sizes must be >= 1 and bandwidth > 0")
    payload = 2 * num_layers * tokens * hidden * dtype_bytes
    wire = ring_all_reduce_bytes(payload, tp)
    return {"payload_bytes": payload, "wire_bytes": wire, "seconds": wire / bandwidth}


_COST_KEYS = ("payload_bytes", "wire_bytes", "seconds")


def _cost(fn, *args):
    out = fn(*args)
    if not isinstance(out, dict) or any(k not in out for k in _COST_KEYS):
        raise Problem(f"all_reduce_cost{args} returned {type(out).__name__}; return a dict with "
                      "'payload_bytes', 'wire_bytes' and 'seconds'")
    return {k: float(out[k]) for k in _COST_KEYS}


def _cost_expect(fn, args, key, why):
    got, want = _cost(fn, *args)[key], reference_all_reduce_cost(*args)[key]
    if math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12):
        return
    hints = []
    if key == "payload_bytes" and math.isclose(got * 2, want, rel_tol=1e-6):
        hints.append("one all-reduce per layer counted; there are two (after o_proj and after "
                     "down_proj)")
    tp = args[4]
    payload = reference_all_reduce_cost(*args)["payload_bytes"]
    if key == "wire_bytes" and math.isclose(got, payload, rel_tol=1e-6):
        hints.append("that is the payload: a ring sends 2 (N - 1) / N of it from each rank")
    if key == "wire_bytes" and math.isclose(got, payload * (tp - 1) / tp, rel_tol=1e-6):
        hints.append("(N - 1) / N is one phase; reduce-scatter AND all-gather: 2 (N - 1) / N")
    raise Problem(f"all_reduce_cost{args}: {key} = {got:.6g}, expected {want:.6g} ({why})"
                  f"{' -- ' + '; '.join(hints) if hints else ''}")


def _ac_payload(fn):
    _cost_expect(fn, (4096, 32, 1, 2, 2, 450e9), "payload_bytes",
                 "2 all-reduces per layer of [tokens, hidden] values")
    _cost_expect(fn, (8192, 80, 64, 2, 8, 450e9), "payload_bytes", "64 tokens in the step")


def _ac_wire(fn):
    _cost_expect(fn, (4096, 32, 1, 2, 8, 450e9), "wire_bytes", "ring factor 2 (N - 1) / N")
    _cost_expect(fn, (4096, 32, 1, 2, 2, 450e9), "wire_bytes", "N = 2: the ring sends it once")


def _ac_single(fn):
    _cost_expect(fn, (4096, 32, 16, 2, 1, 450e9), "wire_bytes", "one rank sends nothing")


def _ac_seconds(fn):
    _cost_expect(fn, (8192, 80, 1, 2, 8, 50e9), "seconds", "wire bytes / link bandwidth")


def _ac_bad(fn):
    expect_value_error(lambda: fn(4096, 32, 1, 2, 0, 450e9), "tp=0")
    expect_value_error(lambda: fn(4096, 32, 1, 2, 2, 0), "bandwidth=0")


COST = Exercise("ch10.all_reduce_cost", "all_reduce_cost", (
    Check("payload: 2 x layers x tokens x hidden x dtype bytes", _ac_payload),
    Check("wire bytes of a ring all-reduce", _ac_wire),
    Check("tp = 1 communicates nothing", _ac_single),
    Check("time = wire bytes / bandwidth", _ac_seconds),
    Check("bad sizes raise ValueError", _ac_bad),
))


def check_all_reduce_cost(all_reduce_cost, time_limit=None):
    return COST.check(all_reduce_cost, time_limit)

# =========================================================================== (c) pipeline_bubble


def _bubble_expect(fn, p, m):
    want = bubble_fraction(gpipe_timeline(p, m), p)
    got = float(fn(p, m))
    if math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
        return
    hint = ""
    if m and math.isclose(got, (p - 1) / m, rel_tol=1e-9):
        hint = (" -- (p - 1) / m leaves the fill and drain slots out of the total: the "
                "schedule lasts m + p - 1 slots")
    elif math.isclose(got, p / (m + p), rel_tol=1e-9):
        hint = " -- off by one: p - 1 idle slots per stage in m + p - 1"
    elif math.isclose(got, 1 - want, rel_tol=1e-9):
        hint = " -- that is the busy share; the bubble is the idle share"
    raise Problem(f"pipeline_bubble({p}, {m}) = {got:.6g}, expected {want:.6g}{hint}")


def _pb_one_stage(fn):
    _bubble_expect(fn, 1, 4)


def _pb_values(fn):
    for p, m in ((2, 1), (2, 4), (4, 4), (8, 32)):
        _bubble_expect(fn, p, m)


def _pb_many(fn):
    if not float(fn(4, 1000)) < float(fn(4, 10)) < float(fn(4, 1)):
        raise Problem("more micro-batches must shrink the bubble: compare (4, 1), (4, 10), "
                      "(4, 1000)")
    _bubble_expect(fn, 4, 1000)


def _pb_timeline(fn):
    for p, m in ((3, 5), (6, 2)):
        _bubble_expect(fn, p, m)


def _pb_bad(fn):
    expect_value_error(lambda: fn(0, 4), "p=0")
    expect_value_error(lambda: fn(2, 0), "m=0")


BUBBLE = Exercise("ch10.pipeline_bubble", "pipeline_bubble", (
    Check("one stage has no bubble", _pb_one_stage),
    Check("bubble = (p - 1) / (m + p - 1)", _pb_values),
    Check("more micro-batches shrink it", _pb_many),
    Check("matches the idle share of the ideal schedule", _pb_timeline),
    Check("p or m below 1 raises ValueError", _pb_bad),
))


def check_pipeline_bubble(pipeline_bubble, time_limit=None):
    return BUBBLE.check(pipeline_bubble, time_limit)

# =========================================================================== (d) choose_parallelism


def reference_choose(model_bytes, num_heads, gpu_bytes, gpus_per_node, num_nodes):
    """Smallest tp (dividing the heads, at most one node) that fits with pp = 1; else the
    largest such tp and the fewest pipeline stages (at most one per node) that fit."""
    if min(num_heads, gpus_per_node, num_nodes) < 1 or model_bytes <= 0 or gpu_bytes <= 0:
        raise ValueError("sizes must be positive")
    tps = [t for t in range(1, gpus_per_node + 1) if num_heads % t == 0]
    for tp in tps:
        if model_bytes / tp <= gpu_bytes:
            return tp, 1
    tp = tps[-1]
    for pp in range(2, num_nodes + 1):
        if model_bytes / (tp * pp) <= gpu_bytes:
            return tp, pp
    raise ValueError("the model does not fit the cluster")


def _choose(fn, *args):
    out = fn(*args)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise Problem(f"choose_parallelism{args} returned {out!r}; return (tp, pp)")
    return int(out[0]), int(out[1])


def _ch_expect(fn, args, why):
    got, want = _choose(fn, *args), reference_choose(*args)
    if got == want:
        return
    tp, pp = got
    model, heads, gpu, per_node, nodes = args
    hints = []
    if tp > per_node:
        hints.append("tp spans nodes: its two all-reduces per layer would cross the slow "
                     "inter-node link; keep tp <= gpus_per_node and add pipeline stages")
    if heads % tp:
        hints.append(f"tp = {tp} does not divide the {heads} heads")
    if model / (tp * pp) > gpu:
        hints.append("that does not fit: model_bytes / (tp x pp) must be <= gpu_bytes")
    if not hints and tp * pp > want[0] * want[1]:
        hints.append("more GPUs than needed: the smallest tp that fits, then the fewest stages")
    raise Problem(f"choose_parallelism{args} = {got}, expected {want} ({why})"
                  f"{' -- ' + '; '.join(hints) if hints else ''}")


GB = 1e9


def _cp_fits_one(fn):
    _ch_expect(fn, (16 * GB, 32, 80 * GB, 8, 1), "fits one GPU")


def _cp_tp(fn):
    _ch_expect(fn, (140 * GB, 64, 80 * GB, 8, 1), "70B in bf16 needs 2 GPUs")
    _ch_expect(fn, (300 * GB, 64, 80 * GB, 8, 2), "4 GPUs in one node")


def _cp_heads(fn):
    _ch_expect(fn, (230 * GB, 40, 80 * GB, 8, 1), "tp must divide 40 heads: 3 does not, 4 does")


def _cp_nodes(fn):
    _ch_expect(fn, (810 * GB, 128, 80 * GB, 8, 2), "405B in bf16: 8 per node, 2 stages")
    _ch_expect(fn, (1500 * GB, 128, 80 * GB, 8, 4), "3 stages of 8")


def _cp_bad(fn):
    expect_value_error(lambda: fn(2000 * GB, 64, 80 * GB, 8, 2), "a model too big for the "
                       "cluster")
    expect_value_error(lambda: fn(10 * GB, 64, 80 * GB, 0, 1), "gpus_per_node=0")


CHOOSE = Exercise("ch10.choose_parallelism", "choose_parallelism", (
    Check("a model that fits one GPU: (1, 1)", _cp_fits_one),
    Check("tensor parallel inside a node", _cp_tp),
    Check("tp divides the heads", _cp_heads),
    Check("across nodes: pipeline stages, not wider tp", _cp_nodes),
    Check("what cannot fit raises ValueError", _cp_bad),
))


def check_choose_parallelism(choose_parallelism, time_limit=None):
    return CHOOSE.check(choose_parallelism, time_limit)


EXERCISES = (LINEAR, COST, BUBBLE, CHOOSE)
