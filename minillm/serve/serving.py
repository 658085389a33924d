"""What the HTTP routes do (chapter 08): vLLM's OpenAIServingCompletion / OpenAIServingChat (and
mini-sglang's FrontendManager) as one small class, `OpenAIServing`.

The routes in api_server.py are one line each; a request's life happens here:

    step            method                    what can go wrong (status, see protocol.py)
    --------------  ------------------------  -----------------------------------------------
    0. body         BodySizeLimit             over --max-request-body-bytes (413), before
                    (api_server.py)           anything is parsed
    1. check        check_request(body)       shutting down (503), unknown model (400),
                                              a field this server does not implement (400)
    2. prompt       check_prompt_text         lone surrogates (400); more characters than
                                              max_model_len tokens could ever hold (400)
                    in_worker(encode or       (a worker thread, off the event loop): bad token
                    chat_prompt_ids)          ids, no chat template, template refused (400)
    3. admit        admit(body, ids, ...)     too long for max_model_len (the
                                              context or the KV pool, whichever is smaller),
                                              bad sampling values (400); too many already
                                              waiting (429). Else: queued on the AsyncEngine,
                                              whose events arrive on a queue
    4a. answer      collect(admitted, req)    waits for Finished; Failed -> 500, Aborted ->
                                              503; a client that hangs up is aborted (499)
                                              within DISCONNECT_POLL_S, even while tokens flow
    4b. stream      sse(admitted, chunk, ...) one `data: {chunk}` per TextDelta, the rest of
                                              the text with the finish_reason, usage, [DONE];
                                              a client that hangs up is aborted
    5. usage        usage(admitted, output)   prompt / completion / total tokens and the
                                              prompt tokens the prefix cache served

The events (TextDelta, Finished, Failed, Aborted) are documented in async_engine.py.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.outputs import RequestOutput
from .async_engine import Aborted, AsyncEngine, Failed, Finished, QueueFull, TextDelta
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body


def chat_prompt_ids(tok, messages: list) -> list:
    """Token ids of a conversation with the assistant's turn opened (the chat template)."""
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                       param="messages")
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)    # the template already has its markers


DISCONNECT_POLL_S = 0.25     # a non-streaming request checks for a gone client this often


def max_model_len(engine) -> int:
    """Tokens (prompt + output) one request can actually use: the model's context, or the KV pool
    when that is smaller (a request needs prompt + max_tokens - 1 cached tokens, and the pool is
    never shared below one request). What /v1/models reports and default max_tokens respects."""
    pool = engine.num_kv_blocks * engine.block_size
    return min(engine.config.max_position_embeddings, pool)


def max_chars_per_token(tok) -> int:
    """An upper bound on the characters one token decodes to: the longest vocabulary entry (a
    byte-level BPE entry has one character per byte; a decoded character is at least one byte).
    A text longer than max_model_len * this can never fit, so it is refused before tokenising."""
    try:
        return max(1, max(len(t) for t in tok.get_vocab()))
    except Exception:                            # noqa: BLE001 - a tokenizer without a vocab
        return 128


