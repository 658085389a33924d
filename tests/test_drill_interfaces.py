"""The drill's interfaces: the terminal quiz driven through a pty, spaced review with a fake clock,
the mock interview's report with a fake clock, the Anki export, and bad input."""
import json
import os
import pty
import select
import sqlite3
import sys
import time
import zipfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from minillm import drill
from minillm.drill import anki
from minillm.drill.mock import estimate_score, run_mock
from minillm.drill.quiz import ReviewState, run_quiz, run_review, select as select_questions
from minillm.drill.state import Progress, load_json

ROOT = Path(__file__).resolve().parents[1]


def _env(tmp_path):
    env = dict(os.environ, MINILLM_CACHE=str(tmp_path), PYTHONPATH=str(ROOT))
    env.pop("COLUMNS", None)
    return env


def _drive_pty(argv, answers, env, timeout=60):
    """Run argv on a pseudo-terminal; send the next answer each time a '> ' prompt appears."""
    pid, fd = pty.fork()
    if pid == 0:                                         # child
        os.chdir(ROOT)
        os.execve(sys.executable, [sys.executable] + argv, env)
    out, pending, deadline = b"", list(answers), time.time() + timeout
    try:
        while time.time() < deadline:
            r, _, _ = select.select([fd], [], [], 0.5)
            if fd in r:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:                          # child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
                if out.rstrip(b" ").endswith(b">") and pending:
                    os.write(fd, (pending.pop(0) + "\n").encode())
        else:
            raise AssertionError(f"quiz did not finish within {timeout} s:\n{out.decode()[-2000:]}")
    finally:
        _, status = os.waitpid(pid, 0)
    return out.decode(errors="replace"), os.waitstatus_to_exitcode(status)


def test_terminal_quiz_through_a_pty(tmp_path):
    seed = "7"
    chosen = select_questions(drill.load_bank(kind="choice"), 3, seed)
    right = [q.instance(seed).correct_letter for q in chosen]
    answers = [right[0], "not a letter", right[2]]
    out, rc = _drive_pty(["-m", "minillm.drill", "quiz", "--kind", "choice", "--n", "3",
                          "--seed", seed], answers, _env(tmp_path))
    assert rc == 0, out
    for q in chosen:
        assert q.id in out
    assert "Could not grade 'not a letter': answer with one letter" in out
    assert "Score: 2.00 / 3" in out
    progress = json.loads((tmp_path / "drill" / "progress.json").read_text())
    got = {qid: a[-1]["score"] for qid, a in progress["attempts"].items()}
    assert got == {chosen[0].id: 1.0, chosen[1].id: 0.0, chosen[2].id: 1.0}


def test_quiz_stops_on_quit_and_numeric_feedback_shows_working(tmp_path):
    qs = drill.load_bank(topic="kv_cache", kind="numeric")
    chosen = select_questions(qs, 2, 3)
    inst = chosen[0].instance(3)
    answers = iter([inst.answer.split(" (")[0], "q"])
    out = []
    scores = run_quiz(qs, 2, 3, lambda prompt: next(answers), out.append,
                      Progress(tmp_path / "p.json"))
    text = "\n".join(out)
    assert scores == {chosen[0].id: 1.0}
    assert "Working:" in text and "Stopped early." in text and "Score: 1.00 / 1" in text


def test_corrupt_progress_is_set_aside_not_lost(tmp_path):
    path = tmp_path / "progress.json"
    path.write_text("{ this is not json")
    warnings = []
    p = Progress(path, warn=warnings.append)
    assert p.data == {"attempts": {}}
    aside = [f for f in tmp_path.iterdir() if f.name.startswith("progress.json.corrupt-")]
    assert len(aside) == 1 and aside[0].read_text() == "{ this is not json"
    assert "could not be read" in warnings[0] and str(aside[0]) in warnings[0]
    p.record("kv.formula", 1.0, 0)
    p.save()
    assert json.loads(path.read_text())["attempts"]["kv.formula"][0]["score"] == 1.0
    # the wrong JSON type is corrupt too
    path.write_text("[1, 2]")
    assert load_json(path, {}, warn=warnings.append) == {}
    assert len([f for f in tmp_path.iterdir() if ".corrupt-" in f.name]) == 2


def _cli(argv, tmp_path, monkeypatch, stdin=""):
    """Run `python -m minillm.drill ARGV` in this process (the pty test covers a real terminal)."""
    import io
    from minillm.drill.__main__ import main
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    monkeypatch.chdir(tmp_path)
    return main(argv)


