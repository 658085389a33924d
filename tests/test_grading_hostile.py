"""The instructor's batch grader against hostile submissions.

Every submission is built from the real chapter-01 notebooks (solutions/ and exercises/) with one
attack added: stale full-mark outputs and a first cell that kills or hangs the kernel, forged and
inflated grade lines, a monkeypatched grader, os._exit(0) inside a graded function, killing the
grader's parent (and grandparent), detached children, an infinite loop in an early exercise.
All of them go through ONE run of `python -m minillm.grading`, which must finish with a row per
submission, grade the honest solution exactly as before, count no forged score, and leave no
process behind. The other tests check the pieces in-process: the in-notebook grade() when
checks never answer, the transcript against forged and broken records, and the policy flag.
"""
import csv
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from minillm.grading import Check, Exercise, ch01, ch03, grade, transcript
from minillm.grading.core import Problem
from minillm.grading.policy import reference_use
from minillm.grading.regrade import replay_transcript
from minillm.grading.testing import function_from_notebook

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "01_kv_cache_math.ipynb"
EXERCISE = ROOT / "exercises" / "01_kv_cache_math.ipynb"
IDS = [e.id for e in ch01.EXERCISES]              # ch01.kv_bytes_per_token, ch01.max_concurrency
FULL = {e.id: e.max for e in ch01.EXERCISES}
TOKEN = secrets.token_hex(8)                           # carried by every process the run starts


# ------------------------------------------------------------------ building submissions

def _read(path):
    return nbformat.read(str(path), as_version=4)


def _index(nb, text):
    """Index of the one code cell whose source contains `text`."""
    hits = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and text in c.source]
    assert len(hits) == 1, f"{len(hits)} cells contain {text!r}"
    return hits[0]


def _insert(nb, before_text, source, after=False):
    i = _index(nb, before_text) + (1 if after else 0)
    nb.cells.insert(i, nbformat.v4.new_code_cell(source))
    return nb


def _replace_body(nb, name, body):
    """The function `name` keeps its signature; its solution body is replaced by `body`."""
    cell = nb.cells[_index(nb, f"def {name}(")]
    lines = cell.source.splitlines()
    begin = next(i for i, line in enumerate(lines) if "### BEGIN SOLUTION" in line)
    end = next(i for i, line in enumerate(lines) if "### END SOLUTION" in line)
    cell.source = "\n".join(lines[:begin] + ["    " + b for b in body.splitlines()]
                            + lines[end + 1:])
    return nb


def _stale():
    """The unfilled exercise notebook carrying the solution's full-mark outputs."""
    stub, sol = _read(EXERCISE), _read(SOLUTION)
    assert [c.cell_type for c in stub.cells] == [c.cell_type for c in sol.cells]
    for mine, theirs in zip(stub.cells, sol.cells):
        if mine.cell_type == "code":
            mine.outputs, mine.execution_count = theirs.outputs, theirs.execution_count
    text = "".join(o.get("text", "") for c in stub.cells if c.cell_type == "code"
                   for o in c.outputs)
    assert all(f"[minillm-grade] {i} {m}/{m}" in text for i, m in FULL.items())
    return stub


FORGE = """
import os
print("[minillm-grade] ch01.kv_bytes_per_token 99/6")
print("[minillm-grade] ch01.max_concurrency 1000/6")
print("[minillm-grade] ch00.top_p 1000/6")
print("[minillm-grade] ch99.made_up 5/5")
os.write(1, b"[minillm-grade] ch01.max_concurrency 77/6\\n")
"""

PATCH = """
import minillm.grading.core as core
from minillm.grading import ch01
core._run_check = lambda check, learner: (True, "")            # every check passes, locally
ch01.check_kv_bytes_per_token = lambda fn, time_limit=None: print(
    "kv_bytes_per_token: 6/6 checks passed. Full marks.\\n"
    "[minillm-grade] ch01.kv_bytes_per_token 6/6")
core.GradeResult.score = property(lambda self: len(self.outcomes))
"""

