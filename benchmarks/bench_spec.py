"""Benchmark: speculative decoding (chapter 07) on the bundled SmolLM2-135M.

Part 1, batch 1 (`minillm.spec.speculative_generate`, contiguous cache): output tokens/s with and
without each method, on an input-grounded prompt set (copy / edit / quote / extract) and an
open-ended one, at several temperatures; acceptance per draft position. Methods:

    none         plain decoding, one target forward per token
    ngram        prompt lookup (num_speculative_tokens K, prompt_lookup_min 1, max 4)
    medusa       the committed Medusa heads (minillm/spec/weights), K <= 4
    draft_model  the target with some layers skipped (a cheaper variant of the same model)
    eagle        the committed EAGLE drafter (minillm/spec/eagle.py), FR-Spec reduced head
    eagle_full   the same drafter with the target's full LM head
    eagle_tree   the drafter's top `--tree-branches` first tokens, each continued to depth K,
                 verified in one forward with the tree mask (spec/tree.py); at temperature > 0
                 the ranked children are one-hot drafts (accept x with p(x), else remove it)
    eagle_tree1  the same tree with the runner-up branches cut to depth 1: the chain of K plus
                 the runner-up first tokens, no extra drafter pass
    eagle_top1   the tree code with one branch: the chain of the drafter's argmax tokens. At
                 temperature 0 it is `eagle`; at temperature > 0 it separates what the tree's
                 branches win from what one-hot (ranked) drafts win over `eagle`'s sampled ones

`--head-cost` also times one EAGLE draft step with each head (the cost FR-Spec removes).

The methods run side by side: for every prompt each method runs once, in rotating order, so
machine load hits them alike. Speedup = that method's tokens/s / none's tokens/s, from the
summed tokens and times over the prompts. Greedy outputs are checked to be identical.

`--engine` runs part 1 through the engine instead (`minillm.LLM`, max_num_seqs 1, the same
speculative_config a user would pass; the tree methods as tree_branches / tree_side_depth), so
its numbers include the engine's own per-step work; eagle_top1 has no engine form.

Part 2, the engine (`minillm.LLM`) at batch 1, 4, 16 with and without ngram on one grounded
prompt replicated B times (acceptance held fixed across batch sizes): where speculation stops
paying as the batch grows (the verification is no longer free when the step is compute-bound; on
a CPU that comes early).

    python benchmarks/bench_spec.py                         # CPU defaults (~10-20 min on 2 cores)
    python benchmarks/bench_spec.py --num-prompts 2 --max-tokens 24 --temperatures 0   # smoke

Each batch-1 row keeps every prompt's acceptance and speedup (`per_prompt`): the spread.
`--append --out FILE` adds a run's rows to FILE, so a long benchmark runs as several short ones.

Writes benchmarks/results/spec_<device>_<date>.json (device, date, versions, command, load) and a
PNG with the same name. CPU numbers describe this CPU only; GPU numbers come from a GPU run.
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
from minillm import SamplingParams, spec  # noqa: E402
from minillm.spec.eagle import DEFAULT_EAGLE_WEIGHTS  # noqa: E402
from minillm.spec.prompts import chat, grounded_prompts, open_prompts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("none", "ngram", "medusa", "draft_model", "eagle", "eagle_full", "eagle_tree",
           "eagle_tree1", "eagle_top1")
# method -> (branches: None for --tree-branches, side_depth: None for every branch K)
TREES = {"eagle_tree": (None, None), "eagle_tree1": (None, 1), "eagle_top1": (1, None)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=4, help="per prompt set")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--temperatures", default="0,0.5,1.0")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--draft-skip", default="4,8,12,16,20,24",
                   help="layers the draft_model variant skips")
    p.add_argument("--sets", default="grounded,open", help="prompt sets of the batch-1 part")
    p.add_argument("--sweep-methods", default="ngram",
                   help="methods of the batch-size sweep ('eagle+off': with disable_by_batch_size)")
    p.add_argument("--sweep-set", default="grounded", help="the sweep's replicated prompt")
    p.add_argument("--head-cost", action="store_true", help="time EAGLE's two heads")
    p.add_argument("--tree-branches", type=int, default=2)
    p.add_argument("--engine", action="store_true",
                   help="run the batch-1 part through minillm.LLM instead of the batch-1 loop")
    p.add_argument("--eagle-weights", default=None,
                   help="an EAGLE drafter file (default: the committed one), e.g. an older one")
    p.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="EAGLE's drafter alone in this dtype (default: the model's)")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--disable-by-batch-size", type=int, default=1,
                   help="the threshold of the sweep's '<method>+off' methods")
    p.add_argument("--sweep-max-tokens", type=int, default=32)
    p.add_argument("--out", default=None)
    p.add_argument("--append", action="store_true",
                   help="add this run's rows to --out (a long benchmark split into short runs)")
    return p.parse_args(argv)


def ngram_config(args) -> dict:
    return dict(method="ngram", num_speculative_tokens=args.k, prompt_lookup_min=1,
                prompt_lookup_max=4)


def eagle_config(args, head: str) -> dict:
    cfg = dict(method="eagle", num_speculative_tokens=args.k, draft_head=head,
               draft_dtype=args.draft_dtype)
    if args.eagle_weights:
        cfg["eagle_weights"] = args.eagle_weights
    return cfg


def sweep_config(args, method: str) -> dict:
    """A sweep method's speculative_config; "<method>+off" is <method> with
    disable_by_batch_size = --disable-by-batch-size (no drafts above that many requests)."""
    if method.endswith("+off"):
        return dict(sweep_config(args, method[:-len("+off")]),
                    disable_by_batch_size=args.disable_by_batch_size)
    return {"ngram": ngram_config, "eagle": lambda a: eagle_config(a, "reduced"),
            "eagle_full": lambda a: eagle_config(a, "full"),
            "eagle_tree": lambda a: tree_config(a, "eagle_tree"),
            "eagle_tree1": lambda a: tree_config(a, "eagle_tree1")}[method](args)


def tree_config(args, method: str) -> dict:
    """A tree method as the engine's speculative_config (tree_branches, tree_side_depth)."""
    branches, side = TREES[method]
    if branches == 1:
        raise ValueError(f"{method} has no engine form (the engine's one-branch EAGLE is the "
                         "chain 'eagle'); leave it out of --methods with --engine")
    cfg = dict(eagle_config(args, "reduced"), tree_branches=branches or args.tree_branches)
    if side is not None:
        cfg["tree_side_depth"] = min(side, args.k)
    return cfg