def test_corrupt_progress_through_the_cli_is_reported(tmp_path, monkeypatch, capsys):
    (tmp_path / "drill").mkdir()
    (tmp_path / "drill" / "progress.json").write_text("garbage")
    assert _cli(["quiz", "--n", "1", "--kind", "choice"], tmp_path, monkeypatch, "A\n") == 0
    err = capsys.readouterr().err
    assert "could not be read" in err and "moved to" in err
    assert any(".corrupt-" in f.name for f in (tmp_path / "drill").iterdir())
    assert json.loads((tmp_path / "drill" / "progress.json").read_text())["attempts"]


@pytest.mark.parametrize("args, message", [
    (["quiz", "--topic", "kvcache"], "unknown topic 'kvcache'"),
    (["quiz", "--kind", "essay"], "unknown kind 'essay'"),
    (["quiz", "--n", "0"], "--n must be at least 1"),
    (["export-anki", "deck.txt"], "must end in .apkg"),
    (["mock", "--prompt", "nope"], "unknown design prompt 'nope'"),
])
def test_cli_bad_input_is_a_clear_error(tmp_path, monkeypatch, capsys, args, message):
    assert _cli(args, tmp_path, monkeypatch) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _right_letter(out):
    """The correct letter of the question just printed: its id is on the header line, and a
    never-reviewed card is asked with the seed 'review-new'."""
    header = next(l for l in reversed(out) if l.startswith("\n["))
    inst = drill.get(header.rsplit("· ", 1)[1].strip()).instance("review-new")
    assert inst.prompt == out[-1]
    return inst.correct_letter


def test_review_schedules_with_fsrs_and_a_fake_clock(tmp_path):
    qs = drill.load_bank(kind="choice")[:3]
    now = [datetime(2026, 1, 1, tzinfo=timezone.utc)]
    out = []
    scores = run_review(qs, n=10, new=3, seed=0, input_fn=lambda p: _right_letter(out),
                        output_fn=out.append, state=ReviewState(tmp_path / "review.json"),
                        now=lambda: now[0])
    assert scores == {q.id: 1.0 for q in qs}
    assert set(json.loads((tmp_path / "review.json").read_text())) == {q.id for q in qs}
    # nothing is due a minute later; everything is due a year later
    now[0] += timedelta(minutes=1)
    assert run_review(qs, n=10, new=0, input_fn=lambda p: "A", output_fn=out.append,
                      state=ReviewState(tmp_path / "review.json"), now=lambda: now[0]) == {}
    now[0] += timedelta(days=365)
    again = run_review(qs, n=10, new=0, input_fn=lambda p: "Z", output_fn=out.append,
                       state=ReviewState(tmp_path / "review.json"), now=lambda: now[0])
    assert again == {q.id: 0.0 for q in qs}
    for card in json.loads((tmp_path / "review.json").read_text()).values():
        # a lapse comes back soon
        assert datetime.fromisoformat(card["due"]) - now[0] < timedelta(days=1)


def test_corrupt_review_state_is_set_aside(tmp_path):
    (tmp_path / "review.json").write_text("\x00\x01")
    warnings = []
    state = ReviewState(tmp_path / "review.json", warn=warnings.append)
    assert state.cards == {} and warnings
    assert any(".corrupt-" in f.name for f in tmp_path.iterdir())


