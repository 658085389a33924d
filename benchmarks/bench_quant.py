"""Weight-only quantization in the engine: speed and quality (chapter 09).

    python benchmarks/bench_quant.py speed   --threads 2    # decode step time, batch 1/4/16
    python benchmarks/bench_quant.py quality --threads 2    # ppl, KL, agreement per format
    python benchmarks/bench_quant.py kv      --threads 2    # fp8 KV cache: quality, capacity
    python benchmarks/bench_quant.py engine  --threads 2    # engine vs transformers, 16 requests
    python benchmarks/bench_quant.py batch1  --threads 2 --repeats 5   # batch 1, LM head too
    python benchmarks/bench_quant.py packed_order --batches 8 16 --repeats 7   # int8 A/B
    python benchmarks/bench_quant.py int8_rows --repeats 7   # where int8 should expand, by rows

speed: the engine (minillm.LLM, greedy, ignore_eos) decodes `--max-tokens` tokens for B prompts
of 16 tokens at B = 1, 4, 16, with the bundled SmolLM2-135M in fp32, bf16, int8 and int4 (RTN,
group 64; GPTQ has the same format and speed), formats interleaved per batch size. The decode
step time is the median over decode-only steps (no prefill token in the step). Beside it: the
bytes of weights one step reads (minillm.quant.weight_bytes) and the step time chapter 00's
roofline predicts from them at this machine's measured bandwidth; a 256-token prefill timed per
format (weight-only quantization saves bytes, and prefill is not limited by bytes); and
transformers' static `generate` (fp32, one left-padded batch) against the engine with int8 on
the same 16 requests.

quality: minillm.lab.quant_quality's table against the fp32 model on its frozen course text:
bf16, int8, int4 RTN and int4 GPTQ (calibrated on other course text) at groups 32 and 64.

kv: the fp8 KV cache (kv_cache_dtype="fp8", e4m3, and "fp8_e5m2") against the model's own fp32
pool, both through the paged cache and the engine (minillm.lab.quant_quality.kv_quality_table),
and the pool's bytes per block read from the engine's cache tensors (fp32, bf16, fp8).

engine: the engine at 16 concurrent requests (greedy, 32 tokens, 16-token prompts) in several
weight formats, the LM head quantized or not, against transformers' static `generate` (fp32),
side by side, best of `--repeats` interleaved rounds; and a torch.profiler split of one decode
step (GEMM vs everything else) for the fp32, int8 and fastest eager variants. A variant named
"..._graphs" is its eager twin's model run with enforce_eager=False (each step through the
compiled graph of minillm/engine/compiled.py; compiled during the warm-up, at both batch sizes);
one named "..._plain..." runs with `Int8Linear.PACKED_ORDER` off (from DEQUANT_ROWS rows the
int8 weight expands into a plain bf16 matrix instead of oneDNN's packed layout: the A/B of that
choice in one run), one named "..._bf16expand" with `Int8Linear.EXPAND_DTYPE` bf16 (on a CPU
without native bf16, the int8 path as it was before it asked the CPU: the A/B of that);
`--variants` picks which run (default: all of ENGINE_SYSTEMS).

batch1: the batch-1 decode step of fp32, int8 and int4 decoder layers, each also with an int8 LM
head (`quantize_model(..., quantize_lm_head="int8")`: the head is a fifth of SmolLM2's weights,
and in fp32 it is half of what an int8 model reads per step), in `--repeats` interleaved rounds
(A B C ... A B C ...), median step per format and every round kept.

packed_order: `Int8Linear.PACKED_ORDER` on and off (the int8 weight expanded into oneDNN's
packed layout, or into a plain matrix, from `DEQUANT_ROWS` rows), alternating on one model in
one process: median decode step per batch size, a 256-token prefill, and the argmax agreement.

int8_rows: every decoder layer's product of the bundled model, one path after another in
`--repeats` interleaved rounds, at 1..256 rows: the fp32 layers (model.Linear, what an fp32
model runs), aten's int8 kernel (bf16 activations), the int8 weight expanded into fp32 or into
bf16 and multiplied there (`Int8Linear.expanded_product`, the layer's own code; bf16 into
oneDNN's packed order where that is available), int4 (the layer: its policy), int4 through
aten's kernel and int4 expanded into fp32 (`Int4Linear.expanded_product`), and bf16 layers
where this CPU has native bf16.
Where expanding starts to beat aten's int8 kernel, per expansion dtype, is the crossover that
`Int8Linear.DEQUANT_ROWS` (native bf16) and `DEQUANT_ROWS_FP32` (without) hold; the int4
expansion against the int4 kernel, `Int4Linear.DEQUANT_ROWS_FP32`.

Each writes JSON to benchmarks/results/ (device, date, command, load average, versions).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import minillm  # noqa: E402
import minillm.engine  # noqa: E402
from minillm import SamplingParams  # noqa: E402
from minillm.quant import DEFAULT_GROUP_SIZE, quantize_model, weight_bytes  # noqa: E402
from minillm.roofline import best_time, measure_bandwidth  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FORMATS = ("fp32", "bf16", "int8", "int4")


def build(fmt: str, group_size: int = 64):
    model, tok = minillm.load_model("smollm2-135m")
    if fmt == "bf16":
        model = model.to(torch.bfloat16)
    elif fmt in ("int8", "int4"):
        quantize_model(model, fmt, group_size=group_size)
    return model.eval(), tok


def prompts_for(tok, batch: int, length: int = 16) -> list:
    ids = tok.encode((Path(minillm.__file__).parent / "README.md").read_text())
    return [ids[i * 40:i * 40 + length] for i in range(batch)]


def decode_run(model, tok, batch: int, max_tokens: int, enforce_eager: bool = True) -> dict:
    llm = minillm.LLM((model, tok), max_num_seqs=batch, enable_prefix_caching=False,
                      num_kv_blocks=batch * 8 + 8, block_size=16, enforce_eager=enforce_eager)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts_for(tok, batch), params, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = [s.duration for s in llm.engine.step_stats
             if s.num_prefill_tokens == 0 and s.num_seqs == batch]
    step = statistics.median(steps)
    return {"batch": batch, "decode_step_s": step, "decode_tokens_per_s": batch / step,
            "num_decode_steps": len(steps), "wall_s": wall,
            "tokens": sum(len(o.token_ids) for o in outs)}


@torch.inference_mode()
def hf_static(batch: int, max_tokens: int) -> dict:
    """transformers' generate on one left-padded batch (fp32), the same prompts."""
    from transformers import AutoModelForCausalLM

    from minillm.loader import bundled_checkpoint
    model, tok = minillm.load_model("smollm2-135m")
    hf = AutoModelForCausalLM.from_pretrained(str(bundled_checkpoint()), dtype=torch.float32)
    ids = torch.tensor(prompts_for(tok, batch))                          # equal lengths: no pad
    kw = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
              pad_token_id=tok.eos_token_id)
    hf.generate(input_ids=ids[:, :4], max_new_tokens=2, do_sample=False,
                pad_token_id=tok.eos_token_id)                           # warm-up
    t0 = time.perf_counter()
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
    wall = time.perf_counter() - t0
    return {"batch": batch, "wall_s": wall, "tokens": int((out.shape[1] - ids.shape[1]) * batch),
            "tokens_per_s": (out.shape[1] - ids.shape[1]) * batch / wall}