def head_cost(model, reps: int = 200, draft_dtype=None, weights=None) -> dict:
    """Seconds per EAGLE draft step (one token through the drafter and its head), with the
    reduced FR-Spec head and with the full LM head, and one plain target decode step."""
    from minillm.spec.eagle import EagleDrafter, new_state
    d = EagleDrafter.load(weights or DEFAULT_EAGLE_WEIGHTS, model)
    if draft_dtype:
        d = d.to(getattr(torch, draft_dtype))
    C = model.config.hidden_size
    out = {"draft_vocab": len(d.draft_vocab), "vocab": model.config.vocab_size,
           "draft_dtype": str(d.fc.weight.dtype)}
    with torch.inference_mode():
        for name, reduced in (("reduced", True), ("full", False)):
            st = new_state(d, reps + 8)
            g, nxt = torch.zeros(1, 1, C, device=model.device), torch.tensor([[1]])
            t0 = time.perf_counter()
            for _ in range(reps):
                g = d(model, g, nxt, st.cache)
                d.logits(model, g[0], reduced).argmax(-1)
            out[f"draft_step_{name}_ms"] = round(1e3 * (time.perf_counter() - t0) / reps, 3)
        from minillm.cache.contiguous import ContiguousKVCache
        cache = ContiguousKVCache(model.config, 1, reps + 8, dtype=model.dtype,
                                  device=model.device)
        t0 = time.perf_counter()
        for _ in range(reps):
            model(torch.tensor([[1]], device=model.device), cache=cache)
        out["target_decode_step_ms"] = round(1e3 * (time.perf_counter() - t0) / reps, 3)
        out["target_pass_ms_by_positions"] = verify_cost(model)
    print(json.dumps(out), flush=True)
    return out


