"""An OpenAI-compatible HTTP server over LLMEngine (chapter 08), on FastAPI + uvicorn.

    POST /v1/completions        text (or token ids) in, text out; `stream: true` for SSE chunks
    POST /v1/chat/completions   messages in (the tokenizer's chat template applied), text out
    GET  /v1/models             the one model served
    GET  /health                200 while the engine thread runs
    GET  /metrics               Prometheus text (see minillm.serve.metrics)

A request's life: the handler validates the body (400 on anything wrong, before any engine
work), tokenises, checks the request fits the context and KV pool, and hands it to the engine
thread (429 if too many are already waiting). The engine thread adds it between two steps; each
later step may produce new text, which arrives on the request's asyncio queue and goes out as one
server-sent event `data: {chunk}`; the last chunk carries the finish_reason, then `data: [DONE]`.
A client that goes away mid-stream has its request aborted, so its KV blocks are free for others.

Shutdown (SIGTERM or Ctrl-C): uvicorn stops accepting connections, new requests on open
connections get 503, running requests get up to `drain_timeout` seconds to finish, then the
rest are aborted and the process exits 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import signal
import socket
import sys
import threading
import time
import uuid
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .async_engine import AsyncEngine, QueueFull
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body


def chat_prompt_ids(tok, messages: list) -> list:
    """Token ids of a conversation with the assistant's turn opened (the chat template)."""
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                       param="messages")
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)    # the template already has its markers


def _validation_message(exc: RequestValidationError) -> tuple:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return "the request body is not valid JSON: " + str(err.get("msg")), None
    if err.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if err.get("type") == "missing":
        return f"'{param}' is a required property", param
    return f"{param or 'body'}: {err.get('msg')} (got {err.get('input')!r:.80})", param


