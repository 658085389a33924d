"""Microbenchmark: a few-row product through F.linear against the same product as (W @ x^T)^T.

Why `minillm.model.Linear` exists. A decode step multiplies one row per running sequence by every
weight matrix; on some CPUs PyTorch's GEMM takes a slower path for such skinny inputs than for the
same product written the other way round. This times both for SmolLM2-135M's weight shapes, with
as many copies of each weight as the model has layers so that, as in a real step, the weights
come from memory rather than the caches:

    python benchmarks/bench_skinny_gemm.py --threads 2

Prints, per shape and row count, F.linear's time over the transposed product's (> 1: the
transposed product is faster). The numbers describe this machine's BLAS and nothing else.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = {"q/o proj 576->576": (576, 576), "gate/up 576->1536": (1536, 576),
          "down 1536->576": (576, 1536), "lm_head 576->49152": (49152, 576)}


def seconds(fn, repeats):
    fn()                                                     # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16, 64])
    p.add_argument("--layers", type=int, default=30, help="copies of each weight (not the head)")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} torch threads; F.linear time / (W @ x.T).T time")
    print(f"{'':22}" + "".join(f"{m:>7}" for m in args.rows))
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k) for _ in range(1 if n > 10_000 else args.layers)]
        ratios = []
        for m in args.rows:
            x = torch.randn(m, k)
            plain = seconds(lambda: [F.linear(x, w) for w in weights], args.repeats)
            flipped = seconds(lambda: [torch.mm(w, x.t()).t().contiguous() for w in weights],
                              args.repeats)
            ratios.append(plain / flipped)
        print(f"{name:22}" + "".join(f"{r:7.2f}" for r in ratios))


if __name__ == "__main__":
    main()
