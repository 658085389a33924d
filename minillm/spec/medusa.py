"""Medusa-style decoding heads (chapter 07): the learned draft of this course.

Medusa (Cai et al. 2024) adds K small heads on top of the target's last hidden state h_t (after
the final norm, the vector the lm_head turns into the next-token logits). Head j guesses the
token j positions further ahead than the model's own next token:

    target's lm_head(h_t)              -> token t + 1     (the verified next token)
    lm_head(h_t + SiLU(W_j h_t + b_j)) -> token t + 1 + j (head j = 1 .. K, a guess)

Each head is one residual block of hidden x hidden weights. Here every head reuses the target's
own frozen lm_head for the vocabulary projection, a simplification of this course that keeps 4
heads for SmolLM2-135M at 4 x 576 x 577 weights (2.7 MB in fp16). The Medusa paper does not
share it: each head has its own output matrix, initialised from the LM head and trained with the
head. Heads see only h_t, not the tokens they guessed before, so their guesses get worse with j
(chapter 07 measures it). EAGLE (Li et al. 2024) instead runs a one-layer transformer on the
target's features autoregressively, which keeps later guesses better, and verifies a tree of
candidates from its first version on; it is not implemented here.

The heads here are trained by self-distillation: on text the bundled model generated itself,
head j learns to predict the token the model produced j steps later (`python -m
minillm.spec.train_medusa`, `make train-draft`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Union

import torch
import torch.nn as nn
import torch.nn.functional as F

WEIGHTS_DIR = Path(__file__).parent / "weights"
DEFAULT_WEIGHTS = WEIGHTS_DIR / "medusa_smollm2-135m.safetensors"


def model_fingerprint(model) -> str:
    """A short checksum of the embedding table: heads trained on one set of weights refuse
    another model of the same shape (e.g. random weights)."""
    w = model.embed_tokens.weight.detach().float().cpu()
    rows = w[:: max(1, w.shape[0] // 64)][:64, :16]
    return f"{float(rows.sum()):.3f}/{float(rows.abs().sum()):.3f}"


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int = 4, vocab_size: int = 0,
                 model_name: str = "", fingerprint: str = ""):
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {num_heads}")
        self.hidden_size, self.num_heads, self.vocab_size = hidden_size, num_heads, vocab_size
        self.model_name, self.fingerprint = model_name, fingerprint
        self.proj = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for lin in self.proj:                                 # start as "repeat the lm_head"
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    @classmethod
    def for_model(cls, model, num_heads: int = 4) -> "MedusaHeads":
        cfg = model.config
        heads = cls(cfg.hidden_size, num_heads, cfg.vocab_size, cfg.name, model_fingerprint(model))
        return heads.to(device=model.device, dtype=model.dtype)

    def forward(self, hidden: torch.Tensor, k: int = None) -> torch.Tensor:
        """hidden [R, C] -> the first k heads' features [R, k, C] (all heads by default)."""
        k = self.num_heads if k is None else k
        if not 1 <= k <= self.num_heads:
            raise ValueError(f"these heads propose at most {self.num_heads} tokens, asked for {k}; "
                             f"lower num_speculative_tokens to <= {self.num_heads}")
        hidden = hidden.to(self.proj[0].weight.dtype)
        return torch.stack([hidden + F.silu(self.proj[j](hidden)) for j in range(k)], dim=1)

    def logits(self, model, hidden: torch.Tensor, k: int = None) -> torch.Tensor:
        """[R, C] -> [R, k, V] through the target's own lm_head (one matmul for all heads)."""
        feats = self(hidden, k)                               # [R, k, C]
        return model.lm_head(feats.to(model.dtype))

    def check_model(self, model) -> None:
        cfg = model.config
        fix = ("train heads for this model with `make train-draft` (python -m "
               "minillm.spec.train_medusa) or use method 'ngram'")
        if (cfg.hidden_size, cfg.vocab_size) != (self.hidden_size, self.vocab_size):
            raise ValueError(f"these Medusa heads were trained for hidden size {self.hidden_size} "
                             f"and vocabulary {self.vocab_size} ({self.model_name}), but the model "
                             f"has {cfg.hidden_size} and {cfg.vocab_size}; {fix}")
        if self.fingerprint and model_fingerprint(model) != self.fingerprint:
            raise ValueError(f"these Medusa heads were trained on {self.model_name}'s weights, "
                             f"and this model's weights differ (e.g. random weights); {fix}")

    # --- files ------------------------------------------------------------------------------
    def save(self, path: Union[str, Path], extra: dict = None) -> None:
        from safetensors.torch import save_file
        meta = {"hidden_size": self.hidden_size, "num_heads": self.num_heads,
                "vocab_size": self.vocab_size, "model_name": self.model_name,
                "fingerprint": self.fingerprint, **(extra or {})}
        state = {k: v.detach().to(torch.float16).cpu().contiguous()
                 for k, v in self.state_dict().items()}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(state, str(path), metadata={"minillm": json.dumps(meta)})

    @classmethod
    def load(cls, path: Union[str, Path] = DEFAULT_WEIGHTS, model=None) -> "MedusaHeads":
        """Load heads (fp16 on disk). With `model`, check they belong to it (ValueError if not)
        and move them to its device and dtype."""
        from safetensors import safe_open
        from safetensors.torch import load_file
        path = Path(path)
        if not path.exists():
            raise ValueError(f"no Medusa weights at {path}; train them with `make train-draft`")
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["minillm"])
        heads = cls(meta["hidden_size"], meta["num_heads"], meta["vocab_size"],
                    meta["model_name"], meta["fingerprint"])
        heads.meta = meta
        heads.load_state_dict({k: v.float() for k, v in load_file(str(path)).items()})
        if model is not None:
            heads.check_model(model)
            heads = heads.to(device=model.device, dtype=model.dtype)
        return heads.eval()


def hidden_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The target's final hidden states (after the last norm) for every position, no cache:
    input_ids [B, T] -> [B, T, C]. Used for training; serving captures them with
    `minillm.model.capture_hidden`."""
    B, T = input_ids.shape
    positions = torch.arange(T, device=input_ids.device).expand(B, T)
    cos, sin = model.rope(positions)
    x = model.embed_tokens(input_ids)
    for layer in model.layers:
        x = layer(x, cos, sin)
    return model.norm(x)
