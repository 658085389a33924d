"""Helpers for testing graders against the real notebook text (used by tests/test_grading.py).

    solution = function_from_notebook("solutions/00_foundations.ipynb", "top_p_filter")
    stub = function_from_notebook("exercises/00_foundations.ipynb", "top_p_filter")

Convention that makes this work: the code cell that defines an exercise function is
self-contained (it imports what it uses and defines nothing the grader needs from elsewhere).
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat


def function_source(path, name: str) -> str:
    """Source of the one code cell of notebook `path` that defines `def name(` or `class name`
    at top level (an exercise may be a function or a class)."""
    nb = nbformat.read(str(path), as_version=4)
    pattern = re.compile(rf"^(def {re.escape(name)}\s*\(|class {re.escape(name)}\b)",
                         re.MULTILINE)
    cells = [c.source for c in nb.cells if c.cell_type == "code" and pattern.search(c.source)]
    if len(cells) != 1:
        raise ValueError(f"{path}: expected exactly one code cell defining {name}, "
                         f"found {len(cells)}")
    return cells[0]


def function_from_notebook(path, name: str):
    """Execute that cell in a fresh namespace and return the function (or class) it
    defines."""
    source = function_source(path, name)
    namespace = {"__name__": f"notebook_{Path(path).stem}"}
    exec(compile(source, f"<{Path(path).name}: {name}>", "exec"), namespace)
    return namespace[name]
