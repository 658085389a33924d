"""Graders for the chapter 01 problem set (solutions/01_kv_cache_math.ipynb).

    ch01.check_kv_bytes_per_token(kv_bytes_per_token)   # (a) bytes of KV cache per token
    ch01.check_max_concurrency(max_concurrent_seqs)      # (b) sequences that fit on one GPU

The references are minillm.kvmath.kv_bytes_per_token and minillm.kvmath.plan_capacity, on the
published configs of minillm.configs.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Optional

from .. import configs, kvmath
from ..configs import ModelConfig
from .core import Check, Exercise, Problem
from .hints import one_fit


def _number_problem(value) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, Real):
        return f"returned {type(value).__name__} {value!r}; expected a number"
    return None


# =========================================================================== (a) KV bytes per token

def _formula(cfg: ModelConfig, dtype) -> str:
    b = kvmath.dtype_bytes(dtype)
    unit = f"{b:g} byte" + ("" if b == 1 else "s")
    if cfg.attention == "mla":
        return (f"{cfg.num_layers} layers x ({cfg.kv_lora_rank} latent + {cfg.qk_rope_head_dim} "
                f"rotary) x {unit}")
    return (f"2 (K and V) x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x "
            f"{cfg.head_dim} head_dim x {unit}")


def _kv_diagnosis(got, expected: int, cfg: ModelConfig, dtype) -> str:
    """The one known mistake that gives `got`, as "; sentence", or "" when none or several fit
    (for DeepSeek-V3 in fp8, a factor 2 too many is either K and V counted separately or fp8
    counted as 2 bytes: no hint then)."""
    b = kvmath.dtype_bytes(dtype)
    candidates = []
    if cfg.attention == "mla":
        candidates += [
            (2 * expected, "MLA caches one latent and one rotary key per layer, not separate K "
                           "and V, so there is no factor 2"),
            (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * b, "that is the MHA "
             "formula, but DeepSeek-V3 caches a compressed latent (kv_lora_rank) plus a shared "
             "rotary key (qk_rope_head_dim) per layer"),
        ]
    else:
        if cfg.num_heads != cfg.num_kv_heads:
            candidates.append((expected * cfg.num_heads / cfg.num_kv_heads, f"you counted the "
                               f"{cfg.num_heads} query heads, but only the {cfg.num_kv_heads} KV "
                               "heads are cached"))
        candidates.append((expected / 2, "keys and values are both cached: a factor 2 is "
                                         "missing"))
    if b == 1:
        candidates.append((2 * expected, f"{dtype} takes 1 byte per element, not 2"))
    elif b == 4:
        candidates.append((expected / 2, f"{dtype} takes 4 bytes per element, not 2"))
    elif b == 2:
        candidates.append((2 * expected, f"{dtype} takes 2 bytes per element, not 4"))
    hint = one_fit(got, candidates, expected=expected)
    return f"; {hint}" if hint else ""


def _kv_cases(cases):
    def check(fn):
        for name, dtype in cases:
            cfg = configs.get(name) if isinstance(name, str) else name
            expected = kvmath.kv_bytes_per_token(cfg, dtype)
            got = fn(cfg, dtype)
            problem = _number_problem(got)
            if problem:
                raise Problem(f"{cfg.name} in {dtype}: {problem}")
            if got != expected:
                hint = _kv_diagnosis(got, expected, cfg, dtype)
                raise Problem(f"{cfg.name} in {dtype}: you returned {got}, expected {expected} "
                              f"= {_formula(cfg, dtype)}{hint}")
    return check


_MQA = configs.get("llama-2-7b").with_(name="llama-2-7b with MQA (1 KV head)", num_kv_heads=1)

KV_BYTES = Exercise("ch01.kv_bytes_per_token", "kv_bytes_per_token", (
    Check("MHA (Llama-2-7B, bf16): 2 x layers x KV heads x head_dim x bytes",
          _kv_cases([("llama-2-7b", "bfloat16")])),
    Check("GQA counts KV heads, not query heads (Llama-3-8B, Llama-2-70B, Mistral, Qwen2.5, "
          "SmolLM2)", _kv_cases([(n, "bfloat16") for n in
                                 ("llama-3-8b", "llama-2-70b", "mistral-7b", "qwen2.5-7b",
                                  "smollm2-135m", "llama-3.1-405b")])),
    Check("MQA: one KV head serves every query head", _kv_cases([(_MQA, "bfloat16")])),
    Check("MLA (DeepSeek-V3): layers x (kv_lora_rank + qk_rope_head_dim) x bytes, no factor 2",
          _kv_cases([("deepseek-v3", "float32"), ("deepseek-v3", "bfloat16")])),
    Check("float32 counts 4 bytes per element, float16 2",
          _kv_cases([("llama-3-8b", "float32"), ("llama-3-8b", "float16"),
                     ("deepseek-v3", "float32")])),
    Check("fp8 and int8 count 1 byte per element",
          _kv_cases([("llama-3-8b", "fp8"), ("llama-2-70b", "int8"), ("deepseek-v3", "fp8")])),
))


def check_kv_bytes_per_token(kv_bytes_per_token, time_limit: Optional[float] = None):
    """Grade exercise (a): kv_bytes_per_token(cfg, dtype) -> bytes per token over all layers."""
    return KV_BYTES.check(kv_bytes_per_token, time_limit)


# =========================================================================== (b) max concurrency

def _custom_gpu(cfg_name, weight_dtype, kv_dtype, context_len, seqs: float) -> kvmath.GPU:
    """A GPU whose memory holds the weights plus exactly `seqs` sequences' worth of KV cache."""
    cfg = configs.get(cfg_name)
    per_seq = kvmath.kv_bytes_per_token(cfg, kv_dtype) * context_len
    memory = kvmath.weight_bytes(cfg, weight_dtype) + int(seqs * per_seq)
    return kvmath.GPU(f"a GPU with {memory:,} bytes", memory, 1e12, 1e14)


