"""Seeded request workloads shared by chapters 02 (contiguous slabs), 03 (paged blocks) and 08
(serving: `workload_requests` turns a mix into prompt texts for the load generator).

A workload is a list of `WorkloadRequest` records: how long each prompt is, how many tokens the
model will generate for it, when it arrives, and how many tokens of KV memory a naive server
reserves for it up front. Everything is drawn from a seeded numpy generator, so the same arguments
give the same trace on every machine.

Length mixes
------------
"sharegpt"      Conversations people shared from ChatGPT. The PagedAttention paper (Kwon et al.,
                SOSP 2023, "Efficient Memory Management for Large Language Model Serving with
                PagedAttention", Fig. 11a) reports a mean of about 161.3 input and about 338
                output tokens, both long-tailed.
"alpaca"        Instruction-following prompts (same paper, Fig. 11b): a mean of about 19.3 input
                and about 58.5 output tokens. Short prompts, short answers.
"uniform"       Prompt and output lengths uniform on [16, 512]: no tail, for clean comparisons.
"long_context"  Prompts uniform between 50% and 90% of the context, outputs log-normal with a
                mean of 64 tokens: a document-question-answering shape.

The paper gives histograms and means, not a formula. We model the two paper mixes as log-normal
distributions whose mean matches the reported mean: if X ~ LogNormal(mu, sigma) then
E[X] = exp(mu + sigma^2 / 2), so mu = ln(mean) - sigma^2 / 2. The spreads (sigma) are our
assumption, chosen so the tails look like the paper's histograms; they are listed in MIXES.

Clipping (stated, never silent)
-------------------------------
Lengths are rounded to whole tokens and are at least 1. A request must fit the model's context:
prompt_len <= context_len - 1 and prompt_len + output_len <= context_len. With
reserve="max_tokens" the output is also capped at max_tokens (the server stops the request there).
Every request that one of these upper limits shortened is counted in `Workload.num_clipped`
and flagged with `WorkloadRequest.clipped`; `Workload.summary()` reports the means after clipping.

Reservation a naive server makes (`reserve`)
--------------------------------------------
"context"     the model's whole context (FasterTransformer, Orca "Max" in the paper);
"max_tokens"  prompt_len + max_tokens, capped at the context (what a client's max_tokens allows);
"oracle"      exactly prompt_len + output_len (Orca "Oracle": knows the future; a lower bound).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

# name -> (kind, parameters). Log-normal entries give (mean, sigma) for prompt and output.
MIXES = {
    "sharegpt": {"kind": "lognormal", "prompt": (161.3, 1.0), "output": (338.0, 0.9),
                 "source": "Kwon et al. 2023 (PagedAttention), Fig. 11a: ShareGPT means"},
    "alpaca": {"kind": "lognormal", "prompt": (19.3, 0.6), "output": (58.5, 0.8),
               "source": "Kwon et al. 2023 (PagedAttention), Fig. 11b: Alpaca means"},
    "uniform": {"kind": "uniform", "prompt": (16, 512), "output": (16, 512),
                "source": "synthetic: uniform lengths, no tail"},
    "long_context": {"kind": "long_context", "prompt_frac": (0.5, 0.9), "output": (64.0, 0.6),
                     "source": "synthetic: long documents, short answers"},
}
RESERVE_POLICIES = ("context", "max_tokens", "oracle")


@dataclass(frozen=True)
class WorkloadRequest:
    id: int
    prompt_len: int
    output_len: int            # tokens the model will generate before it stops
    arrival_time: float        # seconds from the start of the trace
    max_len_reserved: int      # tokens of KV a naive server reserves when it admits the request
    clipped: bool = False      # an upper limit (context or max_tokens) shortened this request

    @property
    def total_len(self) -> int:
        """Tokens whose KV the request finally holds: prompt + generated."""
        return self.prompt_len + self.output_len


@dataclass
class Workload:
    mix: str
    seed: int
    context_len: int
    reserve: str
    rate: Optional[float]      # requests per second (Poisson), None: all arrive at t = 0
    requests: list[WorkloadRequest] = field(default_factory=list)

    @property
    def num_clipped(self) -> int:
        return sum(r.clipped for r in self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.requests)

    def summary(self) -> dict:
        p = np.array([r.prompt_len for r in self.requests])
        o = np.array([r.output_len for r in self.requests])
        res = np.array([r.max_len_reserved for r in self.requests])
        return {"mix": self.mix, "num_requests": len(self.requests),
                "context_len": self.context_len, "mean_prompt_len": float(p.mean()),
                "mean_output_len": float(o.mean()),
                "max_total_len": int((p + o).max()), "mean_reserved": float(res.mean()),
                "used_over_reserved": float((p + o).sum() / res.sum()),
                "num_clipped": self.num_clipped}


def lognormal_mu(mean: float, sigma: float) -> float:
    """mu of the log-normal with this mean and sigma: mean = exp(mu + sigma^2 / 2)."""
    return math.log(mean) - sigma ** 2 / 2


def sample_lengths(mix: str, n: int, rng: np.random.Generator, context_len: int):
    """Raw (unclipped, real-valued) prompt and output lengths: two float arrays of shape [n]."""
    if mix not in MIXES:
        raise ValueError(f"unknown length mix {mix!r}; use one of {', '.join(MIXES)}")
    spec = MIXES[mix]
    if spec["kind"] == "lognormal":
        (pm, ps), (om, os_) = spec["prompt"], spec["output"]
        prompt = rng.lognormal(lognormal_mu(pm, ps), ps, size=n)
        output = rng.lognormal(lognormal_mu(om, os_), os_, size=n)
    elif spec["kind"] == "uniform":
        prompt = rng.integers(spec["prompt"][0], spec["prompt"][1] + 1, size=n).astype(float)
        output = rng.integers(spec["output"][0], spec["output"][1] + 1, size=n).astype(float)
    else:                                                      # long_context
        lo, hi = spec["prompt_frac"]
        prompt = rng.uniform(lo, hi, size=n) * context_len
        om, os_ = spec["output"]
        output = rng.lognormal(lognormal_mu(om, os_), os_, size=n)
    return prompt, output


def arrival_times(n: int, rate: Optional[float], rng: np.random.Generator) -> np.ndarray:
    """Poisson arrivals at `rate` requests/s (exponential gaps), or all at t = 0 when rate is
    None."""
    if rate is None:
        return np.zeros(n)
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s (or None for all at t=0), got {rate}")
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def make_workload(mix: str = "sharegpt", num_requests: int = 100, seed: int = 0,
                  context_len: int = 2048, rate: Optional[float] = None,
                  reserve: str = "context", max_tokens: Optional[int] = None) -> Workload:
    """Draw `num_requests` requests from a length mix (see the module docstring).

    context_len defaults to 2048, the context of OPT-13B that the PagedAttention paper served.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if context_len < 2:
        raise ValueError("context_len must be >= 2 (one prompt and one output token), "
                         f"got {context_len}")
    if reserve not in RESERVE_POLICIES:
        raise ValueError(f"unknown reserve policy {reserve!r}; "
                         f"use one of {', '.join(RESERVE_POLICIES)}")
    if reserve == "max_tokens" and (max_tokens is None or max_tokens < 1):
        raise ValueError("reserve='max_tokens' needs max_tokens >= 1 "
                         "(the output cap the server reserves for)")
    rng = np.random.default_rng(seed)
    raw_prompt, raw_output = sample_lengths(mix, num_requests, rng, context_len)
    arrivals = arrival_times(num_requests, rate, rng)
    requests = []
    for i in range(num_requests):
        p0 = max(1, int(round(raw_prompt[i])))
        o0 = max(1, int(round(raw_output[i])))
        p = min(p0, context_len - 1)
        o = min(o0, context_len - p)
        if reserve == "max_tokens":
            o = min(o, max_tokens)
        if reserve == "context":
            reserved = context_len
        elif reserve == "max_tokens":
            reserved = min(p + max_tokens, context_len)
        else:
            reserved = p + o
        requests.append(WorkloadRequest(id=i, prompt_len=p, output_len=o,
                                        arrival_time=float(arrivals[i]),
                                        max_len_reserved=reserved, clipped=(p, o) != (p0, o0)))
    return Workload(mix=mix, seed=seed, context_len=context_len, reserve=reserve, rate=rate,
                    requests=requests)


