"""Grade a folder of submitted notebooks into a CSV table (the instructor command).

    python -m minillm.grading exercises/ --submissions DIR --out scores.csv

A submission belongs to the problem set whose name its file name contains
(`alice_00_foundations.ipynb` -> 00_foundations). Each one is run from cleared outputs in a fresh
kernel under a per-submission supervisor (supervisor.py: own session, every cell under a time
limit, every process killed at the end). Its check cells record what the learner's code answered
as plain data (transcript.py); this process then re-runs every check of the problem set itself
against those answers (regrade.py). Printed grade lines, stale outputs and a patched grader in
the notebook count for nothing; a check that never answered fails. Each CSV row is written as
soon as its submission is graded. A broken or hostile submission gets a row with a status, never
a crash.
"""
from __future__ import annotations

import csv
import importlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import nbformat

from . import supervisor
from .core import Exercise, GradeResult
from .policy import reference_use
from .timelimit import default_time_limit
from .regrade import replay_transcript
from .transcript import MAX_RECORD_BYTES, RECORD_ENV, BadRecord, read_records, read_regular_file

_CHAPTER = re.compile(r"^(\d{2})_")


def chapter_exercises(chapter: str) -> tuple[Exercise, ...]:
    """The exercises of chapter "NN": minillm.grading.chNN.EXERCISES, or () if there is none."""
    try:
        module = importlib.import_module(f"minillm.grading.ch{chapter}")
    except ModuleNotFoundError as exc:
        if exc.name == f"minillm.grading.ch{chapter}":
            return ()
        raise
    return tuple(getattr(module, "EXERCISES", ()))


@dataclass
class ProblemSet:
    stem: str                                    # "00_foundations"
    exercises: tuple[Exercise, ...]


@dataclass
class Row:
    submission: str
    problem_set: str = ""
    scores: dict[str, int] = field(default_factory=dict)
    maxima: dict[str, int] = field(default_factory=dict)
    status: str = "ok"
    results: dict[str, GradeResult] = field(default_factory=dict)   # the checks' messages


def problem_sets(exercises_dir) -> list[ProblemSet]:
    paths = sorted(Path(exercises_dir).glob("*.ipynb"))
    if not paths:
        raise ValueError(f"no exercise notebooks in {exercises_dir}; pass the exercises/ folder")
    sets = []
    for p in paths:
        m = _CHAPTER.match(p.stem)
        sets.append(ProblemSet(p.stem, chapter_exercises(m.group(1)) if m else ()))
    return sets


def match_problem_set(path: Path, sets: list[ProblemSet]) -> Optional[ProblemSet]:
    """The problem set whose name appears in the submission's file name (longest name wins)."""
    hits = [s for s in sets if s.stem in path.name]
    return max(hits, key=lambda s: len(s.stem)) if hits else None


DEFAULT_CELL_TIMEOUT = 120.0      # seconds one cell may run before it is interrupted
STARTUP_TIMEOUT = 60.0            # seconds a kernel may take to start (not counted in --timeout)