KILL_PARENT = """
import os, signal
os.kill(os.getppid(), signal.SIGKILL)
"""

KILL_PARENTS = f"""
import os, signal, subprocess, sys, time
parent = os.getppid()
with open(f"/proc/{{parent}}/stat") as f:
    grandparent = int(f.read().rsplit(")", 1)[1].split()[1])
os.kill(grandparent, signal.SIGKILL)        # the supervisor first, then the notebook runner
os.kill(parent, signal.SIGKILL)
time.sleep(0.5)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                 env={{**os.environ, "HOSTILE_MARK": "{TOKEN}"}})
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                 env={{"HOSTILE_MARK": "{TOKEN}", "PATH": os.environ.get("PATH", "")}})
time.sleep(600)
"""

DETACH = f"""
import os, subprocess, sys
# a detached sleeper that keeps the environment, one that clears it, and a double fork
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                 env={{"HOSTILE_MARK": "{TOKEN}", "PATH": os.environ.get("PATH", "")}})
subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, "
                  "'-c', 'import time; time.sleep(600)'], start_new_session=True)"])
"""


def _submissions(folder: Path) -> dict:
    """Write the hostile submissions; {file name: what its row must hold}."""
    subs = {}

    def add(name, nb, scores, status=None):
        path = folder / f"{name}_01_kv_cache_math.ipynb"
        nbformat.write(nb, str(path))
        subs[path.name] = (scores, status)

    # honest, with forged lines printed after its real ones: exactly the solution's score
    add("honest_forged", _insert(_read(SOLUTION), "check_max_concurrency", FORGE, after=True),
        FULL)
    # stale full-mark outputs; the first cell kills the kernel / loops forever
    add("stale_sigkill", _insert(_stale(), "from minillm.grading import ch01",
                                 "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"),
        {i: 0 for i in IDS}, "kernel died in cell")
    add("stale_loop", _insert(_stale(), "from minillm.grading import ch01",
                              "while True:\n    pass"),
        {i: 0 for i in IDS}, "ran past the cell time limit")
    # the grader patched in the notebook, forged lines printed; the functions are wrong
    nb = _insert(_read(SOLUTION), "from minillm.grading import ch01", PATCH, after=True)
    nb = _insert(nb, "check_max_concurrency", FORGE, after=True)
    nb = _replace_body(_replace_body(nb, "kv_bytes_per_token", "return 0"),
                       "max_concurrent_seqs", "return 0")
    add("patched", nb, {i: 0 for i in IDS})
    # os._exit(0) inside the graded function, only in the forked check process
    nb = _insert(_read(SOLUTION), "def kv_bytes_per_token(", "import os\nKERNEL = os.getpid()")
    nb = _replace_body(nb, "kv_bytes_per_token",
                       "import os\nif os.getpid() != KERNEL:\n    os._exit(0)\nreturn 0")
    add("exit0", nb, {IDS[0]: 0, IDS[1]: FULL[IDS[1]]}, "errors in cells")
    # the kernel kills its parent after the first exercise was checked
    add("kill_parent", _insert(_read(SOLUTION), "check_kv_bytes_per_token", KILL_PARENT,
                               after=True),
        {IDS[0]: FULL[IDS[0]], IDS[1]: 0}, "notebook runner was killed by signal 9")
    # ... and then its new parent, the supervisor, and starts detached sleepers
    add("kill_parents", _insert(_read(SOLUTION), "check_kv_bytes_per_token", KILL_PARENTS,
                                after=True),
        {IDS[0]: FULL[IDS[0]], IDS[1]: 0}, "supervisor was killed by signal 9")
    # detached children that must not outlive the run; the answers are right
    add("detach", _insert(_read(SOLUTION), "check_max_concurrency", DETACH, after=True), FULL,
        "left behind were killed")
    # an honest problem set whose learner code is a class and a Triton kernel (chapter 03):
    # instances and method calls are recorded, the kernel runs under the interpreter
    nbformat.write(_read(ROOT / "solutions" / "03_paged_blocks.ipynb"),
                   str(folder / "honest_03_paged_blocks.ipynb"))
    # an infinite loop in the first exercise: the second one is still graded
    add("loop_early", _replace_body(_read(SOLUTION), "kv_bytes_per_token", "while True:\n    pass"),
        {IDS[0]: 0, IDS[1]: FULL[IDS[1]]}, "ran past the cell time limit")
    return subs


