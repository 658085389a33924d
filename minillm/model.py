"""A Llama-family decoder in plain PyTorch (chapter 00).

One file to hold in your head: RMSNorm, rotary position embeddings (RoPE), grouped-query
attention (GQA), a SwiGLU MLP, tied or untied embeddings. Qwen2 (bias on q/k/v) and Mistral are
the same network with different numbers, so the same class serves them.

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
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x [B, T, heads, D]; cos/sin [B, T, 1, D]: rotate each pair (i, i + D/2) by its angle."""
    return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


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


class Linear(nn.Linear):
    """nn.Linear that, on a CPU, computes a 2-4 row product as (W @ x^T)^T.

    A decode step multiplies a handful of rows (one per running sequence) by each weight. For
    2-4 rows PyTorch's CPU GEMM took a path 1.3-8x slower than the same product written the
    other way round, W [N, K] @ x^T [K, M], on the course's 2-core CPU; 1 row (a matrix-vector
    product) and many rows were as fast either way (benchmarks/bench_skinny_gemm.py measures a
    machine). Same numbers up to float rounding (tests/test_model.py checks); parameters and
    state-dict names are nn.Linear's. A GPU always takes F.linear.
    """

    SKINNY_ROWS = range(2, 5)                                # set to range(0) to turn it off

    def forward(self, x):                                    # x [..., K] -> [..., N]
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if x.device.type != "cpu" or rows not in self.SKINNY_ROWS:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])                  # [M, K]
        if self.bias is None:
            out = torch.mm(self.weight, flat.t())            # [N, M]
        else:
            out = torch.addmm(self.bias[:, None], self.weight, flat.t())
        return out.t().contiguous().view(*x.shape[:-1], self.out_features)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache=None):              # x [B, T, C]
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)      # [B, T, H, D]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)   # [B, T, KVH, D]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)   # [B, T, KVH, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            out = causal_attention(q, k, v)
        else:
            out = cache.attend(self.layer_idx, q, k, v)                   # the seam
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):                                    # SwiGLU
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
    """The decoder. Parameter names follow transformers' Llama (minus the `model.` prefix), so a
    checkpoint's state dict loads without renaming."""

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
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def rope(self, positions):                         # positions [B, T] -> cos, sin [B, T, 1, D]
        freqs = positions[..., None].float() * self.inv_freq.float()      # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        return emb.cos(), emb.sin()

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