def _plan_case(fn, gpu, cfg_name, weight_dtype, kv_dtype, util, context_len):
    """Ask the learner and minillm's plan_capacity the same question; None or a message."""
    g, cfg = kvmath.get_gpu(gpu), configs.get(cfg_name)
    memory, weights = g.memory_bytes, kvmath.weight_bytes(cfg, weight_dtype)
    per_token = kvmath.kv_bytes_per_token(cfg, kv_dtype)
    expected = kvmath.plan_capacity(g, cfg, weight_dtype, kv_dtype, util, context_len).max_seqs
    got = fn(memory, util, weights, per_token, context_len)
    what = (f"{cfg.name} ({weight_dtype} weights, {kv_dtype} KV) on {g.name} at utilization "
            f"{util}, context {context_len}")
    problem = _number_problem(got)
    if problem:
        return f"{what}: {problem}"
    if got == expected:
        return None
    per_seq = per_token * context_len
    pool = int(memory * util) - weights
    variants = [
        (pool // per_seq, "weights larger than the usable memory leave 0 sequences, never a "
                          "negative number"),
        ((memory - weights) // per_seq, "you ignored gpu_memory_utilization"),
        (int((memory - weights) * util) // per_seq,
         "you applied the utilization to the memory left after the weights; it caps the total "
         "memory, and the weights come out of that share"),
        (int(memory * util) // per_seq, "you forgot to subtract the weights"),
        (pool // per_token, "that is a number of tokens; divide by context_len for sequences"),
        (round(pool / per_seq), "you rounded to the nearest whole sequence; a partial sequence "
                                "does not fit, so round down"),
        (math.ceil(pool / per_seq), "you rounded up; a partial sequence does not fit"),
    ]
    if round(pool / per_seq) == math.ceil(pool / per_seq):        # one mistake, two spellings
        variants[-2:] = [(math.ceil(pool / per_seq), "you rounded to the nearest whole sequence "
                          "(or up); a partial sequence does not fit, so round down")]
    hint = one_fit(got, variants, expected=expected)
    hint = f"; {hint}" if hint else ""
    return (f"{what}: you returned {got}, expected {expected} (usable {int(memory * util):,} "
            f"bytes - weights {weights:,} = {pool:,} bytes for KV; one sequence needs "
            f"{per_token:,} x {context_len} = {per_seq:,} bytes){hint}")


def _plan_cases(cases):
    def check(fn):
        for case in cases:
            message = _plan_case(fn, *case)
            if message:
                raise Problem(message)
    return check


_GRID = [
    ("H100-SXM-80GB", "llama-3-8b", "bf16", "fp8", 0.9, 8192),
    ("H200-SXM-141GB", "llama-3-70b", "fp8", "fp8", 0.92, 8192),
    ("A100-SXM-80GB", "mistral-7b", "bf16", "bf16", 0.85, 32768),
    ("L4-24GB", "qwen2.5-7b", "bf16", "bf16", 0.9, 4096),
    ("RTX-4090-24GB", "smollm2-135m", "bf16", "bf16", 0.8, 8192),
    ("A100-SXM-80GB", "llama-2-70b", "fp8", "int8", 0.9, 4096),
]

MAX_CONCURRENCY = Exercise("ch01.max_concurrency", "max_concurrent_seqs", (
    Check("Llama-3-8B on an H100-80GB at 90% utilization, bf16, 8192-token context",
          _plan_cases([("H100-SXM-80GB", "llama-3-8b", "bf16", "bf16", 0.9, 8192)])),
    Check("agrees with minillm.kvmath.plan_capacity across models, GPUs, dtypes and contexts",
          _plan_cases(_GRID)),
    Check("gpu_memory_utilization caps the total memory, before the weights are subtracted",
          _plan_cases([("H100-SXM-80GB", "llama-2-7b", "bf16", "bf16", 0.6, 4096),
                       ("H100-SXM-80GB", "llama-3.2-1b", "bf16", "bf16", 0.5, 131072),
                       ("H200-SXM-141GB", "llama-2-70b", "bf16", "bf16", 0.95, 4096)])),
    Check("weights that do not fit leave 0 sequences, never a negative number",
          _plan_cases([("L4-24GB", "llama-2-70b", "bf16", "bf16", 0.9, 4096),
                       ("H100-SXM-80GB", "llama-3-70b", "bf16", "bf16", 0.9, 8192)])),
    Check("counts whole sequences only: room for 3.9 sequences serves 3",
          _plan_cases([(_custom_gpu("llama-3-8b", "bf16", "bf16", 8192, 3.9), "llama-3-8b",
                        "bf16", "bf16", 1.0, 8192),
                       ("H100-SXM-80GB", "llama-3.2-1b", "bf16", "bf16", 0.5, 131072)])),
    Check("room for exactly n sequences serves n",
          _plan_cases([(_custom_gpu("llama-3-8b", "bf16", "bf16", 8192, 5), "llama-3-8b",
                        "bf16", "bf16", 1.0, 8192),
                       (_custom_gpu("mistral-7b", "bf16", "fp8", 4096, 1), "mistral-7b",
                        "bf16", "fp8", 1.0, 4096)])),
))


def check_max_concurrency(max_concurrent_seqs, time_limit: Optional[float] = None):
    """Grade exercise (b): max_concurrent_seqs(gpu_memory_bytes, gpu_memory_utilization,
    weight_bytes, kv_bytes_per_token, context_len) -> whole sequences that fit."""
    return MAX_CONCURRENCY.check(max_concurrent_seqs, time_limit)


EXERCISES = (KV_BYTES, MAX_CONCURRENCY)
