"""exercises/ is generated from solutions/: these tests fail when the two drift, and pin down how
generation turns a marked solution into a callable stub."""
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from minillm.grading import parse_grade_lines
from minillm.grading.batch import chapter_exercises
from minillm.grading.make_exercises import (BEGIN, END, main, make_exercise_notebook,
                                            make_exercises, render, strip_solutions)
from minillm.grading.testing import function_from_notebook

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS, EXERCISES = ROOT / "solutions", ROOT / "exercises"
NOTEBOOKS = sorted(p.name for p in SOLUTIONS.glob("*.ipynb"))
MARKED_DEF = re.compile(r"^def (\w+)\(", re.MULTILINE)


def test_there_are_problem_sets():
    assert {"00_foundations.ipynb", "01_kv_cache_math.ipynb"} <= set(NOTEBOOKS)


def test_committed_exercises_match_what_solutions_generate():
    problems = make_exercises(SOLUTIONS, EXERCISES, check=True)
    assert problems == [], "run `make exercises`:\n" + "\n".join(problems)


def test_check_command_names_a_stale_a_missing_and_an_orphan_file(tmp_path):
    sol, ex = tmp_path / "solutions", tmp_path / "exercises"
    sol.mkdir()
    first, second = "00_foundations.ipynb", "01_kv_cache_math.ipynb"
    for name in (first, second):
        shutil.copy(SOLUTIONS / name, sol / name)
    assert main([str(sol), str(ex)]) == 0
    assert main([str(sol), str(ex), "--check"]) == 0
    assert (ex / first).read_bytes() == (EXERCISES / first).read_bytes()
    stale = ex / first
    stale.write_text(stale.read_text().replace("YOUR CODE HERE", "YOUR CODE THERE", 1))
    (ex / second).unlink()
    (ex / "99_orphan.ipynb").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "minillm.grading.make_exercises", str(sol),
                           str(ex), "--check"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert f"{stale} differs" in proc.stderr
    assert f"{ex / second} is missing" in proc.stderr
    assert "99_orphan.ipynb has no solutions notebook" in proc.stderr
    assert main([str(sol), str(ex)]) == 0                # regenerate: up to date again
    (ex / "99_orphan.ipynb").unlink()
    assert main([str(sol), str(ex), "--check"]) == 0
    assert stale.read_bytes() == (EXERCISES / first).read_bytes()


def test_generation_is_deterministic():
    for name in NOTEBOOKS:
        assert render(SOLUTIONS / name) == render(SOLUTIONS / name)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_exercise_notebooks_have_stubs_and_no_outputs_or_answers(name):
    nb = nbformat.read(str(EXERCISES / name), as_version=4)
    text = (EXERCISES / name).read_text()
    assert BEGIN not in text and END not in text and "NBVAL_" not in text
    assert set(nb.metadata) == {"kernelspec", "language_info"}
    stubs = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        assert cell.outputs == [] and cell.execution_count is None
        compile(cell.source, name, "exec")
        stubs += cell.source.count("raise NotImplementedError(\"Exercise: write the body of")
    assert stubs >= 2


