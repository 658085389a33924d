"""Microbenchmark: a few-row product through F.linear against minillm.model.Linear's two CPU paths.

Why `minillm.model.Linear` exists. A decode step multiplies one row per running sequence by every
weight matrix, and PyTorch's default CPU product (F.linear) runs such skinny inputs far below the
machine's limits. Linear has two other paths: the product written the other way round,
(W @ x^T)^T, with a single row sent in as two (a matrix-vector product reads the weights slower
than a two-row product does), and oneDNN's product on a weight prepacked once into its blocked
layout (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise`). This times F.linear
against both, for SmolLM2-135M's weight shapes, with as many copies of each weight as the model
has layers so that, as in a real step, the weights come from memory rather than the caches
(timed alone, a 7 MB weight stays in the cache and hides the difference):

    python benchmarks/bench_skinny_gemm.py --threads 2
    python benchmarks/bench_skinny_gemm.py --threads 2 --dtype bfloat16

Prints, per shape and row count, F.linear's time over each path's (> 1: that path is faster).
The numbers describe this machine's BLAS and oneDNN and nothing else.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

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
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"{torch.get_num_threads()} torch threads, {args.dtype}; F.linear time / each path's")
    paths = {"(W @ x.T).T, one row as two": flip,
             "oneDNN, prepacked weight": packed}
    for label, path in paths.items():
        print(f"{label:28}" + "".join(f"{m:>7}" for m in args.rows))
        for name, (n, k) in SHAPES.items():
            weights = [torch.randn(n, k, dtype=dtype)
                       for _ in range(1 if n > 10_000 else args.layers)]
            packs = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
            ratios = []
            for m in args.rows:
                x = torch.randn(m, k, dtype=dtype)
                plain = seconds(lambda: [F.linear(x, w) for w in weights], args.repeats)
                other = seconds(lambda: [path(w, p, x) for w, p in zip(weights, packs)],
                                args.repeats)
                ratios.append(plain / other)
            print(f"  {name:26}" + "".join(f"{r:7.2f}" for r in ratios))


def flip(w, packed, x):
    """(W @ x^T)^T, one row sent as two: Linear's path for 1-2 fp32 rows. Written out here, not
    called through Linear, so that it is timed at every row count and for bf16 too, where
    Linear does not take it."""
    flat = x.repeat(2, 1) if x.shape[0] == 1 else x
    return torch.mm(w, flat.t())[:, :x.shape[0]].t().contiguous()


def packed(w, packed, x):
    """oneDNN on the prepacked weight: Linear's path otherwise (fp32 from 3 rows, all bf16)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


if __name__ == "__main__":
    main()
