"""Benchmark: latency against offered load for any OpenAI-compatible server
(`vllm bench serve` style).

Sends requests with ShareGPT- or Alpaca-like lengths (minillm.lab.workloads) as streamed
completions, with gamma/Poisson arrivals at each request rate of a sweep (or a fixed max
concurrency), and reports per rate: TTFT, TPOT, ITL, E2E latency (mean, p50, p90, p99), request
and token throughput, goodput under the SLOs given, and the mean concurrency (Little's law:
rate x E2E).
Metric definitions: minillm/serve/loadgen.py (vLLM's, so numbers compare); the summary is
minillm.metrics.summarize, the one the engine's own metrics go through.

    python -m minillm serve --model smollm2-135m --port 8000 &          # or vLLM, SGLang, ...
    python benchmarks/bench_serve.py --base-url http://127.0.0.1:8000 \\
        --mix alpaca --num-prompts 40 --request-rate 0.5 1 2 4 inf \\
        --max-output-len 32 --goodput ttft:2000 tpot:250

Prompts are text built with the bundled SmolLM2 tokenizer to the workload's token counts; the
server's own `usage` gives the counts it saw. EOS is ignored (vLLM's and SGLang's `ignore_eos`)
so every request produces its workload output length. Writes benchmarks/results/
serve_<tag>_<date>.json (device, date, versions, command, load average, one row per rate) and a
PNG with latency and throughput against rate.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.lab.workloads import workload_requests  # noqa: E402
from minillm.metrics import summarize  # noqa: E402
from minillm.serve.loadgen import run_load  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--mix", default="alpaca",
                   help="minillm.lab.workloads mix: sharegpt, alpaca, ...")
    p.add_argument("--num-prompts", type=int, default=100, help="requests per rate")
    p.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                   help="requests/s, one run each; inf = all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--max-input-len", type=int, default=None, help="cap (counted in the JSON)")
    p.add_argument("--max-output-len", type=int, default=None, help="cap (counted in the JSON)")
    p.add_argument("--context-len", type=int, default=2048)
    p.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                   help="SLOs in milliseconds, e.g. ttft:2000 tpot:250 e2el:10000")
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--no-ignore-eos", action="store_true")
    p.add_argument("--warmup", type=int, default=2, help="requests sent first, not measured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device-label", default=None,
                   help="what the server runs on (recorded; default: this machine's CPU)")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    slos = {}
    for item in args.goodput:        # vLLM's flag names (e2el) -> minillm.metrics' (e2e_latency)
        name, _, ms = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not ms:
            p.error(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        slos["e2e_latency" if name == "e2el" else name] = float(ms) / 1000.0
    args.slos = slos
    args.pcts = [float(x) for x in args.percentiles.split(",")]
    return args


def versions() -> dict:
    import httpx
    import openai
    return {"python": platform.python_version(), "openai": openai.__version__,
            "httpx": httpx.__version__}


def main(argv=None) -> dict:
    args = parse_args(argv)
    from minillm.loader import _bundled_tokenizer
    tok = _bundled_tokenizer()
    requests, capped = workload_requests(tok, args.mix, args.num_prompts, args.seed,
                                         args.context_len, args.max_input_len,
                                         args.max_output_len)
    warm, _ = workload_requests(tok, args.mix, args.warmup, args.seed + 1, args.context_len,
                                args.max_input_len, args.max_output_len)
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"benchmark": "serving latency vs request rate", "base_url": args.base_url,
              "device": args.device_label or (f"CPU ({platform.machine()}, {os.cpu_count()} "
                                              "cores), server and client on one machine"),
              "date": now.isoformat(timespec="seconds"), "versions": versions(),
              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
              "load_average_before": os.getloadavg(),
              "workload": {"mix": args.mix, "num_prompts": args.num_prompts, "seed": args.seed,
                           "max_input_len": args.max_input_len,
                           "max_output_len": args.max_output_len, "num_capped": capped,
                           "mean_prompt_len": sum(r.prompt_len for r in requests) / len(requests),
                           "mean_output_len": sum(r.max_tokens for r in requests) / len(requests),
                           "endpoint": args.endpoint, "ignore_eos": not args.no_ignore_eos,
                           "burstiness": args.burstiness,
                           "max_concurrency": args.max_concurrency},
              "slos_s": args.slos, "runs": []}
    if warm:
        asyncio.run(run_load(args.base_url, warm, model=args.model, endpoint=args.endpoint))
    for rate in args.request_rate:
        results, duration = asyncio.run(run_load(
            args.base_url, requests, rate=rate, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, model=args.model, endpoint=args.endpoint,
            ignore_eos=not args.no_ignore_eos, seed=args.seed))
        row = summarize(results, duration, ps=args.pcts,
                        **{f"{name}_slo": bound for name, bound in args.slos.items()})
        row["request_rate"] = "inf" if math.isinf(rate) else rate
        row["load_average_after"] = os.getloadavg()
        row["errors"] = sorted({r.error for r in results if r.error})[:5]
        record["runs"].append(row)
        print(table_row(row), flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"serve_{args.tag}_{now.strftime('%Y%m%d')}"
    path = args.out_dir / f"{stem}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")
    if not args.no_plot:
        plot(record, args.out_dir / f"{stem}.png")
    return record


HEADER = ("rate req/s | done | req/s | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | "
          "ITL p99 ms | E2E p50/p99 s | conc | goodput")


def table_row(r: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{1000 * x:.0f}"
    good = "-" if r["request_goodput"] is None else f"{r['request_goodput']:.2f}"
    return (f"{r['request_rate']} | {r['completed']}/{r['num_requests']} | "
            f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
            f"{ms(r['ttft_p50'])}/{ms(r['ttft_p99'])} | {ms(r['tpot_p50'])}/{ms(r['tpot_p99'])} | "
            f"{ms(r['itl_p99'])} | {r['e2e_latency_p50']:.2f}/{r['e2e_latency_p99']:.2f} | "
            f"{r['mean_concurrency']:.1f} | {good}")


def plot(record, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [r for r in record["runs"] if r["request_rate"] != "inf"]
    if not runs:
        return
    x = [r["request_rate"] for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for key, label in (("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"),
                       ("e2e_latency_p50", "E2E p50"), ("tpot_p50", "TPOT p50")):
        a.plot(x, [r[key] for r in runs], "o-", label=label)
    a.set(xlabel="offered load (requests/s)", ylabel="seconds", yscale="log",
          title="latency vs load")
    a.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)   # beside: never over a line
    b.plot(x, [r["request_throughput"] for r in runs], "o-", label="throughput")
    if runs[0]["request_goodput"] is not None:
        b.plot(x, [r["request_goodput"] for r in runs], "s--", label="goodput (met SLOs)")
    b.plot(x, x, ":", color="grey", label="offered")
    b.set(xlabel="offered load (requests/s)", ylabel="completed requests/s",
          title="throughput and goodput")
    b.legend()
    fig.suptitle(f"{record['device']}, {record['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
