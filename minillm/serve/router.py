"""A router in front of several OpenAI-compatible servers (chapter 11), on FastAPI + httpx.

    python -m minillm serve --port 8001 &  python -m minillm serve --port 8002 &
    python -m minillm router --port 8000 --policy prefix_affinity \\
        --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002

Clients talk to the router exactly as to one server (POST /v1/completions and
/v1/chat/completions, GET /v1/models, /health); the router picks a backend per request with a
policy from routing.py and relays the answer:

    client --POST--> router: read the body (413 over the limit), parse it (400 if not JSON),
                             tokenise the prompt on a worker thread (prefix_affinity only),
                             pick a healthy backend
           router --POST--> backend: the same body, byte for byte
                 a connect failure: the backend is marked down and the next one is tried
                 (nothing was generated yet, so the retry is safe)
           backend --chunks--> router --chunks--> client: streamed chunk by chunk as they come;
                 the backend's status and body pass through unchanged (usage, cached_tokens,
                 its own 4xx errors)
                 the backend dies mid-answer: the client gets an error event (streaming) or a
                 502 (not streaming), the backend is marked down; never retried, since part of
                 the answer may have been generated
           client goes away: the router closes its backend connection, and the backend aborts
                 the request (chapter 08's disconnect handling) so its KV blocks are freed

Every backend is probed on GET /health every `health_interval` seconds: one marked down is taken
back when it answers 200; a healthy one that misses `max_missed_probes` probes in a row (a hung
process) is marked down and its requests in flight fail with a clear error, so nothing waits
on a replica that will never answer. With no healthy backend a request gets 503 at once, never
a hang.
At startup every backend must answer GET /v1/models like an OpenAI server, or the router
refuses to start and says which URL is wrong.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Optional, Sequence

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, \
    generate_latest
from starlette.concurrency import run_in_threadpool

from .api_server import MAX_BODY_BYTES, BackgroundApp, BodySizeLimit
from .protocol import error_body
from .routing import Backend, affinity_key, make_policy

FORWARDED_HEADERS = ("content-type", "authorization", "accept")


def check_backend(url: str, timeout: float = 5.0) -> list:
    """The model ids a backend serves, read from its GET /v1/models; a ValueError naming the
    URL when it is not an OpenAI-compatible server (or does not answer in `timeout` s)."""
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", timeout=timeout)
        data = r.json()["data"]
        ids = [m["id"] for m in data]
    except httpx.HTTPError as e:
        raise ValueError(f"backend {url} does not answer ({type(e).__name__}: {e}); start it "
                         "first, or fix the --backend URL") from None
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"backend {url} answered GET /v1/models with HTTP {r.status_code} but "
                         "not an OpenAI model list; --backend must point at a minillm (or "
                         "other OpenAI-compatible) server, e.g. http://127.0.0.1:8001") from None
    if r.status_code != 200 or not ids:
        raise ValueError(f"backend {url} lists no models (HTTP {r.status_code}); it is not a "
                         "usable OpenAI-compatible server")
    return ids


class RouterMetrics:
    """Prometheus counters and gauges of the router (its own registry)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("router_requests", "requests sent to a backend", ["backend"],
                                registry=self.registry)
        self.failures = Counter("router_backend_failures", "transport failures", ["backend"],
                                registry=self.registry)
        self.up = Gauge("router_backend_up", "1 while the backend is healthy", ["backend"],
                        registry=self.registry)
        self.outstanding = Gauge("router_backend_outstanding", "requests in flight",
                                 ["backend"], registry=self.registry)
        self.fallbacks = Gauge("router_affinity_fallbacks", "requests sent away from their "
                               "prefix owner because it was loaded", registry=self.registry)

    def text(self, backends: Sequence[Backend], fallbacks: int) -> bytes:
        for b in backends:
            self.up.labels(b.url).set(1 if b.healthy else 0)
            self.outstanding.labels(b.url).set(b.outstanding)
        self.fallbacks.set(fallbacks)
        return generate_latest(self.registry)


