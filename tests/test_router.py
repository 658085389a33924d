"""The chapter-11 router: policies (pure), then the openai client through a router in front of
two minillm servers (threads of this process, a tiny random model, loopback), and the faults:
a replica that stops, one that dies mid-stream, a client that leaves, URLs that are not servers.
"""
import json
import random
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from tiny import tiny_model

from minillm.cache.prefix import hash_block_tokens
from minillm.engine import LLMEngine
from minillm.loader import _bundled_tokenizer
from minillm.serve.api_server import BackgroundServer
from minillm.serve.router import BackgroundRouter, Router, check_backend
from minillm.serve.routing import (Backend, LeastOutstanding, PrefixAffinity, RoundRobin,
                                   affinity_key, make_policy)

MODEL = "tiny-test"
pytestmark = pytest.mark.usefixtures("one_thread")


# --- policies, no servers ---------------------------------------------------------------------
def backends(n=3):
    return [Backend(f"http://b{i}") for i in range(n)]


def test_round_robin_cycles_and_skips_a_backend_that_is_down():
    bs, rr = backends(), RoundRobin()
    assert [rr.choose(bs).url for _ in range(4)] == ["http://b0", "http://b1", "http://b2",
                                                     "http://b0"]
    bs[1].healthy = False
    assert [rr.choose(bs).url for _ in range(4)] == ["http://b2", "http://b0", "http://b2",
                                                     "http://b0"]
    for b in bs:
        b.healthy = False
    assert rr.choose(bs) is None


def test_least_outstanding_picks_the_idlest_healthy_backend():
    bs = backends()
    bs[0].outstanding, bs[1].outstanding, bs[2].outstanding = 3, 1, 0
    bs[2].healthy = False
    assert LeastOutstanding().choose(bs).url == "http://b1"


def test_affinity_key_is_the_engine_chain_of_the_first_full_blocks():
    ids = list(range(100, 170))                      # 70 tokens: 4 full blocks of 16
    k1 = hash_block_tokens(None, ids[:16])
    k2 = hash_block_tokens(k1, ids[16:32])
    assert affinity_key(ids, 16, 2) == k2
    assert affinity_key(ids[:15], 16, 2) is None                      # no full block
    assert affinity_key(ids, 16, 2) == affinity_key(ids[:32] + [1, 2, 3], 16, 2)  # tail ignored
    assert affinity_key(ids, 16, 2) != affinity_key([7] + ids[1:], 16, 2)
    assert affinity_key(ids, 16, 2, "tenant-a") != affinity_key(ids, 16, 2, "tenant-b")
    with pytest.raises(ValueError, match="affinity_blocks"):
        affinity_key(ids, 16, 0)


def test_affinity_is_sticky_spread_and_moves_only_the_removed_backends_keys():
    bs = backends(3)
    pol = PrefixAffinity([b.url for b in bs], vnodes=64)
    rng = random.Random(0)
    keys = [rng.getrandbits(64) for _ in range(3000)]
    first = {k: pol.choose(bs, k).url for k in keys}
    assert all(pol.choose(bs, k).url == first[k] for k in keys[:200])          # sticky
    share = {u: sum(v == u for v in first.values()) / len(keys) for u in set(first.values())}
    assert len(share) == 3 and all(0.2 < s < 0.47 for s in share.values()), share
    bs[1].healthy = False                                 # b1 leaves: only its keys move
    after = {k: pol.choose(bs, k).url for k in keys}
    moved = [k for k in keys if after[k] != first[k]]
    assert moved and all(first[k] == "http://b1" for k in moved)
    assert all(after[k] != "http://b1" for k in keys)


def test_affinity_falls_back_to_the_least_loaded_when_the_owner_is_overloaded():
    bs = backends(2)
    pol = PrefixAffinity([b.url for b in bs], balance_abs=4, balance_rel=2.0)
    key = 12345
    owner = pol.choose(bs, key)
    other = next(b for b in bs if b is not owner)
    owner.outstanding = 4                                 # not above balance_abs: stays
    assert pol.choose(bs, key) is owner and pol.fallbacks == 0
    owner.outstanding, other.outstanding = 5, 2           # 5 <= 2 * (2 + 1): stays
    assert pol.choose(bs, key) is owner
    other.outstanding = 1                                 # 5 > 2 * (1 + 1): falls back
    assert pol.choose(bs, key) is other and pol.fallbacks == 1
    assert pol.choose(bs, None) is other                  # no key: least loaded


def test_bad_router_configuration_names_the_fix():
    with pytest.raises(ValueError, match="--backend URL"):
        Router([])
    with pytest.raises(ValueError, match="twice"):
        Router(["http://a", "http://a/"])
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("random", ["http://a"])
    with pytest.raises(ValueError, match="tokenizer"):
        Router(["http://a"], "prefix_affinity")


