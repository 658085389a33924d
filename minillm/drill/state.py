"""Where the drill keeps its files, and reading them without ever losing one.

Progress (quiz history) and review state (FSRS cards) are JSON files in
`$MINILLM_CACHE/drill/` (default `~/.cache/minillm/drill/`). A file that cannot be read is not
overwritten: it is renamed to `NAME.corrupt-YYYYmmdd-HHMMSS`, a warning says where it went, and
the drill starts from an empty state.
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


def load_json(path: Path, default, warn=None):
    """The JSON in path, or `default` when it does not exist. A corrupt file is set aside."""
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
        return data
    except (ValueError, UnicodeDecodeError) as exc:
        aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while aside.exists():
            aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
            n += 1
        path.rename(aside)
        warn(f"warning: {path} could not be read ({exc}); it was moved to {aside} and a fresh "
             "file will be started. Nothing was deleted.")
        return default


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
        self.data = load_json(self.path, {}, warn)
        self.data.setdefault("attempts", {})

    def record(self, qid: str, score: float, seed, when: float = None) -> None:
        self.data["attempts"].setdefault(qid, []).append(
            {"t": time.time() if when is None else when, "score": round(float(score), 4),
             "seed": str(seed)})

    def save(self) -> None:
        save_json(self.path, self.data)

    def attempts(self, qid: str) -> list:
        return self.data["attempts"].get(qid, [])
