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


# --- chapters 06-08: pinned key-figure cells, re-run from their own source ---------------------
# Each cell below is self-contained (given the prelude): it recomputes its figures from lab code
# or reads the newest recorded benchmark JSON. Its committed text must be what it prints today, so
# a changed simulator or a newer benchmark record without a re-executed notebook fails here.
SELF_CONTAINED = [
    ("notebooks/06_prefix_caching.ipynb", "scan_trace(rounds=8", ""),
    ("notebooks/06_prefix_caching.ipynb", 'glob("prefix_cpu_*.json")', "import minillm"),
    ("notebooks/07_speculative_decoding.ipynb", "break-even acceptance alpha",
     "from minillm.spec import theory"),
    ("notebooks/08_serving.ipynb", 'glob("serve_cpu_*.json")', "import minillm"),
]


def printed_today(src: str, prelude: str) -> str:
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(prelude + "\n" + src, "<cell>", "exec"), {"__name__": "cell"})
    return out.getvalue()


@pytest.mark.parametrize("nb,marker,prelude", SELF_CONTAINED,
                         ids=[f"{c[0][10:12]}-{c[1][:20]}" for c in SELF_CONTAINED])
def test_pinned_key_figures_are_what_their_cell_prints_today(nb, marker, prelude):
    src, text = committed(nb, marker)
    assert src.startswith("# NBVAL_CHECK_OUTPUT") or "json" in src, "pin it or read a record"
    assert text == printed_today(src, prelude), \
        f"{nb}: the committed output is stale; re-execute the notebook"


def test_the_stale_check_can_fail():
    """One changed figure in a committed text is told apart from what the cell prints today."""
    nb, marker, prelude = SELF_CONTAINED[2]
    src, text = committed(nb, marker)
    stale = text.replace("0.17", "0.18", 1)
    assert stale != text and stale != printed_today(src, prelude)
