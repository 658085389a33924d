"""Turning logits into the next token (chapter 00).

Order of operations, as in vLLM: divide by temperature, keep the top-k logits, keep the smallest
set of tokens whose probability reaches top-p, then draw. Temperature 0 means greedy (argmax).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                 # -1: no top-k
    max_tokens: int = 16
    seed: Optional[int] = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)           # stop strings
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1                      # parallel samples per prompt

    def __post_init__(self):
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable it")
        if self.top_k == 0 or self.top_k < -1 or int(self.top_k) != self.top_k:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k}")
        if int(self.max_tokens) != self.max_tokens or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if int(self.n) != self.n or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit outside the k largest of each row to -inf. logits [B, V]."""
    if k == -1 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]   # [B, 1]: the k-th largest
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most-likely tokens whose probability sum reaches p. logits [B, V]."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs                   # mass of the tokens ranked above
    drop_sorted = before >= p                               # already reached p without this one
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def make_generator(seed: Optional[int], device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """logits [B, V] -> next token ids [B]."""
    logits = logits.float()
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits / params.temperature
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