def check_text(text: str, param: str) -> None:
    """Lone surrogates ("\\ud800", legal in JSON, not in UTF-8) cannot be tokenised: a 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param} contains an invalid character {text[e.start]!r} at "
                       f"position {e.start} (a lone UTF-16 surrogate); send valid Unicode text",
                       param=param) from None


def sse_data(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload)}\n\n"


@dataclass(frozen=True)
class Admitted:
    """A request handed to the engine thread: where its events arrive, and what its chunks say."""
    request_id: str                 # "cmpl-..." or "chatcmpl-..."
    events: asyncio.Queue           # of TextDelta / Finished / Failed / Aborted
    num_prompt_tokens: int
    created: int                    # unix seconds, the same in every chunk


class OpenAIServing:
    """The OpenAI endpoints over one AsyncEngine. `is_draining()` says the server is shutting
    down (new requests get 503)."""

    def __init__(self, engine, aengine: AsyncEngine, model_name: str,
                 is_draining: Callable[[], bool] = lambda: False):
        self.engine = engine
        self.aengine = aengine
        self.model_name = model_name
        self.context_len = engine.config.max_position_embeddings
        self.max_model_len = max_model_len(engine)
        self.max_prompt_chars = self.max_model_len * max_chars_per_token(engine.tokenizer)
        self.is_draining = is_draining
        # tokenising and chat templating run here, never on the event loop (a long prompt would
        # stall every stream and /health); one worker, so the tokenizer is never used twice at once
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="minillm-tokenizer")

    # --- the endpoints -------------------------------------------------------------------------
    async def create_completion(self, body: CompletionRequest, request: Request):
        self.check_request(body)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            self.check_prompt_text([prompt], "prompt")
        ids = await self.in_worker(self.engine.encode, prompt)
        adm = self.admit(body, ids, body.max_tokens, default_max=16, prefix="cmpl")
        chunk = functools.partial(self.completion_chunk, adm)
        if body.stream:
            return StreamingResponse(self.sse(adm, chunk, body.include_usage),
                                     media_type="text/event-stream")
        out = await self.collect(adm, request)
        if out is None:
            return Response(status_code=499)     # the client hung up; nobody reads this
        return {**chunk(out.text, out.finish_reason), "usage": self.usage(adm, out)}

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request):
        self.check_request(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        self.check_prompt_text([m["content"] for m in messages], "messages")
        ids = await self.in_worker(chat_prompt_ids, self.engine.tokenizer, messages,
                                   param="messages")
        adm = self.admit(body, ids, body.requested_max_tokens, default_max=None,
                         prefix="chatcmpl")
        if body.stream:
            first = self.chat_chunk(adm, "", None, role="assistant")
            return StreamingResponse(self.sse(adm, functools.partial(self.chat_chunk, adm),
                                              body.include_usage, first=first),
                                     media_type="text/event-stream")
        out = await self.collect(adm, request)
        if out is None:
            return Response(status_code=499)
        message = {"role": "assistant", "content": out.text}
        return {"id": adm.request_id, "object": "chat.completion", "created": adm.created,
                "model": self.model_name,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": out.finish_reason}],
                "usage": self.usage(adm, out)}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": 0, "owned_by": "minillm",
                                            "max_model_len": self.max_model_len}]}

    def health(self):
        if not self.aengine.is_running:
            return JSONResponse(error_body("the engine thread is not running",
                                           type="service_unavailable"), status_code=503)
        return {"status": "ok"}

    # --- 1-3: check and admit ------------------------------------------------------------------
    def check_request(self, body) -> None:
        """The checks that need no tokenizer: shutting down, model name, supported fields."""
        if self.is_draining():
            raise APIError(503, "the server is shutting down; retry on another replica",
                           type="service_unavailable", code="draining")
        if body.model != self.model_name:
            raise APIError(400, f"the model '{body.model}' does not exist; this server serves "
                           f"'{self.model_name}' (see GET /v1/models)", param="model",
                           code="model_not_found")
        body.check_supported()

    def check_prompt_text(self, texts: list, param: str) -> None:
        """Before tokenising: valid Unicode, and no more characters than max_model_len tokens
        could ever hold (so a 1 MB prompt is refused in microseconds, not tokenised first)."""
        n = 0
        for text in texts:
            check_text(text, param)
            n += len(text)
        if n > self.max_prompt_chars:
            raise APIError(400, f"{param} has {n} characters, but max_model_len "
                           f"({self.max_model_len} tokens) never holds more than "
                           f"{self.max_prompt_chars}; shorten it", param=param)

    async def in_worker(self, fn, *args, param: Optional[str] = None):
        """fn(*args) on the tokenizer thread; a ValueError (bad ids, template refused) -> 400."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.tokenizer_pool, fn, *args)
        except ValueError as e:
            message = f"{param}: {e}" if param else str(e)
            raise APIError(400, message, param=param) from None

    def admit(self, body, ids: list, max_tokens: Optional[int], default_max: Optional[int],
              prefix: str) -> Admitted:
        """Size max_tokens (None: `default_max`, or what max_model_len leaves when that is None
        too; a default never exceeds what max_model_len leaves), check the request fits and queue
        it on the engine thread."""
        try:
            if max_tokens is None:
                room = max(1, self.max_model_len - len(ids))
                max_tokens = room if default_max is None else min(default_max, room)
            params = body.sampling_params(max_tokens)
            self.engine.check(ids, params)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        rid = f"{prefix}-{uuid.uuid4().hex}"
        try:
            events = self.aengine.submit(rid, ids, params, arrival_time=self.engine.clock())
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        return Admitted(rid, events, len(ids), int(time.time()))

    # --- 4: answer or stream -------------------------------------------------------------------
    async def collect(self, adm: Admitted, request: Request) -> Optional[RequestOutput]:
        """Wait for the finished output; None (and the request aborted) if the client
        disconnects meanwhile."""
        event, checked = None, time.monotonic()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(adm.events.get(), timeout=DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    event = None
                if time.monotonic() - checked >= DISCONNECT_POLL_S:   # also while deltas flow
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return None
                match event:
                    case TextDelta():
                        continue                 # the text comes whole with Finished
                    case Finished(output):
                        return output
                    case Failed(message):
                        raise APIError(500, message, type="internal_error")
                    case Aborted():
                        raise APIError(503, "the server shut down before this request "
                                       "finished", type="service_unavailable", code="draining")
        finally:
            if not isinstance(event, (Finished, Failed, Aborted)):
                self.aengine.abort(adm.request_id)

    async def sse(self, adm: Admitted, chunk: Callable, include_usage: bool,
                  first: Optional[dict] = None):
        """Server-sent events: one `data:` line per chunk, `data: [DONE]` last. `chunk(text,
        finish_reason)` builds the JSON of one chunk."""
        event, sent = None, ""
        try:
            if first is not None:
                yield sse_data(first)
            while not isinstance(event, (Finished, Failed, Aborted)):
                event = await adm.events.get()
                match event:
                    case TextDelta(text):
                        sent += text
                        yield sse_data(chunk(text, None))
                    case Finished(out):          # the engine's text is the reference
                        rest = out.text[len(sent):] if out.text.startswith(sent) else ""
                        yield sse_data(chunk(rest, out.finish_reason))
                        if include_usage:
                            yield sse_data({**chunk("", None), "choices": [],
                                            "usage": self.usage(adm, out)})
                    case Failed(message):
                        yield sse_data(error_body(message, type="internal_error"))
                    case Aborted():
                        yield sse_data(chunk("", "abort"))
            yield "data: [DONE]\n\n"
        finally:
            if not isinstance(event, (Finished, Failed, Aborted)):
                self.aengine.abort(adm.request_id)  # client went away (or the server stops)

    # --- the JSON of answers and chunks --------------------------------------------------------
    def completion_chunk(self, adm: Admitted, text: str, finish_reason: Optional[str]) -> dict:
        return {"id": adm.request_id, "object": "text_completion", "created": adm.created,
                "model": self.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": finish_reason}]}

    def chat_chunk(self, adm: Admitted, text: str, finish_reason: Optional[str],
                   role: Optional[str] = None) -> dict:
        delta = {"content": text} if role is None else {"role": role, "content": text}
        return {"id": adm.request_id, "object": "chat.completion.chunk", "created": adm.created,
                "model": self.model_name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish_reason}]}

    @staticmethod
    def usage(adm: Admitted, out: RequestOutput) -> dict:
        n_prompt, n = adm.num_prompt_tokens, len(out.token_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n,
                "total_tokens": n_prompt + n,      # prompt tokens the prefix cache served:
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens or 0}}


__all__ = ["OpenAIServing", "Admitted", "chat_prompt_ids", "sse_data", "max_model_len",
           "check_text"]
