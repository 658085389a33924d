"""Figures the bank's text quotes, computed from the package when the text is rendered.

A bank entry writes `[[name]]` where a number belongs; `render` replaces it with FACTS[name](),
so a corrected claim's numbers come from minillm's arithmetic and change with it.
"""
from __future__ import annotations

import re

from .. import configs, kvmath, roofline
from ..spec import theory
from . import formulas
from .units import fmt_bytes, fmt_seconds


def _kv(model, dtype="bfloat16"):
    return kvmath.kv_bytes_per_token(configs.get(model), dtype)


def _gpu(name):
    return kvmath.GPUS[name]


def _step_70b_int8():
    cfg = configs.get("llama-2-70b")
    return roofline.weight_read_params(cfg) * 1 / _gpu("H100-SXM-80GB").bandwidth


FACTS = {
    "kv_llama2_70b": lambda: fmt_bytes(_kv("llama-2-70b")),
    "kv_llama2_70b_mha": lambda: fmt_bytes(
        kvmath.mha_equivalent_bytes_per_token(configs.get("llama-2-70b"))),
    "kv_llama3_405b": lambda: fmt_bytes(_kv("llama-3.1-405b")),
    "kv_llama3_8b": lambda: fmt_bytes(_kv("llama-3-8b")),
    "kv_llama3_8b_mha": lambda: fmt_bytes(
        kvmath.mha_equivalent_bytes_per_token(configs.get("llama-3-8b"))),
    "kv_llama2_7b": lambda: fmt_bytes(_kv("llama-2-7b")),
    "kv_smollm2": lambda: fmt_bytes(_kv("smollm2-135m")),
    "kv_deepseek_v3": lambda: fmt_bytes(_kv("deepseek-v3")),
    "mqa_deepseek_depth": lambda: fmt_bytes(61 * (192 + 128) * 2),
    "block16_llama2_70b": lambda: fmt_bytes(16 * _kv("llama-2-70b")),
    "seq4k_llama2_70b": lambda: fmt_bytes(4096 * _kv("llama-2-70b")),
    "seq8k_llama2_70b": lambda: fmt_bytes(8192 * _kv("llama-2-70b")),
    "seq128k_llama2_70b": lambda: fmt_bytes(131072 * _kv("llama-2-70b")),
    "w_llama2_70b_int8": lambda: fmt_bytes(kvmath.weight_bytes(configs.get("llama-2-70b"), "int8")),
    "step_70b_int8_h100": lambda: fmt_seconds(_step_70b_int8()),
    "tps_70b_int8_h100": lambda: f"{1 / _step_70b_int8():.1f} tok/s",
    "cap_70b_int8_h100": lambda: (
        f"{989e12 * 2 / (2 * roofline.matmul_params(configs.get('llama-2-70b'))):,.0f} tok/s"),
    # triple-quoted: before Python 3.12 only these may break a line inside the braces
    "ridge_h100": lambda: f"""{roofline.ridge_point(
        _gpu('H100-SXM-80GB').bandwidth, _gpu('H100-SXM-80GB').bf16_flops):.0f} FLOP/byte""",
    "ridge_a100": lambda: f"""{roofline.ridge_point(
        _gpu('A100-SXM-80GB').bandwidth, _gpu('A100-SXM-80GB').bf16_flops):.0f} FLOP/byte""",
    "bw_h100_a100_80": lambda: (
        f"{_gpu('H100-SXM-80GB').bandwidth / _gpu('A100-SXM-80GB').bandwidth:.2f}x"),
    "bw_h100_a100_40": lambda: (
        f"{_gpu('H100-SXM-80GB').bandwidth / _gpu('A100-SXM-40GB').bandwidth:.2f}x"),
    "spec_k4_c005_a05": lambda: f"{theory.speedup(0.5, 4, 0.05):.2f}x",
    "spec_tokens_k4_a05": lambda: f"{theory.expected_tokens(0.5, 4):.2f}",
    "be_k4_c005": lambda: f"{theory.break_even_alpha(4, 0.05):.2f}",
    "be_k4_c02": lambda: f"{theory.break_even_alpha(4, 0.2):.2f}",
    "be_k4_c05": lambda: f"{theory.break_even_alpha(4, 0.5):.2f}",
    "fork_4x100_at_fork": lambda: str(formulas.fork_blocks(100, 4, 16)["unshared"]
                                      - formulas.fork_blocks(100, 4, 16)["at_fork"]),
    "fork_4x100_after": lambda: str(formulas.fork_blocks(100, 4, 16)["unshared"]
                                    - formulas.fork_blocks(100, 4, 16)["after_first_write"]),
    "mlp_8k_llama3_8b": lambda: fmt_bytes(formulas.mlp_activation_bytes(8192, 14336)),
    "recompute_1000": lambda: f"{formulas.recompute_flop_ratio(1000):.1f}",
    "concurrency_6gb_70b": lambda: f"{6e9 / (32 * 16 * _kv('llama-2-70b')):.1f}",
    "table_overhead_70b": lambda: f"{4 / (16 * _kv('llama-2-70b')):.2g}",
    "w_405b_fp8": lambda: fmt_bytes(kvmath.weight_bytes(configs.get("llama-3.1-405b"), "fp8")),
    "w_405b_bf16": lambda: fmt_bytes(kvmath.weight_bytes(configs.get("llama-3.1-405b"),
                                                         "bfloat16")),
    "lora_7b_r8": lambda: fmt_bytes(formulas.lora_adapter_bytes(32, [(4096, 4096), (4096, 4096)],
                                                                8, 2)),
    "swap_llama3_8b_1k": lambda: fmt_seconds(2 * 1000 * _kv("llama-3-8b") / 64e9),
    "ib_400": lambda: f"{formulas.gbit_to_bytes_per_s(400) / 1e9:g} GB/s",
}

_FIELD = re.compile(r"\[\[([a-z0-9_]+)\]\]")


def render(text: str) -> str:
    """Replace every [[name]] in text by the computed figure."""
    if not text:
        return text

    def sub(m):
        name = m.group(1)
        if name not in FACTS:
            raise ValueError(f"unknown figure [[{name}]]; known: {', '.join(FACTS)}")
        return FACTS[name]()
    return _FIELD.sub(sub, text)

