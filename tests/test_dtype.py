"""dtype= of load_model and LLM: names, the CPU bf16 capability rule, and a bf16 engine run."""
import pytest
import torch

import minillm
from minillm import loader
from minillm.configs import ModelConfig

TINY = ModelConfig(name="tiny", vocab_size=97, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=128)


@pytest.mark.parametrize("name, dtype", [("auto", torch.float32), (None, torch.float32),
                                         ("float32", torch.float32), ("FP32", torch.float32),
                                         (torch.float32, torch.float32)])
def test_dtype_names_resolve_on_cpu(name, dtype):
    assert loader.resolve_dtype(name, "cpu") is dtype


@pytest.mark.parametrize("bad", ["float8", "int8", torch.int64, 3])
def test_unknown_dtype_is_a_value_error(bad):
    with pytest.raises(ValueError, match="dtype"):
        loader.resolve_dtype(bad, "cpu")


def test_bf16_on_a_cpu_without_native_bf16_names_the_fix(monkeypatch):
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(ValueError, match="use dtype='float32'"):
        minillm.load_model(TINY, weights="random", device="cpu", dtype="bfloat16")
    with pytest.raises(ValueError, match="use dtype='float32'"):
        minillm.LLM((loader.random_model(TINY, device="cpu"), None), num_kv_blocks=8,
                    dtype="bf16")


def test_bf16_engine_runs_in_bf16(monkeypatch):
    """Weights and KV pool in bf16, every request served (agreement with fp32 on the bundled
    model is measured in benchmarks/bench_engine.py, not asserted here)."""
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)   # emulated is fine here
    params = minillm.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    llm = minillm.LLM((loader.random_model(TINY, device="cpu", seed=3), None), num_kv_blocks=16,
                      dtype="bfloat16")
    assert llm.model.dtype == torch.bfloat16
    assert llm.engine.runner.cache.k.dtype == torch.bfloat16
    bf16 = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in bf16] == [6, 6]
