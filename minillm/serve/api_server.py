"""An OpenAI-compatible HTTP server over LLMEngine (chapter 08), on FastAPI + uvicorn.

This module wires routes to `OpenAIServing` (serving.py, where a request is checked, admitted,
answered or streamed) and runs the app; `AsyncEngine` (async_engine.py) runs the engine.

    POST /v1/completions        text (or token ids) in, text out; `stream: true` for SSE chunks
    POST /v1/chat/completions   messages in (the tokenizer's chat template applied), text out
    GET  /v1/models             the one model served
    POST /tokenize, /detokenize  vLLM's tokenizer endpoints (text or messages <-> token ids)
    GET  /tokenizer_info        the special tokens and chat template (lm-eval's remote tokenizer)
    GET  /health                200 while the engine thread runs
    GET  /metrics               Prometheus text (see minillm.serve.metrics)

A request's life: a body over `max_body_bytes` is refused with 413 before it is parsed (its
bytes are read and dropped, never kept); the handler validates the body (400 on anything wrong,
before any engine work), tokenises on a worker thread (never on the event loop), checks the
request fits max_model_len (the context or the KV pool, whichever is smaller), and hands it to
the engine thread (429 if too many are already waiting). The engine thread adds it between two
steps; each later step may produce new text, which arrives on the request's asyncio queue as a
TextDelta and goes out as one server-sent event `data: {chunk}`; Finished brings the last chunk
with the finish_reason (and usage if asked), then `data: [DONE]`.
A client that goes away (streaming or not) has its request aborted, so its KV blocks are free
for others. Every error, FastAPI's own 404/405/422 and a crash included, is an OpenAI error body
{"error": {"message", "type", "param", "code"}}.

Shutdown (SIGTERM or Ctrl-C): uvicorn stops accepting connections, new requests on open
connections get 503, running requests get up to `drain_timeout` seconds to finish, then the
rest are aborted and the process exits 0.
"""
from __future__ import annotations

import contextlib
import errno
import json
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncEngine
from .metrics import ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                       TokenizeRequest, error_body)
from .serving import OpenAIServing, chat_prompt_ids


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


