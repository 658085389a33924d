"""A one-page sheet of the figures an inference interview leans on, computed from the package."""
from __future__ import annotations

from .. import configs, kvmath, roofline
from ..spec import theory
from . import formulas
from .units import fmt_bytes, fmt_seconds

MODELS = ["llama-3-8b", "llama-2-70b", "llama-3-70b", "llama-3.1-405b", "mistral-7b",
          "qwen2.5-7b", "deepseek-v3", "smollm2-135m"]


def key_numbers() -> str:
    L = ["# Key numbers (computed by minillm; decimal GB = 1e9 B, GiB = 2^30 B)", ""]
    L += ["## KV cache per token", "",
          "| model | attention | layers x KV heads x head_dim | BF16 | FP8 | "
          "4K-token sequence (BF16) |",
          "|---|---|---|---:|---:|---:|"]
    for name in MODELS:
        cfg = configs.get(name)
        shape = (f"{cfg.num_layers} x latent {cfg.kv_lora_rank}+{cfg.qk_rope_head_dim}"
                 if cfg.attention == "mla"
                 else f"{cfg.num_layers} x {cfg.num_kv_heads} x {cfg.head_dim}")
        L.append(f"| {name} | {cfg.attention.upper()} | {shape} | "
                 f"{kvmath.kv_bytes_per_token(cfg):,} B | "
                 f"{kvmath.kv_bytes_per_token(cfg, 'fp8'):,} B | "
                 f"{fmt_bytes(kvmath.kv_bytes_per_sequence(cfg, 4096))} |")
    L += ["", "## Weights", "", "| model | parameters | BF16 | FP8/INT8 | INT4 |",
          "|---|---:|---:|---:|---:|"]
    for name in ["llama-2-7b", "llama-3-8b", "llama-2-70b", "llama-3.1-405b"]:
        cfg = configs.get(name)
        L.append(f"| {name} | {kvmath.param_count(cfg) / 1e9:.2f} B | "
                 f"{kvmath.weight_bytes(cfg) / 1e9:.1f} GB | "
                 f"{kvmath.weight_bytes(cfg, 'int8') / 1e9:.1f} GB | "
                 f"{kvmath.weight_bytes(cfg, 'int4') / 1e9:.1f} GB |")
    L += ["", "## GPUs (datasheet peaks)", "",
          "| GPU | memory | bandwidth | dense BF16 | ridge (FLOP/byte) | "
          "batch-1 decode floor, Llama-3-8B BF16 |",
          "|---|---:|---:|---:|---:|---:|"]
    cfg8 = configs.get("llama-3-8b")
    w8 = roofline.weight_read_params(cfg8) * 2
    for g in kvmath.GPUS.values():
        L.append(f"| {g.name} | {g.memory_bytes / 1e9:g} GB | {g.bandwidth / 1e12:g} TB/s | "
                 f"{g.bf16_flops / 1e12:g} TFLOP/s | "
                 f"{roofline.ridge_point(g.bandwidth, g.bf16_flops):.0f} | "
                 f"{fmt_seconds(w8 / g.bandwidth)} ({g.bandwidth / w8:.0f} tok/s) |")
    L += ["", "Links: NVLink (H100) 900 GB/s per GPU in total, 450 GB/s each way; "
          "PCIe Gen5 x16 ~64 GB/s per direction; InfiniBand NDR 400 Gb/s = "
          f"{formulas.gbit_to_bytes_per_s(400) / 1e9:g} GB/s.", ""]
    h100 = kvmath.GPUS["H100-SXM-80GB"]
    p = kvmath.plan_capacity("H100-SXM-80GB", configs.get("llama-2-70b"), "int8", "bfloat16",
                             0.9, 1024)
    L += ["## Deployments", "",
          f"- Llama-2-70B INT8 on one H100 at 0.9 utilisation: KV pool "
          f"{fmt_bytes(p.kv_pool_bytes)} = {p.max_tokens:,} tokens = {p.max_tokens // 16:,} blocks "
          f"of 16 = {p.max_seqs} sequences of 1K.",
          f"- Its decode floor: "
          f"{fmt_seconds(roofline.weight_read_params(configs.get('llama-2-70b')) / h100.bandwidth)}"
          f" per step (weights / bandwidth), so at most "
          f"{h100.bandwidth / roofline.weight_read_params(configs.get('llama-2-70b')):.1f} "
          f"tokens/s per stream.",
          f"- Llama-2-70B block of 16 tokens: "
          f"{fmt_bytes(16 * kvmath.kv_bytes_per_token(configs.get('llama-2-70b')))}.",
          "", "## Speculative decoding: speedup (1 - a^(k+1)) / ((1 - a)(k c + 1))", "",
          "| a \\ (k, c) | (4, 0.05) | (4, 0.2) | (8, 0.05) |", "|---|---:|---:|---:|"]
    for a in (0.5, 0.6, 0.7, 0.8, 0.9):
        L.append(f"| {a} | {theory.speedup(a, 4, 0.05):.2f}x | "
                 f"{theory.speedup(a, 4, 0.2):.2f}x | {theory.speedup(a, 8, 0.05):.2f}x |")
    L.append(f"| break-even | {theory.break_even_alpha(4, 0.05):.2f} | "
             f"{theory.break_even_alpha(4, 0.2):.2f} | {theory.break_even_alpha(8, 0.05):.2f} |")
    L += ["", "## Rules", "",
          "- KV bytes/token = 2 x layers x KV heads x head_dim x bytes; "
          "GQA saves query heads / KV heads.",
          "- Decode step >= (weights + KV read) / bandwidth; "
          "prefill step >= 2 x params x tokens / FLOP/s.",
          "- Blocks = ceil(tokens / block_size); "
          "a prefix cache reuses floor(prefix / block_size) full blocks.",
          "- Little's law: in-flight requests = arrival rate x latency.",
          "- Latency = TTFT + (n - 1) x TPOT.",
          "- Cost per 1M tokens = $/h x GPUs / (tokens/s x 3600) x 1e6."]
    return "\n".join(L)
