"""Committed lecture outputs are as new as the code they report on (issue 18).

A notebook's saved output is what a reader sees on GitHub without running anything. When the code
it reports on changes (a question added to the bank, a section relinked), the saved text goes
stale silently: nbval in CI re-runs cells but compares outputs only where a cell says
NBVAL_CHECK_OUTPUT. Here the key figure cells are recomputed from today's code and compared with
the committed text, so a stale output fails without executing the notebook.
"""
import collections
import json
from pathlib import Path

import pytest

from minillm import drill

ROOT = Path(__file__).resolve().parents[1]


def committed(nb: str, marker: str) -> tuple:
    """(source, printed text) of the one code cell of `nb` whose source contains `marker`."""
    cells = [c for c in json.loads((ROOT / nb).read_text())["cells"]
             if c["cell_type"] == "code" and marker in "".join(c["source"])]
    assert len(cells) == 1, f"{nb}: {len(cells)} cells contain {marker!r}"
    cell = cells[0]
    text = "".join("".join(o.get("text", "")) for o in cell["outputs"]
                   if o.get("output_type") == "stream")
    return "".join(cell["source"]), text


def drill_counts() -> str:
    bank = drill.load_bank()
    taught = [q for q in bank if not q.not_taught]
    return (f"{sorted(collections.Counter(q.chapter for q in taught).items())}\n"
            f"not taught in this course yet: {len(bank) - len(taught)} questions, each with a "
            "public source\n")


CASES = [
    ("notebooks/99_interview_drill.ipynb", "collections.Counter(q.chapter", drill_counts),
    ("notebooks/99_interview_drill.ipynb", "questions\")\nassert len(bank)",
     lambda: f"{len(drill.load_bank())} questions\n"),
    ("notebooks/99_interview_drill.ipynb", "print(collections.Counter(q.kind",
     lambda: f"{collections.Counter(q.kind for q in drill.load_bank())}\n"),
]


@pytest.mark.parametrize("nb,marker,expected", CASES, ids=[c[1][:30] for c in CASES])
def test_committed_figures_match_todays_code(nb, marker, expected):
    _, text = committed(nb, marker)
    assert text == expected(), f"{nb}: the committed output is stale; re-execute the notebook"


def test_the_chapter_count_cell_is_pinned_for_nbval():
    src, _ = committed("notebooks/99_interview_drill.ipynb", "collections.Counter(q.chapter")
    assert src.startswith("# NBVAL_CHECK_OUTPUT")
