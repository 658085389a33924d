"""`make test-clients`: third-party clients against `python -m minillm serve`, offline.

Runs with minillm's own Python; the clients live in their own venv (--clients-python). Starts
the server on a free loopback port, runs every client (each bounded in time), prints a
client x feature table, writes it as JSON (--report) and stops the server (SIGTERM, then kill).
Exit status 1 if any check failed.

    clients              how                                    what is checked
    openai               check_openai.py                        every issue-19 feature
    langchain-openai     check_langchain.py                     invoke, stream+usage, batch, n,
                                                                with_structured_output
    litellm              check_litellm.py                       completion, stream, n, text
    llm (CLI)            `llm -m ...` with extra-openai-models  chat, completion, json_object,
                                                                --schema
    guidellm             `guidellm run` synchronous, concurrent every request succeeds; TTFT/ITL
    lm-eval              local-completions (batch 4) and        generate_until and
                         local-chat-completions                 multiple_choice tasks in tasks/
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODEL = "smollm2-135m"
RECORD = {"lm_eval": {}, "guidellm": {}}     # the numbers the report keeps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_env(extra: dict) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
           "OPENAI_API_KEY": "none", "TOKENIZERS_PARALLELISM": "false", **extra}
    return env


class Server:
    """`python -m minillm serve` in a subprocess; stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, port: int, log: Path):
        self.port, self.log = port, log
        self.proc = None

    def __enter__(self):
        self.logf = open(self.log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minillm", "serve", "--model", MODEL, "--port",
             str(self.port), "--max-num-seqs", "16", "--log-level", "warning"],
            cwd=ROOT, stdout=self.logf, stderr=subprocess.STDOUT, env=offline_env({}))
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited; see {self.log}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not become healthy in 180 s")

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.logf.close()


def run(cmd: list, env: dict, timeout: float, cwd=ROOT) -> tuple:
    """(returncode, stdout, stderr) of a bounded subprocess (its whole group killed on timeout)."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return 124, out, err + f"\n(timed out after {timeout} s)"
    return p.returncode, out, err


def python_checks(py: str, env: dict, script: str, timeout: float) -> list:
    rc, out, err = run([py, str(HERE / script)], env, timeout, cwd=HERE)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if rc != 0 or not rows:
        rows.append({"client": script, "feature": "runs", "ok": False,
                     "detail": f"exit {rc}: {err.strip()[-300:]}"})
    return rows


def llm_cli_checks(bindir: Path, env: dict, base: str, tmp: Path) -> list:
    """Simon Willison's `llm` CLI with the server registered in extra-openai-models.yaml."""
    home = tmp / "llm-home"
    home.mkdir()
    (home / "keys.json").write_text('{"minillm": "none"}')
    (home / "extra-openai-models.yaml").write_text(
        f'- model_id: minillm\n  model_name: {MODEL}\n  api_base: "{base}/v1"\n'
        f'  api_key_name: minillm\n  supports_schema: true\n'
        f'- model_id: minillm-completion\n  model_name: {MODEL}\n  api_base: "{base}/v1"\n'
        f'  api_key_name: minillm\n  completion: true\n')
    env = {**env, "LLM_USER_PATH": str(home)}
    llm = str(bindir / "llm")

    def ok_json(text: str, keys=()) -> bool:
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        return isinstance(obj, dict) and all(k in obj for k in keys)

    cases = [("chat, streamed", [llm, "-m", "minillm", "Say hi", "-o", "max_tokens", "8"],
              lambda t: bool(t.strip())),
             ("chat, --no-stream", [llm, "-m", "minillm", "--no-stream", "Say hi", "-o",
                                   "max_tokens", "8"], lambda t: bool(t.strip())),
             ("completion model", [llm, "-m", "minillm-completion", "The capital of France is",
                                   "-o", "temperature", "0", "-o", "max_tokens", "4"],
              lambda t: "Paris" in t),
             ("-o json_object", [llm, "-m", "minillm", "-o", "json_object", "1", "Reply in JSON",
                                 "-o", "max_tokens", "40"], lambda t: t.lstrip().startswith("{")),
             ("--schema (json_schema)", [llm, "-m", "minillm", "--schema",
                                         "city str, population int", "Name a city", "-o",
                                         "max_tokens", "80"],
              lambda t: ok_json(t, ("city", "population")))]
    rows = []
    for feature, cmd, good in cases:
        rc, out, err = run(cmd, env, 120)
        rows.append({"client": "llm", "feature": feature, "ok": rc == 0 and good(out),
                     "detail": (out.strip() or err.strip())[-200:]})
    return rows


