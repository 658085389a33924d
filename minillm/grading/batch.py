"""Grade a folder of submitted notebooks into a CSV table (the instructor command).

    python -m minillm.grading exercises/ --submissions DIR --out scores.csv

A submission belongs to the problem set whose name its file name contains
(`alice_00_foundations.ipynb` -> 00_foundations). Each one is run from cleared outputs in a fresh
kernel under a per-submission supervisor (supervisor.py: own session, every cell under a time
limit, every process killed at the end), with empty folders of its own for HOME, IPYTHONDIR,
Jupyter and matplotlib state (isolated_environment), removed afterwards: what one submission
leaves there cannot reach the next one's kernel. Only regular files are opened as submissions.
Its check cells record what the learner's code answered as plain data (transcript.py); this
process then re-runs every check of the problem set itself against those answers (regrade.py).
Printed grade lines, stale outputs and a patched grader in the notebook count for nothing; a
check that never answered fails. Each CSV row is written as soon as its submission is graded. A
broken or hostile submission gets a row with a status, never a crash.
"""
from __future__ import annotations

import csv
import importlib
import json
import os
import re
import secrets
import shutil
import signal
import stat
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
MAX_SUBMISSION_BYTES = MAX_RECORD_BYTES   # a larger notebook is refused unread

# Per-user state a kernel reads at start-up or writes for later processes (an IPython startup
# file, Jupyter or matplotlib config, user site-packages, caches): each submission's kernel gets
# fresh, empty folders of its own, removed with the submission's work folder.
ISOLATED_DIRS = {"HOME": "home", "IPYTHONDIR": "ipython", "JUPYTER_CONFIG_DIR": "jupyter-config",
                 "JUPYTER_DATA_DIR": "jupyter-data", "JUPYTER_RUNTIME_DIR": "jupyter-runtime",
                 "MPLCONFIGDIR": "matplotlib", "XDG_CONFIG_HOME": "xdg-config",
                 "XDG_CACHE_HOME": "xdg-cache", "XDG_DATA_HOME": "xdg-data"}