MAX_BODY_BYTES = 2 ** 20       # 1 MiB: a full 8k-token prompt is ~40 kB of text, ~60 kB of ids
DRAIN_LIMIT_BYTES = 64 * 2 ** 20   # an oversized body up to this is read (and dropped) so the
                                   # client gets its 413; a larger one has its connection closed


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` gets a 413 (OpenAI error body) before
    any handler parses it. The excess is read in uvicorn's small chunks and dropped, so memory
    does not grow with the body; without Content-Length the limit applies to the bytes read.

        body <= max_bytes  -> replayed to the app as one message
        body >  max_bytes  -> drained (up to DRAIN_LIMIT_BYTES), then 413
    """

    def __init__(self, app, max_bytes: int, on_reject=None):
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        declared = int(length) if length and length.isdigit() else None
        chunks, size, more = [], 0, True
        while more and size <= DRAIN_LIMIT_BYTES and (declared or 0) <= DRAIN_LIMIT_BYTES:
            msg = await receive()
            if msg["type"] != "http.request":
                return                                   # the client went away
            more = msg.get("more_body", False)
            size += len(msg.get("body", b""))
            if size <= self.max_bytes and (declared or 0) <= self.max_bytes:
                chunks.append(msg.get("body", b""))
            else:
                chunks = []                              # over the limit: drop, keep draining
        if size > self.max_bytes or (declared or 0) > self.max_bytes:
            return await self._reject(send, max(size, declared or 0))
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()                   # http.disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _reject(self, send, size: int) -> None:
        if self.on_reject is not None:
            self.on_reject()
        body = json.dumps(error_body(
            f"the request body has at least {size} bytes, more than this server's limit of "
            f"{self.max_bytes} (--max-request-body-bytes); send a shorter prompt",
            code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class InternalErrors:
    """ASGI middleware: a bug anywhere below becomes a 500 in the OpenAI shape (the traceback
    goes to the log) and the connection stays usable; Starlette's own catch-all would answer
    plain text and close it."""

    def __init__(self, app, on_error=None):
        self.app, self.on_error = app, on_error

    async def __call__(self, scope, receive, send):
        started = False

        async def tracked(msg):
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)
        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:                 # noqa: BLE001 - answered, and logged
            if scope["type"] != "http" or started:
                raise                            # too late for a JSON answer
            traceback.print_exc()
            if self.on_error is not None:
                self.on_error()
            await JSONResponse(error_body(f"internal server error ({type(exc).__name__}); see "
                                          "the server log", type="internal_error"),
                               status_code=500)(scope, receive, send)


def build_app(engine, model_name: str, max_waiting: int = 256,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving `engine` (an LLMEngine with a tokenizer) as `model_name`: an
    AsyncEngine, its Prometheus metrics and an OpenAIServing, wired to the routes; bodies over
    `max_body_bytes` are refused (413) before parsing."""
    if engine.tokenizer is None:
        raise ValueError("the server needs a tokenizer to turn text into tokens; load the model "
                         "with one (minillm.load_model returns it)")
    metrics = ServerMetrics(model_name)
    aengine = AsyncEngine(engine, max_waiting=max_waiting, observer=metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        aengine.start()
        yield
        aengine.stop()
        serving.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.draining = False          # set by uvicorn's shutdown (see run_server)

    def draining() -> bool:
        server = getattr(app.state, "server", None)
        return app.state.draining or bool(server is not None and server.should_exit)

    serving = OpenAIServing(engine, aengine, model_name, is_draining=draining)
    app.state.engine, app.state.aengine, app.state.metrics = engine, aengine, metrics
    app.state.model_name, app.state.serving = model_name, serving
    _add_error_handlers(app, metrics)
    app.add_middleware(InternalErrors, on_error=lambda: metrics.reject("engine_error"))
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes,      # the outermost
                       on_reject=lambda: metrics.reject("invalid"))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.create_completion(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.create_chat_completion(body, request)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    _add_tokenizer_routes(app, serving)

    @app.get("/health")
    async def health():
        return serving.health()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return app


def _add_tokenizer_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """vLLM's /tokenize, /detokenize and /tokenizer_info, for clients without a tokenizer."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await serving.detokenize(body)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return serving.tokenizer_info()


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every refusal becomes an OpenAI error body and is counted by reason."""

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

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        """FastAPI's own refusals: 404 (no such route), 405 (wrong method), a body that cannot
        be parsed at all (invalid UTF-8, JSON nested too deeply: FastAPI's 400)."""
        metrics.reject("invalid")
        message, type_ = _http_message(request, exc)
        return JSONResponse(error_body(message, type=type_), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))


def _http_message(request, exc) -> tuple:
    """(message, type) of a Starlette HTTPException, saying what to do."""
    path, method = request.url.path, request.method
    if exc.status_code == 404:
        return (f"no route {path}; this server has POST /v1/completions, POST "
                "/v1/chat/completions, GET /v1/models, POST /tokenize, POST /detokenize, GET "
                "/tokenizer_info, /health, /metrics", "not_found_error")
    if exc.status_code == 405:
        return f"{method} is not allowed on {path}; see the Allow header", "invalid_request_error"
    if exc.status_code == 400:
        return ("the request body could not be parsed: send UTF-8 JSON (no invalid bytes, no "
                "nesting deeper than Python's JSON parser allows)", "invalid_request_error")
    return str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "internal_error"


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
                             "is listening there); stop it or choose another port with --port"
                             ) from None
        raise SystemExit(f"error: cannot listen on {host}:{port}: {e.strerror}; check --host "
                         "and --port") from None
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
               drain_timeout: float = 30.0, log_level: str = "info",
               max_body_bytes: int = MAX_BODY_BYTES) -> None:
    """Serve until SIGTERM / SIGINT, then drain (see the module docstring)."""
    app = build_app(engine, model_name, max_waiting=max_waiting, max_body_bytes=max_body_bytes)
    # uvicorn re-raises the signal once it has shut down; answer it with a normal exit (status
    # 0: the drain finished) instead of dying by the signal's default action.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    make_server(app, drain_timeout, log_level).run(sockets=[sock])


class BackgroundApp:
    """Any FastAPI app served by uvicorn in a thread of this process on a free loopback port
    (tests, notebooks): start() waits until it listens, stop() lets it drain, then closes."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 drain_timeout: float = 5.0, log_level: str = "warning"):
        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.app = app
        self.server = make_server(app, drain_timeout, log_level)
        self._thread: Optional[threading.Thread] = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0):
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name=f"minillm-{type(self).__name__}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the {type(self).__name__} did not start; see its log above")
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


class BackgroundServer(BackgroundApp):
    """The server in a thread of this process on a free loopback port (tests, the notebook).

        with BackgroundServer(engine, "smollm2-135m") as srv:
            client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")
    """

    def __init__(self, engine, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 max_waiting: int = 256, drain_timeout: float = 5.0, log_level: str = "warning",
                 max_body_bytes: int = MAX_BODY_BYTES):
        super().__init__(build_app(engine, model_name, max_waiting=max_waiting,
                                   max_body_bytes=max_body_bytes), host, port, drain_timeout,
                         log_level)

    @property
    def aengine(self) -> AsyncEngine:
        return self.app.state.aengine


__all__ = ["build_app", "run_server", "bind_socket", "make_server", "BackgroundApp",
           "BackgroundServer",
           "BodySizeLimit", "InternalErrors", "MAX_BODY_BYTES", "chat_prompt_ids"]
