"""Grade a folder of submitted notebooks into a CSV table (the instructor command).

    python -m minillm.grading exercises/ --submissions DIR --out scores.csv

Each `*.ipynb` under DIR is executed top to bottom in a fresh kernel (nbclient), errors and all,
within a per-notebook time limit; the grade lines its check cells print
(`[minillm-grade] ch00.top_p 5/6`) become its row. A submission belongs to the problem set whose
file name it contains (`alice_00_foundations.ipynb` -> 00_foundations); its chapter's exercises
(from minillm.grading.chNN.EXERCISES) count 0 when no grade line appears, e.g. because a cell
failed or the notebook ran out of time. A broken submission gets a row with a status, never a
crash.
"""
from __future__ import annotations

import asyncio
import csv
import importlib
import os
import re
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import nbformat

from .core import Exercise, parse_grade_lines

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


def _stream_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stdout":
                parts.append(out.get("text", ""))
    return "".join(parts)


async def _execute(nb, timeout: float, kernel: str, workdir: str, env: dict) -> str:
    """Run every code cell; returns a status sentence ("ok" or what went wrong)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    client = NotebookClient(nb, timeout=max(1, int(timeout)), kernel_name=kernel,
                            allow_errors=True, record_timing=False, shutdown_kernel="immediate",
                            resources={"metadata": {"path": workdir}})
    client.reset_execution_trackers()
    failed = []
    status = "ok"
    try:
        # the kernel's own stderr (start-up warnings, C-level noise) would clutter the log
        async with client.async_setup_kernel(env=env, stderr=subprocess.DEVNULL):
            deadline = time.monotonic() + timeout           # kernel start-up does not count
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                left = deadline - time.monotonic()
                if left < 1:
                    status = f"stopped: time limit of {timeout:g} s reached before cell {index}"
                    break
                client.timeout = int(left)
                try:
                    await client.async_execute_cell(cell, index)
                except CellTimeoutError:
                    status = f"stopped: time limit of {timeout:g} s reached in cell {index}"
                    break
                except DeadKernelError:
                    status = f"stopped: the kernel died in cell {index}"
                    break
                errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
                if errors:
                    failed.append(f"{index} ({errors[0].get('ename', 'error')})")
    except Exception as exc:                     # kernel did not start, client failure, ...
        status = f"stopped: {type(exc).__name__}: {exc}"
    if failed:
        status = ("" if status == "ok" else status + "; ") + "errors in cells " + ", ".join(failed)
    return status


def _run_async(coro):
    """asyncio.run, also from inside a running event loop (e.g. called from a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result = []
    worker = threading.Thread(target=lambda: result.append(asyncio.run(coro)))
    worker.start()
    worker.join()
    return result[0]


def grade_submission(path: Path, sets: list[ProblemSet], timeout: float = 300,
                     kernel: str = "python3", check_time_limit: Optional[float] = None,
                     executed_dir: Optional[Path] = None, name: Optional[str] = None) -> Row:
    """Execute one submitted notebook and read its grade lines. Never raises for a bad file."""
    row = Row(submission=name or path.name)
    ps = match_problem_set(path, sets)
    if ps is not None:
        row.problem_set = ps.stem
        row.maxima = {e.id: e.max for e in ps.exercises}
        row.scores = {e.id: 0 for e in ps.exercises}
    try:
        nb = nbformat.read(str(path), as_version=4)
    except Exception as exc:
        row.status = f"not a readable notebook: {type(exc).__name__}: {str(exc)[:200]}"
        return row
    env = dict(os.environ)
    if check_time_limit is not None:
        env["MINILLM_GRADE_TIME_LIMIT"] = str(check_time_limit)
    with tempfile.TemporaryDirectory(prefix="minillm-grade-") as workdir:
        row.status = _run_async(_execute(nb, timeout, kernel, workdir, env))
    if executed_dir is not None:
        executed_dir.mkdir(parents=True, exist_ok=True)
        flat = (name or path.name).replace("/", "__").replace(os.sep, "__")
        nbformat.write(nb, str(executed_dir / flat))
    for exercise, (score, top) in parse_grade_lines(_stream_text(nb)).items():
        row.scores[exercise] = score
        row.maxima[exercise] = top
    if ps is None:
        row.status = (row.status + "; " if row.status != "ok" else "") + \
            "file name names no problem set of the exercises folder"
    return row


def grade_folder(exercises_dir, submissions_dir, out_csv=None, timeout: float = 300,
                 kernel: str = "python3", check_time_limit: Optional[float] = None,
                 executed_dir=None, log=print) -> list[Row]:
    """Grade every notebook under `submissions_dir`; write the CSV when `out_csv` is given."""
    sets = problem_sets(exercises_dir)
    root = Path(submissions_dir)
    if not root.is_dir():
        raise ValueError(f"submissions folder {root} does not exist")
    paths = sorted(p for p in root.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    rows = []
    for path in paths:
        name = str(path.relative_to(root))
        start = time.monotonic()
        row = grade_submission(path, sets, timeout, kernel, check_time_limit,
                               Path(executed_dir) if executed_dir else None, name)
        rows.append(row)
        if log:
            total = sum(row.scores.values())
            log(f"{name}: {total}/{sum(row.maxima.values())} ({row.status}, "
                f"{time.monotonic() - start:.0f} s)")
    if out_csv is not None:
        write_csv(rows, sets, out_csv)
    return rows


def columns(rows: list[Row], sets: list[ProblemSet]) -> list[str]:
    """Exercise ids: those of the problem sets in order, then any other id a submission printed."""
    cols = [e.id for s in sets for e in s.exercises]
    for row in rows:
        cols += [x for x in row.scores if x not in cols]
    return cols


def write_csv(rows: list[Row], sets: list[ProblemSet], out_csv) -> None:
    cols = columns(rows, sets)
    with open(out_csv, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["submission", "problem_set", *cols, "total", "max", "status"])
        for r in rows:
            w.writerow([r.submission, r.problem_set, *[r.scores.get(c, "") for c in cols],
                        sum(r.scores.values()), sum(r.maxima.values()), r.status])
