"""Benchmark: one decode step of the engine on a GPU, eager against CUDA graphs, bf16 against int4
weights and against an fp8 KV cache (chapters 09 and 12).

Per model (random weights at the preset's real shapes, the device's default dtype) and batch B:
B prompts of --prompt random token ids, greedy, EOS ignored, through `minillm.LLM` built as

    bf16_eager         enforce_eager=True: every kernel of the step launched from Python
    bf16_graphs        enforce_eager=False: decode steps replayed from CUDA graphs
    int4_eager         decoder linears quantized to int4 (round to nearest, group 64): the
    int4_graphs        Triton dequant-GEMM of minillm/kernels/int4_gemm.py, eager / graphs
    bf16_graphs_fp8kv  graphs, kv_cache_dtype="fp8" (e4m3)

Decode time per step = (T(long) - T(short)) / (long - short), where T is the wall time of one
`generate` of the B prompts with max_tokens = short or long (the better of two calls each, after
a warm-up call), so prefill and the engine's setup cancel out. Each variant's greedy tokens are
compared with the same weights' eager tokens (graphs) or with bf16 graphs (fp8 KV): with
random weights the top two logits are often nearly tied, so bf16 rounding differences flip some
tokens and the sequences then diverge; the agreement is recorded, not asserted (tests/
test_cuda_graphs.py asserts graphs == eager in fp32, where no such flips occur).

    python benchmarks/bench_decode_gpu.py                        # SmolLM2-135M and Llama-3.2-1B
    python benchmarks/bench_decode_gpu.py --models llama-3.2-1b --batches 1 16 \\
        --variants bf16_graphs int4_graphs --int4-config results/int4_gemm_..._sweep.json

Writes benchmarks/results/decode_<gpu>_<date>.json (or --out). On a CPU it runs (there
enforce_eager=False compiles the step with torch.compile instead, minillm/engine/compiled.py,
in fp32, the CPU's dtype, whatever the variant's name says) but its times say nothing about a
GPU.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import minillm  # noqa: E402
from minillm import SamplingParams, configs  # noqa: E402
from minillm.loader import load_model  # noqa: E402

VARIANTS = ("bf16_eager", "bf16_graphs", "int4_eager", "int4_graphs", "bf16_graphs_fp8kv")
REFERENCE = {"bf16_graphs": "bf16_eager", "int4_graphs": "int4_eager",   # whose tokens each
             "bf16_graphs_fp8kv": "bf16_graphs"}                         # variant is compared with


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-3.2-1b"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    p.add_argument("--short", type=int, default=4, help="max_tokens of the short call")
    p.add_argument("--long", type=int, default=132, help="max_tokens of the long call")
    p.add_argument("--int4-config", type=Path, default=None, metavar="JSON",
                   help="a bench_int4_gemm.py --sweep record: run int4 with its fastest config")
    p.add_argument("--num-layers", type=int, default=None,
                   help="keep only the first N decoder layers of each preset (a quick check, "
                        "e.g. the tests' CPU run; a record's timings need the whole model)")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed(llm, prompts, n, device):
    """(seconds, greedy token ids) of one generate call with max_tokens = n."""
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    sync(device)
    t = time.perf_counter()
    outs = llm.generate(prompts, [p] * len(prompts), use_tqdm=False)
    sync(device)
    return time.perf_counter() - t, [o.token_ids for o in outs]


def agreement(tokens, ref):
    same = sum(a == r for a, r in zip(tokens, ref))
    equal = sum(x == y for a, r in zip(tokens, ref) for x, y in zip(a, r))
    return {"sequences_equal": same, "of": len(ref),
            "tokens_equal_frac": equal / sum(len(r) for r in ref)}


def variants_of(base, names):
    """name -> (model, enforce_eager, kv_cache_dtype); the int4 copy is made once."""
    out, q = {}, None
    for name in names:
        if name.startswith("int4") and q is None:
            from minillm.quant import quantize_model
            q = quantize_model(copy.deepcopy(base), "int4")
        model = q if name.startswith("int4") else base
        out[name] = (model, name.endswith("eager"), "fp8" if name.endswith("fp8kv") else "auto")
    return out


def run_model(name, args):
    cfg = configs.get(name)
    if args.num_layers is not None:
        cfg = cfg.with_(num_layers=args.num_layers)
    base, _ = load_model(cfg, weights="random", device=args.device)
    rng = random.Random(0)
    hi = base.config.vocab_size - 100
    prompts_all = [[rng.randrange(100, hi) for _ in range(args.prompt)]
                   for _ in range(max(args.batches))]
    rows, got = [], {}
    for vname, (model, eager, kv) in variants_of(base, args.variants).items():
        t0 = time.perf_counter()
        llm = minillm.LLM((model, None), max_num_seqs=max(args.batches),
                          max_num_batched_tokens=max(2048, args.prompt * max(args.batches)),
                          enforce_eager=eager, kv_cache_dtype=kv, enable_prefix_caching=False)
        init_s = time.perf_counter() - t0                  # graph capture happens here
        for b in args.batches:
            prompts = prompts_all[:b]
            timed(llm, prompts, args.short, args.device)  # warm-up
            ts = [timed(llm, prompts, args.short, args.device)[0] for _ in range(2)]
            tl, toks = zip(*[timed(llm, prompts, args.long, args.device) for _ in range(2)])
            step = (min(tl) - min(ts)) / (args.long - args.short)
            got[(vname, b)] = toks[0]
            ref = REFERENCE.get(vname)
            agree = agreement(toks[0], got[(ref, b)]) if (ref, b) in got else None
            row = dict(model=name, variant=vname, batch=b, step_ms=round(step * 1e3, 3),
                       tok_per_s=round(b / step, 1), t_short_s=[round(t, 4) for t in ts],
                       t_long_s=[round(t, 4) for t in tl], init_s=round(init_s, 2),
                       agreement=agree, compared_with=ref if agree else None,
                       repeat_stable=toks[0] == toks[1])
            print(json.dumps(row), flush=True)
            rows.append(row)
        llm.shutdown()
        del llm
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda":
        os.environ.pop("TRITON_INTERPRET", None)
    override = None
    if args.int4_config is not None:
        from minillm.kernels import int4_gemm
        best = json.loads(args.int4_config.read_text())["sweep"][0]["config"]
        override = {k: v for k, v in best.items() if v is not None}
        int4_gemm.OVERRIDE.update(override)
    device_name = (torch.cuda.get_device_name() if args.device == "cuda"
                   else platform.processor() or "cpu")
    record = dict(benchmark="decode_gpu", device=device_name,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=" ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
                  versions={"torch": torch.__version__, "python": platform.python_version()},
                  prompt_len=args.prompt, short=args.short, long=args.long,
                  num_layers=args.num_layers,
                  int4_override=override, rows=[])
    for name in args.models:
        record["rows"] += run_model(name, args)
    gpu = device_name.replace("NVIDIA ", "").replace(" ", "-").lower()
    out = args.out or (ROOT / "benchmarks" / "results" /
                       f"decode_{gpu}_{datetime.date.today():%Y%m%d}.json")
    out.write_text(json.dumps(record, indent=1))
    print("wrote", out)
    return record


if __name__ == "__main__":
    main()
