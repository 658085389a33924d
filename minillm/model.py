"""A Llama-family decoder in plain PyTorch (chapter 00).

One file to hold in your head: RMSNorm, rotary position embeddings (RoPE), grouped-query
attention (GQA), a SwiGLU MLP, tied or untied embeddings. Qwen2 (bias on q/k/v) and Mistral are
the same network with different numbers, so the same class serves them.

Two products that read the same input are one product here (chapter 12): q, k and v come from
one `QKVParallelLinear`, the MLP's gate and up from one `MergedColumnParallelLinear` (vLLM's
names and shapes). The checkpoint keeps them apart; `minillm.loader` copies each part into its
rows. The rotary cos/sin tables are computed once, when the model is built.

Shapes use B = batch, T = tokens in this call, H = query heads, KVH = key/value heads,
D = head_dim, C = hidden size, V = vocabulary.

The KV-cache seam
-----------------
Attention never touches cache memory itself. Each layer hands this step's q, k, v to a cache
object and gets the attention output back:

    out = cache.attend(layer_idx, q, k, v)   # q [B, T, H, D], k/v [B, T, KVH, D] -> [B, T, H, D]

and after the last layer the model calls `cache.advance(T)`. The contiguous cache of chapter 01
(`minillm.cache.contiguous`) writes k/v into one preallocated slab per sequence; the paged cache
of chapter 03 writes them into blocks through a block table. The model does not know which.
Without a cache, `model(input_ids)` runs plain causal attention over the tokens it is given.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .configs import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):                                    # x [..., C]
        # x * rsqrt(mean(x^2) + eps) in float32, as one torch call (F.rms_norm); in fp32 the
        # weight goes in too (one call instead of four: the same products, in the same order)
        if x.dtype == self.weight.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] of the rotary embedding, with Llama-3 frequency scaling if set."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling
    if s and s.get("rope_type", s.get("type")) == "llama3":
        # Long wavelengths are slowed down by `factor`, short ones kept, the middle band blended.
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / lo, inv_freq / factor,
                               torch.where(wavelen < old_len / hi, inv_freq, blended))
    elif s:
        raise ValueError(f"rope_scaling {s!r} is not supported; use a checkpoint without it "
                         "or with rope_type 'llama3'")
    return inv_freq.float()


def rope_tables(cfg: ModelConfig, device=None):
    """The rotary tables, computed once per model: cos, sin [max_position_embeddings, D].

    Row p holds the angles of position p, each frequency twice (pair (i, i + D/2) turns by one
    angle). The sin table's first half is negated, which turns "rotate half" into a roll:
    rotate_half(x) * sin == x.roll(D/2) * sin_signed. A step then looks up its rows instead of
    computing cos and sin again (vLLM keeps the same `cos_sin_cache`).
    """
    inv_freq = rope_inv_freq(cfg).to(device)                          # [D/2]
    positions = torch.arange(cfg.max_position_embeddings, device=device).float()
    freqs = positions[:, None] * inv_freq[None, :]                    # [P, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)   # [P, D] each


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x [B, T, heads, D]; cos/sin [B, T, 1, D] rows of `rope_tables` (sin signed): rotate each
    pair (i, i + D/2) by its angle. Equals x * cos + rotate_half(x) * sin with the plain sin,
    bit for bit, in four ops instead of seven."""
    xf = x.float()
    return (xf * cos + xf.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)


def causal_attention(q, k, v, q_start: int = 0):
    """Plain causal attention, the reference every other attention is checked against.

    q [B, Tq, H, D]; k, v [B, Tk, KVH, D]. Query i sits at position q_start + i and sees keys
    0 .. q_start + i. With GQA each KV head serves H // KVH query heads. Returns [B, Tq, H, D].
    """
    B, Tq, H, D = q.shape
    Tk, KVH = k.shape[1], k.shape[2]
    group = H // KVH
    k = k.repeat_interleave(group, dim=2)                    # [B, Tk, H, D]
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(D)
    q_pos = torch.arange(q_start, q_start + Tq, device=q.device)[:, None]
    k_pos = torch.arange(Tk, device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))   # [B, H, Tq, Tk]
    probs = scores.softmax(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float())
    return out.to(q.dtype)


