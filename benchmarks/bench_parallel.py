"""Benchmark: tensor parallelism on this CPU (chapter 10): tokens/s and the compute /
communication split of engine steps for tp degrees x batch sizes, plus a GPU estimate.

Each configuration runs `batch` greedy requests (16-token prompts, --max-tokens new tokens)
through `LLM(tensor_parallel_size=tp)` on a random-weight model whose heads split over the
ranks. Communication is the time rank 0 spends inside all-reduces (gloo over loopback on THIS
machine, which includes waiting for the slower rank); compute is the rest of the wall time.
A 2-stage pipeline (minillm.parallel.pipeline, stages as threads) runs m = 1, 2, 4, 8
micro-batches of 64 tokens and its measured bubble is recorded beside (p - 1) / (m + p - 1).
The GPU part is an ESTIMATE from public link bandwidths (minillm.parallel.comm.LINKS), not a
measurement: the device lent to the course has one GPU, so TP on it is out of reach.

    python benchmarks/bench_parallel.py --tp 1 2 --batch 1 8 --out benchmarks/results/x.json

Run it under /work/bin/quiet-run: each rank gets --threads-per-rank threads (tp = 2 with 1
thread each uses the same two cores as tp = 1 with 2 threads, which is also measured).
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
from minillm import LLM, SamplingParams, configs  # noqa: E402
from minillm.loader import random_model  # noqa: E402
from minillm.parallel.comm import (LINKS, all_reduce_seconds_estimate,  # noqa: E402
                                   tp_all_reduce_bytes_per_token)
from minillm.parallel.pipeline import bubble_fraction, pipeline_forward  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step_profile import cpu_model  # noqa: E402


def bench_config(args):
    return configs.get("smollm2-135m").with_(
        name="tp-bench", num_layers=args.layers, hidden_size=args.hidden,
        intermediate_size=4 * args.hidden, num_heads=args.hidden // 64, num_kv_heads=2,
        head_dim=64, max_position_embeddings=512)


def run_one(model, tp: int, threads: int, batch: int, max_tokens: int) -> dict:
    torch.set_num_threads(threads)
    llm = LLM((model, None), tensor_parallel_size=tp, max_num_seqs=batch,
              num_kv_blocks=batch * 8 + 8, block_size=16)
    try:
        prompts = [[(7 * i + j) % 1000 + 1 for j in range(16)] for i in range(batch)]
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        if tp > 1:
            llm.engine.executor.comm_stats(reset=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - start
        comm = llm.engine.executor.comm_stats()[0] if tp > 1 else None
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    comm_s = comm.all_reduce_seconds if comm else 0.0
    return {"tp": tp, "threads_per_rank": threads, "batch": batch, "tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "comm_s": round(comm_s, 3), "compute_s": round(wall - comm_s, 3),
            "comm_fraction": round(comm_s / wall, 3),
            "all_reduce_calls": comm.all_reduce_calls if comm else 0,
            "all_reduce_bytes": comm.all_reduce_bytes if comm else 0}


def pipeline_rows(model, micro_batches, tokens: int) -> list:
    """Measured bubble of a 2-stage pipeline (threads, gloo send / recv) against the formula."""
    torch.set_num_threads(1)
    rows = []
    for m in micro_batches:
        micro = [torch.randint(0, model.config.vocab_size, (1, tokens)) for _ in range(m)]
        start = time.perf_counter()
        _, spans, stats = pipeline_forward(model, micro, pp=2)
        wall = time.perf_counter() - start
        rows.append({"pp": 2, "micro_batches": m, "tokens_per_micro_batch": tokens,
                     "wall_s": round(wall, 4),
                     "bubble_measured": round(bubble_fraction(spans, 2), 3),
                     "bubble_formula": round(1 / (m + 1), 3),
                     "p2p_bytes": stats[0].send_bytes})
        print(rows[-1], flush=True)
    return rows


def gpu_estimate() -> list:
    """Per decode token of Llama-3-70B (bf16), the all-reduce time for tp = 8 on each link."""
    cfg = configs.get("llama-3-70b")
    payload = tp_all_reduce_bytes_per_token(cfg, 2) // (2 * cfg.num_layers)   # one all-reduce
    rows = []
    for link in LINKS:
        for batch in (1, 64):
            t = all_reduce_seconds_estimate(payload * batch, 8, link)
            rows.append({"model": cfg.name, "tp": 8, "link": link, "batch": batch,
                         "per_all_reduce_us": round(t * 1e6, 2),
                         "per_step_ms": round(t * 2 * cfg.num_layers * 1e3, 3)})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--micro-batches", type=int, nargs="*", default=[1, 2, 4, 8])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cfg = bench_config(args)
    model = random_model(cfg, "cpu", torch.float32, seed=0)
    rows = []
    for tp in args.tp:
        threads = [args.threads_per_rank] + ([2] if tp == 1 and args.threads_per_rank == 1
                                             else [])
        for th in threads:
            for b in args.batch:
                row = run_one(model, tp, th, b, args.max_tokens)
                print(row, flush=True)
                rows.append(row)
    result = {"benchmark": "bench_parallel", "device": cpu_model(),
              "backend": "gloo over loopback (CPU processes on one machine)",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": shlex.join([sys.executable.split("/")[-1]] + sys.argv),
              "load_average": os.getloadavg(), "torch": torch.__version__,
              "model": {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "num_heads",
                                                     "num_kv_heads", "intermediate_size")},
              "cpu_rows": rows,
              "pipeline_rows": pipeline_rows(model, args.micro_batches, 64),
              "gpu_estimate": {"label": "ESTIMATE from public link bandwidths, not measured",
                               "links_bytes_per_s_one_way": LINKS, "rows": gpu_estimate()}}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        plot(result, Path(args.out).with_suffix(".png"))
    return result


def plot(result: dict, path: Path) -> None:
    """Left: tokens/s per (tp, threads) and batch, the communication share hatched. Right: the
    pipeline's measured bubble against the formula."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    rows = result["cpu_rows"]
    labels = [f"tp{r['tp']} x{r['threads_per_rank']}t\nbatch {r['batch']}" for r in rows]
    tps = [r["tokens_per_s"] for r in rows]
    a.bar(labels, tps, color="C0", label="tokens/s")
    a.bar(labels, [t * r["comm_fraction"] for t, r in zip(tps, rows)], color="none",
          edgecolor="C3", hatch="//", label="share of wall time in all-reduce")
    a.set_ylabel("tokens/s (CPU, gloo over loopback)")
    a.legend(fontsize=8)
    pr = result["pipeline_rows"]
    m = [r["micro_batches"] for r in pr]
    b.plot(m, [r["bubble_formula"] for r in pr], "o-", label="(p-1)/(m+p-1)")
    b.plot(m, [r["bubble_measured"] for r in pr], "s--", label="measured (CPU)")
    b.set_xlabel("micro-batches m (p = 2)")
    b.set_ylabel("bubble fraction")
    b.legend(fontsize=8)
    fig.suptitle(f"{result['device']}, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
