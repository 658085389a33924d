"""Where the drill keeps its files, and reading them without ever losing one.

Progress (quiz history) and review state (FSRS cards) are JSON files in
`$MINILLM_CACHE/drill/` (default `~/.cache/minillm/drill/`). A file that cannot be read is not
overwritten: it is renamed to `NAME.corrupt-YYYYmmdd-HHMMSS`, a one-line warning says where it
went, and the drill starts from an empty state. "Cannot be read" covers valid JSON of the wrong
shape too: every file is checked against the shape its reader expects (`check`), so a hand-edited
`{"attempts": []}` is set aside once instead of failing every later run.

    progress.json   {"attempts": {question id: [{"t": number, "score": number, "seed": str}, ...]}}
    review.json     {question id: an FSRS Card.to_dict() (card_id, state, due, ...)}
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def drill_dir() -> Path:
    base = Path(os.environ.get("MINILLM_CACHE", Path.home() / ".cache" / "minillm"))
    return base / "drill"


class StateError(ValueError):
    """A state file exists but is not a file the drill can read or replace (a folder, no
    permission); the message names the path and the fix."""


def load_json(path: Path, default, warn=None, check=None):
    """The JSON in path, or `default` when it does not exist. A corrupt file, or one whose shape
    `check(data)` rejects by raising ValueError/TypeError/KeyError, is set aside."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    path = Path(path)
    if not path.exists():
        return default
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, type(default)):
            raise ValueError(f"expected a JSON {type(default).__name__}, "
                             f"found {type(data).__name__}")
        if check is not None:
            check(data)
        return data
    except OSError as exc:
        raise StateError(f"cannot read {path} ({exc.strerror or exc}); remove or rename it, or "
                         "point MINILLM_CACHE at another folder") from None
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while aside.exists():
            aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
            n += 1
        try:
            path.rename(aside)
        except OSError as err:
            raise StateError(f"{path} could not be read ({_one_line(exc)}) nor moved aside "
                             f"({err.strerror}); move it away by hand") from None
        warn(f"warning: {path} could not be read ({_one_line(exc)}); it was moved to {aside} and "
             "a fresh file will be started. Nothing was deleted.")
        return default


def _one_line(exc) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def check_progress(data) -> None:
    """Raise ValueError unless `data` has the shape of progress.json (see the module docstring)."""
    attempts = data.get("attempts", {})
    if not isinstance(attempts, dict):
        raise ValueError(f'"attempts" should map question ids to lists, found '
                         f"{type(attempts).__name__}")
    for qid, rows in attempts.items():
        if not isinstance(rows, list):
            raise ValueError(f"attempts of {qid!r} should be a list, found {type(rows).__name__}")
        for row in rows:
            if not (isinstance(row, dict)
                    and all(isinstance(row.get(k), (int, float)) and not isinstance(row[k], bool)
                            for k in ("t", "score"))):
                raise ValueError(f"an attempt of {qid!r} is not "
                                 f'{{"t": number, "score": number, "seed": ...}}: {row!r:.60}')


def save_json(path: Path, data) -> None:
    """Write atomically: a crash mid-write leaves the old file intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


class Progress:
    """Quiz history: per question id, a list of {"t": unix time, "score": float, "seed": ...}."""

    def __init__(self, path=None, warn=None):
        self.path = Path(path) if path else drill_dir() / "progress.json"
        self.data = load_json(self.path, {}, warn, check_progress)
        self.data.setdefault("attempts", {})

    def record(self, qid: str, score: float, seed, when: float = None) -> None:
        self.data["attempts"].setdefault(qid, []).append(
            {"t": time.time() if when is None else when, "score": round(float(score), 4),
             "seed": str(seed)})

    def save(self) -> None:
        save_json(self.path, self.data)

    def attempts(self, qid: str) -> list:
        return self.data["attempts"].get(qid, [])