def _processes_with(token: str) -> list:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    env = f.read()
                with open(f"/proc/{name}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except OSError:
                continue
            if token.encode() in env and state not in (b"Z", b"X"):
                found.append(int(name))
    return found


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    subs_dir = folder / "submissions"
    subs_dir.mkdir()
    expected = _submissions(subs_dir)
    out = folder / "scores.csv"
    env = {**os.environ, "HOSTILE_MARK": TOKEN}
    env.pop("MINILLM_GRADE_RECORD", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "minillm.grading", str(ROOT / "exercises"),
                           "--submissions", str(subs_dir), "--out", str(out), "--timeout", "90",
                           "--check-time-limit", "6", "--cell-timeout", "12",
                           "--feedback", str(folder / "feedback")],
                          capture_output=True, text=True, timeout=900, cwd=folder, env=env)
    elapsed = time.monotonic() - start
    left = _processes_with(f"HOSTILE_MARK={TOKEN}")
    with open(out, newline="") as f:
        rows = {r["submission"]: r for r in csv.DictReader(f)}
    yield proc, rows, expected, left, elapsed, folder / "feedback"
    for pid in left:                                   # never leave the machine dirty
        try:
            os.kill(pid, 9)
        except OSError:
            pass


def test_batch_completes_with_a_row_per_submission(batch):
    proc, rows, expected, _, elapsed, _ = batch
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(rows) == set(expected) | {"honest_03_paged_blocks.ipynb"}, proc.stdout
    assert f"wrote {len(rows)} rows" in proc.stdout
    assert elapsed < 600
    print(proc.stdout)                                # per-submission status and seconds


@pytest.mark.parametrize("name", ["honest_forged", "stale_sigkill", "stale_loop",
                                  "patched", "exit0", "kill_parent", "kill_parents", "detach",
                                  "loop_early"])
def test_hostile_submission_scores_only_what_its_code_earns(batch, name):
    proc, rows, expected, _, _, _ = batch
    file = f"{name}_01_kv_cache_math.ipynb"
    row, (scores, status) = rows[file], expected[file]
    got = {i: int(row[i]) for i in IDS}
    assert got == scores, f"{file}: {row}\n{proc.stdout}"
    assert int(row["total"]) == sum(scores.values())
    assert int(row["max"]) == sum(FULL.values())
    assert row["ch00.top_p"] == "" and "ch99.made_up" not in row      # other ids never count
    if status:
        assert status in row["status"], row["status"]


def test_an_honest_class_and_triton_problem_set_scores_full_marks(batch):
    _, rows, _, _, _, _ = batch
    row = rows["honest_03_paged_blocks.ipynb"]
    assert row["status"] == "ok", row
    assert row["total"] == row["max"] == str(sum(e.max for e in ch03.EXERCISES)), row


def test_feedback_holds_the_grades_computed_by_the_batch(batch):
    *_, feedback = batch
    honest = (feedback / "honest_forged_01_kv_cache_math.txt").read_text()
    assert "12/12" in honest and honest.count("Full marks") == len(IDS)
    patched = (feedback / "patched_01_kv_cache_math.txt").read_text()
    assert "0/12" in patched and "Full marks" not in patched
    assert "was the grader changed in the notebook?" in patched       # the batch's own words,
    assert "no check of this exercise ran" in patched                 # not the notebook's print
    loop = (feedback / "loop_early_01_kv_cache_math.txt").read_text()
    assert "did not finish within the time limit" in loop


