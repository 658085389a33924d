"""Issue 17: one submission must not touch another's grade, and the folder's odd files must not
hang the batch or leak into its reports.

Two small runs of `python -m minillm.grading` (chapter 01, the shortest problem set), each bounded
in time:

- isolation: a submission that writes an IPython startup file into the IPYTHONDIR its kernel
  sees (a post_run_cell hook that swaps the graded functions: max_concurrent_seqs answers 0,
  kv_bytes_per_token becomes minillm's own), then an honest and a wrong submission. The honest
  one keeps full marks, the wrong one its low score, and the file neither survives the batch
  nor reaches the instructor's IPYTHONDIR (nor HOME);
- folder edges: a FIFO named *.ipynb (the batch finishes, in bounded time), a symlink to a
  private file (refused; nothing of the target in the CSV or the feedback), `dup/x_01...` and
  `dup__x_01...` (distinct feedback and executed notebooks, each its own), and chapter 06's
  notebook under a chapter-01 name (a status that says so).
"""
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from minillm.grading import ch01, grade

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "01_kv_cache_math.ipynb"
SET = "01_kv_cache_math"
FULL = sum(e.max for e in ch01.EXERCISES)

CONTAMINATE = '''
import json, os
from IPython.paths import get_ipython_dir
startup = os.path.join(get_ipython_dir(), "profile_default", "startup")
os.makedirs(startup, exist_ok=True)
path = os.path.join(startup, "00-swap.py")
with open(path, "w") as f:
    f.write("""
def _swap(result=None):
    ns = get_ipython().user_ns
    if "kv_bytes_per_token" in ns and not getattr(ns["kv_bytes_per_token"], "swapped", 0):
        from minillm.kvmath import kv_bytes_per_token as reference
        def kv_bytes_per_token(cfg, dtype="bfloat16"):
            return reference(cfg, dtype)
        kv_bytes_per_token.swapped = 1
        ns["kv_bytes_per_token"] = kv_bytes_per_token
    if "max_concurrent_seqs" in ns:
        ns["max_concurrent_seqs"] = lambda *args, **kwargs: 0
get_ipython().events.register("post_run_cell", _swap)
""")
with open(os.environ["CONTAMINATION_REPORT"], "w") as f:
    json.dump({"startup_file": path, "home": os.path.expanduser("~")}, f)
'''


def _read(path):
    return nbformat.read(str(path), as_version=4)


def _wrong():
    """The solution with both function bodies replaced by `return 0`."""
    nb = _read(SOLUTION)
    for cell in nb.cells:
        if cell.cell_type == "code" and "### BEGIN SOLUTION" in cell.source:
            lines = cell.source.splitlines()
            begin = next(i for i, x in enumerate(lines) if "### BEGIN SOLUTION" in x)
            end = next(i for i, x in enumerate(lines) if "### END SOLUTION" in x)
            cell.source = "\n".join(lines[:begin] + ["    return 0"] + lines[end + 1:])
    return nb


def _batch(tmp_path, subs, extra_env=None, timeout=420):
    """Run the command on `subs`; (process, {submission: row}, seconds)."""
    out = tmp_path / "scores.csv"
    env = {**os.environ, **(extra_env or {})}
    env.pop("MINILLM_GRADE_RECORD", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "minillm.grading", str(ROOT / "exercises"),
                           "--submissions", str(subs), "--out", str(out), "--timeout", "90",
                           "--check-time-limit", "6", "--cell-timeout", "12",
                           "--feedback", str(tmp_path / "feedback"),
                           "--executed", str(tmp_path / "executed")],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)
    elapsed = time.monotonic() - start
    with open(out, newline="") as f:
        rows = {r["submission"]: r for r in csv.DictReader(f)}
    return proc, rows, elapsed


@pytest.fixture(scope="module")
def contaminated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("isolation")
    subs = tmp / "subs"
    subs.mkdir()
    nb = _read(SOLUTION)
    first = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells.insert(first + 1, nbformat.v4.new_code_cell(CONTAMINATE))
    nbformat.write(nb, str(subs / f"a_contaminate_{SET}.ipynb"))
    nbformat.write(_read(SOLUTION), str(subs / f"b_honest_{SET}.ipynb"))
    nbformat.write(_wrong(), str(subs / f"c_wrong_{SET}.ipynb"))
    instructor = {"IPYTHONDIR": tmp / "instructor-ipython", "HOME": tmp / "instructor-home"}
    for folder in instructor.values():
        folder.mkdir()
    report = tmp / "contamination.json"
    proc, rows, elapsed = _batch(tmp, subs, {"CONTAMINATION_REPORT": str(report),
                                             **{k: str(v) for k, v in instructor.items()}})
    return proc, rows, elapsed, report, instructor


def test_a_startup_file_does_not_change_other_submissions_grades(contaminated):
    proc, rows, _, _, _ = contaminated
    assert proc.returncode == 0, proc.stderr[-3000:]
    honest, wrong = rows[f"b_honest_{SET}.ipynb"], rows[f"c_wrong_{SET}.ipynb"]
    assert int(honest["total"]) == FULL, (honest, proc.stdout)
    # what `return 0` earns when graded in this process, with no startup file anywhere
    own = sum(grade(e, lambda *a, **k: 0, time_limit=30).score for e in ch01.EXERCISES)
    assert own < FULL // 2
    assert int(wrong["total"]) == own, (wrong, proc.stdout)
    assert int(rows[f"a_contaminate_{SET}.ipynb"]["total"]) == FULL   # its own kernel: honest