FOLD_GQA = True      # gqa_attention folds a decode's query heads (False: enable_gqa's way)


def gqa_attention(q, k, v, attn_mask=None, scale=None):
    """F.scaled_dot_product_attention with grouped-query heads: q [B, H, Tq, D], k/v
    [B, KVH, L, D] -> [B, H, Tq, D]; attn_mask broadcasts to [B, 1, Tq, L] (or is None).

    With one query per sequence (a decode step) the H / KVH query heads that share a KV head
    ride as that head's queries: q is viewed as [B, KVH, H / KVH, D], so attention reads each
    key and value once for its whole group instead of once per query head (enable_gqa's
    way). "Head folding"; the same numbers up to float rounding. On the course's Xeon it took
    0.37-0.85x the time of enable_gqa in fp32 (0.33-0.83x in bf16) at 1-16 sequences of 64-256
    keys (FOLD_GQA = False switches it off, for measurements)."""
    B, H, Tq, D = q.shape
    KVH = k.shape[1]
    if Tq == 1 and H != KVH and FOLD_GQA:
        out = F.scaled_dot_product_attention(q.reshape(B, KVH, H // KVH, D), k, v,
                                             attn_mask=attn_mask, scale=scale)
        return out.reshape(B, H, 1, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale,
                                          enable_gqa=H != KVH)


def fused_causal_attention(q, k, v, q_start: int = 0):
    """causal_attention's contract (same shapes, same positions) through PyTorch's fused
    attention, in fp32: what the contiguous caches run. One query needs no mask (it sees every
    key); several get the causal mask offset by q_start. The tests hold it to its twin."""
    Tq, Tk = q.shape[1], k.shape[1]
    seen = None
    if Tq > 1:
        seen = (torch.arange(Tk, device=q.device)[None, :]
                <= q_start + torch.arange(Tq, device=q.device)[:, None])        # [Tq, Tk]
    out = gqa_attention(q.float().transpose(1, 2), k.float().transpose(1, 2),
                        v.float().transpose(1, 2), attn_mask=seen)             # [B, H, Tq, D]
    return out.transpose(1, 2).to(q.dtype)


class Linear(nn.Linear):
    """nn.Linear that, for inference on a CPU, takes the fastest product measured there.

    A decode step multiplies a handful of rows (one per running sequence, k + 1 when speculation
    verifies k guesses) by every weight, and PyTorch's default CPU product (F.linear) runs far
    below the machine's limits at those shapes. On a CPU, with no gradient wanted, Linear:

    - multiplies on its weight **prepacked** once into the layout the library's kernels read,
      instead of letting the library repack it on every call: a bf16 weight for oneDNN
      (`torch.ops.mkldnn._reorder_linear_weight` once, `_linear_pointwise` per call; what
      torch.compile's CPU backend does for frozen weights), on the course's 2-core AMD CPU
      faster than F.linear on every bf16 shape up to 32 rows (up to 2.7x); an fp32 weight for
      MKL's packed sgemm on Intel CPUs (`torch.ops.mkl._mkl_reorder_linear_weight` once,
      `_mkl_linear` per call; the library behind F.linear, with the packing done once), else
      for oneDNN. On the course's Xeon a step's fp32 products on the MKL copy took 0.85-0.91x
      the oneDNN copy's time from 4 rows to 64 and 1.05x at 256 (`bench_skinny_gemm.py`); on
      its AMD CPU, gone before MKL's copy could be timed there, the oneDNN copy had beaten
      F.linear on almost every fp32 shape from 3 rows up (up to 7.6x). So the default
      (`MKL = None`) is MKL on Intel CPUs and oneDNN elsewhere (`mkl_preferred_here`: the
      vendor is a proxy measured on one machine, not a law); `MKL = True / False` forces it;
    - for 1-2 fp32 rows takes whichever of three products `tune_skinny` measured fastest for
      the weight's shape on this machine: F.linear, the packed product, or (W @ x^T)^T with a
      single row sent in as two. The machines disagree: on the course's AMD CPU a one-row
      F.linear read the weights at about a third of the bandwidth of the swapped two-row
      product; on an Intel Xeon with AMX the one-row F.linear ran 2-3x faster than the swap.
      Layers never tuned take the swap;
    - for 3 fp32 rows (a k = 2 speculative verification, a tree of three candidates, three
      decoding sequences) takes F.linear or the packed product, whichever `tune_skinny`
      measured faster at three rows (`few`): on the Xeon F.linear took 0.81x the packed
      product's time there, on the AMD CPU the packed product was the faster from 3 rows up.
      Layers never tuned take the packed product.

    benchmarks/bench_skinny_gemm.py measures the choices on a machine, with the weights coming
    from memory as in a real step. The packed copy is made at the first call that needs it (an
    engine makes them all when it starts: `prepack`) and made again when the weight changes
    (another tensor, an in-place copy, another dtype); it doubles the memory of the weights it
    packs. Same numbers up to float rounding (tests/test_model.py); parameters and state-dict
    names are nn.Linear's. A GPU, a product that autograd records, or a torch without oneDNN
    takes F.linear. `SKINNY_ROWS = range(0)`, `FEW_ROWS = range(0)` and `PREPACK = False`
    switch the paths off. Traced by torch.compile (a compiled CPU step, engine/compiled.py),
    the forward makes the same choices while tracing, and the product on the packed copy
    becomes one op, `minillm::packed_product`, with the copy an input of the graph.
    """

    SKINNY_ROWS = range(1, 3)                                # fp32 rows tune_skinny decides
    FEW_ROWS = range(3, 4)                                   # ... with F.linear or packed
    PREPACK = True                                           # CPU products on packed weights
    MKL = None                                               # fp32 packed for MKL's sgemm
                                                             # (True), oneDNN's (False), or by
                                                             # the CPU (None: mkl_preferred_here)
    skinny = "swap"                                          # this layer's 1-2 row product:
                                                             # "swap" | "linear" | "packed"
    few = "packed"                                           # its 3-row product: "linear" |
                                                             # "packed"
    opaque_name = None                                       # what a compiled step calls
                                                             # this layer (engine/compiled.py)
    TRACED = True                                            # a compiled step traces this
                                                             # forward (False: one opaque call)

    def forward(self, x):                                    # x [..., K] -> [..., N]
        if torch.compiler.is_compiling() and self.opaque_name is not None and not self.TRACED:
            return torch.ops.minillm.product(x, self.opaque_name)     # engine/compiled.py
        w = self.weight
        if (x.device.type != "cpu" or x.dtype != w.dtype
                or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return F.linear(x, w, self.bias)                 # a GPU, or autograd records it
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        # (bounds, not `rows in range(...)`: traced, the row count is a symbol, which compares)
        if (w.dtype == torch.float32 and self.skinny != "packed"
                and self.SKINNY_ROWS.start <= rows < self.SKINNY_ROWS.stop):
            if self.skinny == "linear":
                return F.linear(x, w, self.bias)
            flat = x.reshape(rows, x.shape[-1])              # [M, K]
            if rows == 1:
                flat = torch.cat((flat, flat))               # [2, K]: a GEMM, not a GEMV
            if self.bias is None:
                out = torch.mm(w, flat.t())                  # [N, M] (one row: M = 2)
            else:
                out = torch.addmm(self.bias[:, None], w, flat.t())
            return out[:, :rows].t().contiguous().view(*x.shape[:-1], self.out_features)
        if (w.dtype == torch.float32 and self.few == "linear"
                and self.FEW_ROWS.start <= rows < self.FEW_ROWS.stop):
            return F.linear(x, w, self.bias)
        if torch.compiler.is_compiling():       # traced (engine/compiled.py): the paths above
            # become the graph's own library calls, this one ONE op on the copy made beforehand
            packed = self._packed if self.PREPACK else None
            if packed is None:
                return F.linear(x, w, self.bias)
            return torch.ops.minillm.packed_product(x, packed, w, self.bias,
                                                    self._packed_for == "mkl")
        packed = self.prepacked() if self.PREPACK else None
        if packed is None:
            return F.linear(x, w, self.bias)
        return packed_product(x, packed, w, self.bias, self.__dict__["_packed_for"] == "mkl")

    # the packed copy, the weight (and library choice) it came from, the library that reads it
    _PACKED_STATE = ("_packed", "_packed_key", "_packed_for")
    _packed = None              # (no copy yet; an attribute always there for a traced
                                # forward to read; engine/compiled.py's model_signature
                                # records whether a layer has one)

    def __getstate__(self):
        """Copies and pickles leave the packed weight behind (it is remade on first use)."""
        state = dict(super().__getstate__())
        for k in self._PACKED_STATE:
            state.pop(k, None)
        return state

    def has_packed(self) -> bool:
        return "_packed" in self.__dict__

    def drop_packed(self) -> None:
        """Forget the packed copy (the next call that needs one makes it again)."""
        for k in self._PACKED_STATE:
            self.__dict__.pop(k, None)

    def prepacked(self):
        """The weight in the layout its product reads (made once per weight version): MKL's
        packed sgemm layout for fp32 when `MKL` (or, left None, `mkl_preferred_here`) says so,
        else oneDNN's blocked layout; None where this torch cannot pack it."""
        w = self.weight
        mkl = mkl_preferred_here() if self.MKL is None else self.MKL
        key = (w.data_ptr(), tensor_version(w), w.dtype, tuple(w.shape), mkl)
        if self.__dict__.get("_packed_key") != key:
            self.__dict__["_packed_key"] = key
            self.__dict__["_packed_for"], self.__dict__["_packed"] = _prepack(w.detach(), mkl)
        return self.__dict__["_packed"]


def tensor_version(t: torch.Tensor):
    """The tensor's version counter (bumped by every in-place write), None for an inference
    tensor, which has none. With its data_ptr, what says a copy made from it is stale."""
    try:
        return t._version
    except RuntimeError:
        return None


def packed_product(x, packed, w, bias=None, mkl: bool = False):
    """x [..., K] times `w` [N, K] on its packed copy (`Linear.prepacked`) -> [..., N]: oneDNN's
    product on its blocked layout, or (`mkl`) MKL's packed sgemm, which needs the row count."""
    if mkl:
        return torch.ops.mkl._mkl_linear(x, packed, w, bias, x.numel() // x.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# `minillm::packed_product`: packed_product as an op a compiled graph calls (the packed copy an
# input of the graph, fetched from the layer at every call). Inductor lowers the libraries'
# own packed ops only on weights frozen into the graph, one graph per model; this op it calls
# as it is. Its kernel is the lambda below: no custom_op wrapper, no layer's forward.
_OPS = torch.library.Library("minillm", "FRAGMENT")
_OPS.define("packed_product(Tensor x, Tensor packed, Tensor w, Tensor? bias, bool mkl) -> Tensor")
_OPS.impl("packed_product", lambda x, packed, w, bias, mkl: packed_product(x, packed, w, bias, mkl),
          "CompositeExplicitAutograd")          # (any backend: oneDNN's copy is MkldnnCPU)


@torch.library.register_fake("minillm::packed_product")
def _(x, packed, w, bias, mkl):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def prepack(model) -> int:
    """Make every CPU Linear's packed weight now, so that no request pays for it later (an
    engine calls this when it starts on a CPU). Returns the bytes of the weights packed: the
    extra memory the packed copies take (0 on a GPU, with PREPACK off, or without oneDNN)."""
    total = 0
    with torch.no_grad():
        for m in model.modules():
            if (isinstance(m, Linear) and m.PREPACK and m.weight.device.type == "cpu"
                    and m.prepacked() is not None):
                total += m.weight.numel() * m.weight.element_size()
    return total


_SKINNY_CHOICE: dict = {}        # (weight shape, bias, threads) -> choices, once per process


def tune_skinny(model, repeats: int = 3, max_bytes: int = 256 << 20) -> dict:
    """Time, for each fp32 weight shape of `model`'s CPU Linears, the products a few rows can
    take and give every layer of that shape the fastest: at one row F.linear, the packed weight
    and (W @ x^T)^T (`Linear.skinny`, used for 1-2 rows), at three rows F.linear and the packed
    weight (`Linear.few`). Each path runs over the layers of the shape in turn (up to
    `max_bytes` of them), so the weights come from memory as in a step, `repeats` times, median
    kept. A shape is timed once per process: later models reuse the choice (same rounding for
    every model of a run). `load_model` calls it on a CPU.
    Returns {shape: {"skinny" | "few": (choice, {path: ms})}}."""
    layers = [m for m in model.modules() if isinstance(m, Linear)
              and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
    out, groups = {}, {}
    if 1 not in Linear.SKINNY_ROWS and not Linear.FEW_ROWS:
        return out
    for m in layers:
        key = (tuple(m.weight.shape), m.bias is not None, torch.get_num_threads())
        groups.setdefault(key, []).append(m)
    for key, ms in groups.items():
        if key not in _SKINNY_CHOICE:
            _SKINNY_CHOICE[key] = _time_few_rows(ms, repeats, max_bytes)
        for attr, (choice, _) in _SKINNY_CHOICE[key].items():
            for m in ms:
                setattr(m, attr, choice)
        out[key[0]] = _SKINNY_CHOICE[key]
    return out


def _time_few_rows(layers, repeats: int, max_bytes: int) -> dict:
    """{"skinny": (choice, ms)} at one row and {"few": ...} at FEW_ROWS[0] rows, for the rules
    that are on; packed copies made only for the timing and chosen by neither are dropped."""
    n = max(1, min(len(layers), max_bytes // max(1, layers[0].weight.nbytes)))
    layers = layers[:n]
    packed_before = [m.has_packed() for m in layers]
    packed = ["packed"] if Linear.PREPACK and layers[0].prepacked() is not None else []
    out = {}
    if 1 in Linear.SKINNY_ROWS:
        out["skinny"] = _time_products(layers, 1, "skinny", ["swap", "linear"] + packed, repeats)
    if Linear.FEW_ROWS and packed:              # without a packed weight only F.linear is left
        out["few"] = _time_products(layers, Linear.FEW_ROWS[0], "few", ["linear"] + packed,
                                    repeats)
    if all(choice != "packed" for choice, _ in out.values()):
        for m, had in zip(layers, packed_before):   # an engine makes the ones it needs later
            if not had:                             # (`prepack`)
                m.drop_packed()
    return out


def _time_products(layers, rows: int, attr: str, paths: list, repeats: int) -> tuple:
    """Run `rows` rows through every layer with each path (set as `attr`) in turn: (the fastest
    path, {path: median ms})."""
    import time
    x = torch.randn(rows, layers[0].in_features)
    times = {p: [] for p in paths}
    with torch.no_grad():
        for _ in range(repeats + 1):                         # the first round warms up
            for p in paths:
                t0 = time.perf_counter()
                for m in layers:
                    setattr(m, attr, p)
                    m(x)
                times[p].append(time.perf_counter() - t0)
    ms = {p: round(1e3 * sorted(t[1:])[len(t[1:]) // 2], 3) for p, t in times.items()}
    return min(ms, key=ms.get), ms


# The row count MKL is told to expect when it packs an fp32 weight. The copy serves any number of
# rows (the rows are the unpacked operand; tests/test_model.py checks 1 to 100 rows against
# F.linear), but MKL picks its blocking from this hint. On the course's Xeon (scratch
# microbenchmarks, not recorded) packs made for 16 rows ran 10-12% slower than oneDNN at 32
# rows, packs made for 1 or 4 rows slower than oneDNN at 16, and packs made for 48 were within
# 2% of the best of 16, 32 and 48 at every size from 4 rows to 128.
MKL_PACK_ROWS = 48


def mkl_packs_here() -> bool:
    """Whether this torch has MKL's packed fp32 GEMM (x86 builds do; ARM builds do not)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl,
                                                         "_mkl_reorder_linear_weight")


@functools.lru_cache(maxsize=None)
def mkl_preferred_here() -> bool:
    """`Linear.MKL`'s default: fp32 weights packed for MKL on an Intel CPU where torch has MKL's
    packed GEMM, for oneDNN elsewhere. MKL's packed copy was measured faster on the course's
    Xeon only; MKL is Intel's library and is not known to take its fastest kernels on other
    vendors' CPUs, and on the course's AMD CPU oneDNN's copy was the measured winner."""
    if not mkl_packs_here():
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
    except OSError:                                          # not Linux: keep oneDNN
        return False


def _prepack(w, mkl: bool):
    """(library, packed copy) of a 2-D CPU weight: ("mkl", ...) for fp32 when `mkl` and MKL's
    packed GEMM is here, else ("onednn", ...); (None, None) where neither can pack it (no
    oneDNN, no bf16 support, another dtype)."""
    # (a normal tensor, even when made in inference mode, as in an engine's step: the copies
    # a compiled graph reads then have the same dispatch keys wherever they were made;
    # inference tensors lack one of them)
    if w.dtype == torch.float32 and mkl and mkl_packs_here():
        with torch.no_grad(), torch.inference_mode(False):
            return "mkl", torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), MKL_PACK_ROWS)
    if not torch.backends.mkldnn.is_available() or w.dtype not in (torch.float32, torch.bfloat16):
        return None, None
    if w.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None, None
    with torch.no_grad(), torch.inference_mode(False):
        return "onednn", torch.ops.mkldnn._reorder_linear_weight(w, None)


class MergedColumnParallelLinear(Linear):
    """Several projections of the same input stacked into ONE weight [sum(output_sizes), K]:
    gate_proj and up_proj of the MLP become `gate_up_proj`, one GEMM instead of two (vLLM's
    name and shapes: its tensor-parallel version splits each part column-wise across GPUs).

    A checkpoint still stores the parts separately; `weight_loader(param, w, shard_id)` copies
    part `shard_id` (0, 1, ...) into its rows. The output is the parts side by side:
    `out.split(self.output_sizes, dim=-1)`.
    """

    def __init__(self, input_size: int, output_sizes, bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        self.shard_ids = list(range(len(output_sizes)))

    def shard_rows(self, shard_id) -> slice:
        """The rows of the stacked weight that hold part `shard_id`."""
        i = self.shard_ids.index(shard_id)
        start = sum(self.output_sizes[:i])
        return slice(start, start + self.output_sizes[i])

    def weight_loader(self, param, loaded_weight, loaded_shard_id) -> None:
        """Copy one checkpoint part (its weight or bias) into the stacked parameter."""
        if loaded_shard_id not in self.shard_ids:
            raise ValueError(f"shard id {loaded_shard_id!r} is not one of {self.shard_ids}")
        dst = param.data[self.shard_rows(loaded_shard_id)]
        if dst.shape != loaded_weight.shape:
            raise ValueError(f"part {loaded_shard_id!r}: checkpoint shape "
                             f"{tuple(loaded_weight.shape)} != model shape {tuple(dst.shape)}")
        dst.copy_(loaded_weight)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q_proj, k_proj and v_proj as one weight [(H + 2 * KVH) * D, C], shards "q", "k", "v"
    (vLLM's QKVParallelLinear; with GQA the k and v parts are smaller than q's)."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False):
        super().__init__(hidden_size, [total_num_heads * head_size,
                                       total_num_kv_heads * head_size,
                                       total_num_kv_heads * head_size], bias=bias)
        self.shard_ids = ["q", "k", "v"]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def project(self, x, cos, sin):                          # x [B, T, C]
        """The rotated queries and keys and the values of x: (q, k, v)."""
        B, T, _ = x.shape
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)                               # [B, T, (H + 2 KVH) D]: one GEMM
        # q and k rotate together (one rope call), v is a view of the same output
        qk = apply_rope(qkv[..., :(H + KVH) * D].view(B, T, H + KVH, D), cos, sin)
        q, k = qk.split([H, KVH], dim=2)                     # [B, T, H, D], [B, T, KVH, D]
        return q, k, qkv[..., (H + KVH) * D:].view(B, T, KVH, D)     # v [B, T, KVH, D]

    def forward(self, x, cos, sin, cache=None):              # x [B, T, C]
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q, k, v = self.project(x, cos, sin)
        if cache is None:
            out = causal_attention(q, k, v)
        else:
            out = cache.attend(self.layer_idx, q, k, v)                   # the seam
        return self.o_proj(out.reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size,
                                                       [cfg.intermediate_size] * 2, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):                                    # SwiGLU
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)     # [..., I] each, from one GEMM
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """The decoder. Parameter names follow transformers' Llama (minus the `model.` prefix),
    except the fused projections: `packed_modules_mapping` says which checkpoint modules each
    one stacks (vLLM's attribute), and `minillm.loader` maps the names."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.attention == "mla":
            raise ValueError(f"{cfg.name} uses multi-head latent attention (MLA), which this "
                             "decoder does not implement; use it with minillm.kvmath only")
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.init_rope()

    def init_rope(self) -> None:
        """(Re)compute the rotary tables on the model's device (the loader calls it after
        materialising a model built on the meta device)."""
        cos, sin = rope_tables(cfg=self.config, device=self.embed_tokens.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)              # [P, D]
        self.register_buffer("rope_sin", sin, persistent=False)              # [P, D] signed

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def rope(self, positions):                # positions [B, T] -> cos, sin [B, T, 1, D]
        """This call's rows of the rotary tables (sin signed, see `rope_tables`)."""
        return (self.rope_cos[positions][:, :, None].float(),
                self.rope_sin[positions][:, :, None].float())

    def forward(self, input_ids, positions: Optional[torch.Tensor] = None, cache=None,
                last_only: bool = False, logits_rows: Optional[torch.Tensor] = None):
        """input_ids [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only, or [B, S, V] for
        the S token positions in logits_rows: the engine needs logits only where it samples).

        Without a cache: full causal forward over the T tokens. With a cache: the T tokens
        continue what the cache already holds; their positions come from the cache unless given.
        """
        if input_ids.dim() != 2:
            raise ValueError("input_ids must be [batch, tokens], got shape "
                             f"{tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if positions is None:
            start = cache.seq_len if cache is not None else 0
            positions = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        limit = self.config.max_position_embeddings
        if T and int(positions.max()) >= limit:
            raise ValueError(f"position {int(positions.max())} is beyond {self.config.name}'s "
                             f"context of {limit} tokens; shorten the prompt or max_new_tokens")
        cos, sin = self.rope(positions)
        x = self.embed_tokens(input_ids)                     # [B, T, C]
        for layer in self.layers:
            x = layer(x, cos, sin, cache)
        if cache is not None:
            cache.advance(T)
        if logits_rows is not None:
            x = x[:, logits_rows]                            # [B, S, C]
        elif last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))                    # [B, T, V]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())     # tied weights count once


class capture_hidden:
    """Context manager: record the input rows of the model's final norm's output during a forward
    (the hidden states at the logits rows). `.value` is [B, S, C] after the forward; None when
    disabled (speculative decoding's Medusa heads read it, chapter 07)."""

    def __init__(self, model, enabled: bool = True):
        self.model, self.enabled, self.value, self._h = model, enabled, None, None

    def __enter__(self):
        if self.enabled:
            self._h = self.model.norm.register_forward_hook(
                lambda mod, inp, out: setattr(self, "value", out))
        return self

    def __exit__(self, *exc):
        if self._h is not None:
            self._h.remove()
        return False


class capture_features:
    """Context manager: record the last decoder layer's output for EVERY position of a forward
    (before the final norm and before the logits rows are picked). `.value` is [B, T, C] after
    a forward that ran once; None when disabled or when the model ran more than once inside.
    The EAGLE drafter reads the target's features from it (chapter 07); off, it adds nothing."""

    def __init__(self, model, enabled: bool = True):
        self.model, self.enabled, self.value, self._h, self._calls = model, enabled, None, None, 0

    def __enter__(self):
        if self.enabled:
            self._h = self.model.layers[-1].register_forward_hook(self._record)
        return self

    def _record(self, mod, inp, out):
        self._calls += 1
        self.value = out if self._calls == 1 else None

    def __exit__(self, *exc):
        if self._h is not None:
            self._h.remove()
            if self._calls > 1:
                self.value = None
        return False
