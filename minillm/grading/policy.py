"""Course policy: a submission must not hand in minillm's own implementation as its answer.

minillm contains the reference for every exercise (`sampling.top_p_filter`, `kvmath`,
`cache.blocks.BlockManager`, ...), and nothing stops a notebook from calling it. Handing it in
does not count as solving the exercise, but the grader cannot tell a wrapper around it from
honest code, so it does not change the score: it flags the submission in the status column
and the instructor decides. Flagged when

- the submitted object itself lives in a minillm module (recorded by the kernel), or
- a cell imports the exercise's function or class from minillm under its own name, or
- the cell that defines it imports from minillm (minillm.grading excepted) or names `minillm`.

Evading this is easy (importlib with a computed name, an earlier cell that stores the reference
under another name); it catches the honest mistake and the lazy copy, not a determined cheat.
"""
from __future__ import annotations

import ast
from typing import Optional


def _parse(source: str) -> Optional[ast.AST]:
    lines = [("pass" if line.lstrip().startswith(("%", "!")) else line)
             for line in source.splitlines()]            # IPython magics are not Python
    try:
        return ast.parse("\n".join(lines))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _minillm_module(name: Optional[str]) -> bool:
    return bool(name) and (name == "minillm" or name.startswith("minillm.")) and \
        not (name == "minillm.grading" or name.startswith("minillm.grading."))


def _defines(tree: ast.AST, title: str) -> bool:
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                node.name == title:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == title
                                                for t in node.targets):
            return True
    return False


def _minillm_uses(tree: ast.AST) -> list[str]:
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            uses += [a.name for a in node.names if _minillm_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and _minillm_module(node.module):
            uses.append(node.module)
        elif isinstance(node, ast.Name) and node.id == "minillm":
            uses.append("minillm")
    return sorted(set(uses))


def reference_use(nb, exercise, run: Optional[dict] = None) -> Optional[str]:
    """A sentence when the submission seems to hand in minillm's own code for `exercise`."""
    title = exercise.title
    origin = (run or {}).get("origin") or {}
    module = origin.get("module") if isinstance(origin.get("module"), str) else ""
    if _minillm_module(module):
        return f"{title} is minillm's own {module}.{origin.get('qualname', '')}"
    defining = None
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        tree = _parse(cell.source)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _minillm_module(node.module) and \
                    any((a.asname or a.name) == title for a in node.names):
                return f"cell {index} imports {title} from {node.module}"
        if _defines(tree, title):
            defining = (index, tree)
    if defining is not None:
        uses = _minillm_uses(defining[1])
        if uses:
            return (f"the cell that defines {title} (cell {defining[0]}) uses "
                    f"{', '.join(uses)}")
    return None
