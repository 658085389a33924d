"""The OpenAI wire format the server speaks (chapter 08): request bodies and error bodies.

Request bodies are pydantic models, so FastAPI validates types before a handler runs. The rules
follow the OpenAI API where it has one:
- a field the API does not know is rejected ("Unrecognized request argument supplied: foo",
  400), never silently ignored, so a typo like `temprature` cannot quietly sample at 1.0;
- a field the API knows but minillm does not implement (tools, functions, logit_bias, suffix)
  is accepted at its neutral value and rejected with a 400 naming it otherwise;
- fields OpenAI clients send that cannot change the output here (store, metadata,
  service_tier, parallel_tool_calls, user) are accepted and have no effect;
- vLLM extensions minillm implements are accepted: top_k, min_p, repetition_penalty,
  ignore_eos, stop_token_ids, guided_json / guided_regex / guided_choice,
  stream_options.continuous_usage_stats.
Types are strict: `"max_tokens": "16"` is a 400, not a silently converted 16.

Error body (every 4xx/5xx):  {"error": {"message", "type", "param", "code"}}
"""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict

from ..sampling import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams


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
    continuous_usage_stats: bool = False     # vLLM: usage in every chunk, not only the last


MAX_N = 16           # samples per prompt (n, best_of): a stated cap, a 400 beyond it
MAX_PROMPTS = 64     # prompts in one /v1/completions request

# fields the OpenAI API knows that minillm does not implement: name -> the neutral value
UNSUPPORTED = {"logit_bias": None, "suffix": None, "tools": None, "tool_choice": None,
               "functions": None, "function_call": None}


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
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    response_format: Optional[dict] = None
    # sent by OpenAI clients, no effect on the output here (nothing is stored or billed)
    store: Optional[bool] = None
    metadata: Optional[dict] = None
    service_tier: Optional[str] = None
    # known to the OpenAI API, not implemented here: only their neutral value is accepted
    logit_bias: Optional[dict] = None
    # vLLM extensions minillm implements
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    guided_json: Optional[Union[dict, str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None

    def check_supported(self) -> None:
        for name, neutral in UNSUPPORTED.items():
            value = getattr(self, name, neutral)
            if value not in (neutral, None, False, 0, 0.0, {}, []):
                raise APIError(400, f"'{name}' is not supported by this server; leave it out",
                               param=name, code="unsupported_parameter")
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be between 1 and {MAX_N} (samples per prompt), got "
                           f"{self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true",
                           param="stream_options")
        self.structured_outputs()            # a malformed response_format is a 400 now

    def structured_outputs(self) -> Optional[StructuredOutputsParams]:
        """response_format (OpenAI) or guided_json / guided_regex / guided_choice (vLLM) ->
        StructuredOutputsParams; at most one of them. The grammar itself is checked later."""
        given = {k: getattr(self, k) for k in ("guided_json", "guided_regex", "guided_choice")
                 if getattr(self, k) is not None}
        rf = self.response_format
        if rf is not None:
            if not isinstance(rf.get("type"), str) or rf["type"] not in (
                    "text", "json_object", "json_schema"):
                raise APIError(400, "response_format.type must be 'text', 'json_object' or "
                               f"'json_schema', got {rf.get('type')!r}", param="response_format")
            if rf["type"] != "text":
                given["response_format"] = rf
        if len(given) > 1:
            raise APIError(400, f"give one of response_format, guided_json, guided_regex, "
                           f"guided_choice, not {sorted(given)}", param=sorted(given)[1])
        try:
            if "guided_json" in given:
                return StructuredOutputsParams(json=self.guided_json)
            if "guided_regex" in given:
                return StructuredOutputsParams(regex=self.guided_regex)
            if "guided_choice" in given:
                return StructuredOutputsParams(choice=self.guided_choice)
        except ValueError as e:
            raise APIError(400, str(e), param=next(iter(given))) from None
        if "response_format" not in given:
            return None
        if rf["type"] == "json_object":
            return StructuredOutputsParams(json_object=True)
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(400, "response_format json_schema needs {'json_schema': {'name': "
                           "..., 'schema': {...}}}", param="response_format.json_schema")
        return StructuredOutputsParams(json=spec["schema"])

    def logprob_counts(self) -> tuple:
        """(logprobs, prompt_logprobs) for SamplingParams; None means not asked."""
        return None, None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises ValueError (-> 400) for out-of-range values, with SamplingParams' message."""
        logprobs, prompt_logprobs = self.logprob_counts()
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            max_tokens=max_tokens, seed=self.seed, ignore_eos=self.ignore_eos,
            stop=[] if self.stop is None else self.stop,
            stop_token_ids=list(self.stop_token_ids or []), n=self.n,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=(1.0 if self.repetition_penalty is None
                                else self.repetition_penalty),
            min_p=self.min_p or 0.0, structured_outputs=self.structured_outputs())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of={self.best_of} with n={self.n}: this server returns "
                           "every sample, so best_of must equal n (or be left out)",
                           param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be between 0 and {MAX_LOGPROBS}, got "
                           f"{self.logprobs}", param="logprobs")
        if self.stream and self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs is answered only with stream=false (the "
                           "prompt's logprobs come when the request finishes)", param="echo")
        self.prompt_list()

    def logprob_counts(self) -> tuple:
        return self.logprobs, (self.logprobs if self.echo else None)

    def prompt_list(self) -> list:
        """The prompts: each a string or a list of token ids (OpenAI's four shapes)."""
        p = self.prompt
        if isinstance(p, str) or not p or not isinstance(p[0], (str, list)):
            return [p]
        if len(p) > MAX_PROMPTS:
            raise APIError(400, f"got {len(p)} prompts; this server takes at most {MAX_PROMPTS} "
                           "per request", param="prompt")
        return list(p)


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
    parallel_tool_calls: Optional[bool] = None      # no tools here: nothing to parallelise

    def logprob_counts(self) -> tuple:
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got "
                               f"{self.top_logprobs}", param="top_logprobs")
            if not self.logprobs and self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if not self.messages:
            raise APIError(400, "messages is empty; send at least one message", param="messages")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "give max_completion_tokens or max_tokens, not both",
                           param="max_completion_tokens")

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class TokenizeRequest(_Strict):
    """vLLM's POST /tokenize: a prompt, or messages with the chat template applied."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: Optional[str] = None
    tokens: list[int]


__all__ = ["APIError", "error_body", "CompletionRequest", "ChatCompletionRequest",
           "ChatMessage", "StreamOptions", "TokenizeRequest", "DetokenizeRequest", "MAX_N"]