def speed(args) -> dict:
    bandwidth = measure_bandwidth("cpu")
    models = {f: build(f) for f in FORMATS}
    rows = {f: {"weight_bytes": weight_bytes(m), "decode": []} for f, (m, _) in models.items()}
    for f, (m, tok) in models.items():
        decode_run(m, tok, 1, 4)                                         # warm-up
        x = torch.tensor([prompts_for(tok, 16)]).view(1, -1)            # [1, 256]
        rows[f]["prefill_256_s"] = best_time(lambda: m(x, last_only=True), repeats=3)
        rows[f]["roofline_step_s"] = rows[f]["weight_bytes"] / bandwidth
    for batch in args.batches:
        for f, (m, tok) in models.items():
            rows[f]["decode"].append(decode_run(m, tok, batch, args.max_tokens))
            print(f, rows[f]["decode"][-1], flush=True)
    base = {d["batch"]: d["decode_tokens_per_s"] for d in rows["fp32"]["decode"]}
    for f in rows:
        for d in rows[f]["decode"]:
            d["speedup_vs_fp32"] = d["decode_tokens_per_s"] / base[d["batch"]]
    n = max(args.batches)
    hf = hf_static(n, args.max_tokens)
    engine = next(d for d in rows["int8"]["decode"] if d["batch"] == n)
    return {"bandwidth_bytes_per_s": bandwidth, "formats": rows, "hf_static_fp32": hf,
            "engine_int8_vs_hf_static": (engine["tokens"] / engine["wall_s"]) / hf["tokens_per_s"]}