# --- two real servers behind a router -----------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return _bundled_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model(512)


@pytest.fixture()
def replicas(model, tok):
    srvs = [BackgroundServer(LLMEngine(model, tok, num_kv_blocks=128, block_size=16), MODEL)
            for _ in range(2)]
    for s in srvs:
        s.start()
    yield srvs
    for s in srvs:
        s.stop(10)


def routed(replicas, tok, policy, **kw):
    r = Router([s.base_url for s in replicas], policy, tokenizer=tok, health_interval=0.2, **kw)
    return BackgroundRouter(r)


def client_for(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=30)


LONG = "You are a careful assistant who answers briefly. " * 8      # several full blocks


def test_openai_through_the_router_equals_the_backend_streamed_or_not(replicas, tok):
    direct = client_for(replicas[0].base_url)
    want = direct.completions.create(model=MODEL, prompt="Hello there", max_tokens=8,
                                     temperature=0, extra_body={"ignore_eos": True})
    with routed(replicas, tok, "round_robin") as rt:
        c = client_for(rt.base_url)
        got = c.completions.create(model=MODEL, prompt="Hello there", max_tokens=8,
                                   temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.choices[0].text
        chunks = list(c.completions.create(model=MODEL, prompt="Hello there", max_tokens=8,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == \
            want.choices[0].text
        assert chunks[-1].usage.completion_tokens == 8
        chat = c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                         messages=[{"role": "user", "content": "Hi"}])
        assert chat.choices[0].finish_reason in ("length", "stop")
        assert [m.id for m in c.models.list().data] == [MODEL]
        errors = []                                     # the backend's own error passes through
        for client in (direct, c):
            with pytest.raises(openai.APIStatusError) as e:
                client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
            errors.append((e.value.status_code, e.value.body))
        assert errors[0] == errors[1] and "no-such-model" in str(errors[1][1])
        state = httpx.get(rt.base_url + "/router/state").json()
        assert [b["served"] for b in state["backends"]] == [2, 2]      # alternated


def cached_tokens(c, prompt):
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    return r.usage.prompt_tokens_details.cached_tokens


def test_affinity_sends_a_repeated_prefix_to_its_cache_round_robin_does_not(replicas, tok):
    # five system prompts, each used twice (in two rounds): affinity spreads the five over both
    # replicas and sends each second use to its first one's cache; round robin (five is odd)
    # sends every second use to the other replica, which has never seen that prefix.
    with routed(replicas, tok, "prefix_affinity") as rt:
        # the ring depends on the replicas' (random) ports: pick prompts owned 3 + 2
        router, owned = rt.router, {s.base_url: [] for s in replicas}
        for i in range(200):
            text = f"System prompt number {i}: " + LONG
            key = router.key_of({"prompt": text + "Q1?"})
            owned[router.policy.owner(key, router.backends).url].append(text)
        a, b = owned.values()
        systems = a[:3] + b[:2]
        c = client_for(rt.base_url)
        assert [cached_tokens(c, s + "Q1?") for s in systems] == [0] * 5
        assert all(n >= 64 for n in [cached_tokens(c, s + "Q2?") for s in systems])
        served = [b["served"] for b in httpx.get(rt.base_url + "/router/state").json()[
            "backends"]]
        assert min(served) >= 2, served                          # spread, not all on one
    for s in replicas:
        s.aengine.engine.reset_prefix_cache()
    with routed(replicas, tok, "round_robin") as rt:
        c = client_for(rt.base_url)
        assert [cached_tokens(c, s + "Q1?") for s in systems] == [0] * 5
        assert [cached_tokens(c, s + "Q2?") for s in systems] == [0] * 5


def test_a_stopped_replica_is_skipped_then_taken_back_and_none_left_is_a_503(replicas, tok):
    with routed(replicas, tok, "round_robin") as rt:
        c = client_for(rt.base_url)
        url0 = replicas[0].base_url
        replicas[0].stop(10)
        for _ in range(3):                               # connect failures are retried elsewhere
            assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        state = httpx.get(rt.base_url + "/router/state").json()["backends"]
        assert [b["healthy"] for b in state] == [False, True] and state[0]["failures"] >= 1
        replicas[1].stop(10)
        t = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and "no healthy backend" in str(e.value)
        assert time.monotonic() - t < 5
        assert httpx.get(rt.base_url + "/health").status_code == 503
        # a replica on the same port again: the probe takes it back
        port = int(url0.rsplit(":", 1)[1])
        again = BackgroundServer(replicas[0].app.state.engine, MODEL, port=port).start()
        try:
            deadline = time.monotonic() + 5
            while httpx.get(rt.base_url + "/health").status_code != 200:
                assert time.monotonic() < deadline, "the probe never took the replica back"
                time.sleep(0.1)
            assert c.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        finally:
            again.stop(10)


class DyingBackend:
    """A fake replica that answers the model list, then starts an SSE stream and dies."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(65536)
            chunk = {"id": "x", "object": "text_completion", "created": 0, "model": MODEL,
                     "choices": [{"index": 0, "text": "partial", "finish_reason": None}]}
            data = f"data: {json.dumps(chunk)}\n\n".encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n"
                         + f"{len(data):x}\r\n".encode() + data + b"\r\n")
            time.sleep(0.2)
            conn.close()                                  # dies without the final chunk

    def close(self):
        self.sock.close()


def test_a_replica_dying_mid_stream_gives_the_client_an_error_event_and_the_router_lives(tok):
    dying = DyingBackend()
    try:
        with BackgroundRouter(Router([dying.url], "round_robin")) as rt:
            c = client_for(rt.base_url)
            texts = []
            with pytest.raises(openai.APIError, match="failed mid-stream"):
                for ch in c.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                               stream=True):
                    texts.append(ch.choices[0].text)
            assert texts == ["partial"]
            assert httpx.get(rt.base_url + "/router/state").json()["backends"][0]["failures"] \
                == 1
    finally:
        dying.close()


def test_a_client_that_leaves_mid_stream_is_aborted_on_the_backend(replicas, tok):
    with routed(replicas[:1], tok, "round_robin") as rt:
        engine = replicas[0].aengine.engine
        with httpx.stream("POST", rt.base_url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "Count:", "max_tokens": 400,
                                "stream": True, "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    break                                  # one chunk, then hang up
        deadline = time.monotonic() + 5
        while engine.has_unfinished():
            assert time.monotonic() < deadline, "the backend kept generating for a gone client"
            time.sleep(0.05)
        state = httpx.get(rt.base_url + "/router/state").json()["backends"][0]
        assert state["outstanding"] == 0


def test_backend_urls_that_are_not_openai_servers_are_refused_with_the_url():
    with pytest.raises(ValueError, match="does not answer"):
        check_backend("http://127.0.0.1:9", timeout=1)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"

    def answer_html():
        conn, _ = srv.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 13\r\n\r\n"
                     b"<html></html>")
        conn.close()
    threading.Thread(target=answer_html, daemon=True).start()
    try:
        with pytest.raises(ValueError, match=url.replace(".", r"\.") + ".*not an OpenAI"):
            check_backend(url, timeout=5)
    finally:
        srv.close()


def test_the_router_command_without_backends_is_one_line_and_exit_2():
    r = subprocess.run([sys.executable, "-m", "minillm", "router", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--backend URL" in r.stderr and "Traceback" not in r.stderr


class HungBackend:
    """A fake replica that accepts connections and never answers (a stopped process)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns = []
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self):
        for c in self.conns:
            c.close()
        self.sock.close()


def test_a_hung_replica_is_taken_out_and_its_requests_fail_instead_of_hanging():
    hung = HungBackend()
    try:
        with BackgroundRouter(Router([hung.url], "round_robin", health_interval=0.2,
                                     probe_timeout=0.5)) as rt:
            c = client_for(rt.base_url)
            t = time.monotonic()
            with pytest.raises(openai.APIStatusError) as e:      # taken out, nobody left
                c.completions.create(model=MODEL, prompt="x", max_tokens=2)
            assert e.value.status_code == 503 and "health probe" in str(e.value)
            assert time.monotonic() - t < 15
            with pytest.raises(openai.APIStatusError) as e:      # now refused at once
                c.completions.create(model=MODEL, prompt="x", max_tokens=2, timeout=2)
            assert e.value.status_code == 503
            state = httpx.get(rt.base_url + "/router/state").json()["backends"][0]
            assert state["healthy"] is False and state["outstanding"] == 0
    finally:
        hung.close()


class SlowBackend:
    """A fake replica whose stream pauses longer than the router's health interval between
    chunks (a long prefill, a slow CPU) while its /health answers at once."""

    def __init__(self, gap=0.6, chunks=3):
        import http.server

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def do_POST(self):
                self.rfile.read(int(self.headers["content-length"]))
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                for i in range(chunks):
                    time.sleep(gap)
                    chunk = {"id": "x", "object": "text_completion", "created": 0,
                             "model": MODEL, "choices": [{"index": 0, "text": f"t{i}",
                                                          "finish_reason": None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_stream_slower_than_the_health_interval_is_relayed_whole():
    slow = SlowBackend(gap=0.6, chunks=3)
    try:
        with BackgroundRouter(Router([slow.url], "round_robin", health_interval=0.2)) as rt:
            c = client_for(rt.base_url)
            texts = [ch.choices[0].text for ch in c.completions.create(
                model=MODEL, prompt="x", max_tokens=3, stream=True)]
            assert texts == ["t0", "t1", "t2"]
    finally:
        slow.close()
