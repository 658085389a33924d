"""The OpenAI wire format the server speaks (chapter 08): request bodies and error bodies.

Request bodies are pydantic models, so FastAPI validates types before a handler runs. The rules
follow the OpenAI API where it has one:
- a field the API does not know is rejected ("Unrecognized request argument supplied: foo",
  400), never silently ignored, so a typo like `temprature` cannot quietly sample at 1.0;
- a field the API knows but minillm does not implement (logprobs, penalties, tools, echo, ...)
  is accepted at its neutral value and rejected with a 400 naming it otherwise;
- a few vLLM extensions that minillm does implement are accepted: top_k, ignore_eos,
  stop_token_ids.
Types are strict: `"max_tokens": "16"` is a 400, not a silently converted 16.

Error body (every 4xx/5xx):  {"error": {"message", "type", "param", "code"}}
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

from ..sampling import SamplingParams


class APIError(Exception):
    """Raised by handlers; turned into an OpenAI-style error response."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


# fields the OpenAI API knows that minillm does not implement: name -> the neutral value
UNSUPPORTED = {"echo": False, "logprobs": None, "top_logprobs": None, "best_of": None,
               "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None,
               "suffix": None, "tools": None, "tool_choice": None, "functions": None,
               "function_call": None, "response_format": None, "parallel_tool_calls": None}


class _Common(_Strict):
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    # known to the OpenAI API, not implemented here: only their neutral value is accepted
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict] = None
    # vLLM extensions minillm implements
    top_k: Optional[int] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None

    def check_supported(self) -> None:
        for name, neutral in UNSUPPORTED.items():
            value = getattr(self, name, neutral)
            if value not in (neutral, None, False, 0, 0.0, {}, []):
                raise APIError(400, f"'{name}' is not supported by this server; leave it out",
                               param=name, code="unsupported_parameter")
        if self.n != 1:
            raise APIError(400, f"n={self.n}: this server returns one choice per request; send "
                           "n separate requests (with different seeds)", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true",
                           param="stream_options")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises ValueError (-> 400) for out-of-range values, with SamplingParams' message."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            max_tokens=max_tokens, seed=self.seed, ignore_eos=self.ignore_eos,
            stop=[] if self.stop is None else self.stop,
            stop_token_ids=list(self.stop_token_ids or []))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def single_prompt(self):
        """The one prompt (text or token ids); a batch of several prompts is a 400."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"got {len(p)} prompts; this server takes one prompt per "
                               "request (send them as separate requests)", param="prompt")
            p = p[0]
        return p


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list] = None
    tool_choice: Optional[Union[str, dict]] = None
    functions: Optional[list] = None
    function_call: Optional[Union[str, dict]] = None
    response_format: Optional[dict] = None
    parallel_tool_calls: Optional[bool] = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise APIError(400, "messages is empty; send at least one message", param="messages")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "give max_completion_tokens or max_tokens, not both",
                           param="max_completion_tokens")

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


__all__ = ["APIError", "error_body", "CompletionRequest", "ChatCompletionRequest",
           "ChatMessage", "StreamOptions"]
