"""Quantization (chapter 09): weights and KV in fewer bits.

    rtn.py      round-to-nearest formats: int8 per channel, int4 group-wise with zero points,
                nibble packing
    linear.py   Int8Linear / Int4Linear on PyTorch's packed CPU kernels, each with a
                plain-PyTorch twin (dequantize, then multiply); int4 on a CUDA device runs
                the Triton dequant-GEMM of minillm/kernels/int4_gemm.py
    gptq.py     GPTQ: int4 that compensates each column's rounding error on the columns not
                yet quantized, using a Hessian from a small calibration set, layer by layer
    gguf.py     the bundled GGUF's Q4_1 blocks, decoded by hand

`quantize_model(model, "int8" | "int4")` swaps every nn.Linear inside the decoder layers for its
quantized twin, whatever the layers are called (separate q/k/v projections or fused ones), so
`LLM(quantization=...)` and `load_model(..., quantization=...)` (vLLM's argument name) need
nothing else from the model. The embedding and the LM head stay in the model's dtype unless
`quantize_lm_head=True` (the head in the same format) or a format name, e.g. int4 decoder layers
with `quantize_lm_head="int8"` (vLLM keeps the head unquantized by default too).
"""
from __future__ import annotations

import torch.nn as nn

from .linear import IMPLS, Int4Linear, Int8Linear, QuantLinear, set_impl
from .rtn import INT4_GROUP_SIZES, check_group_size

QUANTIZATION_METHODS = ("int8", "int4")
DEFAULT_GROUP_SIZE = 64


def check_quantization(quantization, group_size: int = DEFAULT_GROUP_SIZE) -> None:
    """ValueError naming the fix for an argument `quantize_model` cannot serve."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {quantization!r}: use one of "
                         f"{', '.join(map(repr, QUANTIZATION_METHODS))} or None")
    if quantization == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES} for int4, got "
                         f"{group_size!r}")


def quantized_linear(linear: nn.Linear, quantization: str, group_size: int = DEFAULT_GROUP_SIZE):
    if quantization == "int8":
        return Int8Linear(linear)
    return Int4Linear(linear, group_size)


def decoder_linears(model) -> list:
    """[(parent module, attribute name, nn.Linear)] for every linear inside the decoder layers."""
    found = []
    for parent in model.layers.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear):
                found.append((parent, name, child))
    return found


def quantize_model(model, quantization: str, group_size: int = DEFAULT_GROUP_SIZE,
                   quantize_lm_head=False):
    """Replace the decoder's nn.Linear modules with Int8Linear / Int4Linear, in place; returns
    the model. Round-to-nearest; see gptq.py for the error-compensating int4. quantize_lm_head:
    False, True (the same format) or "int8" / "int4" (its own format)."""
    check_quantization(quantization, group_size)
    head_format = quantization if quantize_lm_head is True else (quantize_lm_head or None)
    if quantize_lm_head not in (False, True) and head_format not in QUANTIZATION_METHODS:
        raise ValueError(f"quantize_lm_head must be True, False or one of "
                         f"{', '.join(map(repr, QUANTIZATION_METHODS))}, got {quantize_lm_head!r}")
    if quantization is None:
        return model
    found = decoder_linears(model)
    if quantization == "int4":                       # every layer must fit before any changes
        for _, _, lin in found:
            check_group_size(group_size, lin.in_features)
    for parent, name, lin in found:
        setattr(parent, name, quantized_linear(lin, quantization, group_size))
    if head_format is not None:      # a tied embedding keeps its table: the new head has its own
        model.lm_head = quantized_linear(model.lm_head, head_format, group_size)
    model.quantization = quantization
    return model


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: quantized layers at their packed size, every
    other parameter at its dtype (the embedding table counts: a tied LM head reads it)."""
    total = sum(m.weight_bytes() for m in model.modules() if isinstance(m, QuantLinear))
    seen = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.nbytes
    return total


__all__ = ["QUANTIZATION_METHODS", "DEFAULT_GROUP_SIZE", "check_quantization", "quantize_model",
           "decoder_linears", "weight_bytes", "Int8Linear", "Int4Linear", "QuantLinear", "IMPLS",
           "set_impl"]
