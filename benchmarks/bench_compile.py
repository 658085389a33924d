"""Benchmark: what torch.compile buys on a CPU decode step's products (chapter 12).

A decode step's time outside attention is, per layer: the output projection, a residual add,
the RMSNorm, the fused gate/up product, SiLU * up, the down product, a residual add. This times
that half-layer over all 30 layers of the bundled model, one row (batch-1 decode) and more,
four ways side by side in one process:

    eager_f_linear     the half-layer written with F.linear (what nn.Linear does)
    eager_minillm      the same through the model's own modules (minillm.model.Linear: 1-4 rows
                       as a (W @ x^T)^T product, one row sent as two)
    compiled_f_linear  torch.compile (Inductor, default mode) of the F.linear version
    compiled_minillm   torch.compile of the modules version

The weights are passed as arguments, so one compiled graph serves every layer (no recompiles).
Attention is left out on purpose: it needs the paged KV cache, whose Python bookkeeping breaks
a graph. Same outputs up to float rounding (max |diff| recorded).

    python benchmarks/bench_compile.py --rows 1 4 16 --out benchmarks/results/compile_cpu_x.json

Run it on a quiet machine (/work/bin/quiet-run) with 2 threads; compile time is recorded too.
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

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")   # no compile workers competing
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import minillm  # noqa: E402
from bench_step_profile import cpu_model  # noqa: E402


def half_f_linear(x, h, o_w, norm_w, gate_up_w, down_w, eps: float):
    """x residual [M, C], h attention output [M, C] -> the layer's output [M, C]."""
    x = x + F.linear(h, o_w)
    n = F.rms_norm(x, x.shape[-1:], norm_w, eps)
    gate, up = F.linear(n, gate_up_w).chunk(2, dim=-1)                # [M, I] each
    return x + F.linear(F.silu(gate) * up, down_w)


def half_minillm(x, h, layer):
    """The same half-layer through the model's modules."""
    x = x + layer.self_attn.o_proj(h)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def systems(model):
    eps = model.config.rms_norm_eps
    weights = [(L.self_attn.o_proj.weight, L.post_attention_layernorm.weight,
                L.mlp.gate_up_proj.weight, L.mlp.down_proj.weight) for L in model.layers]
    comp_f = torch.compile(half_f_linear, dynamic=False)
    comp_m = torch.compile(half_minillm, dynamic=False)

    def stack(fn, per_layer):
        def run(x, h):
            for item in per_layer:
                x = fn(x, h, *item) if isinstance(item, tuple) else fn(x, h, item)
            return x
        return run

    with_eps = [w + (eps,) for w in weights]
    return {"eager_f_linear": stack(half_f_linear, with_eps),
            "eager_minillm": stack(half_minillm, list(model.layers)),
            "compiled_f_linear": stack(comp_f, with_eps),
            "compiled_minillm": stack(comp_m, list(model.layers))}


def seconds(fn, x, h, repeats, rounds=3):
    """The best of `rounds` averages of `repeats` calls."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn(x, h)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    model, _ = minillm.load_model("smollm2-135m", device="cpu")
    C = model.config.hidden_size
    rows_out = []
    with torch.inference_mode():
        fns = systems(model)
        for m in args.rows:
            g = torch.Generator().manual_seed(m)
            x, h = torch.randn(m, C, generator=g), torch.randn(m, C, generator=g)
            ref = fns["eager_f_linear"](x, h)
            row = {"rows": m}
            for name, fn in fns.items():                               # compile first
                t0 = time.perf_counter()
                out = fn(x, h)                                         # compiles on first call
                row[f"{name}_first_call_s"] = round(time.perf_counter() - t0, 2)
                row[f"{name}_max_diff"] = float((out - ref).abs().max())
            for name, fn in fns.items():                               # then time, side by side
                row[f"{name}_ms"] = round(1e3 * seconds(fn, x, h, args.repeats), 2)
            print(m, "rows:", {k: v for k, v in row.items() if k.endswith("_ms")})
            rows_out.append(row)
    record = {"benchmark": "compile", "model": "smollm2-135m", "dtype": "float32",
              "what": "o_proj + residual + RMSNorm + gate_up + SiLU*up + down + residual, "
                      "30 layers, no attention",
              "threads": args.threads, "device": cpu_model(), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
              "load_before": load_before, "load_after": os.getloadavg()[0],
              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "rows": rows_out}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
