"""Benchmark: tensor parallelism on this CPU (chapter 10): tokens/s and the compute /
communication split of engine steps for tp degrees x batch sizes, plus a GPU estimate.

Each configuration runs `batch` greedy requests (16-token prompts, --max-tokens new tokens)
through `LLM(tensor_parallel_size=tp)` on a random-weight model whose heads split over the
ranks. Communication is the time rank 0 spends inside all-reduces (gloo over loopback on THIS
machine, which includes waiting for the slower rank); compute is the rest of the wall time.
A 2-stage pipeline (minillm.parallel.pipeline, stages as threads) runs m = 1, 2, 4, 8
micro-batches of 64 tokens and its measured bubble is recorded beside (p - 1) / (m + p - 1).
The engine's pipeline, LLM(pipeline_parallel_size=2) (stage 0 in the driver, stage 1 a worker
process, one thread each), runs --pp-batch requests with m = --pp-micro-batches micro-batches
per step on a model of --pp-layers layers and a small vocabulary (stages of about equal cost),
beside the one-process engine with 1 and 2 threads; the bubble is read off every stage's
compute spans and recorded beside (p - 1) / (m + p - 1). Only the pipeline part:

    python benchmarks/bench_parallel.py --tp --micro-batches --out benchmarks/results/y.json

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


def pp_config(args):
    """The engine pipeline's model: --pp-layers layers of width --hidden and a small vocabulary
    (--pp-vocab), so the last stage's lm_head does not dwarf its layers (stages of about equal
    cost, as the formula assumes)."""
    return bench_config(args).with_(name="pp-bench", num_layers=args.pp_layers,
                                     vocab_size=args.pp_vocab)


def engine_pp_rows(model, batch: int, micro_batches, max_tokens: int) -> list:
    """LLM(pipeline_parallel_size=2) with m micro-batches per step, one thread per process (2
    in all), beside the one-process engine with 1 and 2 threads: tokens/s, and the bubble read
    off every stage's compute spans, summed over the steps: 1 - busy / (p x makespan)."""
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(16)] for i in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        llm = LLM((model, None), max_num_seqs=batch, num_kv_blocks=batch * 8 + 8)
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"pp": 1, "threads_per_process": threads, "processes": 1, "batch": batch,
                     "tokens": tokens, "wall_s": round(wall, 3),
                     "tokens_per_s": round(tokens / wall, 1)})
        print(rows[-1], flush=True)
    torch.set_num_threads(1)
    llm = LLM((model, None), pipeline_parallel_size=2, max_num_seqs=batch,
              num_kv_blocks=batch * 8 + 8)
    try:
        ex = llm.engine.executor
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        for m in micro_batches:
            ex.num_micro_batches = m
            llm.reset_prefix_cache()
            ex.timeline.clear()
            start = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            wall = time.perf_counter() - start
            rows.append(pp_row(list(ex.timeline), m, batch, wall,
                               sum(len(o.outputs[0].token_ids) for o in outs)))
            print(rows[-1], flush=True)
    finally:
        llm.shutdown()
    return rows