def guidellm_checks(bindir: Path, env: dict, base: str, tokdir: Path, tmp: Path) -> list:
    """guidellm's default (streaming chat) backend: a synchronous and a concurrent run; every
    request must succeed and TTFT / ITL be reported."""
    rows = []
    for name, profile, count in [("synchronous, 6 requests", "kind=synchronous", 6),
                                 ("concurrent x4, 12 requests", "kind=concurrent,streams=4", 12)]:
        out = tmp / f"guidellm-{profile.split(',')[0][5:]}.json"
        rc, so, err = run([str(bindir / "guidellm"), "run",
                           "--backend", f"kind=openai_http,target={base},model={MODEL}",
                           "--profile", profile, "--constraint", f"kind=max_requests,count={count}",
                           "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=32",
                           "--tokenizer", f"kind=huggingface_auto,model={tokdir}",
                           "--output", f"kind=json,path={out}", "--disable-console-interactive"],
                          env, 240)
        try:
            m = json.loads(out.read_text())["benchmarks"][0]["metrics"]
            tot = m["request_totals"]
            ttft = m["time_to_first_token_ms"]["successful"]
            itl = m["inter_token_latency_ms"]["successful"]
            RECORD["guidellm"][name] = {
                "successful": tot["successful"], "errored": tot["errored"],
                "ttft_ms_median": ttft["median"], "itl_ms_median": itl["median"],
                "output_tokens_per_s": m["output_tokens_per_second"]["successful"]["mean"]}
            good = (tot["successful"] == count and tot["errored"] == 0
                    and ttft["count"] == count and itl["count"] >= count)
            detail = (f"exit {rc}, {tot['successful']}/{tot['total']} ok ({ttft['count']} TTFT, "
                      f"{itl['count']} ITL samples), TTFT median "
                      f"{ttft['median']:.0f} ms, ITL median {itl['median']:.0f} ms, output "
                      f"{m['output_tokens_per_second']['successful']['mean']:.1f} tok/s")
        except Exception as e:                 # noqa: BLE001 - reported
            good, detail = False, f"exit {rc}: {type(e).__name__}: {e}; {err.strip()[-200:]}"
        rows.append({"client": "guidellm", "feature": name, "ok": rc == 0 and good,
                     "detail": detail})
    return rows


