"""Server admission that one request cannot stall (issue 17 item 2), over loopback, bounded.

A server runs in a thread of the test process (BackgroundServer). Where a test needs a request
to be still running after a few hundred milliseconds, the tiny model's engine steps are slowed by
a fixed sleep (`slow_steps`), so the timings do not depend on how fast this machine is. Every
server is stopped by its `with` block; every client has a timeout.

    finding (issue 17)                                  test
    --------------------------------------------------  -----------------------------------------
    a 10 MB body freezes every stream and /health        test_10mb_body_is_413_and_stalls_nothing
    (then a 400) and keeps ~700 MB                       test_chunked_oversized_body_is_413
    a huge prompt is tokenised before any length check   test_prompt_over_the_character_cap_...
    default max_tokens > the pool: the openai client's   test_default_chat_request_fits_the_pool
    default chat request is a 400; /v1/models lies       test_default_chat_on_the_default_cpu_pool
    a non-streaming client that leaves is never aborted  test_non_streaming_disconnect_is_aborted..
    lone surrogates: plain-text 500; 404/405/nested/     test_errors_are_all_in_the_openai_shape
    invalid UTF-8 answer {"detail": ...}; no catch-all   test_a_crash_is_a_500_in_the_openai_shape
"""
import json
import threading
import time

import httpx
import openai
import pytest
from tiny import tiny_model

import minillm
from minillm.engine import LLMEngine
from minillm.loader import _bundled_tokenizer
from minillm.serve.api_server import BackgroundServer

MODEL = "tiny-test"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return _bundled_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def slow_steps(engine, seconds: float):
    """Each engine step takes at least `seconds` (a stand-in for a bigger model)."""
    step = engine.step_outputs

    def slow():
        time.sleep(seconds)
        return step()
    engine.step_outputs = slow
    return engine


def error_of(r: httpx.Response, status: int) -> dict:
    """The OpenAI error object of a response, checking its status and shape."""
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.text[:300]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"], err
    return err


