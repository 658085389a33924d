"""minillm.grading has no import cycle: the graph of its modules' imports, read from the source
with ast (function-level imports included), is acyclic, and transcript.py (the record format,
used by core on the kernel's side and by regrade on the trusted side) imports no module of the
package but the leaf timelimit.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "minillm.grading"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _base(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute name `from <base> import ...` refers to."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    parts = parts if is_package else parts[:-1]               # the module's own package
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """{module: modules of the same package it imports}, every import statement counted,
    wherever it sits (module level, inside a function, under `if`)."""
    paths = {_module_name(p): p for p in sorted(package_dir.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for module, path in paths.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(node, module, is_package)
                # `from pkg import mod` imports the submodule; `from mod import name`, the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                           for a in node.names]
            else:
                continue
            graph[module] |= {t for t in targets if t in paths and t != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle as [a, b, ..., a], or [] when the graph is acyclic (depth-first search)."""
    state: dict[str, int] = {}                              # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "minillm" / "grading"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .core import grade\n")
    (pkg / "core.py").write_text("def grade():\n    from .transcript import x\n")
    (pkg / "transcript.py").write_text("def x():\n    from . import core\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        graph = import_graph(pkg)
    finally:
        ROOT = saved
    assert graph["minillm.grading.core"] == {"minillm.grading.transcript"}
    assert graph["minillm.grading.transcript"] == {"minillm.grading.core"}
    assert find_cycle(graph)


def test_grading_has_no_import_cycle():
    graph = import_graph(ROOT / "minillm" / "grading")
    assert "minillm.grading.core" in graph and graph["minillm.grading.regrade"]
    cycle = find_cycle(graph)
    assert not cycle, ("import cycle in minillm.grading: " + " -> ".join(cycle) + "; move the "
                       "shared code into the module both sides import (or into a new leaf)")


def test_transcript_is_a_leaf():
    graph = import_graph(ROOT / "minillm" / "grading")
    assert graph[f"{PACKAGE}.transcript"] <= {f"{PACKAGE}.timelimit"}, (
        f"transcript.py imports {sorted(graph[PACKAGE + '.transcript'])}: the record format must "
        "not depend on the framework; put replay code in regrade.py")
    assert not graph[f"{PACKAGE}.timelimit"]
