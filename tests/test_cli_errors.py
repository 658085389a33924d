"""`python -m minillm generate` fails like a command-line tool: one line on stderr, a nonzero
status, no traceback; Ctrl-C exits 130 and a closed pipe ends it quietly. Each case runs the
real command in a subprocess, with a time bound."""
import os
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

import minillm
import minillm.__main__ as cli

CMD = [sys.executable, "-m", "minillm", "generate"]
# random weights with the bundled tokenizer: text that goes on for thousands of tokens
ENDLESS = ["Tell me a story", "--weights", "random", "--raw", "--max-tokens", "4000",
           "--device", "cpu"]


def run(*args, timeout=120):
    return subprocess.run(CMD + list(args), capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(proc, status, *words):
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


UNAVAILABLE_CUDA = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


@pytest.mark.parametrize("args, words", [
    (["--device", "bogus"], ["unknown device 'bogus'", "cpu"]),
    (["--device", UNAVAILABLE_CUDA], ["not available", "use '"]),
    (["--temperature", "nan"], ["temperature"]),
    (["--max-tokens", "0"], ["max_tokens"]),
])
def test_bad_arguments_are_one_line(args, words):
    assert_one_line_error(run("hi", *args), 2, *words)


def test_random_weights_for_a_large_preset_fail_before_building_it():
    start = time.monotonic()
    proc = run("hi", "--model", "llama-3-70b", "--weights", "random", "--device", "cpu")
    assert_one_line_error(proc, 2, "llama-3-70b has no tokenizer", "--model smollm2-135m")
    # building 70B parameters in float32 would need ~280 GB: failing fast proves it was not
    assert time.monotonic() - start < 60


def test_tiny_temperature_is_greedy_not_a_crash():
    proc = run("What is 2+2?", "--temperature", "1e-39", "--max-tokens", "6", "--device", "cpu")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    model, tok = minillm.load_model("smollm2-135m", device="cpu")
    ids = cli.prompt_ids(tok, "What is 2+2?")
    greedy = [t for t in minillm.generate(model, tok, ids, max_new_tokens=6)
              if t != tok.eos_token_id]
    assert proc.stdout == tok.decode(greedy, skip_special_tokens=True) + "\n"


def _start_endless():
    # SIGINT at its default, as under a terminal: a test run started in the background of a
    # non-interactive shell inherits it as ignored, and Ctrl-C could not reach the command
    proc = subprocess.Popen(CMD + ENDLESS, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    ready, _, _ = select.select([proc.stdout], [], [], 120)     # wait for the first text
    if not ready:
        proc.kill()
        pytest.fail("the command printed nothing within 120 s")
    return proc, os.read(proc.stdout.fileno(), 20)


def test_ctrl_c_exits_130_quietly():
    proc, first = _start_endless()
    assert first
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("Ctrl-C did not stop the command within 60 s")
    assert proc.returncode == 130, err
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err and not err.strip()


def test_a_closed_pipe_ends_quietly():
    """Like `python -m minillm generate ... | head -c 20`: the reader closes after 20 bytes."""
    proc, first = _start_endless()
    proc.stdout.close()
    try:
        err = proc.stderr.read()
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the command kept running after its reader went away")
    assert proc.returncode == 141, err
    assert err == b"", err                       # no traceback, no "Exception ignored"


def test_unexpected_errors_are_one_line_too(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")
        yield

    monkeypatch.setattr(cli, "generate_stream", broken)
    monkeypatch.delenv("MINILLM_DEBUG", raising=False)
    assert cli.main(["generate", "hi", "--max-tokens", "2", "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: RuntimeError: injected failure (set MINILLM_DEBUG=1 for the traceback)"]
    monkeypatch.setenv("MINILLM_DEBUG", "1")
    with pytest.raises(RuntimeError, match="injected failure"):
        cli.main(["generate", "hi", "--max-tokens", "2", "--device", "cpu"])
