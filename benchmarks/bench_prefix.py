"""Benchmark: prefix caching on vs off on shared-prefix workloads at several hit rates.

Workload (`minillm.lab.prefix_workloads.shared_prefix_prompts`, seeded): G groups x P prompts per
group; every prompt has the same length L = S + Q, where the S system-prompt tokens are shared
within a group and the Q question tokens are not. S is chosen per point so that the ideal token
hit rate (P - 1) / P * S / L is about 0, 50, 80 and 95%. Prompts are random token ids, outputs
O tokens with EOS ignored, greedy (O = 64 on the CPU: an answer of a few sentences, so the
decode steps, which caching does not shorten, are in the measurement). Requests of a group are
interleaved with the other groups'.

For each point the same prompts run through two fresh engines, minillm.LLM with
enable_prefix_caching=True and =False (same model object, same limits), alternating on/off for
`--repeats` rounds after a warm-up; medians are reported:

    speedup      wall time off / wall time on for the same requests (the same work done);
                 on a CPU also the ratio of this process's CPU time (time.process_time), which
                 a machine shared with other jobs disturbs far less than wall time
    output tok/s generated tokens / wall time: counts no prompt token, so a cached prompt
                 token is never counted as throughput (an (input + output) tok/s would count it)
    computed     prompt tokens actually run through the model (prompt tokens - cached)
    ttft         mean and p90 of per-request time to first token (includes queueing: all
                 requests arrive at once)
    hit_rate     engine.prefix_cache_stats.hit_rate (prompt tokens served from the cache)

    # CPU: bundled SmolLM2-135M, G=1, P=32, L=129, O=64; one hit rate per call (short quiet
    # runs), the rows appended to one record
    python benchmarks/bench_prefix.py --threads 2 --hit-rates 0.0 --out benchmarks/results/x.json
    python benchmarks/bench_prefix.py --threads 2 --hit-rates 0.5 --append benchmarks/results/x.json
    # GPU: random-weight Llama-3.2-1B, G=8, P=32, L=2049
    python benchmarks/bench_prefix.py --device cuda

(L = a multiple of the block size + 1, so that a 95% hit rate is reachable with full blocks.)

Targets (from the course plan): >= 2x throughput at an 80% hit rate and <= 1% throughput loss at
0%. The JSON records whether each holds on the device it ran on. CPU numbers say nothing about
a GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import minillm  # noqa: E402
from minillm import SamplingParams, configs  # noqa: E402
from minillm.cache.blocks import BlockManager  # noqa: E402
from minillm.cache.prefix import PrefixCachingBlockManager  # noqa: E402
from minillm.loader import random_model  # noqa: E402
from minillm.lab.prefix_workloads import ideal_hit_rate, shared_prefix_prompts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULTS = {
    "cpu": dict(model="smollm2-135m", weights="pretrained", num_groups=1, prompts_per_group=32,
                prompt_len=129, output_len=64, max_num_seqs=64, max_num_batched_tokens=1024,
                repeats=3),
    "cuda": dict(model="llama-3.2-1b", weights="random", num_groups=8, prompts_per_group=32,
                 prompt_len=2049, output_len=64, max_num_seqs=256, max_num_batched_tokens=16384,
                 repeats=3),
}
TARGET_HIT_RATES = (0.0, 0.5, 0.8, 0.95)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cpu", "cuda"])
    p.add_argument("--model", default=None)
    p.add_argument("--weights", choices=["pretrained", "random"], default=None)
    p.add_argument("--num-groups", type=int, default=None)
    p.add_argument("--prompts-per-group", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hit-rates", type=float, nargs="+", default=list(TARGET_HIT_RATES))
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--out", type=Path, default=None, help="write the record to this file")
    p.add_argument("--append", type=Path, default=None, metavar="JSON",
                   help="add the rows to this existing record (same workload) instead of a new one")
    p.add_argument("--overhead-only", type=Path, default=None, metavar="JSON",
                   help="only measure the bookkeeping overhead for the workload of an existing "
                        "record and add it to that file")
    args = p.parse_args(argv)
    for k, v in DEFAULTS[args.device].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a GPU; run without it for the CPU mode")
    return args


def system_len_for(hit_rate, args):
    """S such that (P-1)/P * S/L is closest to hit_rate, S a multiple of the block size (only
    full blocks are shared) and S < L."""
    P, L, bs = args.prompts_per_group, args.prompt_len, args.block_size
    best = min(range(0, L, bs), key=lambda s: abs(ideal_hit_rate(P, s, L - s, bs) - hit_rate))
    return best


def load(args, dtype):
    if args.weights == "pretrained":
        return minillm.load_model(args.model, device=args.device, dtype=dtype)
    model = random_model(configs.get(args.model), args.device, dtype, seed=0)
    return model, None


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run_once(model, tok, prompts, caching, args):
    llm = minillm.LLM((model, tok), block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      enable_prefix_caching=caching)
    sp = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    sync(args.device)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    sync(args.device)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    generated = sum(len(o.token_ids) for o in outs)
    assert generated == args.output_len * len(prompts), "ignore_eos: every request runs to O"
    cached = sum(o.num_cached_tokens for o in outs)
    ttfts = sorted(o.metrics.ttft for o in outs)
    return {"seconds": seconds, "output_tok_s": generated / seconds,
            "cpu_seconds": cpu_seconds, "output_tok_per_cpu_s": generated / cpu_seconds,
            "computed_prompt_tokens": sum(map(len, prompts)) - cached,
            "ttft_mean_s": statistics.fmean(ttfts),
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "hit_rate": llm.engine.prefix_cache_stats.hit_rate,
            "cached_tokens": cached,
            "token_ids": [o.token_ids for o in outs]}


def bookkeeping_overhead(prompts, block_size, output_len, repeats=5):
    """CPU seconds the prefix cache's bookkeeping adds to one run of these prompts, measured
    without the model: the block-manager calls the engine makes for each request (lookup,
    allocate, mark pending, grow by output_len, cache full blocks, free) with prefix caching,
    minus the plain BlockManager's allocate / grow / free. Median of `repeats`."""
    def replay(caching):
        n_blocks = sum(-(-(len(p) + output_len) // block_size) for p in prompts) + 1
        bm = (PrefixCachingBlockManager if caching else BlockManager)(n_blocks, block_size)
        t0 = time.process_time()
        for i, p in enumerate(prompts):
            ids = list(p) + [0] * output_len
            if caching:
                hits = bm.find_cached_blocks(p)
                bm.is_computing(p, hits)
                bm.allocate(i, len(p), hits) if hits else bm.allocate(i, len(p))
                bm.mark_pending(i, p)
                bm.cache_full_blocks(i, len(p), lambda a, b: ids[a:b])
            else:
                bm.allocate(i, len(p))
            for n in range(len(p) + 1, len(p) + output_len):
                bm.allocate(i, n)
                if caching:
                    bm.cache_full_blocks(i, n, lambda a, b: ids[a:b])
        for i in range(len(prompts)):
            bm.free(i)
        return time.process_time() - t0
    on = statistics.median(replay(True) for _ in range(repeats))
    off = statistics.median(replay(False) for _ in range(repeats))
    return on - off


def add_overhead(path, args):
    """--overhead-only: the bookkeeping overhead of each row of an existing record."""
    record = json.loads(path.read_text())
    w = record["workload"]
    vocab = w.get("vocab_size", 49152)           # SmolLM2's, for records older than the field
    for row in record["rows"]:
        prompts = shared_prefix_prompts(w["num_groups"], w["prompts_per_group"], row["system_len"],
                                        row["question_len"], vocab, seed=w["seed"])
        extra = bookkeeping_overhead(prompts, w["block_size"], w["output_len"])
        row["bookkeeping_cpu_s"] = extra
        row["bookkeeping_share_of_off_run"] = extra / row["cpu_seconds_off"]
        print(f"hit rate {row['hit_rate_measured']:.2f}: prefix-cache bookkeeping "
              f"{extra * 1e3:.2f} ms CPU = {row['bookkeeping_share_of_off_run']:.5%} "
              "of the caching-off run")
    record["bookkeeping_command"] = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    path.write_text(json.dumps(record, indent=1))


def device_name(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
           f"{torch.get_num_threads()} torch threads)"


def main(argv=None):
    args = parse_args(argv)
    if args.overhead_only is not None:
        return add_overhead(args.overhead_only, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, tok = load(args, dtype)
    vocab = model.config.vocab_size
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"benchmark": "prefix caching on vs off (shared-prefix workload)",
              "device": args.device, "device_name": device_name(args.device),
              "date": now.isoformat(timespec="seconds"),
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "minillm": minillm.__version__},
              "dtype": str(dtype).removeprefix("torch."),
              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
              "load_average_before": os.getloadavg() if hasattr(os, "getloadavg") else None,
              "workload": {"model": args.model, "weights": args.weights,
                           "num_groups": args.num_groups,
                           "prompts_per_group": args.prompts_per_group,
                           "prompt_len": args.prompt_len, "output_len": args.output_len,
                           "block_size": args.block_size, "seed": args.seed,
                           "vocab_size": vocab,
                           "ignore_eos": True, "greedy": True},
              "engine": {"max_num_seqs": args.max_num_seqs,
                         "max_num_batched_tokens": args.max_num_batched_tokens},
              "repeats": args.repeats, "rows": []}
    warm = shared_prefix_prompts(1, 2, 16, 8, vocab, seed=args.seed + 99)
    for caching in (False, True):
        run_once(model, tok, warm, caching, args)
    for target in args.hit_rates:
        load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
        s = system_len_for(target, args)
        prompts = shared_prefix_prompts(args.num_groups, args.prompts_per_group, s,
                                        args.prompt_len - s, vocab, seed=args.seed)
        runs = {False: [], True: []}
        for r in range(args.repeats):
            order = (False, True) if r % 2 == 0 else (True, False)   # alternate who goes first
            for caching in order:
                runs[caching].append(run_once(model, tok, prompts, caching, args))
        row = {"target_hit_rate": target, "load_average_before": load_before,
               "command": record["command"], "date": record["date"], "system_len": s,
               "question_len": args.prompt_len - s,
               "ideal_hit_rate": ideal_hit_rate(args.prompts_per_group, s, args.prompt_len - s,
                                                args.block_size),
               "same_tokens_on_off": runs[True][0]["token_ids"] == runs[False][0]["token_ids"]}
        for caching, name in ((False, "off"), (True, "on")):
            for k in ("seconds", "output_tok_s", "cpu_seconds", "output_tok_per_cpu_s",
                      "ttft_mean_s", "ttft_p90_s", "computed_prompt_tokens"):
                row[f"{k}_{name}"] = statistics.median(x[k] for x in runs[caching])
                row[f"{k}_{name}_all"] = [x[k] for x in runs[caching]]
        row["hit_rate_measured"] = runs[True][0]["hit_rate"]
        row["bookkeeping_cpu_s"] = bookkeeping_overhead(prompts, args.block_size, args.output_len)
        row["bookkeeping_share_of_off_run"] = row["bookkeeping_cpu_s"] / row["cpu_seconds_off"]
        row["prompt_tokens"] = sum(map(len, prompts))
        row["speedup"] = row["seconds_off"] / row["seconds_on"]
        row["speedup_cpu_time"] = row["cpu_seconds_off"] / row["cpu_seconds_on"]
        row["ttft_ratio_off_over_on"] = row["ttft_mean_s_off"] / row["ttft_mean_s_on"]
        record["rows"].append(row)
        print(f"hit rate target {target:4.2f} measured {row['hit_rate_measured']:5.3f}: "
              f"{row['output_tok_s_off']:6.0f} -> {row['output_tok_s_on']:6.0f} output tok/s "
              f"({row['speedup']:.2f}x wall, {row['speedup_cpu_time']:.2f}x CPU time), "
              f"TTFT mean {row['ttft_mean_s_off']:.3f} -> "
              f"{row['ttft_mean_s_on']:.3f} s, same tokens {row['same_tokens_on_off']}",
              flush=True)
    record["load_average_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    if args.append is not None:                     # one record, rows from several short calls
        old = json.loads(args.append.read_text())
        if old["workload"] != record["workload"] or old["engine"] != record["engine"]:
            raise SystemExit(f"{args.append} records another workload; start a new record")
        old["rows"] = sorted(old["rows"] + record["rows"], key=lambda r: r["target_hit_rate"])
        old["commands"] = old.get("commands", [old["command"]]) + [record["command"]]
        record = old
    by = {r["target_hit_rate"]: r for r in record["rows"]}
    # judged on CPU time where the device is a shared CPU (wall time there mostly measures the
    # other processes), on wall time on a GPU
    key = "speedup_cpu_time" if args.device == "cpu" else "speedup"
    record["targets_judged_on"] = key
    record["targets"] = {
        ">= 2x throughput at 80% hit rate": (by[0.8][key] >= 2.0) if 0.8 in by else None,
        "<= 1% loss at 0% hit rate": (by[0.0][key] >= 0.99) if 0.0 in by else None}
    print("targets:", record["targets"])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.append or args.out or \
        args.out_dir / f"prefix_{args.device}_{now.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps(record, indent=1))
    plot(record, path.with_suffix(".png"))
    print(f"wrote {path}")
    return record


def plot(record, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = record["rows"]
    x = [r["hit_rate_measured"] * 100 for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.plot(x, [r["output_tok_s_off"] for r in rows], "o-", label="caching off")
    a.plot(x, [r["output_tok_s_on"] for r in rows], "o-", label="caching on")
    for xi, r in zip(x, rows):
        a.annotate(f"{r['speedup']:.2f}x", (xi, r["output_tok_s_on"]), fontsize=8,
                   textcoords="offset points", xytext=(-10, 6))
    a.set_xlabel("measured prefix-cache hit rate (% of prompt tokens)")
    a.set_ylabel("output tokens / s (cached prompt tokens not counted)")
    a.legend(fontsize=8)
    b.plot(x, [r["ttft_mean_s_off"] * 1e3 for r in rows], "o-", label="caching off")
    b.plot(x, [r["ttft_mean_s_on"] * 1e3 for r in rows], "o-", label="caching on")
    b.set_xlabel("measured prefix-cache hit rate (%)")
    b.set_ylabel("mean TTFT (ms), all requests at once")
    b.legend(fontsize=8)
    w = record["workload"]
    fig.suptitle(f"{record['device_name']}, {record['dtype']}, {w['model']}: "
                 f"{w['num_groups']}x{w['prompts_per_group']} prompts of {w['prompt_len']} "
                 f"tokens, {w['output_len']} out", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
