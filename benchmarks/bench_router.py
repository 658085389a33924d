"""Benchmark: routing policies over replicas on a multi-tenant, multi-turn trace (chapter 11).

For each policy, starts `--replicas` fresh `python -m minillm serve` processes (one torch thread
each: the replicas split the machine's cores), measures each one's cold start (process start to
the first token of a one-token request), puts the router in front (this process), replays the
seeded trace of minillm.lab.tenants open-loop (streamed completions of token-id prompts), and
records the prompt-token hit rate (the servers' usage.prompt_tokens_details.cached_tokens),
TTFT, throughput, requests per replica and the affinity fallbacks.

    python benchmarks/bench_router.py --replicas 2 --sessions 16 --turns 3

Writes benchmarks/results/router_<tag>_<date>.json (device, date, command, load average).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm.lab.tenants import ideal_hit_rate, multi_tenant_trace  # noqa: E402
from minillm.loader import load_tokenizer  # noqa: E402
from minillm.serve.router import BackgroundRouter, Router  # noqa: E402
from minillm.serve.routing import POLICIES  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(args) -> tuple:
    """(process, base url, cold start seconds: spawn -> first token of a 1-token request)."""
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "minillm", "serve", "--model", MODEL, "--port", str(port),
         "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.max_num_seqs),
         "--log-level", "warning"],
        env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"replica on port {port} did not start")
        try:
            r = httpx.post(base + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 1})
            if r.status_code == 200:
                return proc, base, time.perf_counter() - t0
        except httpx.TransportError:
            time.sleep(0.1)


async def one(client, base, req, max_tokens, t0, rows):
    await asyncio.sleep(max(0.0, t0 + req.arrival_time - time.perf_counter()))
    sent = time.perf_counter()
    row = {"tenant": req.tenant, "session": req.session, "turn": req.turn,
           "prompt_tokens": len(req.prompt_ids), "send": sent - t0}
    body = {"model": MODEL, "prompt": list(req.prompt_ids), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", base + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    row["error"] = chunk["error"].get("message", str(chunk["error"]))
                if chunk.get("choices") and "ttft" not in row:
                    row["ttft"] = time.perf_counter() - sent
                if chunk.get("usage"):
                    row["cached_tokens"] = chunk["usage"]["prompt_tokens_details"][
                        "cached_tokens"]
                    row["completion_tokens"] = chunk["usage"]["completion_tokens"]
        row["end"] = time.perf_counter() - t0
        if r.status_code != 200:
            row["error"] = f"HTTP {r.status_code}"
    except httpx.HTTPError as e:
        row["error"] = f"{type(e).__name__}: {e}"
    rows.append(row)


async def replay(base, trace, max_tokens):
    rows: list = []
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, base, r, max_tokens, t0, rows) for r in trace))
    return rows


def summary(rows, state, ideal) -> dict:
    ok = [r for r in rows if "error" not in r and "ttft" in r]
    ttft = np.array([r["ttft"] for r in ok])
    prompt = sum(r["prompt_tokens"] for r in ok)
    served = [b["served"] for b in state["backends"]]
    makespan = max(r["end"] for r in ok) - min(r["send"] for r in ok)
    return {"requests": len(rows), "errors": len(rows) - len(ok),
            "error_messages": sorted({r.get("error", "no token") for r in rows
                                      if r not in ok})[:3],
            "hit_rate": sum(r.get("cached_tokens", 0) for r in ok) / prompt,
            "ideal_hit_rate": ideal,
            "ttft_mean_s": float(ttft.mean()), "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "output_tok_per_s": sum(r.get("completion_tokens", 0) for r in ok) / makespan,
            "served_per_replica": served, "imbalance": max(served) / (sum(served) / len(served)),
            "affinity_fallbacks": state["fallbacks"],
            "hit_rate_turn1": _hit(ok, lambda r: r["turn"] == 0),
            "hit_rate_later_turns": _hit(ok, lambda r: r["turn"] > 0)}


def _hit(rows, pred) -> float:
    sel = [r for r in rows if pred(r)]
    return sum(r.get("cached_tokens", 0) for r in sel) / max(1, sum(r["prompt_tokens"]
                                                                   for r in sel))


def run_policy(spec, args, trace, tok, ideal) -> dict:
    """spec: a policy name, or prefix_affinity:N[:nofallback] (N affinity blocks; nofallback:
    pure affinity, to measure what the load-aware fallback costs and buys)."""
    policy, _, rest = spec.partition(":")
    blocks, _, variant = rest.partition(":")
    kw = {}
    if policy == "prefix_affinity":
        kw = {"balance_abs": 10 ** 9 if variant == "nofallback" else args.balance_abs,
              "balance_rel": args.balance_rel}
    replicas = [start_replica(args) for _ in range(args.replicas)]
    try:
        router = Router([b for _, b, _ in replicas], policy, tokenizer=tok,
                        affinity_blocks=int(blocks or args.affinity_blocks), **kw)
        with BackgroundRouter(router) as rt:
            rows = asyncio.run(replay(rt.base_url, trace, args.max_tokens))
            state = router.state()
        row = {"policy": spec, "affinity_blocks": router.affinity_blocks,
               **summary(rows, state, ideal),
               "cold_start_s": [c for _, _, c in replicas], "load_average_after":
               os.getloadavg()}
        print(f"{spec:18s} hit {row['hit_rate']:.2f} (turn 1 {row['hit_rate_turn1']:.2f}, "
              f"later {row['hit_rate_later_turns']:.2f})  ttft p50 {row['ttft_p50_s']:.2f}s "
              f"p99 {row['ttft_p99_s']:.2f}s  {row['output_tok_per_s']:.1f} tok/s  served "
              f"{row['served_per_replica']}  fallbacks {row['affinity_fallbacks']}", flush=True)
        return row
    finally:
        for proc, _, _ in replicas:
            proc.terminate()
        for proc, _, _ in replicas:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", nargs="+", default=list(POLICIES),
                   help=f"of {', '.join(POLICIES)}; prefix_affinity:N sets N affinity blocks")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-len", type=int, default=96)
    p.add_argument("--user-len", type=int, default=24)
    p.add_argument("--answer-len", type=int, default=24)
    p.add_argument("--popular-share", type=float, default=0.5)
    p.add_argument("--rate", type=float, default=1.0, help="sessions started per second")
    p.add_argument("--turn-gap", type=float, default=4.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--affinity-blocks", type=int, default=4)
    p.add_argument("--balance-abs", type=int, default=4)
    p.add_argument("--balance-rel", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    for spec in args.policies:
        if spec.partition(":")[0] not in POLICIES:
            p.error(f"unknown policy {spec}; use {', '.join(POLICIES)} (prefix_affinity:N)")
    trace = multi_tenant_trace(args.tenants, args.sessions, args.turns, args.system_len,
                               args.user_len, args.answer_len, args.popular_share, args.rate,
                               args.turn_gap, seed=args.seed)
    ideal = ideal_hit_rate(trace, 16)
    tok = load_tokenizer(MODEL)
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"benchmark": "routing policies on a multi-tenant trace",
              "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} "
                        f"cores), {args.replicas} replicas x {args.threads} thread(s), router "
                        "and client in one more process",
              "date": now.isoformat(timespec="seconds"),
              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
              "load_average_before": os.getloadavg(), "args": {
                  k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "trace": {"requests": len(trace), "ideal_hit_rate": ideal,
                        "mean_prompt_tokens": float(np.mean([len(r.prompt_ids)
                                                             for r in trace]))},
              "runs": []}
    for policy in args.policies:
        record["runs"].append(run_policy(policy, args, trace, tok, ideal))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"router_{args.tag}_{now.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps(record, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
