"""Generate exercises/ from solutions/.

    python -m minillm.grading.make_exercises solutions exercises [--check]

In a solutions notebook, the answer sits between two marker lines (the nbgrader convention):

    def top_p_filter(logits, p):
        \"\"\"Docstring stays: the learner needs it.\"\"\"
        ### BEGIN SOLUTION
        ...
        ### END SOLUTION

Generation replaces each marked region of a code cell by, at the indentation of the BEGIN line,

        # YOUR CODE HERE
        raise NotImplementedError("Exercise: write the body of top_p_filter")

(a marked region in a markdown cell becomes "YOUR ANSWER HERE"). Every later code cell that
uses a name the stubbed cells define (the function itself, or a launcher around it), or a name
bound by such a cell, gets the cell tag `raises-exception`: until the learner writes the
function it raises NotImplementedError, and with that tag JupyterLab's Run All and nbclient go
on to the next cell instead of stopping, so the later exercises and their checks still run.
Check cells are left alone: a grader reports an unwritten function as a score, it does not
raise. It drops every output,
execution count and `# NBVAL_...` directive line (nbval runs solutions/, never exercises/),
keeps only the kernelspec and the language name as notebook metadata, and writes nbformat's
stable JSON (sorted keys), so the same solutions always give the same bytes. `--check` writes
nothing: it exits with status 1 and names every exercise file that is missing, differs from
what generation would write, or has no solutions notebook.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import nbformat

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
_DEF = re.compile(r"^(\s*)(?:async\s+)?def\s+(\w+)\s*\(")
_NBVAL = re.compile(r"^\s*#\s*NBVAL_[A-Z_]+\s*$")      # nbval directives: for CI of solutions only
_KEEP_CELL_METADATA = ("tags", "deletable", "editable")
RAISES = "raises-exception"          # the cell tag JupyterLab and nbclient honour


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _enclosing_function(lines: list[str], marker_index: int) -> str | None:
    """Name of the innermost `def` that encloses line `marker_index`."""
    depth = len(_indent(lines[marker_index]))
    for line in reversed(lines[:marker_index]):
        m = _DEF.match(line)
        if m and len(m.group(1)) < depth:
            return m.group(2)
    return None


def strip_solutions(source: str, cell_type: str, where: str) -> str:
    """The cell source with every marked region replaced by its stub."""
    lines = source.split("\n")
    out: list[str] = []
    begin = None
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped == BEGIN:
            if begin is not None:
                raise ValueError(f"{where}: '{BEGIN}' on line {i + 1} before the '{END}' of the "
                                 f"region opened on line {begin + 1}; regions cannot nest")
            begin = i
            pad = _indent(line)
            if cell_type == "code":
                name = _enclosing_function(lines, i)
                task = f"write the body of {name}" if name else "fill in this cell"
                out += [f"{pad}# YOUR CODE HERE",
                        f'{pad}raise NotImplementedError("Exercise: {task}")']
            else:
                out.append(f"{pad}YOUR ANSWER HERE")
        elif stripped == END:
            if begin is None:
                raise ValueError(f"{where}: '{END}' on line {i + 1} without a '{BEGIN}' above it")
            begin = None
        elif BEGIN in line or END in line:
            raise ValueError(f"{where}: line {i + 1} mentions a solution marker but is not exactly "
                             f"'{BEGIN}' or '{END}' on a line of its own: {line.strip()!r}")
        elif begin is None:
            out.append(line)
    if begin is not None:
        raise ValueError(f"{where}: '{BEGIN}' on line {begin + 1} has no '{END}'")
    return "\n".join(out)


def _python(source: str) -> str:
    """IPython magics and shell escapes are not Python; blank them out for parsing."""
    return "\n".join("" if l.lstrip().startswith(("%", "!")) else l for l in source.split("\n"))


def _bound_names(tree: ast.Module) -> set[str]:
    """Names a cell binds at its top level: assignments, defs, classes, imports, loop targets."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            names.update(n.id for n in ast.walk(node)
                         if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    return names


def _used_names(tree: ast.Module) -> set[str]:
    """Names a cell reads, except those handed straight to a grader (`chNN.check_xxx(fn)`)."""
    graded = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr.startswith("check_")):
            graded.update(id(a) for a in node.args if isinstance(a, ast.Name))
    return {n.id for n in ast.walk(tree)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and id(n) not in graded}