def _cleared(nb):
    """The notebook with every output and execution count removed: nothing stale can count."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


def _run(path_nb: Path, work: Path, timeout: float, cell_timeout: float, kernel: str,
         check_time_limit: float, executed: Optional[Path]) -> tuple[str, Path]:
    """Run the cleared notebook under a supervisor; (status sentence, transcript path)."""
    records = work / "records.jsonl"
    records.touch()
    cwd = work / "cwd"
    cwd.mkdir()
    marker = secrets.token_hex(12)
    config = work / "config.json"
    config.write_text(json.dumps({
        "notebook": str(path_nb), "cwd": str(cwd), "kernel": kernel, "timeout": timeout,
        "cell_timeout": cell_timeout, "startup_timeout": STARTUP_TIMEOUT, "marker": marker,
        "executed": str(executed) if executed else None}))
    env = dict(os.environ)
    env.update({RECORD_ENV: str(records), supervisor.MARKER_ENV: marker,
                "MINILLM_GRADE_TIME_LIMIT": str(check_time_limit)})
    env.pop("MINILLM_GRADE_ISOLATION", None)
    proc = subprocess.Popen([sys.executable, supervisor.__file__, str(config)], cwd=str(work),
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    tracked: dict = {}
    deadline = time.monotonic() + timeout + STARTUP_TIMEOUT + 90
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            supervisor.track(tracked, root=proc.pid, session=proc.pid, marker=marker)
            try:
                proc.wait(timeout=0.3)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    finally:
        # whatever survived the supervisor (which the submission may have killed)
        supervisor.kill_processes(session=proc.pid, marker=marker, tracked=tracked)
        proc.wait()
    out = _read_available(proc.stdout)
    report = None
    for line in out.decode(errors="replace").splitlines()[::-1]:
        try:
            report = json.loads(line)
            break
        except ValueError:
            continue
    if isinstance(report, dict) and isinstance(report.get("status"), str):
        status = report["status"]
        if report.get("left_behind"):
            status += f"; {report['left_behind']} process(es) it left behind were killed"
    else:
        how = (f"killed by signal {-proc.returncode}" if (proc.returncode or 0) < 0
               else f"ended with status {proc.returncode}")
        status = f"stopped: the submission's supervisor was {how} (killed by the submission?)"
    return status, records


def _read_available(stream, limit: int = 1 << 20) -> bytes:
    """What the supervisor reported, without waiting on a writer that kept the pipe open."""
    os.set_blocking(stream.fileno(), False)
    data = b""
    try:
        while len(data) < limit:
            chunk = stream.read(1 << 16)
            if not chunk:
                break
            data += chunk
    except (BlockingIOError, OSError):
        pass
    stream.close()
    return data


def grade_submission(path: Path, sets: list[ProblemSet], timeout: float = 300,
                     kernel: str = "python3", check_time_limit: Optional[float] = None,
                     executed_dir: Optional[Path] = None, name: Optional[str] = None,
                     cell_timeout: Optional[float] = None) -> Row:
    """Run one submitted notebook and grade its recorded answers. Never raises for a bad file."""
    path = Path(path)
    row = Row(submission=name or path.name)
    ps = match_problem_set(path, sets)
    if ps is None:
        row.status = "file name names no problem set of the exercises folder; not run"
        return row
    row.problem_set = ps.stem
    row.maxima = {e.id: e.max for e in ps.exercises}
    row.scores = {e.id: 0 for e in ps.exercises}
    limit = default_time_limit() if check_time_limit is None else float(check_time_limit)
    cell_limit = DEFAULT_CELL_TIMEOUT if cell_timeout is None else float(cell_timeout)
    try:
        nb = nbformat.read(str(path), as_version=4)
    except Exception as exc:
        row.status = f"not a readable notebook: {type(exc).__name__}: {str(exc)[:200]}"
        return row
    with tempfile.TemporaryDirectory(prefix="minillm-grade-", ignore_cleanup_errors=True) as tmp:
        work = Path(tmp)
        cleared = work / "submission.ipynb"
        nbformat.write(_cleared(nb), str(cleared))
        executed = work / "executed.ipynb" if executed_dir is not None else None
        row.status, records = _run(cleared, work, timeout, cell_limit, kernel, limit, executed)
        try:
            runs = read_records(records)
        except (BadRecord, OSError) as exc:
            runs = {}
            row.status += f"; its recorded answers were ignored: {exc}"
        for exercise in ps.exercises:             # only this problem set's ids; none printed
            result = replay_transcript(exercise, runs.get(exercise.id))
            row.results[exercise.id] = result
            row.scores[exercise.id] = max(0, min(result.score, exercise.max))
        flags = [reference_use(nb, e, runs.get(e.id)) for e in ps.exercises]
        flags = [f for f in flags if f]
        if flags:
            row.status += "; policy: " + "; ".join(flags)
        if executed is not None:
            try:
                data = read_regular_file(executed, MAX_RECORD_BYTES, "the executed notebook")
            except (BadRecord, OSError):
                data = None
            if data is not None:
                executed_dir.mkdir(parents=True, exist_ok=True)
                flat = (name or path.name).replace("/", "__").replace(os.sep, "__")
                (executed_dir / flat).write_bytes(data)
    return row


def check_limits(timeout: float, check_time_limit: Optional[float],
                 cell_timeout: Optional[float]) -> None:
    """ValueError naming the option to fix when the time limits cannot work together."""
    check = default_time_limit() if check_time_limit is None else float(check_time_limit)
    cell = DEFAULT_CELL_TIMEOUT if cell_timeout is None else float(cell_timeout)
    for name, value in (("--timeout", timeout), ("--check-time-limit", check),
                        ("--cell-timeout", cell)):
        if not value > 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value}")
    if cell <= check:
        raise ValueError(f"--cell-timeout ({cell:g} s) must be longer than --check-time-limit "
                         f"({check:g} s): a check cell runs every check of one exercise within "
                         "the check time limit")


def write_feedback(row: Row, folder: Path) -> None:
    """The grades computed here, one report per exercise with every failed check's message."""
    folder.mkdir(parents=True, exist_ok=True)
    flat = row.submission.replace("/", "__").replace(os.sep, "__")
    text = [f"{row.submission} ({row.problem_set or 'no problem set'}): "
            f"{sum(row.scores.values())}/{sum(row.maxima.values())}", f"status: {row.status}", ""]
    text += [str(result) + "\n" for result in row.results.values()]
    (folder / (Path(flat).stem + ".txt")).write_text("\n".join(text), encoding="utf-8")


