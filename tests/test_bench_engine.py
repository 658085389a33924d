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
        seen.append((Linear.SKINNY_ROWS, Linear.PREPACK))
        raise RuntimeError("boom")

    monkeypatch.setattr(bench, "run_minillm", fake)
    before = Linear.SKINNY_ROWS, Linear.PREPACK
    with pytest.raises(RuntimeError):
        bench.run_minillm_nn_linear(None, [], [], None)
    assert seen == [(range(0), False)]
    assert (Linear.SKINNY_ROWS, Linear.PREPACK) == before and before[0] != range(0) and before[1]


def test_onednn_system_runs_a_copy_with_mkl_off_and_turns_it_back_on(monkeypatch):
    import torch

    bench = load("bench_engine")
    seen = []

    def fake(mini, prompts, outputs, args, scheduling="continuous"):
        seen.append((mini, Linear.MKL))
        raise RuntimeError("boom")

    monkeypatch.setattr(bench, "run_minillm", fake)
    model = torch.nn.Sequential(Linear(4, 4))
    for _ in range(2):
        with pytest.raises(RuntimeError):
            bench.run_minillm_onednn(model, [], [], None)
    assert [mkl for _, mkl in seen] == [False, False] and Linear.MKL is None   # restored
    assert seen[0][0] is seen[1][0] and seen[0][0] is not model    # one copy, made once


def test_plot_draws_the_spread_of_repeats(tmp_path):
    bench = load("bench_engine")
    record = {"device_name": "test", "dtype": "float32", "repeats": 3,
              "workload": {"num_requests": 2, "min_len": 1, "max_len": 2},
              "rows": [{"model": "m", "system": s, "output_tokens": 100, "seconds": 2.0,
                        "output_tokens_per_s": 50.0, "seconds_all": [1.6, 2.0, 2.5]}
                       for s in ("minillm", "hf_static")]}
    bench.plot(record, tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 1000


def test_skinny_gemm_benchmark_runs(capsys, tmp_path):
    import json

    from minillm.model import mkl_packs_here
    out_file = tmp_path / "skinny.json"
    load("bench_skinny_gemm").main(["--rows", "1", "4", "--layers", "1", "--repeats", "1",
                                    "--out", str(out_file)])
    out = capsys.readouterr().out
    paths = 3 if mkl_packs_here() else 2                       # MKL's packed fp32 where here
    for name in ("qkv_proj", "o_proj", "gate_up", "down", "lm_head"):
        lines = [line for line in out.splitlines() if line.strip().startswith(name)]
        assert len(lines) == paths                             # one per path
        assert all(len([float(v) for v in line[28:].split()]) == 2 for line in lines)
    record = json.loads(out_file.read_text())
    assert record["rows"] == [1, 4] and len(record["step_ms"]) == paths + 1   # and F.linear
    for label, ms in record["step_ms"].items():                # a step: the sum of the shapes
        assert ms == pytest.approx([sum(record["ms"][s][label][i] for s in record["ms"])
                                    for i in range(2)])


def test_bf16_system_runs_a_bf16_copy_and_keeps_the_fp32_model(monkeypatch):
    import torch

    from minillm import loader
    from minillm.configs import ModelConfig
    bench = load("bench_engine")
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)
    seen = []
    monkeypatch.setattr(bench, "run_minillm",
                        lambda mini, p, o, a, scheduling="continuous", enforce_eager=True:
                        seen.append((mini.dtype, enforce_eager)))
    cfg = ModelConfig(name="t", vocab_size=50, hidden_size=16, intermediate_size=32,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                      max_position_embeddings=64)
    mini = loader.random_model(cfg, device="cpu", dtype=torch.float32)
    bench.run_minillm_bf16(mini, [], [], None)
    bench.RUNNERS["minillm_bf16_graphs"](mini, None, [], [], None)     # compiled, on a CPU
    assert seen == [(torch.bfloat16, True), (torch.bfloat16, False)]
    assert mini.dtype == torch.float32