# instructor's settings that would point a kernel back at shared writable state
DROPPED_ENV = ("JUPYTER_PATH", "JUPYTER_CONFIG_PATH", "PYTHONSTARTUP", "PYTHONUSERBASE",
               "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def isolated_environment(work: Path) -> dict:
    """{variable: value} that gives one submission's kernel its own empty HOME, IPYTHONDIR,
    Jupyter and matplotlib folders (created under `work`) and no user site-packages; the
    variables of DROPPED_ENV map to None (removed)."""
    env: dict = {name: None for name in DROPPED_ENV}
    for name, sub in ISOLATED_DIRS.items():
        folder = work / "isolated" / sub
        folder.mkdir(parents=True, mode=0o700)
        env[name] = str(folder)
    env["PYTHONNOUSERSITE"] = "1"
    return env


def remove_tree(folder: Path) -> None:
    """Remove `folder` even where the submission took away its own permissions to do so."""
    for root, dirs, _ in os.walk(folder):
        for name in dirs:
            try:
                os.chmod(os.path.join(root, name), 0o700, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass
    shutil.rmtree(folder, ignore_errors=True)


def output_name(submission: str) -> str:
    """A flat file name for a submission's relative path, distinct for distinct paths:
    `dup/x.ipynb` -> `dup%2Fx.ipynb`, while `dup__x.ipynb` stays itself ('%' is escaped too)."""
    return submission.replace("%", "%25").replace("/", "%2F").replace(os.sep, "%2F")


def read_submission(path: Path) -> tuple[Optional[bytes], str]:
    """(the file's bytes, "") or (None, why it was refused). Only a regular file is opened: a
    symlink, FIFO, device or folder is refused without reading anything from it."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return None, f"refused: cannot be examined ({exc.strerror}); not run"
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
             (stat.S_ISDIR, "a folder"), (stat.S_ISSOCK, "a socket"))
    kind = next((what for test, what in kinds if test(info.st_mode)), "a device or special file")
    if not stat.S_ISREG(info.st_mode):
        return None, f"refused: {kind}, not a regular file; not run (submit the notebook itself)"
    try:
        return read_regular_file(path, MAX_SUBMISSION_BYTES, "the submission's bytes"), ""
    except BadRecord:
        return None, (f"refused: not a regular file of at most {MAX_SUBMISSION_BYTES:,} bytes; "
                      "not run")
    except OSError as exc:
        return None, f"refused: cannot be opened as a regular file ({exc.strerror}); not run"


def _mentions(nb, ps: ProblemSet) -> bool:
    """Whether a code cell names the problem set's grader module (`chNN`) or defines one of its
    functions."""
    chapter = ps.stem[:2]
    names = "|".join(re.escape(e.title) for e in ps.exercises)
    pattern = re.compile(rf"\bch{chapter}\b" + (rf"|\b(?:def|class)\s+(?:{names})\b" if names
                                                  else ""))
    return any(cell.cell_type == "code" and pattern.search(cell.source) for cell in nb.cells)


def other_problem_set(nb, ps: ProblemSet, sets: list[ProblemSet]) -> Optional[str]:
    """None when the notebook holds an exercise of `ps` (or `ps` has none), else a status
    saying it is not that problem set and, when one fits, which one it looks like."""
    if not ps.exercises or _mentions(nb, ps):
        return None
    others = [s.stem for s in sets if s is not ps and s.exercises and _mentions(nb, s)]
    looks = f" (it looks like {others[0]}: rename the file to name that problem set)" \
        if len(others) == 1 else ""
    return (f"wrong problem set: the file name says {ps.stem}, but the notebook holds none of "
            f"its exercises{looks}; not run")


def _cleared(nb):
    """The notebook with every output and execution count removed: nothing stale can count."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


def _run(path_nb: Path, work: Path, timeout: float, cell_timeout: float, kernel: str,
         check_time_limit: float, executed: Optional[Path]) -> tuple[str, Path]:
    """Run the cleared notebook under a supervisor; (status sentence, transcript path). The
    kernel gets the fresh folders of isolated_environment(work)."""
    records = work / "records.jsonl"
    records.touch()
    cwd = work / "cwd"
    cwd.mkdir()
    marker = secrets.token_hex(12)
    config = work / "config.json"
    config.write_text(json.dumps({
        "notebook": str(path_nb), "cwd": str(cwd), "kernel": kernel, "timeout": timeout,
        "cell_timeout": cell_timeout, "startup_timeout": STARTUP_TIMEOUT, "marker": marker,
        "executed": str(executed) if executed else None,
        "kernel_env": isolated_environment(work)}))
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
    data, refused = read_submission(path)
    if data is None:
        row.status = refused
        return row
    try:
        nb = nbformat.reads(data.decode("utf-8"), as_version=4)
    except Exception as exc:
        row.status = f"not a readable notebook: {type(exc).__name__}: {str(exc)[:200]}"
        return row
    wrong_set = other_problem_set(nb, ps, sets)
    if wrong_set:
        row.status = wrong_set
        return row
    work = Path(tempfile.mkdtemp(prefix="minillm-grade-"))
    try:
        _grade_in(work, nb, row, ps, timeout, cell_limit, kernel, limit, executed_dir,
                  output_name(name or path.name))
    finally:
        remove_tree(work)
    return row


def _grade_in(work: Path, nb, row: Row, ps: ProblemSet, timeout: float, cell_limit: float,
              kernel: str, limit: float, executed_dir: Optional[Path], flat: str) -> None:
    """Run the notebook in the work folder `work` and fill `row` with its grades."""
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
            (executed_dir / flat).write_bytes(data)


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
    flat = output_name(row.submission)
    if flat.endswith(".ipynb"):
        flat = flat[:-len(".ipynb")]
    text = [f"{row.submission} ({row.problem_set or 'no problem set'}): "
            f"{sum(row.scores.values())}/{sum(row.maxima.values())}", f"status: {row.status}", ""]
    text += [str(result) + "\n" for result in row.results.values()]
    (folder / (flat + ".txt")).write_text("\n".join(text), encoding="utf-8")


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
