"""`python -m minillm serve` as a real process: refuses a port in use, drains on SIGTERM.

One server process (bundled model) for the module. A second `serve` on the same port must fail
fast with a message naming the port, before loading any model. SIGTERM while a stream runs: the
stream still completes in full (finish_reason "length", every token), new connections are
refused, and the process exits 0.
"""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

MODEL = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cmd(port, *extra):
    return [sys.executable, "-m", "minillm", "serve", "--model", MODEL, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", "--num-kv-blocks", "64", *extra]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(serve_cmd(port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("server did not become healthy in 90 s")
        time.sleep(0.2)
    yield proc, port, base
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_second_server_on_the_same_port_is_refused_with_a_clear_message(server):
    _, port, base = server
    t = time.monotonic()
    r = subprocess.run(serve_cmd(port), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert f"port {port}" in r.stderr and "already in use" in r.stderr and "--port" in r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t < 30                  # fails before loading the model
    assert httpx.get(base + "/health", timeout=5).status_code == 200   # the first one is fine


def test_sigterm_finishes_running_stream_then_exits_cleanly(server):
    proc, port, base = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
    chunks, reasons, started = [], [], threading.Event()

    def stream():
        for ch in client.completions.create(model=MODEL, prompt="Tell me a long story:",
                                            max_tokens=48, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True}):
            for c in ch.choices:
                chunks.append(c.text)
                reasons.append(c.finish_reason)
                started.set()
            if ch.usage is not None:
                chunks.append(ch.usage)

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60), "no first chunk"
    proc.send_signal(signal.SIGTERM)
    t.join(60)
    assert not t.is_alive()
    assert [r for r in reasons if r] == ["length"]      # drained, not cut off
    assert chunks[-1].completion_tokens == 48
    assert proc.wait(60) == 0
    with pytest.raises(httpx.TransportError):            # nobody listens any more
        httpx.get(base + "/health", timeout=2)