def test_anki_export_is_a_deck_with_one_note_per_question(tmp_path):
    path = tmp_path / "drill.apkg"
    qs = drill.load_bank()
    n = anki.export_anki(path, qs)
    assert n == len(qs)
    with zipfile.ZipFile(path) as z:
        z.extract("collection.anki2", tmp_path)
    db = sqlite3.connect(tmp_path / "collection.anki2")
    notes = db.execute("select guid, flds from notes").fetchall()
    cards = db.execute("select count(*) from cards").fetchone()[0]
    decks = json.loads(db.execute("select decks from col").fetchone()[0])
    db.close()
    assert len(notes) == len(qs) == cards
    assert any(d["name"] == "minillm interview drill" for d in decks.values())
    assert {g for g, _ in notes} == {anki.guid_for(q.id) for q in qs}
    ids_in_fields = {f.split("\x1f")[0] for _, f in notes}
    assert ids_in_fields == {q.id for q in qs}
    # a second export keeps the GUIDs, so Anki updates the cards instead of duplicating them
    path2 = tmp_path / "again.apkg"
    anki.export_anki(path2, qs[:5])
    with zipfile.ZipFile(path2) as z:
        z.extract("collection.anki2", tmp_path / "b")
    db = sqlite3.connect(tmp_path / "b" / "collection.anki2")
    assert ({g for (g,) in db.execute("select guid from notes")}
            == {anki.guid_for(q.id) for q in qs[:5]})
    db.close()


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_mock_report_with_a_fake_clock(tmp_path):
    clock = FakeClock()
    # (minutes spent before this line is entered, the line)
    script = [
        (3, "latency or throughput? context lengths? which gpu, model and dtype? qps and p99 slo? "
            "cost? tenants?"), (0, "."),
        (6, "the openai api server streams tokens and puts each request in the scheduler's "
            "waiting queue; the scheduler asks the kv block manager for blocks, the model runner "
            "runs one continuous batching step and the sampler picks the tokens"), (0, "."),
        (2, "200"),                                   # the capacity estimate
        (9, "block table and free list; refcount and copy-on-write fork; admission and preemption; "
            "prefix hash; chunked budget"), (10, "."),
        (5, "run replicas behind a load balancer, tensor parallel inside a node and fp8 "
            "quantization; keep prefix caching on and answer 429 on overload. the trade-off is "
            "latency vs cost"), (0, "."),
        (2, "speculative decoding: a draft proposes tokens, the target verifies them in one pass; "
            "rejection sampling keeps the exact distribution; several tokens per pass"),
        (1, "I don't know"),
        (3, "decision: TP 2 with FP8; measure TTFT p99 and KV usage on a dashboard"), (0, "."),
    ]
    lines = iter(script)

    def input_fn(prompt):
        minutes, line = next(lines)
        clock.t += 60 * minutes
        return line

    out = []
    r = run_mock(seed=0, input_fn=input_fn, output_fn=out.append, clock=clock,
                 report_dir=tmp_path, prompt_id="chat-70b")
    assert r.truth.max_seqs == 54                      # kvmath.plan_capacity for this deployment
    assert r.estimate == 200
    assert r.rubric["memory math"][0] == 1             # 200 vs 54: far off
    assert r.rubric["high-level design"][0] == 5
    deep = next(p for p in r.phases if p.name == "deep dive")
    assert deep.used_s == 21 * 60 and deep.over_s == 6 * 60
    assert "(over time by 6.0 min)" in "\n".join(out)
    assert len(r.followups) == 2
    report = r.report_path.read_text()
    assert r.report_path.parent == tmp_path and r.report_path.suffix == ".md"
    assert "| deep dive | 15 min | 21.0 min | 6.0 min |" in report
    assert "**54 sequences**" in report and "Your estimate: 200 sequences" in report
    assert "| memory math | 1 |" in report and "## Follow-up questions" in report
    for criterion in r.rubric:
        assert f"| {criterion} |" in report
    assert all(1 <= s <= 5 for s, _ in r.rubric.values())


def test_mock_survives_end_of_input_and_says_when_time_is_up(tmp_path):
    clock = FakeClock()
    calls = []

    def input_fn(prompt):
        calls.append(prompt)
        if len(calls) == 1:
            clock.t += 50 * 60                         # the candidate talks for 50 minutes
            return "everything about latency and throughput"
        raise EOFError                                 # then Ctrl-D
    out = []
    r = run_mock(seed=1, input_fn=input_fn, output_fn=out.append, clock=clock, report_dir=tmp_path)
    text = "\n".join(out)
    assert "minutes are up" in text
    assert r.estimate is None and r.rubric["memory math"] == (1, "no usable estimate given")
    assert r.report_path.exists() and "_(nothing written)_" in r.report_path.read_text()


def test_mock_estimate_scores():
    assert estimate_score(54, 54)[0] == 5
    assert estimate_score(45, 54)[0] == 4
    assert estimate_score(30, 54)[0] == 3
    assert estimate_score(100, 54)[0] == 2
    assert estimate_score(None, 54)[0] == 1


def test_key_numbers_sheet_is_computed(tmp_path, monkeypatch, capsys):
    assert _cli(["key-numbers"], tmp_path, monkeypatch) == 0
    out = capsys.readouterr().out
    assert "| llama-2-70b | GQA | 80 x 8 x 128 | 327,680 B |" in out
    assert "| llama-3.1-405b | GQA | 126 x 8 x 128 | 516,096 B |" in out
    assert "| H100-SXM-80GB | 80 GB | 3.35 TB/s | 989 TFLOP/s | 295 |" in out


def test_export_anki_command(tmp_path, monkeypatch, capsys):
    assert _cli(["export-anki", "deck.apkg", "--topic", "kv_cache"], tmp_path, monkeypatch) == 0
    n = len(drill.load_bank(topic="kv_cache"))
    assert f"wrote {n} notes to deck.apkg" in capsys.readouterr().out
    assert (tmp_path / "deck.apkg").stat().st_size > 0
