"""benchmarks/bench_engine.py and bench_skinny_gemm.py: the parts that run without a long timing."""
import importlib.util
from pathlib import Path

import pytest

from minillm.model import Linear

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nn_linear_system_turns_the_gemm_choice_off_and_back_on(monkeypatch):
    bench = load("bench_engine")
    seen = []

    def fake(mini, prompts, outputs, args, scheduling="continuous"):
        seen.append(Linear.SKINNY_ROWS)
        raise RuntimeError("boom")

    monkeypatch.setattr(bench, "run_minillm", fake)
    before = Linear.SKINNY_ROWS
    with pytest.raises(RuntimeError):
        bench.run_minillm_nn_linear(None, [], [], None)
    assert seen == [range(0)] and Linear.SKINNY_ROWS == before != range(0)


def test_plot_draws_the_spread_of_repeats(tmp_path):
    bench = load("bench_engine")
    record = {"device_name": "test", "dtype": "float32", "repeats": 3,
              "workload": {"num_requests": 2, "min_len": 1, "max_len": 2},
              "rows": [{"model": "m", "system": s, "output_tokens": 100, "seconds": 2.0,
                        "output_tokens_per_s": 50.0, "seconds_all": [1.6, 2.0, 2.5]}
                       for s in ("minillm", "hf_static")]}
    bench.plot(record, tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 1000


def test_skinny_gemm_benchmark_runs(capsys):
    load("bench_skinny_gemm").main(["--rows", "1", "4", "--layers", "1", "--repeats", "1"])
    out = capsys.readouterr().out
    for name in ("q/o proj", "gate/up", "down", "lm_head"):
        line = next(l for l in out.splitlines() if l.startswith(name))
        assert len([float(v) for v in line[22:].split()]) == 2
