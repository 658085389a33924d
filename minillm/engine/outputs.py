"""What the engine hands back (vLLM's RequestOutput / CompletionOutput shape).

A RequestOutput is one prompt; its `.outputs` list holds one CompletionOutput per sample
(SamplingParams.n of them). For the common n == 1 case the output also answers `.text`,
`.token_ids`, `.finish_reason` and `.metrics` directly: they are those of `.outputs[0]`.

A request the engine refused (bad input: empty prompt, longer than the context, can never fit
in the KV pool...) comes back from `LLM.generate` with finish_reason "error", no tokens, and the
reason in `.error`; the other prompts of the same call are served normally.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..metrics import RequestMetrics


@dataclass(frozen=True)
class Logprob:
    """One token's entry in a logprobs report (vLLM's Logprob): its log-probability under the
    raw model distribution, its rank there (1 = most likely) and its text."""
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    index: int                          # sample index, 0 .. n-1
    text: str
    token_ids: list
    finish_reason: Optional[str]        # "stop" | "length" | "abort" | "error"
    metrics: Optional[RequestMetrics] = None
    stop_reason: Optional[object] = None   # the stop string or stop token id that ended it
    logprobs: Optional[list] = None        # SamplingParams.logprobs: per token {id: Logprob}
    cumulative_logprob: Optional[float] = None   # sum of the sampled tokens' logprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list = field(default_factory=list)   # [CompletionOutput], one per sample
    finished: bool = True
    error: Optional[str] = None         # set when finish_reason == "error"
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache (chapter 06)
    prompt_logprobs: Optional[list] = None   # SamplingParams.prompt_logprobs: None for the
                                             # first token, then {id: Logprob} per prompt token

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason

    @property
    def metrics(self) -> Optional[RequestMetrics]:
        return self.outputs[0].metrics

    @classmethod
    def failed(cls, request_id: str, prompt, message: str) -> "RequestOutput":
        text = prompt if isinstance(prompt, str) else None
        ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
        return cls(request_id, text, ids,
                   [CompletionOutput(0, "", [], "error", None)], True, message)

    def __repr__(self) -> str:
        outs = ", ".join(f"#{o.index}: {o.finish_reason} {len(o.token_ids)} tokens {o.text!r:.40}"
                         for o in self.outputs)
        err = f", error={self.error!r}" if self.error else ""
        return f"RequestOutput({self.request_id!r}, [{outs}]{err})"


@dataclass(frozen=True, kw_only=True)
class TokenDelta:
    """The tokens one sequence got in one step (vLLM's RequestOutput with finished=False and
    output_kind DELTA, cut down to ids): 1 token, or up to k + 1 when drafts were verified.
    Text is the frontend's business (the server detokenises incrementally)."""
    request_id: str
    index: int                          # sample index, 0 .. n-1
    token_ids: tuple                    # this step's new tokens
    num_output_tokens: int              # the sequence's output tokens so far, these included
    finished: bool                      # this sequence finished in this step
    logprobs: tuple = ()                # {id: (logprob, rank)} per token, when asked for


@dataclass(frozen=True, kw_only=True)
class StepOutput:
    """What one `LLMEngine.step_outputs()` call produced."""
    finished: list                      # [RequestOutput]: requests whose every sample finished
    deltas: list                        # [TokenDelta]: every sequence that got tokens
    stats: object                       # StepStats: the step and a snapshot of the engine