def test_no_process_of_the_run_is_left(batch):
    _, _, _, left, _, _ = batch
    assert left == [], f"processes left behind: {left}"


# ------------------------------------------------------------------ in-notebook self-check

def _exits_in_child(cfg, dtype="bfloat16"):
    os._exit(0)


def test_os_exit_0_in_a_graded_function_is_a_failure_not_full_marks(capsys):
    result = ch01.check_kv_bytes_per_token(_exits_in_child, time_limit=30)
    out = capsys.readouterr().out
    assert result.score == 0 and result.max == ch01.KV_BYTES.max
    assert "Full marks" not in out and "0/0" not in out
    assert "exited with status 0 before it had finished" in result.outcomes[0].message
    assert all(o.message.startswith("not run") for o in result.outcomes[1:])


def test_an_exercise_without_outcomes_never_reads_as_full_marks():
    result = grade(Exercise("test.none", "f", ()), lambda: None, time_limit=5)
    assert not result.full_marks and "Full marks" not in str(result)


# ------------------------------------------------------------------ transcripts

def _record(exercise, fn, path):
    os.environ[transcript.RECORD_ENV] = str(path)
    try:
        return grade(exercise, fn, time_limit=30)
    finally:
        del os.environ[transcript.RECORD_ENV]


def test_replay_agrees_with_the_kernel_and_a_changed_grader_fails(tmp_path):
    solution = function_from_notebook(SOLUTION, "kv_bytes_per_token")
    path = tmp_path / "r.jsonl"
    local = _record(ch01.KV_BYTES, solution, path)
    run = transcript.read_records(path)[ch01.KV_BYTES.id]
    assert replay_transcript(ch01.KV_BYTES, run).score == local.score == local.max
    # a grader that asks other questions than the recorded ones (patched in the kernel)
    def other_question(fn):
        if fn(ch01._MQA, "fp8") <= 0:
            raise Problem("not positive")

    asks_other = Exercise(ch01.KV_BYTES.id, "kv_bytes_per_token",
                          tuple(Check(c.name, other_question) for c in ch01.KV_BYTES.checks))
    replayed = replay_transcript(asks_other, run)
    assert replayed.score == 0
    assert all("differ from those your notebook answered" in m for m in replayed.messages)


def test_forged_and_broken_records_fail_without_crashing(tmp_path):
    solution = function_from_notebook(SOLUTION, "kv_bytes_per_token")
    path = tmp_path / "r.jsonl"
    _record(ch01.KV_BYTES, solution, path)
    lines = path.read_text().splitlines()
    bad = []
    for line in lines:
        if '"t":"io"' in line:              # every answer replaced by junk of another shape
            line = line.replace('"response":{"value":', '"response":{"value":{"__tensor__":"AAAA"},'
                                '"x":')
        bad.append(line)
    bad += ["not json", "[1, 2]", '{"run": 5}', "{" * 50000 + "}" * 50000]
    path.write_text("\n".join(bad) + "\n")
    run = transcript.read_records(path)[ch01.KV_BYTES.id]
    result = replay_transcript(ch01.KV_BYTES, run)
    assert result.score == 0, str(result)
    assert all("not valid" in m for m in result.messages), result.messages
    big = tmp_path / "big.jsonl"
    big.write_bytes(b" " * 2048)
    with pytest.raises(transcript.BadRecord, match="more than"):
        transcript.read_records(big, limit=1024)
    # a submission could replace its record by a FIFO (reading would block) or a symlink
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(transcript.BadRecord, match="not in a regular file"):
        transcript.read_records(fifo)
    link = tmp_path / "link.jsonl"
    link.symlink_to(path)
    with pytest.raises(OSError):
        transcript.read_records(link)