def wait_free(engine, timeout: float) -> float:
    """Seconds until the engine has nothing left and every block is free (or AssertionError)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (not engine.has_unfinished()
                and engine.block_manager.num_free_blocks == engine.num_kv_blocks):
            return time.monotonic() - t0
        time.sleep(0.01)
    raise AssertionError(f"the request still runs {timeout} s after its client left")


def stream_gaps(base_url: str, body: dict, out: dict) -> None:
    """Stream a completion; out["gaps"] = seconds between consecutive chunks."""
    gaps, last = [], None
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", base_url + "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    out.setdefault("first", threading.Event()).set()
    out["gaps"] = gaps


# --- a large body -----------------------------------------------------------------------------
def test_10mb_body_is_413_and_stalls_nothing(model, tok):
    """A 10 MB prompt while a stream runs: 413 in the OpenAI shape, and the stream's longest gap
    and every /health answer stay under a second (on main: a 400 after seconds of frozen
    event loop, the body parsed and tokenised first)."""
    eng = slow_steps(LLMEngine(model, tok, num_kv_blocks=64), 0.02)
    with BackgroundServer(eng, MODEL) as srv:
        out = {"first": threading.Event()}
        body = {"model": MODEL, "prompt": "steady", "max_tokens": 200, "ignore_eos": True,
                "temperature": 0}
        t = threading.Thread(target=stream_gaps, args=(srv.base_url, body, out), daemon=True)
        t.start()
        assert out["first"].wait(30)
        big = json.dumps({"model": MODEL, "prompt": "word " * 2_000_000}).encode()  # 10 MB
        result = {}

        def post_big():
            with httpx.Client(timeout=60) as h:
                result["r"] = h.post(srv.base_url + "/v1/completions", content=big,
                                     headers={"content-type": "application/json"})
        health, posted = [], threading.Event()

        def poll_health():                        # from before the upload until its answer
            with httpx.Client(timeout=30) as h:
                while not posted.is_set() or not health:
                    t0 = time.monotonic()
                    assert h.get(srv.base_url + "/health").status_code == 200
                    health.append(time.monotonic() - t0)
                    time.sleep(0.02)
        hp = threading.Thread(target=poll_health, daemon=True)
        hp.start()
        post_big()
        posted.set()
        hp.join(60)
        t.join(60)
        err = error_of(result["r"], 413)
        assert "--max-request-body-bytes" in err["message"]
    assert max(health) < 1.0, f"/health took {max(health):.2f} s"
    assert max(out["gaps"]) < 1.0, f"the stream stalled {max(out['gaps']):.2f} s"


def test_chunked_oversized_body_is_413(model, tok):
    """Without Content-Length the limit applies to the bytes read; a body under it is served."""
    with BackgroundServer(LLMEngine(model, tok, num_kv_blocks=64), MODEL,
                          max_body_bytes=100_000) as srv:
        def chunks():
            yield b'{"model": "tiny-test", "prompt": "'
            for _ in range(40):
                yield b"x" * 8192
            yield b'"}'
        with httpx.Client(timeout=30) as h:
            err = error_of(h.post(srv.base_url + "/v1/completions", content=chunks(),
                                  headers={"content-type": "application/json"}), 413)
            assert "100000" in err["message"]
            ok = h.post(srv.base_url + "/v1/completions",
                        json={"model": MODEL, "prompt": "small", "max_tokens": 2})
            assert ok.status_code == 200, ok.text


def test_prompt_over_the_character_cap_is_refused_before_tokenising(model, tok):
    """A prompt with more characters than max_model_len tokens could ever hold is a 400 that
    says so, for a completion and a chat; the tokenizer is never called for it."""
    eng = LLMEngine(model, tok, num_kv_blocks=64)
    calls = []
    encode = eng.encode
    eng.encode = lambda p: (calls.append(len(p)), encode(p))[1]
    with BackgroundServer(eng, MODEL) as srv:
        cap = srv.app.state.serving.max_prompt_chars
        assert 256 <= cap <= 256 * 200
        long = "a" * (cap + 1)
        with httpx.Client(timeout=30) as h:
            err = error_of(h.post(srv.base_url + "/v1/completions",
                                  json={"model": MODEL, "prompt": long}), 400)
            assert "characters" in err["message"] and err["param"] == "prompt"
            err = error_of(h.post(srv.base_url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": long}]}), 400)
            assert "characters" in err["message"] and err["param"] == "messages"
    assert calls == []


# --- the default max_tokens and max_model_len -------------------------------------------------
def test_default_chat_request_fits_the_pool(model, tok):
    """A pool (128 tokens) smaller than the context (256): /v1/models says 128, and a chat
    request without max_tokens (the openai client's default) runs to that length instead of
    being a 400 for wanting 256 - prompt tokens."""
    eng = LLMEngine(model, tok, num_kv_blocks=8, block_size=16)
    with BackgroundServer(eng, MODEL) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0,
                          timeout=60)
        [m] = httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"]
        assert m["max_model_len"] == 128
        r = c.chat.completions.create(model=MODEL, temperature=0,
                                      messages=[{"role": "user", "content": "Tell a story."}],
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length"
        assert r.usage.total_tokens == 128
        done = c.completions.create(model=MODEL, prompt="x " * 120, temperature=0,
                                    extra_body={"ignore_eos": True})   # default 16, capped
        assert done.usage.total_tokens <= 128


def test_default_chat_on_the_default_cpu_pool():
    """The bundled model with the default CPU pool sizing: the openai client's default chat
    request (no max_tokens) succeeds, and max_model_len is what the pool holds."""
    model, tok = minillm.load_model("smollm2-135m", device="cpu")
    eng = LLMEngine(model, tok)                              # the server's default pool sizing
    pool = eng.num_kv_blocks * eng.block_size
    with BackgroundServer(eng, "smollm2-135m") as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0,
                          timeout=120)
        [m] = c.models.list().data
        assert m.model_extra["max_model_len"] == min(pool, model.config.max_position_embeddings)
        r = c.chat.completions.create(model="smollm2-135m", temperature=0,
                                      messages=[{"role": "user", "content": "Name a colour."}])
    assert r.choices[0].message.content.strip()
    assert r.usage.total_tokens <= pool


# --- a client that leaves ---------------------------------------------------------------------
def test_non_streaming_disconnect_is_aborted_within_a_second(model, tok):
    """A non-streaming client gives up after 0.5 s while tokens flow every step: its request is
    aborted and its blocks freed within a second (on main it ran all 200 steps)."""
    eng = slow_steps(LLMEngine(model, tok, num_kv_blocks=64), 0.02)   # 200 steps: >= 4 s
    with BackgroundServer(eng, MODEL) as srv:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 200, "ignore_eos": True}
        with httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as h:
            with pytest.raises(httpx.ReadTimeout):
                h.post(srv.base_url + "/v1/completions", json=body)
        assert eng.has_unfinished()                          # still running when it left
        assert wait_free(eng, 3.0) < 1.0
        out = srv.aengine.recent
        assert [o.finish_reason for o in out.values()] == ["abort"]


# --- every error in the OpenAI shape ----------------------------------------------------------
def test_errors_are_all_in_the_openai_shape(model, tok):
    with BackgroundServer(LLMEngine(model, tok, num_kv_blocks=64), MODEL) as srv, \
            httpx.Client(timeout=30) as h:
        url = srv.base_url
        post = dict(headers={"content-type": "application/json"})
        for path, field in [("/v1/completions", '"prompt": "ab\\ud800cd"'),
                            ("/v1/chat/completions",
                             '"messages": [{"role": "user", "content": "ab\\udfffcd"}]')]:
            raw = ('{"model": "%s", %s}' % (MODEL, field)).encode()
            err = error_of(h.post(url + path, content=raw, **post), 400)
            assert "surrogate" in err["message"], err
        err = error_of(h.post(url + "/v1/completions", **post,
                              content=b'{"model": "tiny-test", "prompt": "\xff\xfe"}'), 400)
        assert "UTF-8" in err["message"]
        nested = b'{"model": "tiny-test", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        error_of(h.post(url + "/v1/completions", content=nested, **post), 400)
        err = error_of(h.get(url + "/v1/nothing"), 404)
        assert "/v1/completions" in err["message"]
        err = error_of(h.get(url + "/v1/completions"), 405)
        assert "GET" in err["message"]
        err = error_of(h.post(url + "/v1/completions", json={"model": MODEL}), 400)   # 422
        assert err["param"] == "prompt"
        ok = h.post(url + "/v1/completions", json={"model": MODEL, "prompt": "ok",
                                                   "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_a_crash_is_a_500_in_the_openai_shape(model, tok):
    with BackgroundServer(LLMEngine(model, tok, num_kv_blocks=64), MODEL) as srv:
        def broken():
            raise RuntimeError("a bug")
        srv.app.state.serving.models = broken
        with httpx.Client(timeout=30) as h:
            err = error_of(h.get(srv.base_url + "/v1/models"), 500)
            assert err["type"] == "internal_error" and "RuntimeError" in err["message"]
            assert h.get(srv.base_url + "/health").status_code == 200


# --- the command line -------------------------------------------------------------------------
def test_serve_help_states_the_cpu_step_budget_and_the_body_limit():
    import subprocess
    import sys
    from minillm.serve import cli
    proc = subprocess.run([sys.executable, "-m", "minillm", "serve", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert f"{cli.CPU_MAX_NUM_BATCHED_TOKENS} on the CPU" in text
    assert cli.GAP_AT_CPU_DEFAULT in text and "--max-request-body-bytes" in text
    bad = subprocess.run([sys.executable, "-m", "minillm", "serve", "--port", "0",
                          "--max-request-body-bytes", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--max-request-body-bytes" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