class Router:
    """Backends, a policy, and the relay of one request (the FastAPI app is `build_router`)."""

    def __init__(self, urls: Sequence[str], policy: str = "round_robin", tokenizer=None,
                 block_size: int = 16, affinity_blocks: int = 4, health_interval: float = 1.0,
                 request_timeout: float = 600.0, max_missed_probes: int = 3,
                 probe_timeout: float = 5.0, **policy_kwargs):
        if not urls:
            raise ValueError("the router needs at least one backend: pass --backend URL (once "
                             "per replica)")
        urls = [u.rstrip("/") for u in urls]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a backend is listed twice in {urls}; list each replica once")
        if policy == "prefix_affinity" and tokenizer is None:
            raise ValueError("prefix_affinity hashes the prompt's tokens and needs a tokenizer "
                             "(--tokenizer MODEL, the backends' model)")
        self.backends = [Backend(u) for u in urls]
        self.policy = make_policy(policy, urls, **policy_kwargs)
        self.tokenizer, self.block_size = tokenizer, block_size
        self.affinity_blocks = affinity_blocks
        self.health_interval, self.request_timeout = health_interval, request_timeout
        self.max_missed_probes, self.probe_timeout = max_missed_probes, probe_timeout
        self.metrics = RouterMetrics()
        self.client: Optional[httpx.AsyncClient] = None

    # --- choosing ---------------------------------------------------------------------------
    def prompt_ids(self, body: dict) -> list:
        """The token ids the backend's prefix cache will see (chat: the template applied)."""
        tok = self.tokenizer
        if "messages" in body:
            text = tok.apply_chat_template(body["messages"], tokenize=False,
                                           add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False)
        prompt = body.get("prompt", "")
        if isinstance(prompt, list):                       # token ids, or a list of prompts
            prompt = prompt[0] if prompt and not isinstance(prompt[0], int) else prompt
        return list(prompt) if isinstance(prompt, list) else tok.encode(str(prompt))

    def key_of(self, body: dict) -> Optional[int]:
        if self.policy.name != "prefix_affinity":
            return None
        try:
            ids = self.prompt_ids(body)
        except Exception:          # noqa: BLE001 - malformed: the backend will say what is wrong
            return None
        return affinity_key(ids, self.block_size, self.affinity_blocks, body.get("cache_salt"))

    def pick(self, key: Optional[int], exclude: set) -> Optional[Backend]:
        candidates = [b for b in self.backends if b.url not in exclude]
        return self.policy.choose(candidates, key) if candidates else None

    def mark_down(self, backend: Backend, exc: Exception) -> None:
        backend.healthy = False
        backend.failures += 1
        backend.last_error = f"{type(exc).__name__}: {exc}"
        self.metrics.failures.labels(backend.url).inc()

    def no_backend(self) -> JSONResponse:
        down = ", ".join(f"{b.url} ({b.last_error or 'down'})" for b in self.backends)
        return JSONResponse(error_body(f"no healthy backend to serve this request; all "
                                       f"{len(self.backends)} are down: {down}",
                                       type="service_unavailable", code="no_backend"),
                            status_code=503, headers={"Retry-After": "1"})

    # --- relaying ---------------------------------------------------------------------------
    async def forward(self, path: str, request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return JSONResponse(error_body(f"the request body is not a JSON object ({e})"),
                                status_code=400)
        key = await run_in_threadpool(self.key_of, body)   # tokenising: off the event loop
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        tried: set = set()
        while True:
            backend = self.pick(key, tried)
            if backend is None:
                return self.no_backend()
            backend.outstanding += 1
            try:
                req = self.client.build_request("POST", backend.url + path, content=raw,
                                                headers=headers)
                resp = await self._watched(self.client.send(req, stream=True), backend)
                break
            except httpx.TransportError as e:      # no answer yet: the client saw nothing,
                backend.outstanding -= 1           # so another replica may take it
                self.mark_down(backend, e)
                tried.add(backend.url)
        self.metrics.requests.labels(backend.url).inc()
        if body.get("stream") and resp.status_code == 200:
            return StreamingResponse(self._relay(resp, backend), status_code=resp.status_code,
                                     media_type=resp.headers.get("content-type"))
        return await self._whole(resp, backend, request)

    async def _watched(self, awaitable, backend: Backend):
        """Await a backend operation, giving up (ReadTimeout) if the backend is marked down
        meanwhile (the health probes found it hung)."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    return task.result()
                if not backend.healthy:
                    raise httpx.ReadTimeout("the backend stopped answering its health probes")
        finally:
            if not task.done():
                task.cancel()

    async def _relay(self, resp: httpx.Response, backend: Backend):
        """Chunks as they come; a dead (or hung, see probe) backend becomes an error event."""
        chunks, pending = resp.aiter_raw(), None
        try:
            while True:
                # one read in flight at a time, never cancelled while the backend is healthy
                # (cancelling a read would end the stream): silence only checks the probes
                pending = pending or asyncio.ensure_future(anext(chunks))
                done, _ = await asyncio.wait({pending}, timeout=self.health_interval)
                if not done:
                    if not backend.healthy:
                        raise httpx.ReadTimeout("the backend stopped answering its health "
                                                "probes")
                    continue
                try:
                    chunk = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                yield chunk
        except httpx.TransportError as e:
            self.mark_down(backend, e)
            err = error_body(f"backend {backend.url} failed mid-stream ({type(e).__name__}); "
                             "the answer is incomplete; retry the request",
                             type="backend_error", code="backend_failed")
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:                   # also when the client went away: closing aborts upstream
            if pending is not None and not pending.done():
                pending.cancel()
            backend.outstanding -= 1
            backend.served += 1
            with anyio.CancelScope(shield=True):     # runs even while being cancelled
                await resp.aclose()

    async def _whole(self, resp: httpx.Response, backend: Backend, request: Request):
        """A non-streamed answer, read while watching for the client leaving."""
        read = asyncio.ensure_future(resp.aread())
        try:
            while not read.done():
                await asyncio.wait({read}, timeout=0.25)
                if not read.done() and await request.is_disconnected():
                    read.cancel()                  # closing the connection aborts upstream
                    return Response(status_code=499)
                if not read.done() and not backend.healthy:
                    read.cancel()
                    raise httpx.ReadTimeout("the backend stopped answering its health probes")
            content = read.result()
        except httpx.TransportError as e:
            self.mark_down(backend, e)
            return JSONResponse(error_body(f"backend {backend.url} failed before answering in "
                                           f"full ({type(e).__name__}); retry the request",
                                           type="backend_error", code="backend_failed"),
                                status_code=502)
        finally:
            backend.outstanding -= 1
            backend.served += 1
            with anyio.CancelScope(shield=True):
                await resp.aclose()
        keep = {k: v for k, v in resp.headers.items() if k.lower() == "content-type"}
        return Response(content, status_code=resp.status_code, headers=keep)

    # --- health -----------------------------------------------------------------------------
    async def probe(self) -> None:
        """GET /health on every backend (all at once, `probe_timeout` s each). A backend marked
        down that answers 200 is taken back; a healthy one that misses `max_missed_probes`
        probes in a row (hung) is marked down, and its requests in flight fail with a clear
        error instead of waiting for it. A busy replica answers /health from its event loop
        while its engine thread computes, so the default 3 x 5 s leaves a wide margin: under
        load a 1 s timeout took healthy replicas out mid-stream (measured with
        benchmarks/bench_router.py)."""
        async def one(b: Backend) -> None:
            try:
                ok = (await self.client.get(b.url + "/health",
                                            timeout=self.probe_timeout)).status_code == 200
            except httpx.HTTPError as e:
                ok, b.last_error = False, f"health probe: {type(e).__name__}"
            b.missed = 0 if ok else b.missed + 1
            if ok and not b.healthy:
                b.healthy = True
            elif b.healthy and b.missed >= self.max_missed_probes:
                b.healthy = False
                b.failures += 1
        await asyncio.gather(*(one(b) for b in self.backends))

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.probe()

    async def models(self):
        """The first healthy backend's model list (all replicas serve the same model)."""
        for b in self.backends:
            if not b.healthy:
                continue
            try:
                r = await self.client.get(b.url + "/v1/models", timeout=5.0)
                return JSONResponse(r.json(), status_code=r.status_code)
            except (httpx.HTTPError, ValueError) as e:
                self.mark_down(b, e)
        return self.no_backend()

    def state(self) -> dict:
        return {"policy": self.policy.name, "fallbacks": getattr(self.policy, "fallbacks", 0),
                "backends": [vars(b).copy() for b in self.backends]}


def build_router(router: Router, max_body_bytes: Optional[int] = None) -> FastAPI:
    """The FastAPI app of `router`: the OpenAI routes relayed, /health, /metrics, /router/state."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        router.client = httpx.AsyncClient(timeout=httpx.Timeout(router.request_timeout,
                                                                connect=2.0))
        task = asyncio.create_task(router.health_loop())
        yield
        task.cancel()
        await router.client.aclose()

    app = FastAPI(title="minillm router", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes or MAX_BODY_BYTES)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.forward("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models():
        return await router.models()

    @app.get("/health")
    async def health():
        up = sum(b.healthy for b in router.backends)
        return JSONResponse({"status": "ok" if up else "no healthy backend", "healthy": up,
                             "backends": len(router.backends)}, status_code=200 if up else 503)

    @app.get("/router/state")
    async def state():
        return router.state()

    @app.get("/metrics")
    async def metrics():
        text = router.metrics.text(router.backends, router.state()["fallbacks"])
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app


class BackgroundRouter(BackgroundApp):
    """The router in a thread of this process on a free loopback port (tests, notebooks)."""

    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning"):
        super().__init__(build_router(router), host, port, 1.0, log_level)
        self.router = router


__all__ = ["Router", "build_router", "check_backend", "BackgroundRouter", "RouterMetrics"]
