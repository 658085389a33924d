"""pyproject.toml and environment.yml list the same dependencies; the layout is complete."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req.strip(), maxsplit=1)[0].lower()


def _spec(req: str) -> str:
    return req.split(";")[0].replace(" ", "").lower()


def _pyproject():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(data["dependencies"]) + list(data["optional-dependencies"]["dev"])
    return {_name(r): _spec(r) for r in reqs}


def _environment():
    reqs = {}
    in_pip = False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        if line.strip().startswith("- pip:"):
            in_pip = True
            continue
        if in_pip and line.strip().startswith("- "):
            r = line.split("#")[0].strip()[2:].strip().strip('"')
            reqs[_name(r)] = _spec(r)
    return reqs


def _markers(reqs) -> dict:
    return {_name(r): r.split(";", 1)[1].replace(" ", "") for r in reqs if ";" in r}


def test_environment_yml_keeps_pyproject_platform_markers():
    """triton is Linux-only in pyproject.toml; environment.yml must say so too, or the README's
    conda path fails on macOS (issue 18)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    py = _markers(list(data["dependencies"]) + list(data["optional-dependencies"]["dev"]))
    env = _markers([line.split("#")[0].strip()[2:].strip().strip('"')
                    for line in (ROOT / "environment.yml").read_text().splitlines()
                    if line.strip().startswith("- ") and ";" in line])
    assert py and py == env, (py, env)


def test_environment_yml_matches_pyproject():
    py, env = _pyproject(), _environment()
    assert py == env, (f"only in pyproject: {sorted(py.keys() - env.keys())}, only in "
                       f"environment.yml: {sorted(env.keys() - py.keys())}, differing: "
                       f"{sorted(k for k in py.keys() & env.keys() if py[k] != env[k])}")


def test_course_dependencies_present():
    py = _pyproject()
    for dep in ("jupyterlab", "torch", "triton", "transformers", "numpy", "matplotlib",
                "ipywidgets", "nbval", "gguf", "accelerate", "pytest", "hypothesis"):
        assert dep in py, dep


def test_layout():
    for path in ("README.md", "environment.yml", "pyproject.toml", "Makefile", "minillm",
                 "notebooks", "exercises", "solutions", "tests", ".ci/run"):
        assert (ROOT / path).exists(), path
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme and "environment.yml" in readme