def quality(args) -> dict:
    from minillm.lab import quant_quality as qq
    from minillm.quant.gptq import gptq_quantize_model

    ref, tok = build("fp32")
    if args.lm_head:        # what quantizing the LM head too costs, beside the same format without
        variants = {"int8": build("int8")[0], "int8_lm_head": build_variant("int8_lm_head")[0],
                    "int4": build("int4", DEFAULT_GROUP_SIZE)[0],
                    "int4_lm_head": build_variant("int4_lm_head")[0],
                    "int4_int8_lm_head": build_variant("int4_int8_lm_head")[0]}
        extra = {"group_size": DEFAULT_GROUP_SIZE}
    else:
        variants, seconds = {"bf16": build("bf16")[0], "int8": build("int8")[0]}, {}
        for g in args.groups:
            variants[f"int4_rtn_g{g}"] = build("int4", g)[0]
            t0 = time.perf_counter()
            variants[f"int4_gptq_g{g}"] = gptq_quantize_model(build("fp32")[0],
                                                              qq.calibration_ids(tok), g)
            seconds[f"int4_gptq_g{g}"] = time.perf_counter() - t0
        extra = {"gptq_seconds": seconds,
                 "calibration_text": [f"minillm/{f}" for f in qq.CALIBRATION_FILES]}
    table = qq.quality_table(ref, variants, tok, max_new_tokens=args.max_tokens)
    return {"table": {k: v.row() for k, v in table.items()}, **extra,
            "eval_text": [f"minillm/{f}" for f in qq.EVAL_FILES],
            "weight_bytes": {k: weight_bytes(m) for k, m in variants.items()}}