def build_app(engine, model_name: str, max_waiting: int = 256) -> FastAPI:
    """The FastAPI app serving `engine` (an LLMEngine with a tokenizer) as `model_name`."""
    if engine.tokenizer is None:
        raise ValueError("the server needs a tokenizer to turn text into tokens; load the model "
                         "with one (minillm.load_model returns it)")
    metrics = ServerMetrics(model_name)
    aengine = AsyncEngine(engine, max_waiting=max_waiting, observer=metrics)
    tok = engine.tokenizer
    context_len = engine.config.max_position_embeddings

    @contextlib.asynccontextmanager
    async def lifespan(app):
        aengine.start()
        yield
        aengine.stop()

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.engine, app.state.aengine, app.state.metrics = engine, aengine, metrics
    app.state.model_name = model_name
    app.state.draining = False          # set by uvicorn's shutdown (see run_server)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        reason = {429: "queue_full", 503: "draining",
                  500: "engine_error"}.get(exc.status, "invalid")
        metrics.reject(reason)
        headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        metrics.reject("invalid")
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, param=param), status_code=400)

    def draining() -> bool:
        server = getattr(app.state, "server", None)
        return app.state.draining or bool(server is not None and server.should_exit)

    def precheck(body) -> None:
        """The checks that need no tokenizer: shutting down, model name, supported fields."""
        if draining():
            raise APIError(503, "the server is shutting down; retry on another replica",
                           type="service_unavailable", code="draining")
        if body.model != model_name:
            raise APIError(400, f"the model '{body.model}' does not exist; this server serves "
                           f"'{model_name}' (see GET /v1/models)", param="model",
                           code="model_not_found")
        body.check_supported()

    def admit(body, ids: list, default_max: int):
        """Validate one request and queue it. Returns (request_id, events queue, prompt length)."""
        precheck(body)
        try:
            ids = engine.encode(ids)
            max_tokens = body.requested_max_tokens if isinstance(body, ChatCompletionRequest) \
                else body.max_tokens
            if max_tokens is None:
                max_tokens = max(1, context_len - len(ids)) if default_max is None else default_max
            params = body.sampling_params(max_tokens)
            engine.check(ids, params)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        rid = f"{'chatcmpl' if isinstance(body, ChatCompletionRequest) else 'cmpl'}-" \
              f"{uuid.uuid4().hex}"
        try:
            events = aengine.submit(rid, ids, params, arrival_time=engine.clock())
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        return rid, events, len(ids)

    async def collect(rid: str, events: asyncio.Queue, request: Request):
        """Wait for the finished output; abort if the client disconnects meanwhile."""
        done = False
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return None
                    continue
                if ev[0] == "error":
                    done = True
                    raise APIError(500, ev[1], type="internal_error")
                if ev[0] == "finished_abort":
                    done = True
                    raise APIError(503, "the server shut down before this request finished",
                                   type="service_unavailable", code="draining")
                if ev[0] == "finished":
                    done = True
                    return ev[1]
        finally:
            if not done:
                aengine.abort(rid)

    def usage(n_prompt: int, out) -> dict:
        n = len(out.token_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n,
                "total_tokens": n_prompt + n,      # prompt tokens the prefix cache served:
                "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens or 0}}

    async def sse(rid: str, events: asyncio.Queue, chunk, n_prompt: int, include_usage: bool,
                  first: Optional[dict] = None):
        """Server-sent events: one `data:` line per chunk, `data: [DONE]` last. `chunk(text,
        finish_reason)` builds the JSON of one chunk."""
        done, sent = False, ""
        try:
            if first is not None:
                yield f"data: {json.dumps(first)}\n\n"
            while True:
                ev = await events.get()
                if ev[0] == "delta":
                    if ev[1]:
                        sent += ev[1]
                        yield f"data: {json.dumps(chunk(ev[1], None))}\n\n"
                    continue
                done = True
                if ev[0] == "error":
                    yield f"data: {json.dumps(error_body(ev[1], type='internal_error'))}\n\n"
                elif ev[0] == "finished_abort":
                    yield f"data: {json.dumps(chunk('', 'abort'))}\n\n"
                else:
                    out = ev[1]
                    rest = out.text[len(sent):] if out.text.startswith(sent) else ""
                    yield f"data: {json.dumps(chunk(rest, out.finish_reason))}\n\n"
                    if include_usage:
                        last = chunk("", None)
                        last["choices"], last["usage"] = [], usage(n_prompt, out)
                        yield f"data: {json.dumps(last)}\n\n"
                break
            yield "data: [DONE]\n\n"
        finally:
            if not done:                         # client went away (or the server is stopping)
                aengine.abort(rid)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        rid, events, n_prompt = admit(body, body.single_prompt(), default_max=16)
        created = int(time.time())

        def chunk(text, finish_reason):
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": model_name, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                      "finish_reason": finish_reason}]}

        if body.stream:
            return StreamingResponse(sse(rid, events, chunk, n_prompt, body.include_usage),
                                     media_type="text/event-stream")
        out = await collect(rid, events, request)
        if out is None:
            return Response(status_code=499)
        resp = chunk(out.text, out.finish_reason)
        resp["usage"] = usage(n_prompt, out)
        return resp

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        precheck(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = chat_prompt_ids(tok, messages)
        except ValueError as e:                  # the template refused the conversation
            raise APIError(400, f"messages: {e}", param="messages") from None
        rid, events, n_prompt = admit(body, ids, default_max=None)
        created = int(time.time())

        def chunk(text, finish_reason, role=None):
            delta = {"content": text} if role is None else {"role": role, "content": text}
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": model_name, "choices": [{"index": 0, "delta": delta,
                                                      "logprobs": None,
                                                      "finish_reason": finish_reason}]}

        if body.stream:
            return StreamingResponse(sse(rid, events, chunk, n_prompt, body.include_usage,
                                         first=chunk("", None, role="assistant")),
                                     media_type="text/event-stream")
        out = await collect(rid, events, request)
        if out is None:
            return Response(status_code=499)
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                             "logprobs": None, "finish_reason": out.finish_reason}],
                "usage": usage(n_prompt, out)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "minillm",
                                            "max_model_len": context_len}]}

    @app.get("/health")
    async def health():
        if not aengine.is_running:
            return JSONResponse(error_body("the engine thread is not running",
                                           type="service_unavailable"), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


# --- running it -------------------------------------------------------------------------------
def bind_socket(host: str, port: int) -> socket.socket:
    """Bind host:port now (before the model loads), or exit with a message saying what to do."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise SystemExit(f"error: port {port} on {host} is already in use (another server "
                             "is listening there); stop it or choose another port with --port")
        raise SystemExit(f"error: cannot listen on {host}:{port}: {e.strerror}; check --host "
                         "and --port")
    sock.set_inheritable(True)
    return sock


def make_server(app: FastAPI, drain_timeout: float = 30.0, log_level: str = "info"):
    import uvicorn
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_timeout,
                            lifespan="on")
    server = uvicorn.Server(config)
    app.state.server = server
    return server


def run_server(engine, model_name: str, sock: socket.socket, max_waiting: int = 256,
               drain_timeout: float = 30.0, log_level: str = "info") -> None:
    """Serve until SIGTERM / SIGINT, then drain (see the module docstring)."""
    app = build_app(engine, model_name, max_waiting=max_waiting)
    # uvicorn re-raises the signal once it has shut down; answer it with a normal exit (status
    # 0: the drain finished) instead of dying by the signal's default action.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    make_server(app, drain_timeout, log_level).run(sockets=[sock])


class BackgroundServer:
    """The server in a thread of this process on a free loopback port (tests, the notebook).

        with BackgroundServer(engine, "smollm2-135m") as srv:
            client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")
    """

    def __init__(self, engine, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 max_waiting: int = 256, drain_timeout: float = 5.0, log_level: str = "warning"):
        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.app = build_app(engine, model_name, max_waiting=max_waiting)
        self.server = make_server(self.app, drain_timeout, log_level)
        self._thread: Optional[threading.Thread] = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def aengine(self) -> AsyncEngine:
        return self.app.state.aengine

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name="minillm-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start; see its log above")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            self.server.should_exit = True
            self._thread.join(timeout)
            self._thread = None
        self.sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


__all__ = ["build_app", "run_server", "bind_socket", "make_server", "BackgroundServer",
           "chat_prompt_ids"]
