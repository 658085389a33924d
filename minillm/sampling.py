"""Turning logits into the next token (chapter 00).

Order of operations, as in vLLM: divide by temperature, keep the top-k logits, keep the smallest
set of tokens whose probability reaches top-p, then draw. Temperature 0 means greedy (argmax), and
so does any temperature below GREEDY_EPSILON (1e-5).

    probs(logits, params)   the final distribution after that pipeline [R, V] (one place)
    sample(logits, params)  one draw per row from it (greedy: the argmax, no distribution built)
Chapter 07's speculative verification compares `probs` with the draft's distributions.
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch

# Temperatures below this sample greedily: dividing logits by 1e-39 overflows to inf, and the
# distribution is a one-hot on the argmax long before that anyway.
GREEDY_EPSILON = 1e-5


def _number(name: str, value, hint: str) -> float:
    """A real, finite number (not a bool, not a string), else ValueError naming the fix."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}; {hint}")
    return float(value)


def _integer(name: str, value, hint: str) -> int:
    """An integer (ints, numpy ints, integral floats like 4.0), else ValueError naming the fix."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{name} must be an integer, got {value!r}; {hint}")
    try:
        return operator.index(value)
    except TypeError:
        pass
    if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        return int(value)
    raise ValueError(f"{name} must be an integer, got {value!r}; {hint}")


@dataclass
class SamplingParams:
    """How to pick each next token. Checked when built (and again by the engine when a request
    is added): a wrong type or value raises ValueError naming the fix. `stop` and
    `stop_token_ids` accept None (no stops); `stop` accepts one string."""
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
        self.validate()

    def validate(self) -> None:
        """Check every field and normalise in place (stop=None -> [], stop="x" -> ["x"])."""
        t = _number("temperature", self.temperature, "use 0 for greedy or e.g. 0.8")
        if t < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        p = _number("top_p", self.top_p, "use 1.0 to disable it")
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable it")
        k = _integer("top_k", self.top_k, "use -1 to disable it or a positive integer")
        if k == 0 or k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k}")
        m = _integer("max_tokens", self.max_tokens,
                     "give a positive integer such as 64 (there is no unlimited setting)")
        if m <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens}")
        n = _integer("n", self.n, "give the number of samples per prompt, e.g. 1")
        if n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n}")
        if self.seed is not None:
            seed = _integer("seed", self.seed, "give an integer such as 0, or None for a "
                                               "fresh random seed")
            if not 0 <= seed < 2**63 - n:
                raise ValueError(f"seed must be in [0, 2**63 - n), got {self.seed}")
            self.seed = seed
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        self.top_k, self.max_tokens, self.n = k, m, n
        self.stop = self._stop_strings(self.stop)
        self.stop_token_ids = self._stop_ids(self.stop_token_ids)

    @staticmethod
    def _stop_strings(stop) -> list:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s
                                                       for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, "
                             f"got {stop!r}")
        return list(stop)

    @staticmethod
    def _stop_ids(ids) -> list:
        if ids is None:
            return []
        hint = "give a list of token ids, e.g. [2]"
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, set, frozenset)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}; {hint}")
        out = []
        for t in ids:
            try:
                if isinstance(t, bool):
                    raise TypeError
                out.append(operator.index(t))
            except TypeError:
                raise ValueError(f"stop_token_ids must hold integers, got {t!r}; {hint}") from None
            if out[-1] < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")
        return out

    @property
    def greedy(self) -> bool:
        """Temperature 0, or below GREEDY_EPSILON: argmax."""
        return self.temperature < GREEDY_EPSILON


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit outside the k largest of each row to -inf. logits [B, V]."""
    if k == -1 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]   # [B, 1]: the k-th largest
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most-likely tokens whose probability sum reaches p.
    logits [B, V]."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs     # mass of the tokens ranked above
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


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [R, V] -> the final distributions [R, V] float32 that sampling draws from:
    temperature, then top-k, then top-p, then softmax. Greedy is a one-hot on the argmax.
    `sample` draws from these rows; speculative verification (chapter 07) compares them with the
    draft's distributions, so both use exactly the same pipeline."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    return logits.softmax(dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """logits [B, V] -> next token ids [B]: the argmax for greedy (no distribution needed), else
    one draw per row from `probs(logits, params)`."""
    if params.greedy:
        return logits.float().argmax(dim=-1)
    return torch.multinomial(probs(logits, params), 1, generator=generator).squeeze(-1)
