"""Microbenchmark: a few-row product through F.linear against minillm.model.Linear's (W @ x^T)^T.

Why `minillm.model.Linear` exists. A decode step multiplies one row per running sequence by every
weight matrix; on some CPUs PyTorch's GEMM takes a slower path for such skinny inputs than for the
same product written the other way round, and a single row (a matrix-vector product) reads the
weights slower than two rows do, so Linear sends one row in as two. This times F.linear against
that path (`flip` below, at every row count) for SmolLM2-135M's weight shapes, with as many
copies of each weight as the model has layers so that, as in a real step, the weights come from
memory rather than the caches (timed alone, a 7 MB weight stays in the cache and hides the
difference):

    python benchmarks/bench_skinny_gemm.py --threads 2

Prints, per shape and row count, F.linear's time over Linear's transposed product's (> 1: the
transposed product is faster). `--dtype bfloat16` times bf16 weights the same way. The
numbers describe this machine's BLAS and nothing else.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.model import skinny_rows  # noqa: E402

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
    p.add_argument("--rows", type=int, nargs="+",
                   default=[1, 2, 3, 4, 6, 8, 12, 16, 20, 32, 64, 128, 256])
    p.add_argument("--layers", type=int, default=30, help="copies of each weight (not the head)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"{torch.get_num_threads()} torch threads, {args.dtype}; "
          "F.linear time / (W @ x.T).T time (one row sent as two, 9+ padded to a multiple of 8)")
    print(f"{'':22}" + "".join(f"{m:>7}" for m in args.rows))
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, dtype=dtype) for _ in range(1 if n > 10_000 else args.layers)]
        ratios = []
        for m in args.rows:
            x = torch.randn(m, k, dtype=dtype)
            plain = seconds(lambda: [F.linear(x, w) for w in weights], args.repeats)
            flipped = seconds(lambda: [flip(w, x) for w in weights], args.repeats)
            ratios.append(plain / flipped)
        print(f"{name:22}" + "".join(f"{r:7.2f}" for r in ratios))


def flip(w, x):
    """minillm.model.Linear's CPU path at any row count and dtype: (W @ x^T)^T, one row as two,
    9 or more rows padded with zero rows to a multiple of 8 (minillm.model.skinny_rows)."""
    m = x.shape[0]
    flat = x.repeat(2, 1) if m == 1 else x
    if skinny_rows(m) > flat.shape[0]:
        flat = torch.cat((flat, flat.new_zeros(skinny_rows(m) - m, flat.shape[1])))
    return torch.mm(w, flat.t())[:, :m].t().contiguous()


if __name__ == "__main__":
    main()