def workload_requests(tokenizer, mix: str = "alpaca", num_requests: int = 100, seed: int = 0,
                      context_len: int = 2048, max_input_len: Optional[int] = None,
                      max_output_len: Optional[int] = None) -> tuple:
    """Prompts with the lengths of a workload mix (see `make_workload`): text that the tokenizer
    encodes to exactly prompt_len tokens (slices of a fixed passage), as
    `minillm.serve.loadgen.LoadRequest`s for `run_load`. Returns (requests, num_capped)."""
    from ..serve.loadgen import LoadRequest          # chapter 08's client; chapters 02-03 need none

    wl = make_workload(mix, num_requests, seed=seed, context_len=context_len, reserve="oracle")
    words = ("serving systems batch requests together so that the weights read from memory "
             "for one step are shared by every sequence in it ").split()
    base = tokenizer.encode(" ".join(words * 400), add_special_tokens=False)
    rng = np.random.default_rng(seed)
    reqs, capped = [], 0
    for r in wl:
        p, o = r.prompt_len, r.output_len
        if max_input_len is not None and p > max_input_len:
            p, capped = max_input_len, capped + 1
        if max_output_len is not None and o > max_output_len:
            o, capped = max_output_len, capped + 1
        start = int(rng.integers(0, len(base) - p))
        text = _text_of_length(tokenizer, base[start:start + p], p)
        reqs.append(LoadRequest(text, p, o))
    return reqs, capped


def _text_of_length(tokenizer, ids, n: int) -> str:
    """Decode ids to text, trimming until the text re-encodes to at most n tokens."""
    ids = list(ids)
    while True:
        text = tokenizer.decode(ids)
        if len(tokenizer.encode(text, add_special_tokens=False)) <= n or len(ids) <= 1:
            return text
        ids = ids[:-1]


__all__ = ["MIXES", "RESERVE_POLICIES", "WorkloadRequest", "Workload", "make_workload",
           "sample_lengths", "arrival_times", "lognormal_mu", "workload_requests"]
