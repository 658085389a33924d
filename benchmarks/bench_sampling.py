"""Benchmark: the cost of drawing a sampled token (chapter 12's overheads), two ways.

`minillm.sampling.draw_from` (the inverse CDF: a float64 running sum and a binary search) against
`torch.multinomial`, the call it replaced, on the same probabilities:

    draws    one draw per row of 49,152 probabilities, at 1 and 16 rows (the median of --repeats)
    engine   minillm.LLM decoding --num-seqs sampled requests (temperature 0.7, seeded,
             ignore_eos) with each sampler in turn, alternating order, --rounds times: the engine
             draws every sampled row with that request's own generator, once per step

    python benchmarks/bench_sampling.py --out benchmarks/results/sampling_cpu_x.json

Run it under /work/bin/quiet-run (or on any quiet machine): both samplers run in one process,
side by side. Seeded outputs differ between the two (different draws from the same
distribution), so their lengths are fixed with ignore_eos.
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
from minillm import SamplingParams, sampling  # noqa: E402
from minillm.spec.prompts import chat, open_prompts  # noqa: E402


def multinomial(p: torch.Tensor, generator=None) -> torch.Tensor:
    """What `sample` called before draw_from: one id per row [R]."""
    return torch.multinomial(p.float(), 1, generator=generator).squeeze(-1)


SAMPLERS = {"draw_from": sampling.draw_from, "multinomial": multinomial}


def draws(repeats: int) -> list:
    rows = []
    g = torch.Generator().manual_seed(0)
    for R in (1, 16):
        p = torch.randn(R, 49152, generator=g).mul(3).softmax(-1)
        for name, fn in SAMPLERS.items():
            for _ in range(10):
                fn(p, g)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(p, g)
                times.append(time.perf_counter() - t0)
            rows.append(dict(rows=R, sampler=name, ms=round(1e3 * statistics.median(times), 4)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def engine(args) -> list:
    llm = minillm.LLM("smollm2-135m", max_num_seqs=args.num_seqs)
    prompts = chat(llm.tokenizer, open_prompts(args.num_seqs))
    rows = []
    for r in range(args.rounds):
        order = list(SAMPLERS) if r % 2 == 0 else list(SAMPLERS)[::-1]
        for name in order:
            sampling.draw_from = SAMPLERS[name]          # `sample` looks it up at each call
            params = [SamplingParams(temperature=0.7, max_tokens=args.max_tokens, seed=i,
                                     ignore_eos=True) for i in range(args.num_seqs)]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append(dict(round=r, sampler=name, output_tokens=n, seconds=round(dt, 3),
                             tokens_per_s=round(n / dt, 2)))
            print(json.dumps(rows[-1]), flush=True)
    sampling.draw_from = SAMPLERS["draw_from"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--num-seqs", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    before = os.getloadavg()
    t0 = time.perf_counter()
    result = dict(device=f"CPU ({platform.machine()}, {os.cpu_count()} cores, "
                         f"{args.threads} threads)",
                  date=datetime.date.today().isoformat(), torch=torch.__version__,
                  command="python " + shlex.join(sys.argv), load_average_before=before,
                  draws=draws(args.repeats), engine=engine(args))
    tps = {n: [r["tokens_per_s"] for r in result["engine"] if r["sampler"] == n] for n in SAMPLERS}
    result["engine_ratio_median"] = round(statistics.median(tps["draw_from"])
                                          / statistics.median(tps["multinomial"]), 3)
    result["load_average_after"] = os.getloadavg()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("engine tokens/s, draw_from / multinomial (medians):", result["engine_ratio_median"])
    print("wrote", args.out)


if __name__ == "__main__":
    main()