def _marked_top_level_functions(source):
    """Names of the undecorated top-level functions whose body holds a solution region."""
    lines = source.split("\n")
    names = []
    for i, line in enumerate(lines):
        if line.strip() == BEGIN:
            for j in range(i - 1, -1, -1):
                if lines[j] and not lines[j][0].isspace():          # the top-level statement
                    m = MARKED_DEF.match(lines[j])
                    if m and not (j and lines[j - 1].startswith("@")):
                        names.append(m.group(1))
                    break
    return names


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_stub_keeps_its_signature_and_docstring_and_raises(name):
    sol_nb = nbformat.read(str(SOLUTIONS / name), as_version=4)
    marked = [c.source for c in sol_nb.cells if c.cell_type == "code" and BEGIN in c.source]
    assert marked
    for source in marked:
        for fname in _marked_top_level_functions(source):
            solved = function_from_notebook(SOLUTIONS / name, fname)
            stub = function_from_notebook(EXERCISES / name, fname)
            assert inspect.signature(stub) == inspect.signature(solved)
            assert stub.__doc__ and stub.__doc__ == solved.__doc__
            args = [None] * len(inspect.signature(stub).parameters)
            with pytest.raises(NotImplementedError, match=f"Exercise: write the body of {fname}"):
                stub(*args)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_solutions_are_committed_with_full_marks_for_every_exercise(name):
    nb = nbformat.read(str(SOLUTIONS / name), as_version=4)
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.outputs if o.get("output_type") == "stream")
    grades = parse_grade_lines(printed)
    registered = {e.id: e.max for e in chapter_exercises(name[:2])}
    assert registered, f"no minillm.grading.ch{name[:2]}.EXERCISES"
    assert grades == {k: (m, m) for k, m in registered.items()}


# ------------------------------------------------------------------ the generator itself

def test_stub_replaces_the_region_at_its_indentation():
    source = "\n".join([
        "import torch",
        "",
        "class Box:",
        "    def area(self, w, h):",
        '        """Docstring stays."""',
        "        " + BEGIN,
        "        a = w * h",
        "        return a",
        "        " + END,
        "",
        "x = 1",
    ])
    assert strip_solutions(source, "code", "t") == "\n".join([
        "import torch",
        "",
        "class Box:",
        "    def area(self, w, h):",
        '        """Docstring stays."""',
        "        # YOUR CODE HERE",
        '        raise NotImplementedError("Exercise: write the body of area")',
        "",
        "x = 1",
    ])


def test_top_level_region_and_markdown_region():
    assert strip_solutions(f"{BEGIN}\ny = 2\n{END}\nprint(y)", "code", "t") == (
        '# YOUR CODE HERE\nraise NotImplementedError("Exercise: fill in this cell")\nprint(y)')
    assert strip_solutions(f"Why?\n{BEGIN}\nBecause.\n{END}", "markdown", "t") == \
        "Why?\nYOUR ANSWER HERE"


@pytest.mark.parametrize("source, words", [
    (f"def f():\n    {BEGIN}\n    return 1\n", "has no"),
    (f"def f():\n    return 1\n    {END}\n", "without"),
    (f"def f():\n    {BEGIN}\n    {BEGIN}\n    return 1\n    {END}\n", "cannot nest"),
    (f"def f():\n    x = 1  {BEGIN}\n    return 1\n", "line of its own"),
])
def test_malformed_markers_are_rejected_with_the_place(source, words):
    with pytest.raises(ValueError, match=words) as info:
        strip_solutions(source, "code", "demo.ipynb cell 3")
    assert "demo.ipynb cell 3" in str(info.value)


def test_generated_notebook_drops_outputs_metadata_and_nbval_lines():
    nb = new_notebook()
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                  "language": "python"},
                   "language_info": {"name": "python", "version": "3.11.7"}, "widgets": {}}
    code = new_code_cell(f"# NBVAL_CHECK_OUTPUT\ndef f(x):\n    {BEGIN}\n    return x\n    {END}",
                         execution_count=3,
                         metadata={"execution": {"iopub.status.idle": "2025"}, "tags": ["keep"]})
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="hi\n")]
    nb.cells = [new_markdown_cell("# title"), code]
    out = make_exercise_notebook(nb, "demo")
    cell = out.cells[1]
    assert cell.outputs == [] and cell.execution_count is None
    assert cell.metadata == {"tags": ["keep"]}
    assert "NBVAL" not in cell.source and "raise NotImplementedError" in cell.source
    assert out.metadata == {"kernelspec": nb.metadata["kernelspec"],
                            "language_info": {"name": "python"}}
    assert nb.cells[1].outputs, "the input notebook must not be modified"


