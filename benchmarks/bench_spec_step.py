"""Benchmark: where a speculative step's time goes in the engine at batch 1 (chapter 07).

Each configuration (a method, with the 2026-11-26 changes on or off) is a `minillm.LLM` with
`max_num_seqs=1`; they generate the same open chat prompts one request at a time, taking turns
prompt by prompt. For each, `minillm.lab.profiling.step_parts` splits the steps' wall time into
the target's forward, the proposer's drafting and the rest; the record has ms per step of each,
tokens per step, ms per token, the speedup over plain decoding with the same switches, and the
EAGLE proposer's prefix-feature memo hits and misses. It also times the target's decoder
products alone at 1, 2 and 3 rows (every layer in turn, weights streamed from memory): what a
verification's extra rows cost before any attention or drafting.

"before" turns three changes off: `kernels.batched.VIEW_EQUAL_CHUNKS` (a verification's queries
attended as a view of q, not gathered and scattered back), the proposer's `PrefixFeatures` memo
(a prompt prefix that came from the prefix cache has its features recomputed for every request),
and the drafter's tuned few-row products (the Linear class defaults instead).

    python benchmarks/bench_spec_step.py --num-prompts 8 --out benchmarks/results/x.json

Run it under /work/bin/quiet-run (or on any quiet machine) with 2 threads.
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
from minillm.kernels import batched  # noqa: E402
from minillm.lab.profiling import step_parts  # noqa: E402
from minillm.model import Linear  # noqa: E402
from minillm.spec.prompts import chat, open_prompts  # noqa: E402

from bench_step_profile import cpu_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=1, help="num_speculative_tokens")
    p.add_argument("--methods", default="none,eagle,eagle_tree",
                   help="none, eagle (a chain), eagle_tree (tree_branches 2)")
    p.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (outputs checked against plain decoding); > 0: sampled, "
                        "seed = the prompt's index")
    p.add_argument("--no-before", action="store_true", help="the current engine only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def config(method: str, args) -> dict:
    if method == "none":
        return None
    cfg = dict(method="eagle", num_speculative_tokens=args.k, draft_dtype=args.draft_dtype)
    if method == "eagle_tree":
        cfg["tree_branches"] = 2
    return cfg


def set_before(llm, before: bool) -> None:
    """Turn the memo and the drafter's tuned products off (before) for this LLM's proposer."""
    prop = llm.engine.proposer
    if not before or not hasattr(prop, "drafter"):
        return
    prop.prefix_features = None
    for m in prop.drafter.modules():
        if isinstance(m, Linear):
            m.__dict__.pop("skinny", None)               # the class defaults again
            m.__dict__.pop("few", None)


@torch.inference_mode()
def product_ms(model, rows_list=(1, 2, 3), repeats: int = 7) -> dict:
    """Median ms of all decoder products (not the LM head) at each row count, layer by layer,
    through Linear's own paths (the ones the loader tuned)."""
    layers = [m for m in model.layers.modules() if isinstance(m, Linear)]
    xs = {r: {m.in_features: torch.randn(r, m.in_features, dtype=model.dtype) for m in layers}
          for r in rows_list}
    times = {r: [] for r in rows_list}
    for i in range(repeats + 1):
        for r in rows_list:
            t0 = time.perf_counter()
            for m in layers:
                m(xs[r][m.in_features])
            if i:
                times[r].append(time.perf_counter() - t0)
    return {str(r): round(1e3 * sorted(t)[len(t) // 2], 2) for r, t in times.items()}


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = minillm.load_model("smollm2-135m")
    prompts = chat(tok, open_prompts(args.num_prompts + 1))
    warm, prompts = prompts[-1], prompts[:-1]
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    names = [(m, before) for before in ((False,) if args.no_before else (False, True))
             for m in args.methods.split(",")]
    llms = {}
    for m, before in names:
        llm = minillm.LLM((model, tok), num_kv_blocks=64, max_num_seqs=1,
                          speculative_config=config(m, args))
        set_before(llm, before)
        batched.VIEW_EQUAL_CHUNKS = not before
        llm.generate([warm], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        if llm.engine.spec_stats is not None:            # count the measured prompts only
            llm.engine.spec_stats = type(llm.engine.spec_stats)()
        llms[m, before] = llm
    acc = {key: dict(parts=[], tokens=0, seconds=0.0, outs=[]) for key in names}
    for i, prompt in enumerate(prompts):
        for key in names[i % len(names):] + names[:i % len(names)]:      # take turns
            batched.VIEW_EQUAL_CHUNKS = not key[1]
            eng = llms[key].engine
            with step_parts(eng) as parts:
                t0 = time.perf_counter()
                sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                    seed=i)
                out = llms[key].generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
                dt = time.perf_counter() - t0
            a = acc[key]
            a["parts"].append((parts.seconds, parts.steps))
            a["tokens"] += len(out)
            a["seconds"] += dt
            a["outs"].append(list(out))
    batched.VIEW_EQUAL_CHUNKS = True
    rows = []
    for (m, before), a in acc.items():
        steps = sum(n for _, n in a["parts"])
        ms = {p: round(1e3 * sum(s[p] for s, _ in a["parts"]) / steps, 2)
              for p in ("step", "forward", "propose")}
        ms["other"] = round(ms["step"] - ms["forward"] - ms["propose"], 2)
        base = acc["none", before]
        prop = llms[m, before].engine.proposer
        memo = getattr(prop, "prefix_features", None)
        st = llms[m, before].engine.spec_decode_stats
        rows.append(dict(
            method=m, before=before, tokens=a["tokens"], steps=steps,
            seconds=round(a["seconds"], 3),
            ms_per_step=ms, tokens_per_step=round(a["tokens"] / steps, 3),
            ms_per_token=round(1e3 * a["seconds"] / a["tokens"], 2),
            speedup=round((a["tokens"] / a["seconds"]) / (base["tokens"] / base["seconds"]), 3),
            identical_to_plain_greedy=(a["outs"] == base["outs"] if args.temperature == 0
                                       else None),
            memo_hits=memo.hits if memo is not None else None,
            memo_misses=memo.misses if memo is not None else None,
            acceptance_rate=st.acceptance_rate if st is not None else None))
        print(json.dumps({k: rows[-1][k] for k in ("method", "before", "ms_per_step",
                                                   "tokens_per_step", "speedup")}), flush=True)
    result = dict(
        device=f"{cpu_model()}, {os.cpu_count()} cores, {args.threads} threads",
        date=datetime.date.today().isoformat(), torch=torch.__version__,
        command="python " + " ".join(shlex.quote(a) for a in sys.argv),
        model="smollm2-135m", k=args.k, max_tokens=args.max_tokens, temperature=args.temperature,
        num_prompts=len(prompts), draft_dtype=args.draft_dtype or "the model's (float32)",
        load_average_before=load_before, rows=rows, product_ms=product_ms(model),
        load_average_after=os.getloadavg(), seconds=round(time.perf_counter() - t_start, 1))
    print("products alone, ms at 1 / 2 / 3 rows:", result["product_ms"])
    RESULTS.mkdir(exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / f"spec_step_cpu_{result['date']}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
