"""The package's layer rules (COURSE.md section 4, issue 16 item 6), checked on the source with
`ast`.

Every module of minillm/ belongs to one layer:

    engine   what a reader studies as "how an inference engine works": the package __init__,
             __main__ (the `python -m minillm generate | serve` command line), configs, kvmath,
             model, loader, sampling, generate, metrics, roofline, and cache.*, kernels.*,
             engine.*, spec.* (train_medusa too: it trains the chapter-07 heads with the engine
             and needs nothing else), serve.*, quant.*
    lab      minillm.lab.*: simulators, workloads, traces, replays, drawings the lectures use
    tooling  minillm.grading.*, minillm.drill.*: course tooling (each has its own
             `python -m minillm.grading | minillm.drill` entry point, so the engine's CLI needs
             neither)

Rules (every import counts: module level or inside a function, absolute or relative, and
`importlib.import_module("...")` / `__import__("...")` with a literal name):
    1. the engine never imports minillm.lab, minillm.viz, minillm.grading or minillm.drill;
    2. the lab imports the engine, never grading or drill;
    3. a module that fits no layer fails: add it to LAYERS below, deliberately.
Grading and drill may import the engine and the lab.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "minillm"

# layer -> module names (exact) and package prefixes (the package and everything below it)
LAYERS = {
    "engine": {"exact": {"minillm", "minillm.__main__", "minillm.configs", "minillm.kvmath",
                         "minillm.model", "minillm.loader", "minillm.sampling", "minillm.generate",
                         "minillm.metrics", "minillm.roofline"},
               "packages": {"minillm.cache", "minillm.kernels", "minillm.engine", "minillm.spec",
                            "minillm.serve", "minillm.quant", "minillm.parallel"}},
    "lab": {"exact": set(), "packages": {"minillm.lab"}},
    "tooling": {"exact": set(), "packages": {"minillm.grading", "minillm.drill"}},
}
# layer -> modules it must not import (a name and everything below it)
FORBIDDEN = {
    "engine": ("minillm.lab", "minillm.viz", "minillm.grading", "minillm.drill"),
    "lab": ("minillm.grading", "minillm.drill"),
    "tooling": (),
}


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(module: str):
    """The layer a module belongs to, or None."""
    for layer, members in LAYERS.items():
        if module in members["exact"] or any(_within(module, p) for p in members["packages"]):
            return layer
    return None


def imported_names(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in `source`, wherever it sits.

    `from X import y` yields X and X.y (y may be a submodule: `from minillm import viz`).
    Relative imports are resolved against the module's package (`from ..lab import viz` in
    minillm.cache.blocks -> minillm.lab, minillm.lab.viz)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    raise ValueError(f"{module}:{node.lineno}: relative import beyond the "
                                     "top package")
                base = ".".join(parts[:len(parts) - (node.level - 1)] + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call) and node.args and _is_dynamic_import(node.func):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((node.lineno, arg.value))
    return found


def _is_dynamic_import(func) -> bool:
    """importlib.import_module(...), import_module(...) or __import__(...)."""
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("import_module", "__import__")


def violations(module: str, source: str, is_package: bool, path: str) -> list[str]:
    """One message per import that breaks the rule of `module`'s layer."""
    layer = layer_of(module)
    worst: dict = {}                      # (line, forbidden package) -> the most specific name
    for line, name in imported_names(source, module, is_package):
        bad = next((p for p in FORBIDDEN.get(layer, ()) if _within(name, p)), None)
        if bad and len(name) > len(worst.get((line, bad), "")):
            worst[(line, bad)] = name
    return [f"{path}:{line}: {module} ({layer}) imports {name}; the {layer} must not import "
            f"{bad}: move the code that needs it into minillm/lab/ (or the tooling), or have the "
            f"caller pass it in" for (line, bad), name in sorted(worst.items())]


def package_modules() -> list[tuple[str, Path, bool]]:
    """(module name, path, is_package) for every .py file under minillm/."""
    out = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out.append((".".join(parts), path, is_package))
    return out


# --- the package ----------------------------------------------------------------------------------