def verify_cost(model, context: int = 96, rounds: int = 40, sizes=(1, 2, 3, 5)) -> dict:
    """Median ms of one target pass over m new positions after `context` cached tokens, for
    each m in sizes, the sizes taken in turn every round (so drift hits all alike): what a
    verification of m - 1 drafts costs next to a plain decode step, in this run."""
    from minillm.cache.contiguous import ContiguousKVCache
    cache = ContiguousKVCache(model.config, 1, context + max(sizes), dtype=model.dtype,
                              device=model.device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, min(1000, model.config.vocab_size), (1, context + max(sizes)),
                        generator=g).to(model.device)
    times = {m: [] for m in sizes}
    with torch.inference_mode():
        model(ids[:, :context], cache=cache)
        for _ in range(rounds):
            for m in sizes:
                cache.seq_len = context
                t0 = time.perf_counter()
                model(ids[:, context:context + m], cache=cache)
                times[m].append(time.perf_counter() - t0)
    return {str(m): round(1e3 * statistics.median(t), 3) for m, t in times.items()}


def proposers(model, tok, args):
    """The engine's own proposer objects (build_proposer, as minillm.LLM builds them), one per
    method; the batch-1 loop asks them for a batch of one. With --engine: one minillm.LLM per
    method instead."""
    wanted = args.methods.split(",")
    skip = [int(x) for x in args.draft_skip.split(",") if x]
    configs = {"ngram": lambda: ngram_config(args),
               "medusa": lambda: dict(method="medusa", num_speculative_tokens=args.k),
               "draft_model": lambda: dict(method="draft_model", num_speculative_tokens=args.k,
                                           model=spec.skip_layer_model(model, skip)),
               "eagle": lambda: eagle_config(args, "reduced"),
               "eagle_full": lambda: eagle_config(args, "full"),
               "eagle_tree": lambda: eagle_config(args, "reduced"),
               "eagle_tree1": lambda: eagle_config(args, "reduced"),
               "eagle_top1": lambda: eagle_config(args, "reduced")}
    if not spec.DEFAULT_WEIGHTS.exists():
        del configs["medusa"]
    if not DEFAULT_EAGLE_WEIGHTS.exists():
        for m in ("eagle", "eagle_full", *TREES):
            del configs[m]
    out = {"none": None} if "none" in wanted else {}
    if args.engine:                     # the configs themselves: each method gets an LLM
        out.update({m: tree_config(args, m) if m in TREES else make()
                    for m, make in configs.items() if m in wanted})
        return {m: minillm.LLM((model, tok), num_kv_blocks=64, max_num_seqs=1,
                               speculative_config=cfg) for m, cfg in out.items()}
    out.update({m: spec.build_proposer(make(), model)
                for m, make in configs.items() if m in wanted})
    return out


def engine_generate(llm, prompt, sp, stats) -> list:
    """One prompt through an LLM (batch 1), its speculation counters merged into stats."""
    eng = llm.engine
    if eng.spec_stats is not None:
        eng.spec_stats = spec.SpecStats()
    out = llm.generate([prompt], sp, use_tqdm=False)[0].token_ids
    if eng.spec_stats is not None:
        stats.merge(eng.spec_stats)
    return out


def _per_prompt(runs, base) -> list:
    """Each prompt's acceptance and its own speedup (tokens/s over plain decoding's tokens/s on
    the same prompt): the spread a conclusion must survive."""
    out = []
    for i, r in enumerate(runs):
        b = base["per_prompt"][i] if base else None
        sp = ((r["tokens"] / r["seconds"]) / (b["tokens"] / b["seconds"])) if b else None
        out.append(dict(r, speedup=round(sp, 3) if sp else None))
    return out


