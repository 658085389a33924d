"""An OpenAI-compatible HTTP server over LLMEngine (chapter 08), on FastAPI + uvicorn.

This module wires routes to `OpenAIServing` (serving.py, where a request is checked, admitted,
answered or streamed) and runs the app; `AsyncEngine` (async_engine.py) runs the engine.

    POST /v1/completions        text (or token ids) in, text out; `stream: true` for SSE chunks
    POST /v1/chat/completions   messages in (the tokenizer's chat template applied), text out
    GET  /v1/models             the one model served
    GET  /health                200 while the engine thread runs
    GET  /metrics               Prometheus text (see minillm.serve.metrics)

A request's life: the handler validates the body (400 on anything wrong, before any engine
work), tokenises, checks the request fits the context and KV pool, and hands it to the engine
thread (429 if too many are already waiting). The engine thread adds it between two steps; each
later step may produce new text, which arrives on the request's asyncio queue as a TextDelta and
goes out as one server-sent event `data: {chunk}`; Finished brings the last chunk with the
finish_reason (and usage if asked), then `data: [DONE]`.
A client that goes away mid-stream has its request aborted, so its KV blocks are free for others.

Shutdown (SIGTERM or Ctrl-C): uvicorn stops accepting connections, new requests on open
connections get 503, running requests get up to `drain_timeout` seconds to finish, then the
rest are aborted and the process exits 0.
"""
from __future__ import annotations

import contextlib
import errno
import signal
import socket
import sys
import threading
import time
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .async_engine import AsyncEngine
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
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


def build_app(engine, model_name: str, max_waiting: int = 256) -> FastAPI:
    """The FastAPI app serving `engine` (an LLMEngine with a tokenizer) as `model_name`: an
    AsyncEngine, its Prometheus metrics and an OpenAIServing, wired to the routes."""
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

    app = FastAPI(title="minillm", lifespan=lifespan)
    app.state.draining = False          # set by uvicorn's shutdown (see run_server)

    def draining() -> bool:
        server = getattr(app.state, "server", None)
        return app.state.draining or bool(server is not None and server.should_exit)

    serving = OpenAIServing(engine, aengine, model_name, is_draining=draining)
    app.state.engine, app.state.aengine, app.state.metrics = engine, aengine, metrics
    app.state.model_name, app.state.serving = model_name, serving
    _add_error_handlers(app, metrics)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.create_completion(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.create_chat_completion(body, request)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.get("/health")
    async def health():
        return serving.health()

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    return app


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
