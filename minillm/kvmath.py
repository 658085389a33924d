"""KV-cache arithmetic (chapter 01).

Every layer caches one key and one value vector per KV head for every token:

    kv_bytes_per_token = 2 (K and V) x num_layers x num_kv_heads x head_dim x bytes_per_element

MHA has num_kv_heads == num_heads, GQA fewer, MQA one. MLA (DeepSeek-V2/V3) caches neither K
nor V per head: one compressed latent of kv_lora_rank values plus one shared rotary key of
qk_rope_head_dim values per token and layer, so there is no factor 2:

    mla_bytes_per_token = num_layers x (kv_lora_rank + qk_rope_head_dim) x bytes_per_element

The counts are elements only: an fp8/int8 cache also keeps scale factors (one per tensor or per
token and head in common engines), a few bytes beside hundreds of kilobytes, left out here.
Capacities use decimal units where a datasheet does (an "80 GB" GPU is 80 x 10^9 bytes here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .configs import ModelConfig

DTYPE_BYTES = {
    "float32": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
    "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
    "int4": 0.5, "fp4": 0.5,
}


def dtype_bytes(dtype) -> float:
    """Bytes per element of a dtype given by name ("bf16", "fp8", ...) or as a torch.dtype."""
    key = str(dtype).removeprefix("torch.").lower()
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


def kv_elements_per_token(cfg: ModelConfig) -> int:
    """Cached numbers per token over all layers."""
    if cfg.attention == "mla":
        return cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim


def kv_bytes_per_token(cfg: ModelConfig, dtype="bfloat16") -> int:
    """Bytes of KV cache one token occupies across all layers."""
    return math.ceil(kv_elements_per_token(cfg) * dtype_bytes(dtype))   # a partial byte is a byte


def kv_bytes_per_sequence(cfg: ModelConfig, seq_len: int, dtype="bfloat16") -> int:
    """Bytes of KV cache one sequence of seq_len tokens occupies."""
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    return kv_bytes_per_token(cfg, dtype) * seq_len


def mha_equivalent_bytes_per_token(cfg: ModelConfig, dtype="bfloat16") -> int:
    """What the cache would cost if every query head kept its own K and V (no GQA/MQA/MLA).

    For MLA that is the decompressed per-head keys (head_dim) and values (v_head_dim)."""
    v_dim = cfg.v_head_dim or cfg.head_dim
    elements = cfg.num_layers * cfg.num_heads * (cfg.head_dim + v_dim)
    return math.ceil(elements * dtype_bytes(dtype))


def param_count(cfg: ModelConfig) -> int:
    """Parameters of a Llama-family decoder with this config (MLA/MoE: the published count)."""
    if cfg.attention == "mla":
        return int(cfg.published_params)
    C, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attn = C * cfg.num_heads * D * 2 + C * cfg.num_kv_heads * D * 2        # q, o + k, v
    if cfg.attention_bias:
        attn += cfg.num_heads * D + 2 * cfg.num_kv_heads * D
    mlp = 3 * C * I
    per_layer = attn + mlp + 2 * C                                          # + two RMSNorms
    embed = cfg.vocab_size * C * (1 if cfg.tie_word_embeddings else 2)
    return cfg.num_layers * per_layer + embed + C                           # + final norm


def weight_bytes(cfg: ModelConfig, dtype="bfloat16") -> int:
    return int(param_count(cfg) * dtype_bytes(dtype))


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int          # HBM capacity as the datasheet states it (decimal GB)
    bandwidth: float           # bytes/s, datasheet peak
    bf16_flops: float          # dense tensor-core FLOP/s, datasheet peak (no sparsity)


GPUS = {
    "H100-SXM-80GB": GPU("H100-SXM-80GB", 80 * 10**9, 3.35e12, 989e12),
    "H200-SXM-141GB": GPU("H200-SXM-141GB", 141 * 10**9, 4.8e12, 989e12),
    "A100-SXM-80GB": GPU("A100-SXM-80GB", 80 * 10**9, 2.039e12, 312e12),
    "A100-SXM-40GB": GPU("A100-SXM-40GB", 40 * 10**9, 1.555e12, 312e12),
    "L4-24GB": GPU("L4-24GB", 24 * 10**9, 0.3e12, 121e12),
    "RTX-4090-24GB": GPU("RTX-4090-24GB", 24 * 10**9, 1.008e12, 165e12),
}


def get_gpu(gpu) -> GPU:
    if isinstance(gpu, GPU):
        return gpu
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; use one of {', '.join(GPUS)} or a kvmath.GPU")
    return GPUS[gpu]


@dataclass(frozen=True)
class CapacityPlan:
    gpu: str
    model: str
    usable_bytes: int          # memory_bytes x gpu_memory_utilization
    weight_bytes: int
    reserved_bytes: int        # activations, CUDA graphs, workspace
    kv_pool_bytes: int         # what is left for the KV cache (0 if the weights do not fit)
    kv_bytes_per_token: int
    max_tokens: int            # tokens the pool holds
    context_len: int
    max_seqs: int              # sequences of context_len that fit at once

    @property
    def fits(self) -> bool:
        return self.max_seqs > 0


def plan_capacity(gpu, cfg: ModelConfig, weight_dtype="bfloat16", kv_dtype="bfloat16",
                  gpu_memory_utilization: float = 0.9, context_len: int = 4096,
                  reserved_bytes: int = 0, num_gpus: int = 1) -> CapacityPlan:
    """How much KV cache fits next to the weights, and how many sequences that serves.

    Like vLLM, the engine may use `gpu_memory_utilization` of each GPU's memory; the weights and
    `reserved_bytes` per GPU (activations, CUDA graphs, workspace) come out of that, and the rest
    is the KV pool. Weights and KV heads are split evenly over `num_gpus` (tensor parallelism),
    so per GPU the pool is (utilization x memory - weights / n - reserve) and each token costs
    1/n of its bytes there; the plan reports the totals over all GPUs.
    """
    g = get_gpu(gpu)
    if not 0 < gpu_memory_utilization <= 1:        # also rejects NaN
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}; "
                         "it is the fraction of GPU memory the engine may use, e.g. 0.9")
    if int(context_len) != context_len or context_len <= 0:
        raise ValueError(f"context_len must be a positive integer, got {context_len}")
    if context_len > cfg.max_position_embeddings:
        raise ValueError(f"context_len {context_len} exceeds {cfg.name}'s context of "
                         f"{cfg.max_position_embeddings} tokens; plan for at most that")
    if reserved_bytes < 0:
        raise ValueError(f"reserved_bytes must be >= 0, got {reserved_bytes}")
    if int(num_gpus) != num_gpus or num_gpus < 1:
        raise ValueError(f"num_gpus must be a positive integer, got {num_gpus}")
    context_len, num_gpus, reserved_bytes = int(context_len), int(num_gpus), int(reserved_bytes)
    usable = int(g.memory_bytes * gpu_memory_utilization) * num_gpus
    weights = weight_bytes(cfg, weight_dtype)
    pool = max(0, usable - weights - reserved_bytes * num_gpus)
    per_token = kv_bytes_per_token(cfg, kv_dtype)
    max_tokens = pool // per_token
    return CapacityPlan(gpu=g.name if num_gpus == 1 else f"{num_gpus}x {g.name}", model=cfg.name,
                        usable_bytes=usable, weight_bytes=weights,
                        reserved_bytes=reserved_bytes * num_gpus, kv_pool_bytes=pool,
                        kv_bytes_per_token=per_token, max_tokens=max_tokens,
                        context_len=context_len, max_seqs=max_tokens // context_len)