@pytest.mark.parametrize("native", [True, False])
def test_int4_system_quantizes_a_copy_and_keeps_the_fp32_model(monkeypatch, native):
    """A bf16 copy where the CPU has native bf16, an fp32 one where torch would emulate it; the
    LM head in the model's dtype unless --int4-lm-head names a format (a copy per head)."""
    from types import SimpleNamespace

    import torch

    from minillm import loader
    from minillm.configs import ModelConfig
    from minillm.model import Linear
    from minillm.quant import Int4Linear, Int8Linear
    bench = load("bench_engine")
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: native)
    seen, copies = [], []

    def fake_run(mini, p, o, a, scheduling="continuous", enforce_eager=True):
        seen.append((mini.dtype, type(mini.layers[0].mlp.down_proj), type(mini.lm_head),
                     enforce_eager))
        copies.append(id(mini))
        return [], {}
    monkeypatch.setattr(bench, "run_minillm", fake_run)
    cfg = ModelConfig(name="t", vocab_size=50, hidden_size=64, intermediate_size=128,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=32,
                      max_position_embeddings=64)
    mini = loader.random_model(cfg, device="cpu", dtype=torch.float32)
    model_head, int8_head = (SimpleNamespace(int4_lm_head=h) for h in ("model", "int8"))
    assert bench.run_minillm_int4(mini, [], [], model_head)[1] == {"lm_head": "model"}
    bench.RUNNERS["minillm_int4_graphs"](mini, None, [], [], model_head)  # compiled: same copy
    assert bench.run_minillm_int4(mini, [], [], int8_head)[1] == {"lm_head": "int8"}
    copy_dtype = torch.bfloat16 if native else torch.float32
    assert seen == [(copy_dtype, Int4Linear, Linear, True), (copy_dtype, Int4Linear, Linear, False),
                    (copy_dtype, Int4Linear, Int8Linear, True)]
    assert copies[0] == copies[1] != copies[2]
    assert mini.dtype == torch.float32
    assert type(mini.layers[0].mlp.down_proj) is not Int4Linear


def test_llama_cpp_system_produces_the_requested_lengths():
    pytest.importorskip("llama_cpp")
    from minillm.loader import find_bundled_gguf
    if find_bundled_gguf() is None:
        pytest.skip("the bundled GGUF is not installed")
    tokens, info = load("bench_engine").run_llama_cpp([[504, 3458, 314], [28, 9]], [3, 2], None)
    assert [len(t) for t in tokens] == [3, 2] and info["gguf"].endswith(".gguf")


def test_decode_gpu_bench_runs_on_cpu_and_compares_graphs_with_eager(tmp_path):
    """bench_decode_gpu.py end to end at toy lengths on the CPU, where the "graphs" variant is
    the torch.compile'd step in fp32: it must agree with eager token for token. Two of the
    model's 30 layers: compiling all 30 made this the slowest unit test (247 s on a 2-core
    AVX2-only EPYC)."""
    bench = load("bench_decode_gpu")
    out = tmp_path / "d.json"
    record = bench.main(["--device", "cpu", "--models", "smollm2-135m", "--num-layers", "2",
                         "--batches", "1", "2", "--variants", "bf16_eager", "bf16_graphs",
                         "--prompt", "3", "--short", "1", "--long", "3", "--out", str(out)])
    assert record["num_layers"] == 2
    rows = {(r["variant"], r["batch"]): r for r in record["rows"]}
    assert set(rows) == {(v, b) for v in ("bf16_eager", "bf16_graphs") for b in (1, 2)}
    for b in (1, 2):
        assert rows[("bf16_graphs", b)]["compared_with"] == "bf16_eager"
        assert rows[("bf16_graphs", b)]["agreement"]["sequences_equal"] == b
        r = rows[("bf16_eager", b)]                  # a step = the long run's extra time per
        assert len(r["t_short_s"]) == len(r["t_long_s"]) == 2   # token (no sign asserted: a
        assert r["step_ms"] == pytest.approx(                   # toy run on a busy CPU can
            (min(r["t_long_s"]) - min(r["t_short_s"])) / 2 * 1e3, abs=0.1)    # dip below 0)
    assert out.exists() and record["device"]


def test_default_systems_follow_the_device():
    bench = load("bench_engine")
    assert bench.parse_args(["--device", "cpu"]).systems == list(bench.DEFAULT_SYSTEMS)
    assert bench.parse_args(["--device", "cpu", "--systems", "minillm"]).systems == ["minillm"]
    cuda = bench.DEFAULTS["cuda"]["systems"]
    assert "minillm_graphs" in cuda and "minillm_nn_linear" not in cuda
    assert set(cuda) <= set(bench.SYSTEMS)


def test_several_lm_heads_run_each_int4_system_once_per_head(monkeypatch):
    """--int4-lm-head int4 model: SYSTEM:HEAD entries, each run with its own head."""
    bench = load("bench_engine")
    args = bench.parse_args(["--systems", "llama_cpp", "minillm_int4_graphs",
                             "--int4-lm-head", "int4", "model"])
    assert args.systems == ["llama_cpp", "minillm_int4_graphs:int4", "minillm_int4_graphs:model"]
    heads = []
    monkeypatch.setitem(bench.RUNNERS, "minillm_int4_graphs",
                        lambda m, h, p, o, a: (heads.append(a.int4_lm_head) or [], {}))
    for system in args.systems[1:]:
        bench.timed(system, None, None, [], [], args)
    assert heads == ["int4", "model"]
    one = bench.parse_args(["--systems", "minillm_int4", "--int4-lm-head", "int8"])
    assert one.systems == ["minillm_int4"] and one.int4_lm_head == "int8"