def lm_eval_checks(bindir: Path, env: dict, base: str, tmp: Path) -> list:
    """lm-eval's local-completions (loglikelihood for multiple_choice: echo + logprobs on
    token-id prompts in batches of 4; generate_until) and local-chat-completions."""
    rows = []
    runs = [("local-completions: minillm_mc (multiple_choice, batch 4) + minillm_gen",
             ["--model", "local-completions", "--model_args",
              f"model={MODEL},base_url={base}/v1/completions,num_concurrent=2,max_retries=1,"
              "tokenized_requests=True", "--batch_size", "4",
              "--tasks", "minillm_mc,minillm_gen"]),
            ("local-chat-completions: minillm_gen (generate_until)",
             ["--model", "local-chat-completions", "--model_args",
              f"model={MODEL},base_url={base}/v1/chat/completions,num_concurrent=1,"
              "max_retries=1", "--apply_chat_template", "--tasks", "minillm_gen"])]
    for i, (name, args) in enumerate(runs):
        out = tmp / f"lm-eval-{i}"
        rc, so, err = run([str(bindir / "lm_eval"), *args, "--include_path",
                           str(HERE / "tasks"), "--output_path", str(out), "--log_samples"],
                          env, 300)
        try:
            res = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
            samples = [json.loads(line) for f in out.rglob("samples_*.jsonl")
                       for line in f.read_text().splitlines()]
            answered = all(s["resps"] and s["resps"][0] for s in samples)
            scores = {t: {k: v for k, v in r.items() if k in ("acc,none", "acc_norm,none",
                                                               "exact_match,strip")}
                      for t, r in res.items()}
            RECORD["lm_eval"].update(scores if i == 0 else {f"chat:{t}": v
                                                             for t, v in scores.items()})
            good, detail = answered and bool(samples), f"{len(samples)} docs, {scores}"
        except Exception as e:                 # noqa: BLE001 - reported
            good, detail = False, f"exit {rc}: {type(e).__name__}: {e}; {err.strip()[-200:]}"
        rows.append({"client": "lm-eval", "feature": name, "ok": rc == 0 and good,
                     "detail": detail})
    return rows


def environment() -> dict:
    """Device, date, command, load and versions for the recorded report."""
    import platform
    import torch
    model = next((line.split(":", 1)[1].strip() for line in
                  subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                  if line.startswith("Model name")), platform.processor())
    return {"device": model, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "make test-clients (tests/clients/run_clients.py)",
            "load_average": os.getloadavg(), "torch": torch.__version__}


def table(rows: list) -> str:
    width = max(len(r["feature"]) for r in rows)
    lines = [f"{'client':17} {'feature':{width}} result  detail"]
    for r in rows:
        lines.append(f"{r['client']:17} {r['feature']:{width}} "
                     f"{'works ' if r['ok'] else 'FAILS '}  {r['detail'][:110]}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients-python", required=True, help="python of the clients' venv")
    ap.add_argument("--report", default=None, help="write the rows as JSON here")
    ap.add_argument("--only", default=None, help="comma-separated: openai,langchain,litellm,"
                                                 "llm,guidellm,lm-eval")
    args = ap.parse_args()
    py = Path(args.clients_python).absolute()      # not resolve(): keep the venv
    bindir = py.parent
    only = set(args.only.split(",")) if args.only else None
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="minillm-clients-") as t:
        tmp = Path(t)
        tokdir = tmp / "tokenizer"           # guidellm counts tokens with the model's tokenizer
        from minillm.loader import _bundled_tokenizer
        _bundled_tokenizer().save_pretrained(tokdir)
        env = offline_env({"MINILLM_BASE_URL": base, "MINILLM_MODEL": MODEL})
        with Server(port, tmp / "server.log"):
            def want(name):
                return only is None or name in only
            for name, script in [("openai", "check_openai.py"),
                                 ("langchain", "check_langchain.py"),
                                 ("litellm", "check_litellm.py")]:
                if want(name):
                    rows += python_checks(str(py), env, script, 300)
            if want("llm"):
                rows += llm_cli_checks(bindir, env, base, tmp)
            if want("guidellm"):
                rows += guidellm_checks(bindir, env, base, tokdir, tmp)
            if want("lm-eval"):
                rows += lm_eval_checks(bindir, env, base, tmp)
        if any(not r["ok"] for r in rows):
            print((tmp / "server.log").read_text()[-3000:], file=sys.stderr)
    print(table(rows))
    took = time.monotonic() - started
    print(f"\n{sum(r['ok'] for r in rows)}/{len(rows)} checks work; {took:.0f} s")
    if args.report:
        Path(args.report).write_text(json.dumps({**environment(), "seconds": round(took),
                                                 **RECORD, "rows": rows}, indent=1) + "\n")
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
