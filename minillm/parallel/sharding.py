"""Megatron-style tensor parallelism: which rows and columns of each weight a rank holds
(chapter 10).

A decoder layer has two pairs of products, and each pair is split the same way:

    attention   qkv_proj  COLUMN-parallel (split by heads)  ->  attention on local heads
                o_proj    ROW-parallel (split by input)      ->  partial sums  ->  all-reduce
    MLP         gate_up   COLUMN-parallel (split by neuron)  ->  SiLU(gate) * up, local
                down_proj ROW-parallel                       ->  partial sums  ->  all-reduce

A column-parallel product needs the whole input and gives a slice of the output; a
row-parallel product takes that slice and gives a partial sum of the whole output. Chained, they
need no communication in between, and ONE all-reduce after each row-parallel product: two per
layer. Attention is local because every head is: rank r runs its own query heads against its
own KV heads, and its paged KV pool holds only those heads.

KV heads: with tp <= num_kv_heads each rank holds num_kv_heads / tp of them; with more ranks
than KV heads each KV head is REPLICATED on tp / num_kv_heads ranks (vLLM does the same), and
rank r holds KV head r // (tp / num_kv_heads), the one its query heads use.

The embedding, the final norm and lm_head are REPLICATED here, not vocab-parallel: every rank
then has the full hidden state and the full logits without another collective, and for the
course's models (a 49k x 576 table) the copy is small. vLLM splits both by vocabulary rows to
save memory on big models, at the price of an all-reduce after the embedding and a gather of
the logits.

A rank's shard is an ordinary `Transformer` built from `shard_config` (the local numbers of
heads and MLP neurons), so the paged KV cache, the kernels and the loader see nothing new;
`shard_state_dict` cuts the full weights for it.
"""
from __future__ import annotations

import torch

from ..configs import ModelConfig


def tp_sizes(cfg: ModelConfig, limit: int = 64) -> list:
    """The tensor-parallel sizes up to `limit` that split this model's heads and MLP evenly."""
    return [tp for tp in range(1, limit + 1) if _tp_problem(cfg, tp) is None]


def _tp_problem(cfg: ModelConfig, tp: int):
    if cfg.num_heads % tp:
        return f"{cfg.num_heads} query heads do not split over {tp} ranks"
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        return (f"{cfg.num_kv_heads} KV heads neither split over {tp} ranks nor replicate "
                f"evenly onto them")
    if cfg.intermediate_size % tp:
        return f"the MLP's {cfg.intermediate_size} neurons do not split over {tp} ranks"
    return None


def check_tp_size(cfg: ModelConfig, tp) -> None:
    """ValueError naming the sizes that work when `tp` cannot split this model."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    problem = _tp_problem(cfg, tp)
    if problem is not None:
        raise ValueError(f"tensor_parallel_size={tp} does not fit {cfg.name}: {problem}; "
                         f"sizes that work: {tp_sizes(cfg, max(tp, 16))}")


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The numbers of ONE rank's shard: H / tp query heads, max(1, KVH / tp) KV heads,
    I / tp MLP neurons; everything else (hidden size, head_dim, vocabulary) unchanged."""
    check_tp_size(cfg, tp)
    return cfg.with_(num_heads=cfg.num_heads // tp,
                     num_kv_heads=max(1, cfg.num_kv_heads // tp),
                     intermediate_size=cfg.intermediate_size // tp)


def kv_head_range(cfg: ModelConfig, rank: int, tp: int) -> range:
    """The KV heads rank `rank` holds (one replicated head when tp > num_kv_heads)."""
    local = max(1, cfg.num_kv_heads // tp)
    first = rank * cfg.num_kv_heads // tp if tp <= cfg.num_kv_heads else rank // (
        tp // cfg.num_kv_heads)
    return range(first, first + local)


def _rows(w, start: int, length: int):
    return w[start:start + length]


def shard_state_dict(state: dict, cfg: ModelConfig, rank: int, tp: int) -> dict:
    """The full model's state dict -> rank `rank`'s (cloned, contiguous tensors).

    qkv_proj [(H + 2 KVH) D, C]: the rank's q rows, then its k rows, then its v rows.
    o_proj [C, H D]: the columns of its q heads. gate_up_proj [2 I, C]: its gate rows and its
    up rows. down_proj [C, I]: the columns of its neurons. The rest is copied whole."""
    check_tp_size(cfg, tp)
    D, H, KVH, I = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    h, i = H // tp, I // tp
    kv = kv_head_range(cfg, rank, tp)
    out = {}
    for name, w in state.items():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            q = _rows(w, rank * h * D, h * D)
            k = _rows(w, H * D + kv.start * D, len(kv) * D)
            v = _rows(w, (H + KVH) * D + kv.start * D, len(kv) * D)
            w = torch.cat([q, k, v])
        elif name.endswith("o_proj.weight"):
            w = w[:, rank * h * D:(rank + 1) * h * D]
        elif name.endswith("gate_up_proj.weight"):
            w = torch.cat([_rows(w, rank * i, i), _rows(w, I + rank * i, i)])
        elif name.endswith("down_proj.weight"):
            w = w[:, rank * i:(rank + 1) * i]
        out[name] = w.clone().contiguous()
    return out
