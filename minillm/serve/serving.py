"""What the HTTP routes do (chapter 08): vLLM's OpenAIServingCompletion / OpenAIServingChat (and
mini-sglang's FrontendManager) as one small class, `OpenAIServing`.

The routes in api_server.py are one line each; a request's life happens here:

    step            method                    what can go wrong (status, see protocol.py)
    --------------  ------------------------  -----------------------------------------------
    0. body         BodySizeLimit             over --max-request-body-bytes (413), before
                    (api_server.py)           anything is parsed
    1. check        check_request(body)       shutting down (503), unknown model (404),
                                              a field this server does not implement, n over
                                              MAX_N, logprobs over 20, a malformed
                                              response_format (400)
    2. prompt       check_prompt_text         lone surrogates (400); more characters than
                                              max_model_len tokens could ever hold (400)
                    in_worker(encode or       (a worker thread, off the event loop): bad token
                    chat_prompt_ids)          ids, no chat template, template refused (400)
    3. admit        admit_all(body, ids, ...) per prompt (a completions request may carry a
                    -> plan, then submit      list): too long for max_model_len (the context
                                              or the KV pool, whichever is smaller; echo
                                              included), bad sampling values, an invalid or
                                              unmatchable grammar (400, nothing queued); too
                                              many already waiting (429). Else: each prompt is
                                              queued on the AsyncEngine as its own request
    4a. answer      collect_all(reply, req)   waits for every Finished; Failed -> 500, Aborted
                                              -> 503; a client that hangs up is aborted (499)
                                              within DISCONNECT_POLL_S, even while tokens flow
    4b. stream      sse(reply, chunk, body)   the prompts' events merged; one `data: {chunk}`
                                              per TextDelta (choice index = prompt * n +
                                              sample), the rest of each sample's text with its
                                              finish_reason, usage, [DONE]; a client that
                                              hangs up is aborted
    5. usage        usage(reply, outputs)     prompt / completion / total tokens and the
                                              prompt tokens the prefix cache served (every
                                              chunk too with continuous_usage_stats)

Logprobs are the raw model's (see sampling.py); their two wire shapes are in logprobs.py.
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
from ..sampling import SamplingParams
from .logprobs import chat_logprobs, completion_logprobs
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeRequest, error_body)


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
    request_id: str                 # the engine's id: the reply's ("cmpl-...", "chatcmpl-...")
                                    # or, for a prompt list, the reply's + "-<prompt index>"
    events: asyncio.Queue           # of TextDelta / Finished / Failed / Aborted
    num_prompt_tokens: int
    created: int                    # unix seconds, the same in every chunk


@dataclass
class Reply:
    """One HTTP answer over one or more engine requests (a completions prompt list: one per
    prompt). Choice `index` = prompt index * n + sample index, as OpenAI numbers them."""
    id: str                         # "cmpl-..." / "chatcmpl-...": the same in every chunk
    admitted: list                  # [Admitted], one per prompt
    n: int
    echo: list                      # per prompt: text put before each choice (echo) or ""
    prompt_chars: list              # per prompt: len of the prompt text (text_offset base)

    @property
    def created(self) -> int:
        return self.admitted[0].created

    @property
    def num_prompt_tokens(self) -> int:
        return sum(a.num_prompt_tokens for a in self.admitted)


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
        prompts = body.prompt_list()
        self.check_prompt_text([p for p in prompts if isinstance(p, str)], "prompt")
        ids = [await self.in_worker(self.engine.encode, p, param="prompt") for p in prompts]
        texts = [p if isinstance(p, str) else await self.in_worker(self.engine.decode_prompt, i)
                 for p, i in zip(prompts, ids)]
        reply = await self.admit_all(body, ids, body.max_tokens, 16, "cmpl",
                               [t if body.echo else "" for t in texts], [len(t) for t in texts])
        chunk = functools.partial(self.completion_chunk, reply, body.logprobs)
        if body.stream:
            return StreamingResponse(self.sse(reply, chunk, body),
                                     media_type="text/event-stream")
        outs = await self.collect_all(reply, request)
        if outs is None:
            return Response(status_code=499)     # the client hung up; nobody reads this
        choices = [self.completion_choice(reply, i, out, c, body)
                   for i, out in enumerate(outs) for c in out.outputs]
        return {"id": reply.id, "object": "text_completion", "created": reply.created,
                "model": self.model_name, "choices": choices, "usage": self.usage(reply, outs)}

    async def create_chat_completion(self, body: ChatCompletionRequest, request: Request):
        self.check_request(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        self.check_prompt_text([m["content"] for m in messages], "messages")
        ids = await self.in_worker(chat_prompt_ids, self.engine.tokenizer, messages,
                                   param="messages")
        reply = await self.admit_all(body, [ids], body.requested_max_tokens, None, "chatcmpl",
                               [""], [0])
        k = (body.top_logprobs or 0) if body.logprobs else None
        chunk = functools.partial(self.chat_chunk, reply, k)
        if body.stream:
            first = [chunk(i, "", None, role="assistant") for i in range(body.n)]
            return StreamingResponse(self.sse(reply, chunk, body, first=first),
                                     media_type="text/event-stream")
        outs = await self.collect_all(reply, request)
        if outs is None:
            return Response(status_code=499)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": None if k is None else chat_logprobs(c.logprobs, c.token_ids, k),
                    "finish_reason": c.finish_reason} for c in outs[0].outputs]
        return {"id": reply.id, "object": "chat.completion", "created": reply.created,
                "model": self.model_name, "choices": choices, "usage": self.usage(reply, outs)}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": 0, "owned_by": "minillm",
                                            "max_model_len": self.max_model_len}]}

    def health(self):
        if not self.aengine.is_running:
            return JSONResponse(error_body("the engine thread is not running",
                                           type="service_unavailable"), status_code=503)
        return {"status": "ok"}

    # --- vLLM's tokenizer endpoints (so clients without the tokenizer can count and score) ----
    async def tokenize(self, body: TokenizeRequest) -> dict:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        tok = self.engine.tokenizer
        if body.prompt is not None:
            self.check_prompt_text([body.prompt], "prompt")
            ids = await self.in_worker(lambda: tok.encode(
                body.prompt, add_special_tokens=body.add_special_tokens), param="prompt")
        else:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            self.check_prompt_text([m["content"] for m in messages], "messages")
            ids = await self.in_worker(chat_prompt_ids, tok, messages, param="messages")
        strs = ([self.engine.decode_token(t) for t in ids] if body.return_token_strs else None)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        vocab = self.engine.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:5]}",
                           param="tokens")
        text = await self.in_worker(lambda: self.engine.tokenizer.decode(body.tokens))
        return {"prompt": text}

    def tokenizer_info(self) -> dict:
        tok = self.engine.tokenizer
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token,
                "bos_token": tok.bos_token, "pad_token": tok.pad_token,
                "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": self.max_model_len}

    # --- 1-3: check and admit ------------------------------------------------------------------
    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                           f"'{self.model_name}' (see GET /v1/models)", param="model",
                           code="model_not_found")

    def check_request(self, body) -> None:
        """The checks that need no tokenizer: shutting down, model name, supported fields."""
        if self.is_draining():
            raise APIError(503, "the server is shutting down; retry on another replica",
                           type="service_unavailable", code="draining")
        self.check_model(body.model)
        body.check_supported()

    def check_prompt_text(self, texts: list, param: str) -> None:
        """Before tokenising: valid Unicode, and no more characters than max_model_len tokens
        could ever hold (so a 1 MB prompt is refused in microseconds, not tokenised first)."""
        n = 0
        for text in texts:
            check_text(text, param)
            n = max(n, len(text))
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

    def plan(self, body, ids: list, max_tokens: Optional[int],
             default_max: Optional[int]) -> SamplingParams:
        """Size max_tokens (None: `default_max`, or what max_model_len leaves when that is None
        too; a default never exceeds what max_model_len leaves) and check the request fits."""
        try:
            if max_tokens is None:
                room = max(1, self.max_model_len - len(ids))
                max_tokens = room if default_max is None else min(default_max, room)
            params = body.sampling_params(max_tokens)
            self.engine.check(ids, params)
            self.engine.check_grammar(params)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return params

    async def admit_all(self, body, ids_list: list, max_tokens: Optional[int],
                  default_max: Optional[int], prefix: str, echo: list,
                  prompt_chars: list) -> Reply:
        """Check every prompt first (one bad prompt refuses the whole request with nothing
        queued), then queue them all on the engine thread (429 if the queue is full, and the
        ones already queued are aborted)."""
        plans = [await self.in_worker(self.plan, body, ids, max_tokens, default_max)
                 for ids in ids_list]          # a grammar compiles off the event loop
        rid = f"{prefix}-{uuid.uuid4().hex}"
        admitted = []
        try:
            for i, (ids, params) in enumerate(zip(ids_list, plans)):
                eid = rid if len(ids_list) == 1 else f"{rid}-{i}"   # the engine's request id
                events = self.aengine.submit(eid, ids, params, arrival_time=self.engine.clock())
                admitted.append(Admitted(eid, events, len(ids), int(time.time())))
        except QueueFull as e:
            for adm in admitted:
                self.aengine.abort(adm.request_id)
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        return Reply(rid, admitted, body.n, echo, prompt_chars)

    # --- 4: answer or stream -------------------------------------------------------------------
    async def collect_all(self, reply: Reply, request: Request) -> Optional[list]:
        """Every prompt's finished output, in order; None if the client hung up (then every
        request of the reply is aborted)."""
        outs = []
        try:
            for adm in reply.admitted:
                out = await self.collect(adm, request)
                if out is None:
                    return None
                outs.append(out)
            return outs
        finally:
            for adm in reply.admitted[len(outs):]:
                self.aengine.abort(adm.request_id)

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

    async def sse(self, reply: Reply, chunk: Callable, body, first: Optional[list] = None):
        """Server-sent events: one `data:` line per chunk, `data: [DONE]` last. `chunk(index,
        text, finish_reason, logprobs)` builds one chunk's JSON; the prompts' events are
        merged as they come."""
        merged: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(_pump(i, adm.events, merged))
                 for i, adm in enumerate(reply.admitted)]
        st = _StreamState(reply)
        try:
            for c in first or []:
                yield sse_data(st.with_usage(c, body.continuous_usage))
            for i, text in enumerate(reply.echo):
                for j in range(reply.n) if text else ():
                    yield sse_data(st.with_usage(chunk(i * reply.n + j, text, None, None),
                                                 body.continuous_usage))
            while st.open:
                i, event = await merged.get()
                for payload in st.on_event(i, event, chunk):
                    yield sse_data(st.with_usage(payload, body.continuous_usage))
            if body.include_usage and st.outs:
                yield sse_data({**chunk(0, "", None, None), "choices": [],
                                "usage": self.usage(reply, st.outs)})
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            for i, adm in enumerate(reply.admitted):
                if i in st.live:              # client went away (or the server stops)
                    self.aengine.abort(adm.request_id)

    # --- the JSON of answers and chunks --------------------------------------------------------
    def completion_choice(self, reply: Reply, i: int, out: RequestOutput, c,
                          body: CompletionRequest) -> dict:
        """One choice of a finished completion (echo, logprobs)."""
        lp = None
        if body.logprobs is not None:
            if body.echo:
                lp = completion_logprobs(out.prompt_logprobs + c.logprobs,
                                         out.prompt_token_ids + c.token_ids, 0,
                                         self.engine.decode_token)
            else:
                lp = completion_logprobs(c.logprobs, c.token_ids, reply.prompt_chars[i],
                                         self.engine.decode_token)
        return {"index": i * reply.n + c.index, "text": reply.echo[i] + c.text, "logprobs": lp,
                "finish_reason": c.finish_reason}

    def completion_chunk(self, reply: Reply, k: Optional[int], index: int, text: str,
                         finish_reason: Optional[str], logprobs: Optional[list]) -> dict:
        lp = None
        if k is not None and logprobs:
            ids = [next(iter(d)) for d in logprobs]     # the sampled token is the first key
            lp = completion_logprobs(logprobs, ids, 0, self.engine.decode_token)
        return {"id": reply.id, "object": "text_completion", "created": reply.created,
                "model": self.model_name,
                "choices": [{"index": index, "text": text, "logprobs": lp,
                             "finish_reason": finish_reason}]}

    def chat_chunk(self, reply: Reply, k: Optional[int], index: int, text: str,
                   finish_reason: Optional[str], logprobs: Optional[list] = None,
                   role: Optional[str] = None) -> dict:
        delta = {"content": text} if role is None else {"role": role, "content": text}
        lp = None
        if k is not None and logprobs:
            lp = chat_logprobs(logprobs, [next(iter(d)) for d in logprobs], k)
        return {"id": reply.id, "object": "chat.completion.chunk", "created": reply.created,
                "model": self.model_name,
                "choices": [{"index": index, "delta": delta, "logprobs": lp,
                             "finish_reason": finish_reason}]}

    @staticmethod
    def usage(reply: Reply, outs: list) -> dict:
        n_prompt = reply.num_prompt_tokens
        n = sum(len(c.token_ids) for out in outs for c in out.outputs)
        return {"prompt_tokens": n_prompt, "completion_tokens": n,
                "total_tokens": n_prompt + n,      # prompt tokens the prefix cache served:
                "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens or 0
                                                               for o in outs)}}


async def _pump(i: int, source: asyncio.Queue, merged: asyncio.Queue) -> None:
    """Forward one request's events, tagged with its prompt index, until its last one."""
    while True:
        event = await source.get()
        await merged.put((i, event))
        if isinstance(event, (Finished, Failed, Aborted)):
            return


