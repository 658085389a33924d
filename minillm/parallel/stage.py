"""One pipeline stage of the model, with a paged KV pool for its own layers (chapter 10).

    stage 0        embed_tokens, layers[0 : a]          x [1, T, C] --send-->
    stage s        layers[a : b]                         --recv--> x --send-->
    stage p - 1    layers[b : L], norm, lm_head          --recv--> logits [1, S, V] --> driver

A decoder layer's only state across steps is its K/V, so a stage's `PagedKVCache` holds its
layers and nothing else: the pool is built for `len(layers)` layers and `LayerOffset` turns the
global layer index an `Attention` asks for into the stage's local one. The block ids, block
tables and slot mapping are the engine's (one block manager, in the driver): every stage
receives the same `StepMetadata` and writes the same slots of its own layers.

The residual stream IS the hidden state here (each `Block` returns x + attn(...) + mlp(...)),
so one tensor [1, T, C] per micro-batch crosses each boundary.
"""
from __future__ import annotations

import torch
from torch import nn

from .pipeline import stage_layers


class LayerOffset:
    """The cache as a stage's layers see it: global layer i -> the pool's layer i - first."""

    def __init__(self, cache, first: int):
        self.cache, self.first = cache, first

    def attend(self, layer: int, q, k, v):
        return self.cache.attend(layer - self.first, q, k, v)


class PipelineStage(nn.Module):
    """Stage `stage` of `pp` of a Transformer: the SAME modules (no copy), a contiguous layer
    range, the embedding on stage 0, the final norm and lm_head on the last stage.

    `config` is the stage's KV-pool shape (the model's config with num_layers = its layers);
    `model_config` is the whole model's."""

    def __init__(self, model, stage: int, pp: int):
        super().__init__()
        layers = stage_layers(len(model.layers), pp)[stage]
        self.stage, self.pp, self.first = stage, pp, layers.start
        self.model_config = model.config
        self.config = model.config.with_(num_layers=len(layers))
        self.is_first, self.is_last = stage == 0, stage == pp - 1
        self.embed_tokens = model.embed_tokens if self.is_first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)     # [P, D]
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.layers[0].input_layernorm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].input_layernorm.weight.dtype

    def forward(self, x, meta, cache, logits_rows=None):
        """x: token ids [1, T] on stage 0, else the previous stage's hidden states [1, T, C].
        Returns hidden states [1, T, C], or on the last stage logits [1, S, V] of logits_rows."""
        positions = meta.positions[None]                               # [1, T]
        cos = self.rope_cos[positions][:, :, None].float()             # [1, T, 1, D]
        sin = self.rope_sin[positions][:, :, None].float()
        if self.is_first:
            x = self.embed_tokens(x)                                   # [1, T, C]
        view = LayerOffset(cache, self.first)
        for layer in self.layers:
            x = layer(x, cos, sin, view)
        cache.advance(x.shape[1])
        if not self.is_last:
            return x
        return self.lm_head(self.norm(x[:, logits_rows]))             # [1, S, V]


def build_stage(model_config, stage: int, pp: int, state: dict, dtype) -> PipelineStage:
    """A worker's stage from its weights alone: the model is laid out on the meta device (no
    memory), the stage's modules are materialised and `state` (a PipelineStage's state dict)
    loaded into them."""
    from ..model import Transformer, rope_tables
    with torch.device("meta"):
        full = Transformer(model_config)
    module = PipelineStage(full, stage, pp)
    module = module.to_empty(device="cpu").to(dtype)
    module.load_state_dict(state, strict=True)
    cos, sin = rope_tables(cfg=model_config, device="cpu")
    module.rope_cos, module.rope_sin = cos, sin
    return module.eval()


def stage_state_dict(model, stage: int, pp: int) -> dict:
    """Cloned weights of one stage (what its worker process receives)."""
    return {k: v.detach().clone() for k, v in PipelineStage(model, stage, pp).state_dict().items()}


def split_micro_batches(scheduled: list, m: int) -> list:
    """Cut a step's [(request, num_new_tokens)] into at most m contiguous groups of about equal
    tokens (order kept; never an empty group). Fewer requests than m give fewer groups."""
    m = max(1, min(m, len(scheduled)))
    total = sum(n for _, n in scheduled)
    groups, current, done = [], [], 0
    for i, (req, n) in enumerate(scheduled):
        current.append((req, n))
        done += n
        left_groups = m - len(groups) - 1
        left_items = len(scheduled) - i - 1
        if left_groups and (done >= total * (len(groups) + 1) / m or left_items == left_groups):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups
