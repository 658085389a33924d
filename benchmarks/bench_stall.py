"""Benchmark: how long a decoding stream waits while a long prompt prefills in chunks.

A stream decodes one token per engine step, so its gap between two tokens is one step's wall
time, and a step that carries a prefill chunk costs the chunk's GEMMs plus attention over the
whole context so far. The worst gap comes at the end of a long prompt. This script prefills
one `--context`-token prompt to `--context` minus a little with a large budget, then runs
`--steps` steps at each `--budgets` value (the stream's decode + a chunk of budget - 1 tokens)
and records each step's time: the stall a stream sees at that budget and that context.

    python benchmarks/bench_stall.py --budgets 32 64 128 256 --out benchmarks/results/x.json

(`minillm/serve/cli.py` picks its CPU default for --max-num-batched-tokens from this.)
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
from minillm import SamplingParams  # noqa: E402
from minillm.engine.llm_engine import LLMEngine  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step_profile import cpu_model  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=8000)
    p.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = minillm.load_model("smollm2-135m", device="cpu")
    engine = LLMEngine(model, None, num_kv_blocks=640, max_num_seqs=8,
                       max_num_batched_tokens=2048, enable_prefix_caching=False)
    vocab = model.config.vocab_size
    stream = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    engine.add_request("stream", [11, 12, 13, 14], stream)
    engine.step()                                       # the stream is decoding from here on
    long_prompt = [(17 * t) % vocab for t in range(args.context)]
    engine.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=1))
    long = engine.groups["long"][0]
    tail = sum(b - 1 for b in args.budgets) * args.steps
    t0 = time.perf_counter()
    while long.num_computed_tokens < args.context - tail - 2048:
        engine.step()
    engine.scheduler.max_num_batched_tokens = args.context - tail - long.num_computed_tokens
    engine.step()                                       # up to context - tail
    prefill_s = time.perf_counter() - t0
    rows = []
    for budget in args.budgets:
        engine.scheduler.max_num_batched_tokens = budget
        times = []
        for _ in range(args.steps):
            at = long.num_computed_tokens
            s = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - s)
        rows.append({"budget": budget, "context_at_start": at, "step_s": [round(t, 3)
                                                                          for t in times],
                     "max_gap_s": round(max(times), 3)})
        print(f"budget {budget:4d} at context {at}: steps {' '.join(f'{t:.3f}' for t in times)} s")
    record = {"benchmark": "decode stall during a long prefill", "label": args.label,
              "model": "smollm2-135m", "dtype": "float32", "threads": args.threads,
              "context": args.context, "device": cpu_model(), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
              "load_before": os.getloadavg()[0], "prefill_to_tail_s": round(prefill_s, 1),
              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