def test_every_module_has_a_layer():
    modules = package_modules()
    assert len(modules) > 50 and any(m == "minillm.engine.llm_engine" for m, _, _ in modules)
    loose = [f"{path.relative_to(PACKAGE_DIR.parent)} ({m})" for m, path, _ in modules
             if layer_of(m) is None]
    assert not loose, ("modules in no layer (add each to LAYERS in tests/test_layers.py: engine, "
                       "lab or tooling): " + ", ".join(loose))


def test_lab_modules_exist_where_the_lectures_import_them():
    names = {m for m, _, _ in package_modules()}
    for m in ("minillm.lab.workloads", "minillm.lab.arena", "minillm.lab.memory_sim",
              "minillm.lab.viz", "minillm.lab.step_trace", "minillm.lab.radix",
              "minillm.lab.prefix_sim", "minillm.lab.serving_replay", "minillm.lab.capacity"):
        assert m in names and layer_of(m) == "lab", m
    for old in ("minillm.viz", "minillm.workloads", "minillm.prefix_workloads",
                "minillm.engine.trace", "minillm.cache.prefix_sim", "minillm.cache.radix",
                "minillm.serve.replay", "minillm.serve.capacity"):
        assert old not in names, f"{old} is lab equipment: it lives in minillm.lab now"


@pytest.mark.parametrize("layer", ["engine", "lab"])
def test_layer_imports_nothing_above_it(layer):
    found = []
    for module, path, is_package in package_modules():
        if layer_of(module) == layer:
            rel = str(path.relative_to(PACKAGE_DIR.parent))
            found += violations(module, path.read_text(encoding="utf-8"), is_package, rel)
    assert not found, "\n".join(found)


# --- the checker itself can fail ------------------------------------------------------------------

@pytest.mark.parametrize("module, is_package, source, line, name", [
    # the import the issue found: cache/blocks.py took MemoryTrace from the chapter-02 module
    ("minillm.cache.blocks", False, "from ..lab.memory_sim import MemoryTrace\n", 1,
     "minillm.lab.memory_sim"),
    # a function-level import, absolute, of a submodule named in `from minillm import ...`
    ("minillm.serve.loadgen", False, "import os\n\ndef f():\n    from minillm import viz\n", 4,
     "minillm.viz"),
    ("minillm.engine.llm_engine", False, "from .. import drill\n", 1, "minillm.drill"),
    ("minillm.generate", False, "import minillm.grading.core as core\n", 1, "minillm.grading.core"),
    # the package __init__ resolves `.` to itself
    ("minillm", True, "from . import configs\nfrom .lab import workloads\n", 2, "minillm.lab"),
    ("minillm.kernels", True, "import importlib\nimportlib.import_module('minillm.lab.viz')\n", 2,
     "minillm.lab.viz"),
    ("minillm.lab.viz", False, "def f():\n    from ..grading import core\n", 2, "minillm.grading"),
])
def test_checker_reports_module_and_line(module, is_package, source, line, name):
    found = violations(module, source, is_package, "x.py")
    assert found and found[0].startswith(f"x.py:{line}: {module} "), found
    assert f"imports {name}" in found[0]


@pytest.mark.parametrize("module, is_package, source", [
    ("minillm.cache.blocks", False, "from collections import deque\nfrom .contiguous import x\n"),
    ("minillm.spec", True, "from . import theory\nfrom ..engine.spec_decode import Draft\n"),
    ("minillm.engine.llm", False, "from minillm import labels, drilling\nimport laboratory\n"),
    ("minillm.lab.arena", False, "from ..model import causal_attention\nfrom . import viz\n"),
    ("minillm.drill.generators", False, "from ..lab import capacity\nfrom ..spec import theory\n"),
])
def test_checker_allows_what_the_layers_allow(module, is_package, source):
    assert violations(module, source, is_package, "x.py") == []


def test_relative_imports_resolve_against_the_package():
    names = [n for _, n in imported_names("from ..lab import viz\nfrom . import paged\n",
                                          "minillm.cache.blocks", False)]
    assert names == ["minillm.lab", "minillm.lab.viz", "minillm.cache", "minillm.cache.paged"]
    with pytest.raises(ValueError, match="beyond the top package"):
        imported_names("from ... import x\n", "minillm.cache", True)
