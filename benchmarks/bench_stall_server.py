"""Benchmark: the stall a streaming client sees through `python -m minillm serve` while another
client's long prompt prefills (issue 17's target; bench_stall.py measures the same in-process).

Starts the server with its defaults (plus --num-kv-blocks so an 8k prompt fits), opens a
streamed completion that decodes for the whole run, sends one `--context`-token prompt, and
records the streaming client's longest gap between two tokens while that prompt was being
prefilled (from its send to its answer), as the client measured it over HTTP.

    python benchmarks/bench_stall_server.py --context 8000

Writes benchmarks/results/stall_server_<tag>_<date>.json (device, date, command, load average).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

RESULTS = Path(__file__).resolve().parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--num-kv-blocks", type=int, default=640)
    p.add_argument("--serve-args", default="",
                   help='more `serve` arguments, one string: "--max-num-batched-tokens 32"')
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "minillm", "serve", "--port", str(port), "--num-kv-blocks",
           str(args.num_kv_blocks), "--log-level", "warning", *shlex.split(args.serve_args)]
    load_before = os.getloadavg()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        times, stop = [], threading.Event()

        def stream():
            body = {"model": "smollm2-135m", "prompt": "Count slowly:", "max_tokens": 4000,
                    "ignore_eos": True, "stream": True, "temperature": 0}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=900) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())
                    if stop.is_set():
                        return

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        while len(times) < 5:
            time.sleep(0.05)
        prompt = [1000 + (i * 7919) % 40000 for i in range(args.context)]
        sent = time.perf_counter()
        r = httpx.post(base + "/v1/completions", timeout=1800, json={
            "model": "smollm2-135m", "prompt": prompt, "max_tokens": 1})
        done = time.perf_counter()
        stop.set()
        r.raise_for_status()
        during = [b - a for a, b in zip(times, times[1:]) if b > sent and a < done]
        record = {
            "benchmark": "stall of a streaming client while a long prompt prefills, over HTTP",
            "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} "
                      "cores), server and clients on one machine",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
            "server_command": " ".join(cmd[1:]), "load_average_before": load_before,
            "context": args.context, "prefill_seconds": done - sent,
            "longest_gap_s": max(during), "gaps_during_prefill": len(during),
            "median_gap_s": sorted(during)[len(during) // 2],
            "load_average_after": os.getloadavg()}
        print(json.dumps({k: record[k] for k in ("prefill_seconds", "longest_gap_s",
                                                 "median_gap_s", "gaps_during_prefill")}))
        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / (f"stall_server_{args.tag}_"
                               f"{datetime.date.today().strftime('%Y%m%d')}.json")
        path.write_text(json.dumps(record, indent=1))
        print("wrote", path)
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