def test_a_check_that_never_answered_fails_with_the_recorded_reason(tmp_path):
    def loops(cfg, dtype="bfloat16"):
        while True:
            pass

    path = tmp_path / "r.jsonl"
    os.environ[transcript.RECORD_ENV] = str(path)
    try:
        grade(ch01.KV_BYTES, loops, time_limit=1)
    finally:
        del os.environ[transcript.RECORD_ENV]
    run = transcript.read_records(path)[ch01.KV_BYTES.id]
    result = replay_transcript(ch01.KV_BYTES, run)
    assert result.score == 0
    assert "time limit" in result.messages[0] and "not run" in result.messages[1]
    none = replay_transcript(ch01.KV_BYTES, None)
    assert none.score == 0 and "no check of this exercise ran" in none.messages[0]


# ------------------------------------------------------------------ policy

def test_policy_flags_minillms_own_implementation_and_not_the_solutions():
    for folder in ("solutions", "exercises"):
        nb = _read(ROOT / folder / "01_kv_cache_math.ipynb")
        assert all(reference_use(nb, e) is None for e in ch01.EXERCISES), folder
    nb = _insert(_read(SOLUTION), "def kv_bytes_per_token(",
                 "from minillm.kvmath import kv_bytes_per_token", after=True)
    assert "imports kv_bytes_per_token from minillm.kvmath" in reference_use(nb, ch01.KV_BYTES)
    nb = _replace_body(_read(SOLUTION), "kv_bytes_per_token",
                       "from minillm import kvmath\nreturn kvmath.kv_bytes_per_token(cfg, dtype)")
    assert "uses minillm" in reference_use(nb, ch01.KV_BYTES)
    run = {"origin": {"module": "minillm.kvmath", "qualname": "kv_bytes_per_token"}}
    assert "minillm's own minillm.kvmath" in reference_use(_read(SOLUTION), ch01.KV_BYTES, run)


# ------------------------------------------------------------------ the command itself

def test_rows_are_written_as_each_submission_finishes(tmp_path):
    from minillm.grading.batch import grade_folder
    subs = tmp_path / "subs"
    subs.mkdir()
    for name in ("a_01_kv_cache_math.ipynb", "b_01_kv_cache_math.ipynb", "c_no_set.ipynb"):
        (subs / name).write_text("{ not a notebook")
    out = tmp_path / "scores.csv"
    seen = []

    def log(line):                       # called after each row: the file must hold it already
        with open(out, newline="") as f:
            seen.append(len(list(csv.reader(f))) - 1)

    rows = grade_folder(ROOT / "exercises", subs, out, log=log)
    assert seen == [1, 2, 3] and len(rows) == 3
    assert "names no problem set" in rows[2].status


def test_limits_that_cannot_work_together_are_refused(tmp_path, capsys):
    from minillm.grading.__main__ import main
    code = main([str(ROOT / "exercises"), "--submissions", str(tmp_path), "--out",
                 str(tmp_path / "s.csv"), "--cell-timeout", "5", "--check-time-limit", "10"])
    assert code == 2
    assert "--cell-timeout (5 s) must be longer than --check-time-limit (10 s)" in \
        capsys.readouterr().err


def test_measure_runs_beside_the_learner_and_is_replayed_as_a_number(tmp_path):
    from minillm.grading.core import measure
    calls = []

    def calls_made(fn, n):                    # a stand-in for timing the learner's code
        calls.append(n)
        return sum(fn(i) for i in range(n))

    def sums(fn):
        if measure(calls_made, fn, 1000) != 499500:
            raise Problem("wrong sum")

    exercise = Exercise("test.measure", "f", (Check("sum", sums),))
    path = tmp_path / "r.jsonl"
    os.environ[transcript.RECORD_ENV] = str(path)
    try:
        local = grade(exercise, lambda i: i, time_limit=30, isolation="none")
    finally:
        del os.environ[transcript.RECORD_ENV]
    assert local.full_marks and calls == [1000]          # ran once, on the real function
    lines = path.read_text().splitlines()
    assert sum('"t":"io"' in line for line in lines) == 1   # one answer, not 1000 calls
    replayed = replay_transcript(exercise, transcript.read_records(path)["test.measure"])
    assert replayed.full_marks and calls == [1000]       # the replay did not run the helper