def test_the_startup_file_survives_neither_the_batch_nor_reaches_the_instructor(contaminated):
    _, _, _, report, instructor = contaminated
    written = json.loads(report.read_text())          # where the kernel wrote it
    assert not os.path.exists(written["startup_file"]), written
    assert written["home"] != str(instructor["HOME"]), written      # a HOME of its own
    assert not os.path.exists(written["home"]), written              # removed afterwards
    for folder in instructor.values():
        left = [str(p) for p in folder.rglob("*") if p.is_file()]
        assert not any("startup" in p for p in left), left


@pytest.fixture(scope="module")
def edges(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edges")
    subs = tmp / "subs"
    (subs / "dup").mkdir(parents=True)
    for name, marker in ((f"dup/x_{SET}.ipynb", "MARK-SLASH"), (f"dup__x_{SET}.ipynb",
                                                                 "MARK-UNDERSCORES")):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_markdown_cell("# Chapter 01"), nbformat.v4.new_code_cell(
            f"from minillm.grading import ch01\nprint('{marker}')")]
        nbformat.write(nb, str(subs / name))
    # a notebook whose first cell is code (the kernel's warm-up once replaced that cell)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("from minillm.grading import ch01\nprint('MARK-FIRST')")]
    nbformat.write(nb, str(subs / f"first_{SET}.ipynb"))
    os.mkfifo(subs / f"fifo_{SET}.ipynb")
    secret = tmp / "private.txt"
    secret.write_text("SECRET-TARGET-CONTENT " * 20)
    (subs / f"link_{SET}.ipynb").symlink_to(secret)
    nbformat.write(_read(ROOT / "exercises" / "06_prefix_caching.ipynb"),
                   str(subs / f"other_{SET}.ipynb"))
    proc, rows, elapsed = _batch(tmp, subs, timeout=300)
    return proc, rows, elapsed, tmp


def test_a_fifo_does_not_hang_the_batch(edges):
    proc, rows, elapsed, _ = edges
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(rows) == 6, proc.stdout
    assert "refused: a FIFO" in rows[f"fifo_{SET}.ipynb"]["status"]
    assert elapsed < 240


def test_a_symlinked_submission_is_refused_and_its_target_never_echoed(edges):
    _, rows, _, tmp = edges
    assert "refused: a symbolic link" in rows[f"link_{SET}.ipynb"]["status"]
    assert "SECRET" not in (tmp / "scores.csv").read_text()
    for report in (tmp / "feedback").iterdir():
        assert "SECRET" not in report.read_text(), report


def test_colliding_names_get_their_own_feedback_and_executed_notebook(edges):
    from minillm.grading.batch import output_name
    _, rows, _, tmp = edges
    feedback = {p.name: p.read_text() for p in (tmp / "feedback").iterdir()}
    executed = {p.name: p.read_text() for p in (tmp / "executed").iterdir()}
    for name, marker in ((f"dup/x_{SET}.ipynb", "MARK-SLASH"), (f"dup__x_{SET}.ipynb",
                                                                 "MARK-UNDERSCORES")):
        assert rows[name]["status"] == "ok", rows[name]
        flat = output_name(name)
        assert feedback[flat[:-len(".ipynb")] + ".txt"].startswith(name + " ("), feedback
        assert marker + "\\n" in executed[flat], sorted(executed)          # its own output
    assert len(feedback) == len(rows)


def test_another_problem_sets_notebook_gets_a_status_that_says_so(edges):
    _, rows, _, _ = edges
    status = rows[f"other_{SET}.ipynb"]["status"]
    assert "wrong problem set" in status and "06_prefix_caching" in status, status
    assert rows[f"other_{SET}.ipynb"]["total"] == "0"


def test_a_first_code_cell_runs_and_is_kept_in_the_executed_notebook(edges):
    _, rows, _, tmp = edges
    executed = [p.read_text() for p in (tmp / "executed").iterdir() if "first_" in p.name]
    assert len(executed) == 1 and "MARK-FIRST\\n" in executed[0], executed   # its output


def test_every_course_notebook_is_its_own_problem_set_only():
    from minillm.grading.batch import ProblemSet, other_problem_set, problem_sets
    sets = problem_sets(ROOT / "exercises")
    for ps in sets:
        for folder in ("solutions", "exercises"):
            nb = _read(ROOT / folder / f"{ps.stem}.ipynb")
            assert other_problem_set(nb, ps, sets) is None, (folder, ps.stem)
    ch01_set = next(s for s in sets if s.stem == SET)
    for ps in sets:
        if ps.exercises and ps is not ch01_set:
            status = other_problem_set(_read(ROOT / "exercises" / f"{ps.stem}.ipynb"), ch01_set,
                                       sets)
            assert status and SET in status, ps.stem
    assert other_problem_set(_read(SOLUTION), ProblemSet("42_none", ()), sets) is None


def test_output_names_are_distinct_for_distinct_submissions():
    from minillm.grading.batch import output_name
    names = ["dup/x.ipynb", "dup__x.ipynb", "dup%2Fx.ipynb", "a/b/c.ipynb", "a__b/c.ipynb"]
    assert len({output_name(n) for n in names}) == len(names)
    assert all("/" not in output_name(n) for n in names)
