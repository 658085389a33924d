"""Microbenchmark: a few-row product through F.linear against minillm.model.Linear's CPU paths.

Why `minillm.model.Linear` exists. A decode step multiplies one row per running sequence by every
weight matrix, and PyTorch's default CPU product (F.linear) runs such skinny inputs far below the
machine's limits. Linear has other paths: the product written the other way round,
(W @ x^T)^T, with a single row sent in as two (a matrix-vector product reads the weights slower
than a two-row product does), oneDNN's product on a weight prepacked once into its blocked
layout (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`), and, for fp32, MKL's
sgemm (the library behind F.linear) on a weight packed once for it
(`torch.ops.mkl._mkl_reorder_linear_weight` / `_mkl_linear`). This times F.linear against each,
for SmolLM2-135M's weight shapes, with as many copies of each weight as the model has layers so
that, as in a real step, the weights come from memory rather than the caches (timed alone, a 7 MB
weight stays in the cache and hides the difference):

    python benchmarks/bench_skinny_gemm.py --threads 2
    python benchmarks/bench_skinny_gemm.py --threads 2 --dtype bfloat16
    python benchmarks/bench_skinny_gemm.py --threads 2 --out benchmarks/results/x.json

Prints, per shape and row count, F.linear's time over each path's (> 1: that path is faster),
then a step's products (every layer's four weights and the LM head) in ms per path. `--out`
records the times as JSON. The numbers describe this machine's BLAS, oneDNN and MKL and nothing
else.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from bench_step_profile import cpu_model  # noqa: E402
from minillm.model import MKL_PACK_ROWS, mkl_packs_here  # noqa: E402

SHAPES = {"qkv_proj 576->960": (960, 576), "o_proj 576->576": (576, 576),
          "gate_up 576->3072": (3072, 576), "down 1536->576": (576, 1536),
          "lm_head 576->49152": (49152, 576)}


def seconds(fn, repeats):
    fn()                                                     # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64, 256])
    p.add_argument("--layers", type=int, default=30, help="copies of each weight (not the head)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", default=None, help="write the times (ms) as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    load = os.getloadavg()[0]
    print(f"{torch.get_num_threads()} torch threads, {args.dtype}, load {load:.2f}; "
          "F.linear time / each path's")
    paths = {"(W @ x.T).T, one row as two": flip, "oneDNN, prepacked weight": packed}
    if dtype == torch.float32 and mkl_packs_here():
        paths["MKL, prepacked weight"] = mkl_packed
    ms = {name: {"F.linear": [], **{label: [] for label in paths}} for name in SHAPES}
    for name, (n, k) in SHAPES.items():             # every path side by side, per row count
        weights = [torch.randn(n, k, dtype=dtype)
                   for _ in range(1 if n > 10_000 else args.layers)]
        packs = {"oneDNN, prepacked weight": [torch.ops.mkldnn._reorder_linear_weight(w, None)
                                              for w in weights]}
        if "MKL, prepacked weight" in paths:
            packs["MKL, prepacked weight"] = [
                torch.ops.mkl._mkl_reorder_linear_weight(w, MKL_PACK_ROWS) for w in weights]
        for m in args.rows:
            x = torch.randn(m, k, dtype=dtype)
            ms[name]["F.linear"].append(
                1e3 * seconds(lambda: [F.linear(x, w) for w in weights], args.repeats))
            for label, path in paths.items():
                pk = packs.get(label, weights)
                ms[name][label].append(1e3 * seconds(
                    lambda: [path(w, q, x) for w, q in zip(weights, pk)], args.repeats))
    for label in paths:
        print(f"{label:28}" + "".join(f"{m:>7}" for m in args.rows))
        for name in SHAPES:
            print(f"  {name:26}" + "".join(f"{a / b:7.2f}" for a, b in
                                            zip(ms[name]["F.linear"], ms[name][label])))
    step = {label: [sum(ms[name][label][i] for name in SHAPES) for i in range(len(args.rows))]
            for label in ["F.linear", *paths]}
    print(f"a step's products, ms{'':14}" + "".join(f"{m:>7}" for m in args.rows))
    for label, row in step.items():
        print(f"  {label:26}" + "".join(f"{t:7.1f}" for t in row))
    if args.out:
        record = {"benchmark": "skinny_gemm", "dtype": args.dtype, "threads":
                  torch.get_num_threads(), "layers": args.layers, "repeats": args.repeats,
                  "rows": args.rows, "mkl_pack_rows": MKL_PACK_ROWS, "load_before": load,
                  "device": cpu_model(), "torch": torch.__version__,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="minutes"),
                  "command": "python benchmarks/bench_skinny_gemm.py " + shlex.join(
                      argv if argv is not None else sys.argv[1:]),
                  "ms": ms, "step_ms": step}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")


def flip(w, packed, x):
    """(W @ x^T)^T, one row sent as two: Linear's path for 1-2 fp32 rows. Written out here, not
    called through Linear, so that it is timed at every row count and for bf16 too, where
    Linear does not take it."""
    flat = x.repeat(2, 1) if x.shape[0] == 1 else x
    return torch.mm(w, flat.t())[:, :x.shape[0]].t().contiguous()


def packed(w, packed, x):
    """oneDNN on the prepacked weight: Linear's path for bf16, and for fp32 where MKL's is not
    the default (`minillm.model.mkl_preferred_here`: CPUs other than Intel's, torch without
    MKL)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def mkl_packed(w, packed, x):
    """MKL's sgemm on its packed copy: Linear's fp32 path from 3 or 4 rows on an Intel CPU."""
    return torch.ops.mkl._mkl_linear(x, packed, w, None, x.shape[0])


if __name__ == "__main__":
    main()