def pp_row(steps: list, m: int, batch: int, wall: float, tokens: int) -> dict:
    """One pp = 2 row from the steps' spans ([[Span]] per step)."""
    busy = sum(s.end - s.start for spans in steps for s in spans)
    makespans = [max(s.end for s in spans) - min(s.start for s in spans) for spans in steps]
    per_step = [len(spans) // 2 for spans in steps]               # micro-batches each step ran
    m_used = max(set(per_step), key=per_step.count)
    return {"pp": 2, "threads_per_process": 1, "processes": 2, "batch": batch,
            "micro_batches": m, "micro_batches_most_steps": m_used, "steps": len(steps),
            "tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "forward_share_of_wall": round(sum(makespans) / wall, 3),
            "bubble_measured": round(1 - busy / (2 * sum(makespans)), 3),
            "bubble_formula": round(1 / (m_used + 1), 3)}


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
    p.add_argument("--tp", type=int, nargs="*", default=[1, 2])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--micro-batches", type=int, nargs="*", default=[1, 2, 4, 8])
    p.add_argument("--pp-micro-batches", type=int, nargs="*", default=[1, 2, 4])
    p.add_argument("--pp-batch", type=int, default=8)
    p.add_argument("--pp-layers", type=int, default=8)
    p.add_argument("--pp-vocab", type=int, default=4096)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cfg = bench_config(args)
    model = random_model(cfg, "cpu", torch.float32, seed=0)
    pp_cfg = pp_config(args)
    pp_model = random_model(pp_cfg, "cpu", torch.float32, seed=0)
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
              "engine_pp_model": {k: getattr(pp_cfg, k) for k in (
                  "num_layers", "hidden_size", "num_heads", "num_kv_heads",
                  "intermediate_size", "vocab_size")},
              "engine_pp_rows": (engine_pp_rows(pp_model, args.pp_batch, args.pp_micro_batches,
                                                args.max_tokens)
                                 if args.pp_micro_batches else []),
              "gpu_estimate": {"label": "ESTIMATE from public link bandwidths, not measured",
                               "links_bytes_per_s_one_way": LINKS, "rows": gpu_estimate()}}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        plot(result, Path(args.out).with_suffix(".png"))
    return result


def plot(result: dict, path: Path) -> None:
    """One panel per part present: tokens/s per (tp, threads) and batch with the communication
    share hatched; the threaded pipeline's bubble against the formula; the engine pipeline's
    tokens/s and bubble against the formula."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    parts = [k for k in ("cpu_rows", "pipeline_rows", "engine_pp_rows") if result.get(k)]
    fig, axes = plt.subplots(1, len(parts), figsize=(5.5 * len(parts), 4), squeeze=False)
    for ax, part in zip(axes[0], parts):
        {"cpu_rows": _plot_tp, "pipeline_rows": _plot_threads,
         "engine_pp_rows": _plot_engine_pp}[part](ax, result[part])
    fig.suptitle(f"{result['device']}, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_tp(a, rows) -> None:
    labels = [f"tp{r['tp']} x{r['threads_per_rank']}t\nbatch {r['batch']}" for r in rows]
    tps = [r["tokens_per_s"] for r in rows]
    a.bar(labels, tps, color="C0", label="tokens/s")
    a.bar(labels, [t * r["comm_fraction"] for t, r in zip(tps, rows)], color="none",
          edgecolor="C3", hatch="//", label="share of wall time in all-reduce")
    a.set_ylabel("tokens/s (CPU, gloo over loopback)")
    a.legend(fontsize=8)


def _plot_threads(b, pr) -> None:
    m = [r["micro_batches"] for r in pr]
    b.plot(m, [r["bubble_formula"] for r in pr], "o-", label="(p-1)/(m+p-1)")
    b.plot(m, [r["bubble_measured"] for r in pr], "s--", label="measured (CPU)")
    b.set_xlabel("micro-batches m (p = 2, stages as threads)")
    b.set_ylabel("bubble fraction")
    b.legend(fontsize=8)


def _plot_engine_pp(c, rows) -> None:
    one = [r for r in rows if r["pp"] == 1]
    pp = [r for r in rows if r["pp"] == 2]
    labels = ([f"pp1 x{r['threads_per_process']}t" for r in one]
              + [f"pp2 m={r['micro_batches']}" for r in pp])
    c.bar(labels, [r["tokens_per_s"] for r in one + pp], color="C0")
    c.set_ylabel(f"tokens/s (engine, batch {rows[0]['batch']})")
    d = c.twinx()
    x = list(range(len(one), len(one) + len(pp)))
    d.plot(x, [r["bubble_formula"] for r in pp], "o-", color="C1", label="(p-1)/(m+p-1)")
    d.plot(x, [r["bubble_measured"] for r in pp], "s--", color="C3", label="measured bubble")
    d.set_ylim(0, 1)
    d.set_ylabel("bubble fraction")
    d.legend(fontsize=8)


if __name__ == "__main__":
    main()
