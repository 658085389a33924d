"""`python -m minillm generate` streams the same tokens `minillm.generate` returns."""
import subprocess
import sys

import minillm
from minillm.__main__ import main, prompt_ids


def test_cli_streams_the_greedy_reply(capsys):
    model, tok = minillm.load_model("smollm2-135m", device="cpu")
    ids = prompt_ids(tok, "What is the capital of France?")
    assert tok.decode(ids).startswith("<|im_start|>")           # the chat template was applied
    expected = minillm.generate(model, tok, ids, max_new_tokens=12)
    expected = [t for t in expected if t != tok.eos_token_id]
    assert main(["generate", "What is the capital of France?", "--max-tokens", "12",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out == tok.decode(expected, skip_special_tokens=True) + "\n"
    assert "Paris" in out


def test_cli_reports_bad_input_without_a_traceback():
    proc = subprocess.run([sys.executable, "-m", "minillm", "generate", "hi", "--model", "gpt-9"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown model 'gpt-9'" in proc.stderr and "smollm2-135m" in proc.stderr
    assert "Traceback" not in proc.stderr