def grade_folder(exercises_dir, submissions_dir, out_csv=None, timeout: float = 300,
                 kernel: str = "python3", check_time_limit: Optional[float] = None,
                 executed_dir=None, log=print, cell_timeout: Optional[float] = None,
                 feedback_dir=None) -> list[Row]:
    """Grade every notebook under `submissions_dir`. With `out_csv`, the CSV is written row by
    row, each row as soon as its submission is graded (flushed), so a run cut short keeps the
    rows it finished. With `feedback_dir`, each submission also gets a text report of the
    grades computed here (the messages of the failed checks included)."""
    check_limits(timeout, check_time_limit, cell_timeout)
    sets = problem_sets(exercises_dir)
    root = Path(submissions_dir)
    if not root.is_dir():
        raise ValueError(f"submissions folder {root} does not exist")
    paths = sorted(p for p in root.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    cols = columns(sets)
    rows = []
    out = open(out_csv, "w", newline="", encoding="utf-8") if out_csv is not None else None
    try:
        writer = csv.writer(out) if out else None
        if writer:
            writer.writerow(header(cols))
            out.flush()
        for path in paths:
            name = str(path.relative_to(root))
            start = time.monotonic()
            try:
                row = grade_submission(path, sets, timeout, kernel, check_time_limit,
                                       Path(executed_dir) if executed_dir else None, name,
                                       cell_timeout)
            except Exception as exc:              # a grader bug must not cost later rows
                row = Row(submission=name, status=f"not graded: the grader failed: "
                                                  f"{type(exc).__name__}: {str(exc)[:200]}")
            rows.append(row)
            if feedback_dir is not None:
                write_feedback(row, Path(feedback_dir))
            if writer:
                writer.writerow(csv_row(row, cols))
                out.flush()
                os.fsync(out.fileno())
            if log:
                log(f"{name}: {sum(row.scores.values())}/{sum(row.maxima.values())} "
                    f"({row.status}, {time.monotonic() - start:.0f} s)")
    finally:
        if out:
            out.close()
    return rows


def columns(sets: list[ProblemSet]) -> list[str]:
    """Exercise ids of every problem set, in order (ids a submission printed do not count)."""
    return [e.id for s in sets for e in s.exercises]


def header(cols: list[str]) -> list[str]:
    return ["submission", "problem_set", *cols, "total", "max", "status"]


def csv_row(r: Row, cols: list[str]) -> list:
    return [r.submission, r.problem_set, *[r.scores.get(c, "") for c in cols],
            sum(r.scores.values()), sum(r.maxima.values()), r.status]