def tag_cells_that_raise(cells, stub_cells: set[int]) -> None:
    """Add the `raises-exception` tag to every code cell after a stub that depends on it.

    A name is "unsolved" when a stub cell binds it, or when a cell that uses an unsolved name
    binds it; a cell that uses an unsolved name raises until the exercises are written."""
    unsolved: set[str] = set()
    for index, cell in enumerate(cells):
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(_python(cell.source))
        except SyntaxError:
            continue                              # not Python; _check_compiles covers stubs
        if index in stub_cells:
            unsolved |= _bound_names(tree)
        elif _used_names(tree) & unsolved:
            tags = list(cell.metadata.get("tags", []))
            if RAISES not in tags:
                cell.metadata["tags"] = tags + [RAISES]
            unsolved |= _bound_names(tree)


def _check_compiles(source: str, where: str) -> None:
    try:
        compile(_python(source), where, "exec")
    except SyntaxError as exc:
        raise ValueError(f"{where}: the generated stub is not valid Python ({exc.msg}, line "
                         f"{exc.lineno}); keep def lines and docstrings outside the markers and "
                         "put the markers on their own lines inside the body") from None


def make_exercise_notebook(nb: nbformat.NotebookNode, name: str = "notebook"):
    """A new notebook: `nb` with solutions replaced by stubs and all outputs removed."""
    nb = nbformat.from_dict(nb)                  # a deep copy
    marked = 0
    stub_cells = set()
    for index, cell in enumerate(nb.cells):
        where = f"{name} cell {index}"
        if BEGIN in cell.source or END in cell.source:
            marked += 1
            cell.source = strip_solutions(cell.source, cell.cell_type, where)
            if cell.cell_type == "code":
                _check_compiles(cell.source, where)
                stub_cells.add(index)
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in _KEEP_CELL_METADATA}
        if cell.cell_type == "code":
            cell.source = "\n".join(l for l in cell.source.split("\n") if not _NBVAL.match(l))
            cell.outputs = []
            cell.execution_count = None
    if not marked:
        raise ValueError(f"{name} has no '{BEGIN}' region: a problem set needs at least one")
    tag_cells_that_raise(nb.cells, stub_cells)
    meta = {}
    if "kernelspec" in nb.metadata:
        meta["kernelspec"] = nb.metadata["kernelspec"]
    meta["language_info"] = {"name": nb.metadata.get("language_info", {}).get("name", "python")}
    nb.metadata = meta
    return nb


def render(path: Path) -> str:
    """The exact text of the exercise notebook generated from solutions notebook `path`."""
    nb = nbformat.read(str(path), as_version=4)
    text = nbformat.writes(make_exercise_notebook(nb, str(path)))
    return text if text.endswith("\n") else text + "\n"


def make_exercises(solutions_dir, exercises_dir, check: bool = False) -> list[str]:
    """Write (or with check=True only compare) every exercise notebook. Returns the problems
    found in check mode: one sentence per stale, missing or orphaned exercise file."""
    src, dst = Path(solutions_dir), Path(exercises_dir)
    sources = sorted(p for p in src.glob("*.ipynb"))
    if not sources:
        raise ValueError(f"no notebooks in {src}; expected solutions/NN_topic.ipynb files")
    problems = []
    for path in sources:
        target = dst / path.name
        text = render(path)
        if check:
            if not target.exists():
                problems.append(f"{target} is missing")
            elif target.read_text(encoding="utf-8") != text:
                problems.append(f"{target} differs from what {path} generates")
        else:
            dst.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
    names = {p.name for p in sources}
    for extra in sorted(dst.glob("*.ipynb")) if dst.exists() else []:
        if extra.name not in names:
            problems.append(f"{extra} has no solutions notebook {src / extra.name}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillm.grading.make_exercises",
                                 description="Generate exercise notebooks from solutions.")
    ap.add_argument("solutions", help="folder of solutions notebooks (the source)")
    ap.add_argument("exercises", help="folder to write the exercise notebooks to")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 and name each exercise file that is out of date")
    args = ap.parse_args(argv)
    try:
        problems = make_exercises(args.solutions, args.exercises, check=args.check)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        for p in problems:
            print(f"out of date: {p}", file=sys.stderr)
        if problems:
            print("run `make exercises` (python -m minillm.grading.make_exercises solutions "
                  "exercises) and commit the result", file=sys.stderr)
            return 1
        print(f"{args.exercises} is up to date with {args.solutions}")
        return 0
    for p in problems:                           # orphans: reported, never deleted
        print(f"warning: {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