class _StreamState:
    """What a stream has sent per choice: text, logprob entries, tokens (for usage)."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.live = set(range(len(reply.admitted)))    # prompts not finished yet
        self.sent: dict = {}                           # choice index -> text sent
        self.sent_lps: dict = {}                       # choice index -> logprob entries sent
        self.tokens: dict = {}                         # choice index -> output tokens so far
        self.outs: list = []                           # finished outputs (for the usage)
        self.failed = False

    @property
    def open(self) -> bool:
        return bool(self.live) and not self.failed

    def on_event(self, i: int, event, chunk: Callable) -> list:
        """The chunks one event of prompt i produces."""
        n = self.reply.n
        match event:
            case TextDelta(text, num_tokens, index, lps):
                c = i * n + index
                self.sent[c] = self.sent.get(c, "") + text
                self.sent_lps[c] = self.sent_lps.get(c, 0) + len(lps)
                self.tokens[c] = num_tokens
                return [chunk(c, text, None, list(lps))]
            case Finished(out):                # the engine's text is the reference
                self.live.discard(i)
                self.outs.append(out)
                payloads = []
                for s in out.outputs:
                    c, sent = i * n + s.index, self.sent.get(i * n + s.index, "")
                    self.tokens[c] = len(s.token_ids)
                    rest = s.text[len(sent):] if s.text.startswith(sent) else ""
                    lps = (s.logprobs or [])[self.sent_lps.get(c, 0):]
                    payloads.append(chunk(c, rest, s.finish_reason, lps))
                return payloads
            case Failed(message):
                self.live.discard(i)
                self.failed = True
                return [error_body(message, type="internal_error")]
            case Aborted():
                self.live.discard(i)
                return [chunk(i * n + j, "", "abort", None) for j in range(n)]
        return []

    def with_usage(self, payload: dict, continuous: bool) -> dict:
        """vLLM's continuous_usage_stats: every chunk says the tokens so far."""
        if not continuous or "error" in payload:
            return payload
        n_prompt, done = self.reply.num_prompt_tokens, sum(self.tokens.values())
        return {**payload, "usage": {"prompt_tokens": n_prompt, "completion_tokens": done,
                                     "total_tokens": n_prompt + done}}


__all__ = ["OpenAIServing", "Admitted", "Reply", "chat_prompt_ids", "sse_data", "max_model_len",
           "check_text"]
