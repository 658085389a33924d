"""Numeric question generators: fresh parameters per seed, answers from minillm's own arithmetic.

A generator takes a seeded `random.Random` and the question's options from the bank and returns a
`Numeric`: the prompt, the value (in the base unit of its dimension), the tolerance, the working
shown in the feedback, and the drawn parameters (tests recompute the answer from them by hand).
The answers come from `minillm.kvmath`, `minillm.roofline`, `minillm.spec.theory`,
`minillm.lab.capacity` and `minillm.drill.formulas`; nothing is typed in.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from .. import configs, kvmath, roofline
from ..lab import capacity
from ..spec import theory
from . import formulas
from .units import fmt_bytes, fmt_seconds, fmt_value


@dataclass
class Numeric:
    prompt: str
    value: float
    dimension: str            # see units.DIMENSION_WORDS
    working: str
    params: dict = field(default_factory=dict)
    rel_tol: float = 0.02
    abs_tol: float = 0.0
    unit: str = ""            # the unit a bare number is read in ("" = the base unit)


GENERATORS: dict[str, Callable[..., Numeric]] = {}


def generator(fn):
    GENERATORS[fn.__name__] = fn
    return fn


# pools the bank may narrow with `models:`, `dtypes:`, `gpus:` options
DENSE_MODELS = ["llama-2-7b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "llama-3.1-405b",
                "llama-3.2-1b", "mistral-7b", "qwen2.5-7b", "qwen2.5-0.5b", "smollm2-135m"]
ALL_MODELS = DENSE_MODELS + ["deepseek-v3"]
KV_DTYPES = ["bfloat16", "fp8"]
GPUS = list(kvmath.GPUS)
DTYPE_NAME = {"bfloat16": "BF16", "float16": "FP16", "fp8": "FP8", "int8": "INT8", "int4": "INT4",
              "float32": "FP32"}


def _cfg_line(cfg) -> str:
    if cfg.attention == "mla":
        return (f"{cfg.name}: {cfg.num_layers} layers, MLA with a {cfg.kv_lora_rank}-value latent "
                f"plus a {cfg.qk_rope_head_dim}-value rotary key cached per token and layer")
    return (f"{cfg.name}: {cfg.num_layers} layers, {cfg.num_heads} query heads, "
            f"{cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}")


def _kv_working(cfg, dtype) -> str:
    b = kvmath.dtype_bytes(dtype)
    if cfg.attention == "mla":
        return (f"{cfg.num_layers} layers x ({cfg.kv_lora_rank} + {cfg.qk_rope_head_dim}) "
                f"x {b:g} B = {kvmath.kv_bytes_per_token(cfg, dtype):,} B per token "
                f"(no factor 2: one latent, not K and V)")
    return (f"2 (K and V) x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim} "
            f"x {b:g} B = {kvmath.kv_bytes_per_token(cfg, dtype):,} B per token")


def _pick(rng, options, key, default):
    return rng.choice(list(options.get(key, default)))


# --- KV cache and memory -----------------------------------------------------------------------

@generator
def kv_per_token(rng: random.Random, **o) -> Numeric:
    cfg = configs.get(_pick(rng, o, "models", ALL_MODELS))
    dtype = _pick(rng, o, "dtypes", KV_DTYPES)
    v = kvmath.kv_bytes_per_token(cfg, dtype)
    return Numeric(
        f"How many bytes of KV cache does one token occupy in {cfg.name} with a "
        f"{DTYPE_NAME[dtype]} cache? ({_cfg_line(cfg)}.)",
        v, "bytes", _kv_working(cfg, dtype), dict(model=cfg.name, dtype=dtype), rel_tol=0.005)


@generator
def kv_per_sequence(rng, **o) -> Numeric:
    cfg = configs.get(_pick(rng, o, "models", DENSE_MODELS))
    dtype = _pick(rng, o, "dtypes", KV_DTYPES)
    lens = [n for n in o.get("seq_lens", [1024, 2048, 4096, 8192, 32768, 131072])
            if n <= cfg.max_position_embeddings]
    n = rng.choice(lens)
    v = kvmath.kv_bytes_per_sequence(cfg, n, dtype)
    return Numeric(
        f"One sequence of {n:,} tokens in {cfg.name} ({_cfg_line(cfg)}), {DTYPE_NAME[dtype]} KV "
        f"cache: how much KV memory does it hold? Give a size with its unit.",
        v, "bytes", f"{_kv_working(cfg, dtype)}; x {n:,} tokens = {fmt_bytes(v)}",
        dict(model=cfg.name, dtype=dtype, seq_len=n), rel_tol=0.01)


def _fitting_plan(rng, o, tries=200):
    for _ in range(tries):
        cfg = configs.get(_pick(rng, o, "models", DENSE_MODELS))
        gpu = kvmath.GPUS[_pick(rng, o, "gpus", GPUS)]
        wd = _pick(rng, o, "weight_dtypes", ["bfloat16", "fp8", "int4"])
        kd = _pick(rng, o, "dtypes", KV_DTYPES)
        ngpu = _pick(rng, o, "num_gpus", [1])
        ctx = rng.choice([c for c in o.get("contexts", [1024, 2048, 4096, 8192])
                          if c <= cfg.max_position_embeddings])
        util = _pick(rng, o, "utilizations", [0.9])
        plan = kvmath.plan_capacity(gpu.name, cfg, wd, kd, util, ctx, 0, ngpu)
        if plan.max_seqs >= 1:
            return cfg, gpu, wd, kd, ngpu, ctx, util, plan
    raise RuntimeError("no fitting deployment drawn; widen the options")


def _plan_prompt(cfg, gpu, wd, kd, ngpu, ctx, util, plan) -> str:
    where = f"{ngpu} x {gpu.name}" if ngpu > 1 else f"one {gpu.name}"
    return (f"{cfg.name} ({plan.weight_bytes / 1e9:,.2f} GB of weights in {DTYPE_NAME[wd]}; "
            f"{_cfg_line(cfg)}) on {where} ({gpu.memory_bytes / 1e9:g} GB each). The engine may "
            f"use {util:g} of the memory; weights come out of that, the rest is the KV pool "
            f"({DTYPE_NAME[kd]} KV, no other reserve).")


def _plan_working(plan) -> str:
    return (f"usable {plan.usable_bytes:,} B - weights {plan.weight_bytes:,} B = pool "
            f"{fmt_bytes(plan.kv_pool_bytes)}; / {plan.kv_bytes_per_token:,} B per token = "
            f"{plan.max_tokens:,} tokens; / {plan.context_len:,} tokens per sequence = "
            f"{plan.max_seqs} sequences")


@generator
def max_concurrency(rng, **o) -> Numeric:
    cfg, gpu, wd, kd, ngpu, ctx, util, plan = _fitting_plan(rng, o)
    return Numeric(
        _plan_prompt(cfg, gpu, wd, kd, ngpu, ctx, util, plan)
        + f" How many sequences of {ctx:,} tokens can be cached at once (round down)?",
        plan.max_seqs, "count", _plan_working(plan),
        dict(model=cfg.name, gpu=gpu.name, weight_dtype=wd, kv_dtype=kd, num_gpus=ngpu,
             context=ctx, util=util), rel_tol=0.0, abs_tol=max(1, round(plan.max_seqs * 0.02)))


@generator
def kv_pool_tokens(rng, **o) -> Numeric:
    cfg, gpu, wd, kd, ngpu, ctx, util, plan = _fitting_plan(rng, o)
    return Numeric(
        _plan_prompt(cfg, gpu, wd, kd, ngpu, ctx, util, plan)
        + " How many tokens of KV cache does the pool hold?",
        plan.max_tokens, "count", _plan_working(plan),
        dict(model=cfg.name, gpu=gpu.name, weight_dtype=wd, kv_dtype=kd, num_gpus=ngpu,
             context=ctx, util=util), rel_tol=0.02)


@generator
def weight_memory(rng, **o) -> Numeric:
    cfg = configs.get(_pick(rng, o, "models", DENSE_MODELS))
    dtype = _pick(rng, o, "dtypes", ["bfloat16", "fp8", "int8", "int4"])
    n = kvmath.param_count(cfg)
    v = kvmath.weight_bytes(cfg, dtype)
    return Numeric(
        f"{cfg.name} has {n:,} parameters. How much memory do its weights take in "
        f"{DTYPE_NAME[dtype]} (ignore quantization scales)?",
        v, "bytes", f"{n:,} parameters x {kvmath.dtype_bytes(dtype):g} B = {fmt_bytes(v)}",
        dict(model=cfg.name, dtype=dtype, params=n), rel_tol=0.01)


@generator
def tp_weights_per_gpu(rng, **o) -> Numeric:
    cfg = configs.get(_pick(rng, o, "models", ["llama-2-70b", "llama-3-70b", "llama-3.1-405b"]))
    dtype = _pick(rng, o, "dtypes", ["bfloat16", "fp8"])
    tp = rng.choice([2, 4, 8])
    total = kvmath.weight_bytes(cfg, dtype)
    v = total / tp
    return Numeric(
        f"{cfg.name} ({kvmath.param_count(cfg):,} parameters, {DTYPE_NAME[dtype]}) is split with "
        f"tensor parallelism over {tp} GPUs. How much weight memory does each GPU hold?",
        v, "bytes", f"{fmt_bytes(total)} / {tp} = {fmt_bytes(v)} (every layer is split, so each "
        "GPU holds a 1/TP slice of every matrix)", dict(model=cfg.name, dtype=dtype, tp=tp),
        rel_tol=0.01)


@generator
def block_bytes(rng, **o) -> Numeric:
    cfg = configs.get(_pick(rng, o, "models", DENSE_MODELS))
    dtype = _pick(rng, o, "dtypes", KV_DTYPES)
    bs = rng.choice([8, 16, 32])
    v = bs * kvmath.kv_bytes_per_token(cfg, dtype)
    return Numeric(
        f"A KV block of {bs} tokens for {cfg.name} ({_cfg_line(cfg)}), {DTYPE_NAME[dtype]} cache, "
        f"all layers: how many bytes?",
        v, "bytes", f"{bs} x ({_kv_working(cfg, dtype)}) = {fmt_bytes(v)}",
        dict(model=cfg.name, dtype=dtype, block_size=bs), rel_tol=0.005)


@generator
def block_table_overhead(rng, **o) -> Numeric:
    cfg = configs.get(_pick(rng, o, "models", DENSE_MODELS))
    bs = rng.choice([16, 32])
    per_block = bs * kvmath.kv_bytes_per_token(cfg, "bfloat16")
    v = 4 / per_block
    return Numeric(
        f"A block table stores one int32 per block. For {cfg.name} with BF16 KV and blocks of {bs} "
        f"tokens, what fraction of the KV memory is block-table metadata?",
        v, "fraction", f"4 B / ({bs} x {kvmath.kv_bytes_per_token(cfg, 'bfloat16'):,} B) = {v:.3g}",
        dict(model=cfg.name, block_size=bs), rel_tol=0.02)


@generator
def gqa_saving(rng, **o) -> Numeric:
    cfg = configs.get(_pick(rng, o, "models", ["llama-3-8b", "llama-2-70b", "llama-3.1-405b",
                                                "qwen2.5-7b", "mistral-7b", "smollm2-135m",
                                                "deepseek-v3"]))
    mha = kvmath.mha_equivalent_bytes_per_token(cfg)
    kv = kvmath.kv_bytes_per_token(cfg)
    v = mha / kv
    extra = ("decompressed per-head keys and values vs the cached latent"
             if cfg.attention == "mla" else
             f"{cfg.num_heads} query heads / {cfg.num_kv_heads} KV heads")
    return Numeric(
        f"How many times smaller is {cfg.name}'s KV cache than it would be if every query head "
        f"kept its own K and V (plain multi-head attention)? ({_cfg_line(cfg)}.)",
        v, "ratio", f"{mha:,} B / {kv:,} B per token = {v:.3g}x ({extra})",
        dict(model=cfg.name), rel_tol=0.01)


@generator
def long_context_kv(rng, **o) -> Numeric:
    cfg = configs.get(_pick(rng, o, "models", ["llama-3.1-405b", "llama-3.2-1b", "qwen2.5-7b",
                                                "mistral-7b"]))
    n = min(cfg.max_position_embeddings, rng.choice([32768, 65536, 131072]))
    dtype = _pick(rng, o, "dtypes", KV_DTYPES)
    v = kvmath.kv_bytes_per_sequence(cfg, n, dtype)
    return Numeric(
        f"A single {n:,}-token request to {cfg.name} ({_cfg_line(cfg)}), {DTYPE_NAME[dtype]} KV: "
        f"how much KV cache does it need?",
        v, "bytes", f"{_kv_working(cfg, dtype)}; x {n:,} = {fmt_bytes(v)}",
        dict(model=cfg.name, dtype=dtype, seq_len=n), rel_tol=0.01)


@generator
def mlp_activation(rng, **o) -> Numeric:
    cfg = configs.get(_pick(rng, o, "models", ["llama-3-8b", "llama-2-70b", "mistral-7b",
                                                "qwen2.5-7b"]))
    t = rng.choice([2048, 4096, 8192, 16384])
    v = formulas.mlp_activation_bytes(t, cfg.intermediate_size, 2)
    return Numeric(
        f"A step of {t:,} tokens through one MLP of {cfg.name} (intermediate size "
        f"{cfg.intermediate_size:,}, BF16): how many bytes do the gate and up projections' outputs "
        f"take before they are multiplied together?",
        v, "bytes", f"{t:,} tokens x 2 x {cfg.intermediate_size:,} x 2 B = {fmt_bytes(v)}; memory "
        "outside the KV pool that grows with the step's token count",
        dict(model=cfg.name, tokens=t), rel_tol=0.01)


# --- roofline ----------------------------------------------------------------------------------

@generator
def ridge(rng, **o) -> Numeric:
    gpu = kvmath.GPUS[_pick(rng, o, "gpus", GPUS)]
    v = roofline.ridge_point(gpu.bandwidth, gpu.bf16_flops)
    return Numeric(
        f"{gpu.name}: {gpu.bf16_flops / 1e12:g} TFLOP/s dense BF16, {gpu.bandwidth / 1e12:g} TB/s. "
        f"At what arithmetic intensity (FLOP per byte) does a kernel stop being memory-bound?",
        v, "flop_per_byte",
        f"{gpu.bf16_flops:.4g} FLOP/s / {gpu.bandwidth:.4g} B/s = {v:.1f} FLOP/byte",
        dict(gpu=gpu.name), rel_tol=0.02)


def _fits(cfg, gpu, dtype="bfloat16", share=0.9) -> bool:
    """A question about one GPU never poses weights that do not fit on it (70B in BF16 is
    ~140 GB: no single 80 GB or 141 GB GPU holds it with room for KV)."""
    return kvmath.weight_bytes(cfg, dtype) <= share * gpu.memory_bytes


def _model_on_gpu(rng, o, models, gpus, dtypes=("bfloat16",), tries=200):
    for _ in range(tries):
        cfg = configs.get(_pick(rng, o, "models", models))
        gpu = kvmath.GPUS[_pick(rng, o, "gpus", gpus)]
        dtype = _pick(rng, o, "dtypes", list(dtypes))
        if _fits(cfg, gpu, dtype):
            return cfg, gpu, dtype
    raise ValueError("no drawn model fits on the drawn GPU; widen the bank entry's options")


def _decode_setup(rng, o):
    cfg, gpu, _ = _model_on_gpu(rng, o, ["llama-3-8b", "llama-2-7b", "llama-2-70b", "mistral-7b",
                                         "qwen2.5-7b", "llama-3-70b"],
                                ["H100-SXM-80GB", "A100-SXM-80GB", "H200-SXM-141GB"])
    batch = _pick(rng, o, "batches", [1, 8, 32, 64])
    ctx = _pick(rng, o, "contexts", [0, 512, 2048, 4096])
    return cfg, gpu, batch, ctx


@generator
def decode_step_time(rng, **o) -> Numeric:
    cfg, gpu, batch, ctx = _decode_setup(rng, o)
    nbytes = roofline.bytes_moved(cfg, batch, 1, ctx, "bfloat16")
    v = nbytes / gpu.bandwidth
    w = roofline.weight_read_params(cfg)
    return Numeric(
        f"{cfg.name} in BF16 ({w:,} parameters read per step; {_cfg_line(cfg)}) decodes a batch "
        f"of {batch} sequence{'s' if batch > 1 else ''}, each with {ctx:,} tokens cached, "
        f"on an {gpu.name} ({gpu.bandwidth / 1e12:g} TB/s). What is the lower bound on one "
        f"decode step's time set by memory bandwidth (weights read once, every sequence's KV "
        f"read, new KV written)?",
        v, "seconds", f"({w:,} x 2 B weights + {batch} x {ctx:,} x "
        f"{kvmath.kv_bytes_per_token(cfg):,} B KV read + {batch} x "
        f"{kvmath.kv_bytes_per_token(cfg):,} B written) = {fmt_bytes(nbytes)}; "
        f"/ {gpu.bandwidth:.4g} B/s = {fmt_seconds(v)}",
        dict(model=cfg.name, gpu=gpu.name, batch=batch, context=ctx), rel_tol=0.03, unit="ms")


@generator
def decode_tokens_per_s(rng, **o) -> Numeric:
    cfg, gpu, dtype = _model_on_gpu(rng, o, ["llama-2-70b", "llama-3-8b", "llama-3-70b",
                                             "mistral-7b"],
                                    ["H100-SXM-80GB", "A100-SXM-80GB", "H200-SXM-141GB"],
                                    ["bfloat16", "int8", "int4"])
    nbytes = roofline.weight_read_params(cfg) * kvmath.dtype_bytes(dtype)
    v = gpu.bandwidth / nbytes
    return Numeric(
        f"Batch-1 decode of {cfg.name} with {DTYPE_NAME[dtype]} weights "
        f"({roofline.weight_read_params(cfg):,} parameters read per step) on an {gpu.name} "
        f"({gpu.bandwidth / 1e12:g} TB/s). Ignoring the KV read, what is the most tokens/s one "
        f"request can get?",
        v, "tokens_per_s", f"{gpu.bandwidth:.4g} B/s / {nbytes:.4g} B per step = {v:.1f} tok/s "
        f"(a step takes at least {fmt_seconds(1 / v)})",
        dict(model=cfg.name, gpu=gpu.name, dtype=dtype), rel_tol=0.03)


@generator
def decode_intensity(rng, **o) -> Numeric:
    cfg, gpu, batch, ctx = _decode_setup(rng, o)
    flops = roofline.forward_flops(cfg, 1, ctx, batch)
    nbytes = roofline.bytes_moved(cfg, batch, 1, ctx, "bfloat16")
    v = flops / nbytes
    r = roofline.ridge_point(gpu.bandwidth, gpu.bf16_flops)
    return Numeric(
        f"Decode step of {cfg.name} in BF16, batch {batch}, {ctx:,} tokens cached per sequence "
        f"({_cfg_line(cfg)}). Estimate its arithmetic intensity in FLOP per byte (2 FLOPs per "
        f"parameter per token plus attention; bytes = weights + KV read + KV written).",
        v, "flop_per_byte", f"{flops:.4g} FLOPs / {nbytes:.4g} B = {v:.3g} FLOP/byte; the "
        f"{gpu.name} ridge is {r:.0f}, so this step is "
        f"{'memory' if v < r else 'compute'}-bound",
        dict(model=cfg.name, batch=batch, context=ctx), rel_tol=0.15)


@generator
def prefill_time(rng, **o) -> Numeric:
    cfg = configs.get(_pick(rng, o, "models", ["llama-3-8b", "llama-2-7b", "mistral-7b",
                                                "qwen2.5-7b"]))
    gpu = kvmath.GPUS[_pick(rng, o, "gpus", ["H100-SXM-80GB", "A100-SXM-80GB"])]
    t = rng.choice([1024, 2048, 4096, 8192])
    flops = roofline.forward_flops(cfg, t, 0, 1, last_only=True)
    nbytes = roofline.bytes_moved(cfg, 1, t, 0, "bfloat16")
    v = max(flops / gpu.bf16_flops, nbytes / gpu.bandwidth)
    return Numeric(
        f"Prefill of a {t:,}-token prompt on {cfg.name} (BF16, {roofline.matmul_params(cfg):,} "
        f"parameters in matmuls) on an {gpu.name} ({gpu.bf16_flops / 1e12:g} TFLOP/s, "
        f"{gpu.bandwidth / 1e12:g} TB/s). Lower bound on its time from the roofline?",
        v, "seconds", f"compute {flops:.4g} FLOPs / {gpu.bf16_flops:.4g} = "
        f"{fmt_seconds(flops / gpu.bf16_flops)}; memory {fmt_bytes(nbytes)} / "
        f"{gpu.bandwidth:.4g} = {fmt_seconds(nbytes / gpu.bandwidth)}; the larger bounds the step "
        f"({'compute' if flops / gpu.bf16_flops > nbytes / gpu.bandwidth else 'memory'}-bound)",
        dict(model=cfg.name, gpu=gpu.name, tokens=t), rel_tol=0.10, unit="ms")


@generator
def compute_cap_tokens(rng, **o) -> Numeric:
    cfg, gpu, _ = _model_on_gpu(rng, o, ["llama-2-70b", "llama-3-8b", "llama-3-70b",
                                         "mistral-7b"], ["H100-SXM-80GB", "A100-SXM-80GB"])
    flops_per_token = 2 * roofline.matmul_params(cfg)
    v = gpu.bf16_flops / flops_per_token
    return Numeric(
        f"However large the batch, {cfg.name} ({roofline.matmul_params(cfg):,} parameters in "
        f"matmuls) in BF16 on one {gpu.name} ({gpu.bf16_flops / 1e12:g} TFLOP/s dense) cannot "
        f"process more than how many tokens per second (attention ignored)?",
        v, "tokens_per_s", f"{gpu.bf16_flops:.4g} / (2 x {roofline.matmul_params(cfg):,}) = "
        f"{v:,.0f} tok/s", dict(model=cfg.name, gpu=gpu.name), rel_tol=0.03)


@generator
def bandwidth_ratio(rng, **o) -> Numeric:
    a, b = sorted(rng.sample(["H100-SXM-80GB", "H200-SXM-141GB", "A100-SXM-80GB", "A100-SXM-40GB",
                              "L4-24GB", "RTX-4090-24GB"], 2),
                  key=lambda name: -kvmath.GPUS[name].bandwidth)          # a is the faster one
    ga, gb = kvmath.GPUS[a], kvmath.GPUS[b]
    v = ga.bandwidth / gb.bandwidth
    return Numeric(
        f"Batch-1 decode is bandwidth-bound. Roughly how many times faster does it run on an {a} "
        f"({ga.bandwidth / 1e12:g} TB/s) than on an {b} ({gb.bandwidth / 1e12:g} TB/s)?",
        v, "ratio", f"{ga.bandwidth:.4g} / {gb.bandwidth:.4g} = {v:.3g}x",
        dict(a=a, b=b), rel_tol=0.02)


# --- blocks and fragmentation ------------------------------------------------------------------

def _lengths(rng, k=None):
    k = k or rng.randint(3, 6)
    return [rng.randint(1, 600) for _ in range(k)]


@generator
def blocks_for_mix(rng, **o) -> Numeric:
    bs = rng.choice([8, 16, 32])
    lens = _lengths(rng)
    v = sum(formulas.blocks_needed(n, bs) for n in lens)
    return Numeric(
        f"Sequences of {', '.join(map(str, lens))} tokens live in a paged cache with blocks of "
        f"{bs} tokens. How many blocks do they hold in total?",
        v, "count", " + ".join(f"ceil({n}/{bs})={formulas.blocks_needed(n, bs)}" for n in lens)
        + f" = {v}", dict(lengths=lens, block_size=bs), rel_tol=0.0)


@generator
def paged_waste(rng, **o) -> Numeric:
    bs = rng.choice([16, 32])
    lens = _lengths(rng)
    waste = formulas.paged_waste_slots(lens, bs)
    alloc = sum(formulas.blocks_needed(n, bs) for n in lens) * bs
    v = waste / alloc
    return Numeric(
        f"Sequences of {', '.join(map(str, lens))} tokens, blocks of {bs}. What fraction of the "
        f"allocated token slots is empty?",
        v, "fraction", f"empty slots {waste} / allocated {alloc} = {v:.3f} (only each sequence's "
        "last block can be partly empty)", dict(lengths=lens, block_size=bs),
        rel_tol=0.02, abs_tol=0.002)


@generator
def contiguous_waste(rng, **o) -> Numeric:
    max_len = rng.choice([2048, 4096, 8192])
    lens = [rng.randint(50, 1500) for _ in range(rng.randint(3, 6))]
    waste = formulas.contiguous_waste_slots(lens, max_len)
    v = waste / (max_len * len(lens))
    return Numeric(
        f"Every request reserves a contiguous slab of {max_len:,} token slots (the model's "
        f"maximum) and the requests end up with {', '.join(map(str, lens))} tokens. What "
        f"fraction of the reserved slots is never used?",
        v, "fraction", f"1 - {sum(lens):,} / ({len(lens)} x {max_len:,}) = {v:.3f}",
        dict(lengths=lens, max_len=max_len), rel_tol=0.01, abs_tol=0.002)


@generator
def fork_sharing(rng, **o) -> Numeric:
    bs = rng.choice([16, 32])
    prompt = rng.randint(30, 400)
    n = rng.choice([2, 3, 4, 8])
    when = rng.choice(["at_fork", "after_first_write"])
    b = formulas.fork_blocks(prompt, n, bs)
    v = b["unshared"] - b[when]
    moment = ("right after the fork, before any new token" if when == "at_fork" else
              "after every sample has written its first new token")
    why = (f"the children share all {b['at_fork']} blocks of the table (refcounts only)"
           if when == "at_fork" else
           f"the {prompt // bs} full blocks stay shared; the partly filled block ({prompt % bs} "
           f"tokens) was copied for every sample that wrote into it")
    return Numeric(
        f"A {prompt}-token prompt is forked into {n} samples (parallel sampling), blocks of {bs}, "
        f"copy-on-write. How many blocks are saved compared with {n} independent copies, "
        f"{moment}?",
        v, "count", f"independent: {n} x ceil({prompt}/{bs}) = {b['unshared']}; shared: "
        f"{b[when]} because {why}; saved {v}",
        dict(prompt=prompt, n=n, block_size=bs, when=when), rel_tol=0.0)


@generator
def prefix_savings(rng, **o) -> Numeric:
    bs = rng.choice([16, 32])
    prefix = rng.randint(5, 900)
    n = rng.choice([10, 100, 1000])
    per = formulas.prefix_cached_tokens(prefix, bs)
    v = per * (n - 1)
    return Numeric(
        f"{n} requests share the same {prefix}-token system prompt (then differ). A block-level "
        f"prefix cache with blocks of {bs} tokens is on and the first request computed and cached "
        f"the prefix. How many prompt tokens in total do the other {n - 1} requests skip "
        f"computing?",
        v, "count", f"only full blocks are cached: floor({prefix}/{bs}) x {bs} = {per} tokens per "
        f"request; x {n - 1} = {v:,}", dict(prefix=prefix, n=n, block_size=bs), rel_tol=0.0)


@generator
def chunked_prefill_steps(rng, **o) -> Numeric:
    budget = rng.choice([256, 512, 1024, 2048])
    decodes = rng.randint(0, min(64, budget // 4))
    prompt = rng.randint(budget, 8 * budget)
    v = formulas.ceil_div(prompt, budget - decodes)
    return Numeric(
        f"A token budget of {budget} per step; {decodes} running requests each decode one token "
        f"every step and are scheduled first. A {prompt:,}-token prompt arrives and is chunked "
        f"into the leftover budget. How many steps until its prefill is done?",
        v, "count", f"{budget} - {decodes} = {budget - decodes} prompt tokens per step; "
        f"ceil({prompt:,} / {budget - decodes}) = {v}",
        dict(budget=budget, decodes=decodes, prompt=prompt), rel_tol=0.0)


# --- speculative decoding ----------------------------------------------------------------------

def _spec_params(rng):
    alpha = rng.choice([0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    k = rng.choice([2, 3, 4, 5, 6, 8])
    c = rng.choice([0.0, 0.02, 0.05, 0.1, 0.2, 0.5])
    return alpha, k, c


@generator
def spec_speedup(rng, **o) -> Numeric:
    alpha, k, c = _spec_params(rng)
    v = theory.speedup(alpha, k, c)
    t = theory.expected_tokens(alpha, k)
    return Numeric(
        f"Speculative decoding with k = {k} draft tokens per step, per-token acceptance rate "
        f"alpha = {alpha}, and a draft that costs c = {c} of a target forward pass per token. "
        f"Expected speedup over plain decoding (verification costs one target pass)?",
        v, "ratio", f"tokens per step (1 - {alpha}^{k + 1}) / (1 - {alpha}) = {t:.3f}; cost "
        f"{k} x {c} + 1 = {k * c + 1:.3f} target passes; speedup {t:.3f} / {k * c + 1:.3f} = "
        f"{v:.3f}x", dict(alpha=alpha, k=k, c=c), rel_tol=0.01)


@generator
def spec_tokens_per_step(rng, **o) -> Numeric:
    alpha, k, _ = _spec_params(rng)
    v = theory.expected_tokens(alpha, k)
    return Numeric(
        f"k = {k} draft tokens, each accepted with probability alpha = {alpha} (independently, "
        f"stopping at the first rejection). Expected tokens emitted per verification step, "
        f"counting the target's own corrected or bonus token?",
        v, "count", f"1 + {alpha} + {alpha}^2 + ... + {alpha}^{k} = (1 - {alpha}^{k + 1}) / "
        f"(1 - {alpha}) = {v:.3f}", dict(alpha=alpha, k=k), rel_tol=0.01)


@generator
def spec_break_even(rng, **o) -> Numeric:
    k = rng.choice([2, 3, 4, 5, 8])
    c = rng.choice([0.05, 0.1, 0.2, 0.3, 0.5])
    v = theory.break_even_alpha(k, c)
    return Numeric(
        f"k = {k} draft tokens per step and a draft costing c = {c} of a target pass per token. "
        f"Below what per-token acceptance rate does speculation make decoding slower?",
        v, "fraction", f"solve (1 - a^{k + 1}) / ((1 - a)({k} x {c} + 1)) = 1 for a: a = {v:.3f}; "
        "the break-even moves with k and c", dict(k=k, c=c), rel_tol=0.02, abs_tol=0.01)


# --- serving -----------------------------------------------------------------------------------

@generator
def littles_concurrency(rng, **o) -> Numeric:
    rate = rng.choice([2, 5, 10, 20, 50, 100])
    latency = rng.choice([0.5, 1.5, 3, 6, 12, 20])
    v = capacity.littles_law_concurrency(rate, latency)
    return Numeric(
        f"A service receives {rate} requests/s on average and each request spends {latency} s in "
        f"the system (queue + prefill + decode). How many requests are in flight on average?",
        v, "count", f"Little's law L = lambda x W = {rate} x {latency} = {v:g}",
        dict(rate=rate, latency=latency), rel_tol=0.01)


@generator
def littles_latency(rng, **o) -> Numeric:
    slots = rng.choice([16, 32, 64, 128, 256])
    rate = rng.choice([4, 8, 10, 16, 25])
    v = capacity.littles_law_latency(slots, rate)
    return Numeric(
        f"An engine holds at most {slots} requests at once and is kept full; requests complete at "
        f"{rate} per second. How long does each request stay in the engine on average?",
        v, "seconds", f"W = L / lambda = {slots} / {rate} = {v:g} s",
        dict(slots=slots, rate=rate), rel_tol=0.01, unit="s")


@generator
def e2e_latency(rng, **o) -> Numeric:
    ttft = rng.choice([0.05, 0.12, 0.3, 0.8])
    tpot = rng.choice([0.01, 0.02, 0.03, 0.05])
    n = rng.choice([50, 128, 256, 500])
    v = formulas.request_latency(ttft, tpot, n)
    return Numeric(
        f"TTFT is {ttft * 1e3:g} ms, TPOT (mean gap after the first token) is {tpot * 1e3:g} ms, "
        f"and the reply has {n} tokens. End-to-end latency?",
        v, "seconds", f"TTFT + (n - 1) x TPOT = {ttft} + {n - 1} x {tpot} = {v:.4g} s",
        dict(ttft=ttft, tpot=tpot, n=n), rel_tol=0.005, unit="s")


@generator
def cost_per_mtok(rng, **o) -> Numeric:
    price = rng.choice([1.2, 2.0, 2.5, 3.5, 4.0])
    tps = rng.choice([500, 1500, 3000, 6000, 12000])
    ngpu = rng.choice([1, 2, 4, 8])
    v = capacity.cost_per_million_tokens(price, tps, ngpu)
    return Numeric(
        f"{ngpu} GPU(s) at ${price}/hour each produce {tps:,} output tokens/s in total at a steady "
        f"load. Cost per million output tokens?",
        v, "dollars", f"{ngpu} x ${price} / ({tps:,} x 3600 tokens/h) x 1e6 = ${v:.4g}",
        dict(price=price, tps=tps, num_gpus=ngpu), rel_tol=0.01)


@generator
def swap_time(rng, **o) -> Numeric:
    cfg = configs.get(_pick(rng, o, "models", ["llama-3-8b", "llama-2-7b", "mistral-7b",
                                                "llama-2-70b"]))
    n = rng.choice([500, 1000, 2000, 4000])
    bw = rng.choice([25, 32, 64])
    nbytes = kvmath.kv_bytes_per_sequence(cfg, n)
    v = 2 * formulas.transfer_seconds(nbytes, bw * 1e9)
    return Numeric(
        f"A {n:,}-token sequence of {cfg.name} (BF16 KV; {_cfg_line(cfg)}) is preempted by "
        f"swapping its KV to CPU memory and later swapped back, over a {bw} GB/s host link. "
        f"Transfer time out and in together?",
        v, "seconds", f"{fmt_bytes(nbytes)} x 2 directions / {bw} GB/s = {fmt_seconds(v)}",
        dict(model=cfg.name, seq_len=n, bw_gb=bw), rel_tol=0.02, unit="ms")


@generator
def kv_transfer_disagg(rng, **o) -> Numeric:
    cfg = configs.get(_pick(rng, o, "models", ["llama-3-8b", "llama-2-70b", "llama-3-70b"]))
    n = rng.choice([1000, 4000, 16000])
    gbit = rng.choice([100, 200, 400])
    nbytes = kvmath.kv_bytes_per_sequence(cfg, n)
    v = formulas.transfer_seconds(nbytes, formulas.gbit_to_bytes_per_s(gbit))
    return Numeric(
        f"Prefill/decode disaggregation: the prefill worker ships a {n:,}-token prompt's KV "
        f"({cfg.name}, BF16; {_cfg_line(cfg)}) to a decode worker over a {gbit} Gb/s network link. "
        f"Transfer time at full link speed?",
        v, "seconds", f"{fmt_bytes(nbytes)} / ({gbit} Gb/s = {gbit / 8:g} GB/s) = {fmt_seconds(v)}",
        dict(model=cfg.name, seq_len=n, gbit=gbit), rel_tol=0.02, unit="ms")


@generator
def lora_size(rng, **o) -> Numeric:
    cfg = configs.get(_pick(rng, o, "models", ["llama-2-7b", "llama-3-8b", "llama-2-70b"]))
    r = rng.choice([8, 16, 32, 64])
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    proj = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h)}
    names = rng.choice([("q", "v"), ("q", "k", "v", "o")])
    shapes = [proj[n] for n in names]
    v = formulas.lora_adapter_bytes(cfg.num_layers, shapes, r, 2)
    listed = ", ".join(f"{n}: {i} -> {out}" for n, (i, out) in zip(names, shapes))
    return Numeric(
        f"A rank-{r} LoRA adapter on the {' and '.join(names)} projections of all "
        f"{cfg.num_layers} layers of {cfg.name} ({listed}), stored in BF16. Size?",
        v, "bytes", f"per module r x (in + out); {cfg.num_layers} layers x ("
        + " + ".join(f"{r} x ({i} + {out})" for i, out in shapes) + f") x 2 B = {fmt_bytes(v)}: "
        f"tiny next to the base model's {fmt_bytes(kvmath.weight_bytes(cfg))}",
        dict(model=cfg.name, rank=r, modules=list(names)), rel_tol=0.01)


@generator
def recompute_ratio(rng, **o) -> Numeric:
    n = rng.choice([100, 500, 1000, 2000, 4096])
    v = formulas.recompute_flop_ratio(n)
    return Numeric(
        f"Generating {n:,} tokens one by one, how many times more token positions go through the "
        f"model without a KV cache (re-running the whole prefix every step) than with one?",
        v, "ratio", f"without: 1 + 2 + ... + {n} = {n * (n + 1) // 2:,}; with: {n:,}; ratio "
        f"(N + 1) / 2 = {v:g}", dict(n=n), rel_tol=0.01)


def make_numeric(name: str, seed, options: dict) -> Numeric:
    if name not in GENERATORS:
        raise ValueError(f"unknown numeric generator {name!r}; known: {', '.join(GENERATORS)}")
    rng = random.Random(f"{name}:{seed}")
    return GENERATORS[name](rng, **(options or {}))


def fmt_answer(n: Numeric) -> str:
    return fmt_value(n.value, n.dimension)
