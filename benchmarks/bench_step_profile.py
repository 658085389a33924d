"""Benchmark: where one engine step's time goes (chapter 12), with torch.profiler.

For each batch size, `batch` requests with `--context`-token prompts are prefilled, then decode
steps are timed (no profiler) and profiled: GEMM self time (`minillm.lab.profiling.GEMM_OPS`)
against everything else, torch ops per step, and the heaviest ops.

    python benchmarks/bench_step_profile.py --batch 1 16 64 --out benchmarks/results/x.json

`--skeleton` profiles `minillm.lab.profiling.skeleton_config` of the model instead (random
weights): the same ops and code path with next to no arithmetic, the eager floor of a step.

Run it under /work/bin/quiet-run (or on any quiet machine) with 2 threads: the numbers are this
machine's, measured side by side in one process.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import minillm  # noqa: E402
from minillm.lab.profiling import (decode_engine, op_table, profile_steps,  # noqa: E402
                                   skeleton_config)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(l.split(":", 1)[1].strip() for l in out.splitlines()  # noqa: E741
                    if l.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None, choices=["int8", "int4"],
                   help="chapter 09's weight quantization of the decoder linears")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5,
                   help="profile this many times and keep the round with the median step time "
                        "(a shared machine's step time moves by a third from one second to the "
                        "next; every round's time is recorded)")
    p.add_argument("--skeleton", action="store_true",
                   help="the model's skeleton (same ops, next to no arithmetic, random weights)")
    p.add_argument("--bf16-attention", choices=["auto", "on", "off"], default="auto",
                   help="bf16 queries attend in bf16 (on), upcast to fp32 (off), or by the CPU's "
                        "AMX (auto: minillm.kernels.batched.bf16_attention_here)")
    p.add_argument("--gqa-fold", choices=["on", "off"], default="on",
                   help="a decode's query heads folded onto their KV head in attention (on, "
                        "the default) or enable_gqa's way (off): minillm.model.FOLD_GQA")
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]            # at the start, before this run adds to it
    from minillm.kernels import batched
    batched.BF16_ATTENTION = {"auto": None, "on": True, "off": False}[args.bf16_attention]
    minillm.model.FOLD_GQA = args.gqa_fold == "on"
    torch.set_num_threads(args.threads)
    name = args.model
    if args.skeleton:
        name = skeleton_config(minillm.load_model(args.model, device="meta")[0].config)
    model, _ = minillm.load_model(name, device="cpu", dtype=getattr(torch, args.dtype),
                                  quantization=args.quantization,
                                  weights="random" if args.skeleton else "pretrained")
    rows = []
    for b in args.batch:
        engine = decode_engine(model, b, args.context,
                               max_new_tokens=(2 * args.steps + 3) * args.rounds + 8)
        with torch.inference_mode():
            rounds = sorted((profile_steps(engine, args.steps) for _ in range(args.rounds)),
                            key=lambda pr: pr.step_ms)
        prof = rounds[len(rounds) // 2]
        print(f"--- batch {b}, context {args.context}, {args.dtype}\n{op_table(prof)}\n")
        rows.append({"batch": b, "step_ms": round(prof.step_ms, 2),
                     "gemm_ms": round(prof.gemm_ms, 2), "other_ms": round(prof.other_ms, 2),
                     "ops_per_step": round(prof.ops_per_step),
                     "step_ms_rounds": [round(pr.step_ms, 2) for pr in rounds],
                     "top_ops": [[n, round(c, 1), round(ms, 3)] for n, c, ms in prof.rows[:10]]})
    record = {"benchmark": "step_profile", "label": args.label, "model": model.config.name,
              "dtype": args.dtype, "quantization": args.quantization, "context": args.context,
              "bf16_attention": batched.bf16_attention_here(), "gqa_fold": minillm.model.FOLD_GQA,
              "threads": args.threads,
              "device": cpu_model(), "date": datetime.datetime.now(datetime.timezone.utc)
              .strftime("%Y-%m-%dT%H:%MZ"), "torch": torch.__version__,
              "load_before": load_before, "load_after": os.getloadavg()[0],
              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
