"""Benchmark: what torch.compile buys on this machine for the decoder's per-token work (chapter 12).

The bundled model's 30 layers WITHOUT attention (RMSNorm -> fused gate/up -> SiLU x up -> down,
with the residual add: the products and the small element-wise ops compile can fuse), run on
`rows` token rows, eager against `torch.compile` (inductor, default mode). Attention is left out
on purpose: the engine's paged CPU attention reads its step's tables on the host, which a
compiled graph would break around. Times are medians of interleaved rounds (roofline's
`interleaved_times`), compile time excluded and reported.

    python benchmarks/bench_compile.py --rows 1 16 --out benchmarks/results/compile_cpu_x.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import minillm  # noqa: E402
from minillm.roofline import interleaved_times  # noqa: E402

from bench_step_profile import cpu_model  # noqa: E402


class MLPStack(torch.nn.Module):
    """Every layer's post-attention half: x + mlp(norm(x))."""

    def __init__(self, model):
        super().__init__()
        self.norms = torch.nn.ModuleList(b.post_attention_layernorm for b in model.layers)
        self.mlps = torch.nn.ModuleList(b.mlp for b in model.layers)

    def forward(self, x):                                    # x [rows, C]
        for norm, mlp in zip(self.norms, self.mlps):
            x = x + mlp(norm(x))
        return x


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    model, _ = minillm.load_model(args.model, device="cpu", dtype=getattr(torch, args.dtype))
    stack = MLPStack(model).eval()
    rows = []
    for n in args.rows:
        x = torch.randn(n, model.config.hidden_size, dtype=model.dtype)
        compiled = torch.compile(stack)
        with torch.inference_mode():
            t0 = time.perf_counter()
            got = compiled(x)
            compile_s = time.perf_counter() - t0
            same = torch.allclose(got, stack(x), atol=1e-3, rtol=1e-3)
            t = interleaved_times({"eager": lambda: stack(x), "compiled": lambda: compiled(x)},
                                  repeats=args.repeats)
        med = {k: 1e3 * sorted(v)[len(v) // 2] for k, v in t.items()}
        rows.append({"rows": n, "eager_ms": round(med["eager"], 3),
                     "compiled_ms": round(med["compiled"], 3),
                     "speedup": round(med["eager"] / med["compiled"], 3),
                     "compile_s": round(compile_s, 1), "same_output": bool(same)})
        print(rows[-1], flush=True)
    record = {"benchmark": "compile_mlp_stack", "model": args.model, "dtype": args.dtype,
              "threads": args.threads, "device": cpu_model(), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
              "load_before": load_before, "load_after": os.getloadavg()[0],
              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
