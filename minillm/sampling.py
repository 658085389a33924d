"""Turning logits into the next token (chapter 00).

Order of operations, as in vLLM: penalties on the raw logits (they need the request's tokens,
so the engine applies them with `apply_penalties` before anything else), divide by temperature,
drop tokens below min-p times the top probability, keep the top-k logits, keep the smallest set
of tokens whose probability reaches top-p, then draw. Temperature 0 means greedy (argmax), and so
does any temperature below GREEDY_EPSILON (1e-5).

    apply_penalties(logits, params, prompt_ids, output_ids)   repetition / frequency / presence
    probs(logits, params)   the final distribution after that pipeline [R, V] (one place)
    sample(logits, params)  one draw per row from it (greedy: the argmax, no distribution built)
    token_logprobs(logprobs_row, token, k)   a token's log-probability, its rank and the top k
Chapter 07's speculative verification compares `probs` with the draft's distributions.

Log-probabilities the engine reports (SamplingParams.logprobs / prompt_logprobs) are those of
the RAW model distribution, log_softmax of the logits before penalties, temperature, filters or a
grammar's mask: vLLM's default ("raw_logprobs"). They say what the model believes, which is what
scoring and multiple-choice evaluation need, and they do not collapse to 0 / -inf for greedy.
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Optional

import torch

MAX_LOGPROBS = 20               # most alternatives per position (OpenAI's and vLLM's cap)

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
    logprobs: Optional[int] = None          # per output token: its logprob + the top-k (0..20)
    prompt_logprobs: Optional[int] = None   # the same for every prompt token after the first
    presence_penalty: float = 0.0           # subtract once from every token already generated
    frequency_penalty: float = 0.0          # subtract per occurrence in the output
    repetition_penalty: float = 1.0         # divide (>0) / multiply (<0) logits of seen tokens
    min_p: float = 0.0                      # drop tokens below min_p * the top probability
    structured_outputs: Optional["StructuredOutputsParams"] = None   # a grammar (chapter 08)

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
        self._check_extras()
        self.stop = self._stop_strings(self.stop)
        self.stop_token_ids = self._stop_ids(self.stop_token_ids)

    def _check_extras(self) -> None:
        """logprobs, penalties, min_p, structured_outputs (issue 19; vLLM's ranges)."""
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                v = _integer(name, v, f"give 0..{MAX_LOGPROBS} alternatives, or None for none")
                if not 0 <= v <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be in 0..{MAX_LOGPROBS} (alternatives per "
                                     f"token), got {v}")
                setattr(self, name, v)
        for name in ("presence_penalty", "frequency_penalty"):
            v = _number(name, getattr(self, name), "use 0.0 to disable it")
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}; use 0.0 to disable it")
        r = _number("repetition_penalty", self.repetition_penalty, "use 1.0 to disable it")
        if r <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0 disables it), got {r}")
        mp = _number("min_p", self.min_p, "use 0.0 to disable it")
        if not 0.0 <= mp <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {mp}; use 0.0 to disable it")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams(json=..., "
                             f"regex=..., choice=... or json_object=True), got {so!r}")

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def allows_drafts(self) -> bool:
        """Speculative drafts are verified on logits that must not depend on tokens the step
        itself adds; penalties and grammars do, so such requests decode without drafts."""
        return not self.has_penalties and self.structured_outputs is None

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


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's StructuredOutputsParams; exactly one field):
    json (a JSON schema, dict or string), regex, choice (a list of strings), or json_object=True
    (any JSON object). minillm/engine/structured.py compiles it into a per-step token mask."""
    json: Optional[object] = None
    regex: Optional[str] = None
    choice: Optional[list] = None
    json_object: bool = False

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of json, regex, choice, "
                             f"json_object; got {given or 'none'}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"regex must be a string, got {self.regex!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not
                                        self.choice or not all(isinstance(c, str) and c
                                                               for c in self.choice)):
            raise ValueError(f"choice must be a non-empty list of non-empty strings, got "
                             f"{self.choice!r}")


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list,
                    output_ids: list) -> torch.Tensor:
    """Penalties on raw logits [R, V], in place (vLLM's definitions): repetition over prompt and
    output tokens (a positive logit is divided by it, a negative one multiplied), then
    frequency (times the token's count in the output) and presence (once if it occurs) over
    the output only."""
    if not params.has_penalties:
        return logits
    V = logits.shape[-1]
    dev = logits.device
    out = torch.tensor(output_ids, dtype=torch.long, device=dev)
    counts = torch.zeros(V, device=dev).index_add_(0, out, torch.ones(len(output_ids),
                                                                      device=dev))   # [V]
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[torch.tensor(prompt_ids, dtype=torch.long, device=dev)] = True
        r = params.repetition_penalty
        pen = torch.where(logits > 0, logits / r, logits * r)
        logits.copy_(torch.where(seen, pen, logits))
    logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop every token whose probability is below min_p times the row's top probability.
    logits [B, V] (already divided by the temperature)."""
    if min_p <= 0.0:
        return logits
    p = logits.softmax(dim=-1)
    return logits.masked_fill(p < min_p * p.max(dim=-1, keepdim=True).values, float("-inf"))


def token_logprobs(logprobs: torch.Tensor, token: int, k: int) -> dict:
    """One position's report from its raw log-probabilities [V]: {token id: (logprob, rank)} for
    the given token (rank 1 = the most likely) and the k most likely tokens."""
    lp = float(logprobs[token])
    out = {int(token): (lp, int((logprobs > logprobs[token]).sum()) + 1)}
    if k:
        top = torch.topk(logprobs, k)
        for rank, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            out.setdefault(int(t), (float(v), rank))
    return out


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
    temperature, then min-p, then top-k, then top-p, then softmax. Greedy is a one-hot on the
    argmax.
    `sample` draws from these rows; speculative verification (chapter 07) compares them with the
    draft's distributions, so both use exactly the same pipeline."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    logits = min_p_filter(logits, params.min_p)
    logits = top_k_filter(logits, params.top_k)
    logits = top_p_filter(logits, params.top_p)
    return logits.softmax(dim=-1)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> the argmax ids [...], the first index where a row ties. In fp32 (bf16 ->
    fp32 is exact, so the same index) and through max(dim), which returns the same index: on the
    course's 2-core Xeon it took 0.36-0.40x the time of argmax for 1-64 rows of 49,152 logits
    (at 16 rows bf16's own max was slower than the upcast plus fp32's, hence the upcast)."""
    return logits.float().max(dim=-1).indices


def draw_from(p: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One id per row of p [R, V] (probabilities, not necessarily normalised) by the inverse
    CDF: u uniform in [0, row sum), then the first index whose running sum exceeds u. A token of
    probability 0 adds nothing to the running sum, so it is never the first to exceed u. The
    same distribution as torch.multinomial(p, 1), which on the course's 2-core Xeon took
    0.88 ms for one row of 49,152 against 0.07 ms for this (per sampled row, every step).
    A row with a negative, NaN or infinite entry, or nothing but zeros, raises ValueError (as
    multinomial refuses it) rather than return an id outside the row. A single row [V] gives a
    0-d id."""
    if p.dim() == 1:
        return draw_from(p[None], generator)[0]
    c = p.double().cumsum(dim=-1)                                       # [R, V]
    total = c[:, -1:]                                                   # [R, 1]
    if not (bool(torch.isfinite(total).all()) and bool((total > 0).all())
            and float(p.min()) >= 0):
        raise ValueError("cannot draw from these probabilities: every row needs non-negative, "
                         "finite entries with a positive sum (NaN logits, or a mask that left "
                         "no token, give rows that fail this)")
    u = torch.rand(p.shape[0], 1, generator=generator, device=p.device,
                   dtype=torch.float64) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))   # u < total always
    return torch.searchsorted(c, u, right=True).squeeze(-1)            # [R]


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """logits [B, V] -> next token ids [B]: the argmax for greedy (no distribution needed), else
    one draw per row from `probs(logits, params)` (`draw_from`)."""
    if params.greedy:
        return greedy_ids(logits)
    return draw_from(probs(logits, params), generator)