def batch1(model, tok, args, props) -> list:
    rows = []
    sets = {"grounded": lambda: chat(tok, grounded_prompts(args.num_prompts)),
            "open": lambda: chat(tok, open_prompts(args.num_prompts))}
    sets = {name: make() for name, make in sets.items() if name in args.sets.split(",")}
    for temp in [float(t) for t in args.temperatures.split(",") if t]:
        names = list(props)
        for set_name, prompts in sets.items():
            acc = {m: dict(tokens=0, time=0.0, stats=spec.SpecStats(), outs=[], per_prompt=[])
                   for m in names}
            for i, prompt in enumerate(prompts):
                order = names[i % len(names):] + names[:i % len(names)]   # rotate
                for m in order:
                    sp = SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=i)
                    st = spec.SpecStats()
                    t0 = time.perf_counter()
                    if args.engine:
                        out = engine_generate(props[m], prompt, sp, st)
                    elif m in TREES:
                        branches, side = TREES[m]
                        out = spec.tree_generate(model, tok, prompt, props[m], args.k,
                                                 args.max_tokens, branches or args.tree_branches,
                                                 stats=st, side_depth=side, sampling=sp)
                    else:
                        out = spec.speculative_generate(model, tok, prompt, props[m], args.k,
                                                        args.max_tokens, sp, stats=st)
                    dt = time.perf_counter() - t0
                    a = acc[m]
                    a["tokens"] += len(out)
                    a["time"] += dt
                    a["outs"].append(out)
                    a["stats"].merge(st)
                    a["per_prompt"].append(dict(tokens=len(out), seconds=round(dt, 4),
                                                acceptance_rate=st.acceptance_rate,
                                                mean_accepted_length=st.mean_accepted_length))
            base = acc["none"]["tokens"] / acc["none"]["time"] if "none" in acc else None
            for m in names:
                a = acc[m]
                tps = a["tokens"] / a["time"]
                row = dict(set=set_name, temperature=temp, method=m, k=args.k,
                           num_prompts=len(prompts), output_tokens=a["tokens"],
                           seconds=round(a["time"], 3), tokens_per_s=round(tps, 3),
                           speedup=round(tps / base, 3) if base else None,
                           draft_seconds=round(a["stats"].draft_time, 3),
                           per_prompt=_per_prompt(a["per_prompt"], acc.get("none")),
                           **{k: v for k, v in a["stats"].as_dict().items()})
                if m in TREES:
                    row["tree_branches"] = TREES[m][0] or args.tree_branches
                    row["tree_side_depth"] = TREES[m][1] or args.k
                if temp == 0 and "none" in acc:
                    row["identical_to_plain_greedy"] = a["outs"] == acc["none"]["outs"]
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("set", "temperature", "method",
                                                      "tokens_per_s", "speedup",
                                                      "acceptance_rate")}), flush=True)
    return rows