def test_a_notebook_without_regions_or_with_a_broken_stub_is_rejected():
    nb = new_notebook(cells=[new_code_cell("x = 1")])
    with pytest.raises(ValueError, match="no '### BEGIN SOLUTION' region"):
        make_exercise_notebook(nb, "plain")
    nb = new_notebook(cells=[new_code_cell(f"if True:\n{BEGIN}\n    x = 1\n{END}")])
    with pytest.raises(ValueError, match="not valid Python"):
        make_exercise_notebook(nb, "broken")


# ---------------------------------------------------------------- Run All goes past unsolved cells

def test_cells_that_use_an_unsolved_function_are_tagged_and_check_cells_are_not():
    # a grader handed the function by name reports it unwritten and does not raise; a check
    # handed a lambda around it (cell 10) is tagged too: harmless, the tag only allows an error
    nb = new_notebook(cells=[
        new_code_cell("from minillm.grading import ch00\nimport torch"),              # 0
        new_code_cell(f"def f(x):\n    {BEGIN}\n    return x\n    {END}\n\n\n"
                      "def launch(x):\n    return f(x)"),                             # 1 stub
        new_code_cell("result = ch00.check_top_p(f)"),                                # 2 check
        new_code_cell("result = ch00.check_top_p(launch)"),                           # 3 check
        new_code_cell("y = launch(3)\nz = 1"),                                        # 4 raises
        new_code_cell("print(z + 1)"),                                                # 5 via 4
        new_code_cell("print(torch.ones(2))\n%time 1"),                               # 6 unrelated
        new_code_cell("def g():\n    return f(2)\n\n\ng()"),                          # 7 inside def
        new_code_cell("plain = 2", metadata={"tags": ["keep"]}),                      # 8
        new_code_cell("print(result, plain)", metadata={"tags": ["keep"]}),           # 9
        new_code_cell("w = ch00.check_top_p(lambda v: f(v))"),                        # 10 wrapped
    ])
    out = make_exercise_notebook(nb, "demo")
    tagged = [i for i, c in enumerate(out.cells)
              if "raises-exception" in c.metadata.get("tags", [])]
    assert tagged == [4, 5, 7, 10]
    assert out.cells[8].metadata == {"tags": ["keep"]} == out.cells[9].metadata
    assert "tags" not in nb.cells[4].metadata, "the input notebook must not be modified"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_tagged_cell_uses_an_exercise_and_no_check_cell_is_tagged(name):
    nb = nbformat.read(str(EXERCISES / name), as_version=4)
    stub_at = min(i for i, c in enumerate(nb.cells) if "raise NotImplementedError" in c.source)
    tagged = [(i, c) for i, c in enumerate(nb.cells)
              if "raises-exception" in c.metadata.get("tags", [])]
    assert tagged, "illustration cells after an exercise use the learner's function"
    for i, cell in tagged:
        assert i > stub_at and ".check_" not in cell.source, cell.source


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_run_all_on_an_unsolved_problem_set_reaches_every_check(name):
    """What a learner gets from Run All on the untouched exercise notebook: nbclient stops at a
    cell that raises unless it carries the raises-exception tag (JupyterLab's Run All does the
    same), so every exercise's check must still run and print its grade line, with 0."""
    from nbclient import NotebookClient
    nb = nbformat.read(str(EXERCISES / name), as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()   # raises if stuck
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.outputs if o.get("output_type") == "stream")
    assert parse_grade_lines(printed) == {e.id: (0, e.max) for e in chapter_exercises(name[:2])}
    raised = {i for i, c in enumerate(nb.cells) if c.cell_type == "code"
              and any(o.output_type == "error" for o in c.outputs)}
    tagged = {i for i, c in enumerate(nb.cells) if "raises-exception" in c.metadata.get("tags", [])}
    assert raised == tagged, "a tagged cell that does not raise is tagged for nothing"
