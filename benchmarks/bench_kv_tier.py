"""Benchmark: reload a prefix from the disk KV tier, or recompute it? (chapter 11)

For each prompt length, one engine (prefix caching on, a pool just big enough) serves the prompt,
then a filler prompt of the same length evicts its blocks, then the prompt comes back:
  recompute   no tier: its blocks are gone, the prefill runs again (TTFT of the third request)
  reload      with a tier: the evicted blocks were written to disk and are read back
The files live in a temporary directory, so reads are served from the OS page cache (memory
speed), as they would be right after eviction; a cold NVMe read would add its own latency.

    python benchmarks/bench_kv_tier.py --lengths 32 128 512 2048

Writes benchmarks/results/kv_tier_<tag>_<date>.json (device, date, command, load average).
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
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minillm import SamplingParams, load_model  # noqa: E402
from minillm.engine import LLM  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BS = 16


def ttft_after_eviction(model, length, tier_dir, seed) -> tuple:
    """(TTFT of the returning prompt in s, blocks loaded from the tier, tier load seconds)."""
    rng = np.random.default_rng(seed)
    prompt, filler = (rng.integers(10, 49000, size=length).tolist() for _ in range(2))
    blocks = -(-length // BS)                  # exactly one request: the filler evicts all
    tier = None if tier_dir is None else {"kv_connector": "disk", "path": tier_dir}
    llm = LLM((model, None), num_kv_blocks=blocks, block_size=BS, max_num_seqs=1,
              max_num_batched_tokens=max(2048, length + 1), kv_transfer_config=tier)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([prompt], one, use_tqdm=False)
    llm.generate([filler], one, use_tqdm=False)           # evicts (and saves) every block
    out = llm.generate([prompt], one, use_tqdm=False)[0]
    conn = llm.engine.kv_connector
    loads = getattr(getattr(conn, "stats", None), "loads", 0)
    load_s = getattr(getattr(conn, "stats", None), "load_seconds", 0.0)
    return out.metrics.ttft, loads, load_s, out.num_cached_tokens


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_model("smollm2-135m")
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"benchmark": "disk KV tier: reload vs recompute a prefix",
              "device": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} "
                        f"cores), {args.threads} threads; tier files on local disk, read from "
                        "the page cache", "model": "smollm2-135m (fp32)",
              "date": now.isoformat(timespec="seconds"),
              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
              "load_average_before": os.getloadavg(), "rows": []}
    for length in args.lengths:
        rec, rel = [], []
        for r in range(args.repeats):
            rec.append(ttft_after_eviction(model, length, None, r))
            with tempfile.TemporaryDirectory() as d:
                rel.append(ttft_after_eviction(model, length, d, r))
        assert all(x[3] == 0 for x in rec) and all(x[3] == (length - 1) // BS * BS for x in rel)
        row = {"prompt_tokens": length, "blocks_reloaded": rel[0][1],
               "recompute_ttft_s": statistics.median(x[0] for x in rec),
               "reload_ttft_s": statistics.median(x[0] for x in rel),
               "tier_read_s": statistics.median(x[2] for x in rel),
               "recompute_all_s": [x[0] for x in rec], "reload_all_s": [x[0] for x in rel]}
        row["speedup"] = row["recompute_ttft_s"] / row["reload_ttft_s"]
        record["rows"].append(row)
        print(f"{length:5d} tokens: recompute {row['recompute_ttft_s'] * 1e3:8.1f} ms, reload "
              f"{row['reload_ttft_s'] * 1e3:8.1f} ms (tier read {row['tier_read_s'] * 1e3:.1f} "
              f"ms, {row['blocks_reloaded']} blocks)  x{row['speedup']:.2f}", flush=True)
    record["load_average_after"] = os.getloadavg()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"kv_tier_{args.tag}_{now.strftime('%Y%m%d')}.json"
    path.write_text(json.dumps(record, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