def engine_sweep(model, tok, args) -> list:
    rows = []
    # one grounded prompt replicated B times: every batch size sees the same acceptance, so a
    # change of speedup with B is the batch's doing, not a different prompt mix's
    one = grounded_prompts(1) if args.sweep_set == "grounded" else open_prompts(1)
    prompts = chat(tok, one) * max(int(b) for b in args.batch_sizes.split(","))
    methods = [m for m in args.sweep_methods.split(",") if m]
    sp = SamplingParams(temperature=0.0, max_tokens=args.sweep_max_tokens)
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        res = {}
        for _rep in range(2):                                 # interleaved: A B A B
            for name, cfg in [("none", None)] + [(m, sweep_config(args, m)) for m in methods]:
                llm = minillm.LLM((model, tok), num_kv_blocks=64 * bs, max_num_seqs=bs,
                                  speculative_config=cfg)
                t0 = time.perf_counter()
                outs = llm.generate(prompts[:bs], sp, use_tqdm=False)
                dt = time.perf_counter() - t0
                r = res.setdefault(name, dict(times=[], tokens=sum(len(o.token_ids) for o in outs),
                                              outs=[o.token_ids for o in outs]))
                r["times"].append(dt)
                st = llm.engine.spec_decode_stats
                r["acceptance_rate"] = st.acceptance_rate if st else None
                r["num_steps_off"] = st.num_steps_off if st else None     # +off methods
        for name, r in res.items():
            t = statistics.median(r["times"])
            rows.append(dict(batch_size=bs, method=name, prompt_set=args.sweep_set,
                             output_tokens=r["tokens"],
                             seconds=round(t, 3), tokens_per_s=round(r["tokens"] / t, 3),
                             acceptance_rate=r["acceptance_rate"],
                             num_steps_off=r["num_steps_off"],
                             identical_to_plain_greedy=r["outs"] == res["none"]["outs"]))
        n = 1 + len(methods)
        base = rows[-n]["tokens_per_s"]
        for r in rows[-n:]:
            r["speedup"] = round(r["tokens_per_s"] / base, 3)
        print(json.dumps(rows[-1]), flush=True)
    return rows


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    b1 = [r for r in result["batch1"] if r["temperature"] == 0 and r["method"] != "none"]
    labels = [f"{r['method']}\n{r['set']}" for r in b1]
    axes[0].bar(labels, [r["speedup"] for r in b1], color="tab:blue")
    axes[0].axhline(1, color="k", lw=0.8)
    axes[0].set_ylabel("speedup vs plain decoding (batch 1, greedy)")
    axes[0].tick_params(axis="x", labelsize=7)
    for r in b1:
        if r["set"] == "grounded" or r["method"] in ("medusa", "eagle"):
            axes[1].plot(range(1, len(r["acceptance_by_position"]) + 1),
                         r["acceptance_by_position"], marker="o", label=f"{r['method']} {r['set']}")
    axes[1].set_xlabel("draft position")
    axes[1].set_ylabel("P(accepted | proposed), greedy")
    axes[1].set_ylim(0, 1.05)
    axes[1].legend(fontsize=7)
    sw = [r for r in result["engine_sweep"] if r["method"] != "none"]
    if not sw:                                                # --batch-sizes "": no sweep
        axes[2].set_visible(False)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return
    for m in sorted({r["method"] for r in sw}):
        pts = [r for r in sw if r["method"] == m]
        axes[2].plot([r["batch_size"] for r in pts], [r["speedup"] for r in pts], marker="o",
                     label=m)
    axes[2].legend(fontsize=7)
    axes[2].axhline(1, color="k", lw=0.8)
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel(f"batch size (engine, {sw[0]['prompt_set'] if sw else 'grounded'} "
                       "prompt replicated)")
    axes[2].set_ylabel("speedup vs no speculation")
    fig.suptitle(f"speculative decoding, {result['device']}, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _run_meta(r) -> dict:
    return {k: r.get(k) for k in ("command", "date", "load_average_before", "load_average_after",
                                  "seconds")}


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = minillm.load_model("smollm2-135m", device=args.device)
    props = proposers(model, tok, args)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    result = dict(
        device=(torch.cuda.get_device_name() if args.device == "cuda" else
                f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                f"{args.threads} threads)"),
        date=datetime.date.today().isoformat(), torch=torch.__version__,
        command="python " + " ".join(shlex.quote(a) for a in sys.argv),
        model="smollm2-135m", k=args.k, max_tokens=args.max_tokens,
        batch1_runs_on="minillm.LLM (max_num_seqs 1)" if args.engine else "the batch-1 loop",
        draft_model=f"SmolLM2-135M skipping layers {args.draft_skip}",
        load_average_before=load_before)
    result["head_cost"] = (head_cost(model, draft_dtype=args.draft_dtype,
                                     weights=args.eagle_weights) if args.head_cost else None)
    result["batch1"] = batch1(model, tok, args, props)
    result["engine_sweep"] = engine_sweep(model, tok, args) if args.batch_sizes else []
    result["load_average_after"] = os.getloadavg()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    RESULTS.mkdir(exist_ok=True)
    out = (Path(args.out) if args.out
           else RESULTS / f"spec_{args.device}_{result['date'].replace('-', '')}.json")
    if args.append and out.exists():              # one record from several short runs
        old = json.loads(out.read_text())
        for key in ("batch1", "engine_sweep"):
            old[key] = old.get(key, []) + result[key]
        old["runs"] = old.get("runs", [_run_meta(old)]) + [_run_meta(result)]
        result = old
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