def kv(args) -> dict:
    from minillm.lab import quant_quality as qq
    model, tok = build("fp32")
    table = qq.kv_quality_table(model, tok, ("fp8", "fp8_e5m2"),
                                max_new_tokens=args.max_tokens)
    per_block = {}
    for name, dtype, kv_dtype in (("fp32", torch.float32, "auto"),
                                  ("bf16", torch.bfloat16, "auto"),
                                  ("fp8_e4m3", torch.float32, "fp8")):
        eng = minillm.engine.LLMEngine(model.to(dtype), tok, num_kv_blocks=64,
                                       kv_cache_dtype=kv_dtype)
        per_block[name] = eng.runner.cache.nbytes // 64
    model.to(torch.float32)
    return {"table": {k: v.row() for k, v in table.items()},
            "reference": "the same fp32 model with its own fp32 KV pool (kv_cache_dtype='auto')",
            "kv_scales": "per tensor, k_scale = v_scale = 1.0 (vLLM's default uncalibrated)",
            "eval_text": [f"minillm/{f}" for f in qq.EVAL_FILES],
            "kv_bytes_per_block_16_tokens": per_block,
            "blocks_per_gb": {k: 10**9 // v for k, v in per_block.items()}}


ENGINE_VARIANTS = {                      # name: (model dtype, weight format, LM head quantized)
    "fp32": (torch.float32, None, False),
    "bf16": (torch.bfloat16, None, False),
    "int8": (torch.float32, "int8", False),
    "bf16_int8": (torch.bfloat16, "int8", False),
    "int4": (torch.float32, "int4", False),
    "int8_lm_head": (torch.float32, "int8", True),
    "bf16_int8_lm_head": (torch.bfloat16, "int8", True),
    "int4_lm_head": (torch.float32, "int4", True),
    "int4_int8_lm_head": (torch.float32, "int4", "int8"),
    "bf16_int4_lm_head": (torch.bfloat16, "int4", True),
}


# What `engine` times: the variants above; each "_graphs" one the same model with
# enforce_eager=False (the engine's compiled step); each "_plain" one with
# Int8Linear.PACKED_ORDER off (int8 expanded into a plain bf16 matrix); each "_bf16expand" one
# with Int8Linear.EXPAND_DTYPE bf16 (on a CPU without native bf16: the expansion as it was
# before `Int8Linear.expansion` asked the CPU)
ENGINE_SYSTEMS = ("fp32", "bf16", "int8", "bf16_int8", "int8_lm_head", "bf16_int8_lm_head",
                  "int4", "int4_lm_head", "bf16_int4_lm_head",
                  "fp32_graphs", "bf16_graphs", "int8_graphs", "bf16_int8_graphs",
                  "int4_lm_head_graphs", "bf16_int8_plain", "bf16_int8_plain_graphs",
                  "int8_bf16expand")
GRAPHS, PLAIN, BF16_EXPAND = "_graphs", "_plain", "_bf16expand"


def base_variant(name: str) -> str:
    """The ENGINE_VARIANTS entry whose model a variant runs."""
    return name.removesuffix(GRAPHS).removesuffix(PLAIN).removesuffix(BF16_EXPAND)


def run_variant(name, model, tok, batch: int, max_tokens: int) -> dict:
    """decode_run as the variant's name says: eager or compiled, int8 expanded into oneDNN's
    packed order or into a plain matrix, into bf16 whatever the CPU."""
    from minillm.quant import Int8Linear
    saved = Int8Linear.PACKED_ORDER, Int8Linear.EXPAND_DTYPE
    Int8Linear.PACKED_ORDER = PLAIN not in name
    Int8Linear.EXPAND_DTYPE = torch.bfloat16 if BF16_EXPAND in name else None
    try:
        return decode_run(model, tok, batch, max_tokens, enforce_eager=not name.endswith(GRAPHS))
    finally:
        Int8Linear.PACKED_ORDER, Int8Linear.EXPAND_DTYPE = saved


BATCH1_VARIANTS = ("fp32", "int8", "int8_lm_head", "int4", "int4_int8_lm_head")


def build_variant(name: str):
    dtype, fmt, lm_head = ENGINE_VARIANTS[name]
    model, tok = minillm.load_model("smollm2-135m")
    model = model.to(dtype)
    if fmt is not None:                  # the embedding it is tied to keeps its own table
        quantize_model(model, fmt, quantize_lm_head=lm_head)
    return model.eval(), tok


def engine(args) -> dict:
    from minillm.lab.profiling import decode_engine, profile_steps
    n = max(args.batches)
    names = [v for v in ENGINE_SYSTEMS if v in (args.variants or ENGINE_SYSTEMS)]
    built = {}                            # "_graphs", "_plain": the eager twin's model
    for base in dict.fromkeys(map(base_variant, names)):
        built[base] = build_variant(base)
    models = {name: built[base_variant(name)] for name in names}
    eager = {name: not name.endswith(GRAPHS) for name in names}
    runs = {name: [] for name in models}
    hf = []
    for name, (m, tok) in models.items():                                # warm-up (and the
        run_variant(name, m, tok, 1, 4)                                  # graphs' compiles,
        if not eager[name]:                                              # at both batch
            run_variant(name, m, tok, n, 4)                              # sizes)
    for _ in range(args.repeats):                                        # interleaved rounds
        hf.append(hf_static(n, args.max_tokens))
        for name, (m, tok) in models.items():
            runs[name].append(run_variant(name, m, tok, n, args.max_tokens))
            print(name, runs[name][-1], flush=True)
    hf_best = max(hf, key=lambda r: r["tokens_per_s"])
    rows = {}
    for name, rs in runs.items():
        best = min(rs, key=lambda r: r["wall_s"])
        rows[name] = dict(best, tokens_per_s=best["tokens"] / best["wall_s"],
                          vs_hf_static=best["tokens"] / best["wall_s"] / hf_best["tokens_per_s"],
                          weight_bytes=weight_bytes(models[name][0]),
                          walls=[r["wall_s"] for r in rs], enforce_eager=eager[name],
                          vs_hf_rounds=[r["tokens"] / r["wall_s"] / h["tokens_per_s"]
                                        for h, r in zip(hf, rs)])    # each round's own HF
    fastest = max(rows, key=lambda k: rows[k]["tokens_per_s"])
    profiles = {}                                 # eager steps only: the profiler's op split
    fastest_eager = max((k for k in rows if eager[k] and PLAIN not in k),
                        key=lambda k: rows[k]["tokens_per_s"],
                        default=None)
    for name in dict.fromkeys(k for k in ("fp32", "int8", fastest_eager) if k in rows):
        p = profile_steps(decode_engine(models[name][0], n, 16, max_new_tokens=64))
        profiles[name] = {"step_ms": p.step_ms, "gemm_ms": p.gemm_ms, "other_ms": p.other_ms,
                          "ops_per_step": p.ops_per_step, "top_ops": p.rows[:8]}
    return {"batch": n, "hf_static_fp32": hf_best, "hf_walls": [r["wall_s"] for r in hf],
            "engine": rows, "fastest": fastest, "profiles": profiles,
            "target": "engine >= 2x transformers' static generate at 16 concurrent requests"}


def batch1(args) -> dict:
    models = {name: build_variant(name) for name in BATCH1_VARIANTS}
    for m, tok in models.values():
        decode_run(m, tok, 1, 4)                                         # warm-up
    steps = {name: [] for name in models}
    for _ in range(args.repeats):                                        # interleaved rounds
        for name, (m, tok) in models.items():
            steps[name].append(decode_run(m, tok, 1, args.max_tokens)["decode_step_s"])
        print({k: round(v[-1] * 1e3, 1) for k, v in steps.items()}, flush=True)
    median = {name: statistics.median(v) for name, v in steps.items()}
    return {"batch": 1, "rounds": args.repeats,
            "variants": {name: {"decode_step_s": median[name], "steps_s": steps[name],
                                "weight_bytes": weight_bytes(models[name][0]),
                                "speedup_vs_fp32": median["fp32"] / median[name]}
                         for name in models},
            "targets": "int8 >= 1.5x and int4 >= 2x fp32 decode throughput at batch 1"}


def packed_order(args) -> dict:
    """Int8Linear.PACKED_ORDER on and off, alternating round by round on ONE bf16 model with
    int8 decoder layers (eager): the median decode step at each batch size and a 256-token
    prefill, and whether the greedy tokens agree."""
    from minillm.quant import Int8Linear
    model, tok = build_variant("bf16_int8")
    x = torch.tensor([prompts_for(tok, 16)]).view(1, -1)                # [1, 256]
    sides = {"packed": True, "plain": False}
    steps = {name: {b: [] for b in args.batches} for name in sides}
    prefill = {name: [] for name in sides}
    tokens = {}
    saved = Int8Linear.PACKED_ORDER
    try:
        for flag in sides.values():                                     # warm-up (builds the
            Int8Linear.PACKED_ORDER = flag                              # packed-order copies)
            decode_run(model, tok, max(args.batches), 4)
        for _ in range(args.repeats):
            for name, flag in sides.items():
                Int8Linear.PACKED_ORDER = flag
                for b in args.batches:
                    steps[name][b].append(decode_run(model, tok, b, args.max_tokens)
                                          ["decode_step_s"])
                with torch.inference_mode():
                    prefill[name].append(best_time(lambda: model(x, last_only=True), repeats=1))
                    tokens[name] = model(x).argmax(-1)
            print({n: {b: round(v[-1] * 1e3, 1) for b, v in s.items()} for n, s in steps.items()},
                  flush=True)
    finally:
        Int8Linear.PACKED_ORDER = saved
    med = {n: {b: statistics.median(v) for b, v in s.items()} for n, s in steps.items()}
    return {"rounds": args.repeats, "model": "bf16 with int8 decoder layers (bf16_int8)",
            "decode_step_s": steps, "median_decode_step_s": med,
            "plain_over_packed": {b: med["plain"][b] / med["packed"][b] for b in args.batches},
            "prefill_256_s": prefill,
            "prefill_plain_over_packed": statistics.median(prefill["plain"])
            / statistics.median(prefill["packed"]),
            "same_argmax_fraction": float((tokens["packed"] == tokens["plain"]).float().mean()),
            "dequant_rows": Int8Linear.DEQUANT_ROWS}


INT8_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 64, 256)


def int8_rows(args) -> dict:
    """Median ms of all decoder layers' products per path and row count (see the docstring)."""
    import copy

    from minillm.loader import cpu_has_native_bf16
    from minillm.quant import Int4Linear, Int8Linear, decoder_linears
    from minillm.roofline import interleaved_times
    fp32, _ = build("fp32")
    q8 = [m for m in quantize_model(copy.deepcopy(fp32), "int8").layers.modules()
          if isinstance(m, Int8Linear)]
    q4 = [m for m in quantize_model(copy.deepcopy(fp32), "int4").layers.modules()
          if isinstance(m, Int4Linear)]
    assert len(q8) == len(q4) == len(decoder_linears(fp32))          # every decoder product
    layers = {"fp32": [m for _, _, m in decoder_linears(fp32)], "int4": q4}
    native = cpu_has_native_bf16()
    if native:
        layers["bf16"] = [m for _, _, m in decoder_linears(copy.deepcopy(fp32).to(torch.bfloat16))]
    int8 = {"int8_kernel": lambda x, m: torch.ops.aten._weight_int8pack_mm(
                x.to(torch.bfloat16), m.qweight, m.scale_bf16),
            "expand_fp32": lambda x, m: m.expanded_product(x, torch.float32),
            "expand_bf16": lambda x, m: m.expanded_product(x, torch.bfloat16)}
    int4 = {"int4_kernel": lambda x, m: m.packed_product(x),
            "int4_expand_fp32": lambda x, m: m.expanded_product(x)}

    def run(ms, fn, xs):
        return lambda: [fn(xs[m.in_features], m) for m in ms]

    def layer_in(dtype):                 # a model's own layer, its input in the layer's dtype
        return lambda x, m: m(x.to(dtype))

    ms = {}
    with torch.inference_mode():
        for rows in args.rows:
            xs = {k: torch.randn(rows, k) for k in {m.in_features for m in q8}}
            fns = {name: run(ls, layer_in(torch.bfloat16 if name == "bf16" else torch.float32),
                             xs) for name, ls in layers.items()}
            fns.update({name: run(q8, fn, xs) for name, fn in int8.items()})
            fns.update({name: run(q4, fn, xs) for name, fn in int4.items()})
            times = interleaved_times(fns, repeats=args.repeats)
            ms[rows] = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            print(rows, {k: round(v, 1) for k, v in ms[rows].items()}, flush=True)

    def crossover(path, kernel="int8_kernel"):   # the fewest rows from which expanding beats
        wins = [r for r in args.rows if ms[r][path] < ms[r][kernel]]     # the kernel, for good
        return next((r for r in wins if all(q in wins for q in args.rows if q >= r)), None)

    return {"rows": args.rows, "rounds": args.repeats, "median_ms": ms, "native_bf16": native,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "crossover_rows": {**{p: crossover(p) for p in ("expand_fp32", "expand_bf16")},
                               "int4_expand_fp32": crossover("int4_expand_fp32", "int4_kernel")},
            "policy": {"dequant_rows": Int8Linear.DEQUANT_ROWS,
                       "dequant_rows_fp32": Int8Linear.DEQUANT_ROWS_FP32,
                       "expansion_here": [str(Int8Linear.expansion()[0]),
                                          Int8Linear.expansion()[1]],
                       "int4_dequant_rows_fp32": Int4Linear.DEQUANT_ROWS_FP32,
                       "int4_expands_here_from": (Int4Linear.DEQUANT_ROWS_FP32
                                                  if q4[0].expands(10 ** 6) else None)}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("speed", "quality", "kv", "engine", "batch1",
                                    "packed_order", "int8_rows"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rows", type=int, nargs="+", default=list(INT8_ROWS),
                   help="int8_rows: the row counts")
    p.add_argument("--groups", type=int, nargs="+", default=[32, 64])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--lm-head", action="store_true",
                   help="quality: int8 and int4 with and without the LM head quantized")
    p.add_argument("--variants", nargs="+", choices=ENGINE_SYSTEMS, default=None,
                   help="engine: the variants to time (default: all of ENGINE_SYSTEMS); a "
                        "'_graphs' one runs with enforce_eager=False (the compiled step), a "
                        "'_plain' one with Int8Linear.PACKED_ORDER off, a '_bf16expand' one "
                        "with Int8Linear.EXPAND_DTYPE bf16")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"benchmark": f"quantization {args.part}", "date": now.isoformat(timespec="seconds"),
              "device": "cpu", "device_name": _cpu_name(), "threads": torch.get_num_threads(),
              "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
              "load_before": os.getloadavg()[0],
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__}}
    record.update({"speed": speed, "quality": quality, "kv": kv, "engine": engine,
                   "batch1": batch1, "packed_order": packed_order,
                   "int8_rows": int8_rows}[args.part](args))
    record["load_after"] = os.getloadavg()[0]
    out = Path(args.out) if args.out else RESULTS / f"quant_{args.part}_cpu_{now:%Y%m%d}.json"
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
