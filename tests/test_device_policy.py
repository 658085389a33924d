"""Device policy (minillm.loader.default_dtype): fp32 on the CPU, bf16 on a GPU with native bf16,
fp16 on a GPU without it (T4, V100), so the course runs on free notebook GPUs. No GPU is needed:
the CUDA queries are replaced by stand-ins that answer as each GPU would."""
import contextlib

import pytest
import torch

from minillm import loader


def test_cpu_is_float32():
    assert loader.default_dtype("cpu") == torch.float32
    assert loader.default_dtype(torch.device("cpu")) == torch.float32


@pytest.mark.parametrize("gpu, native_bf16, want", [
    ("H100 (sm_90)", True, torch.bfloat16),
    ("A100 (sm_80)", True, torch.bfloat16),
    ("T4 (sm_75)", False, torch.float16),
    ("V100 (sm_70)", False, torch.float16),
])
def test_gpu_dtype_follows_native_bf16_support(monkeypatch, gpu, native_bf16, want):
    asked = []

    def is_bf16_supported(including_emulation=True):
        asked.append(including_emulation)
        return native_bf16 or including_emulation      # pre-Ampere parts emulate bf16, slowly

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    assert loader.default_dtype("cuda:0") == want, gpu
    assert asked == [False], "emulated bf16 must not count as support"


def test_random_model_on_cpu_takes_the_policy_dtype():
    from minillm import configs
    cfg = configs.get("smollm2-135m").with_(name="tiny", num_layers=1, hidden_size=16,
                                            intermediate_size=32, num_heads=2, num_kv_heads=1,
                                            head_dim=8, vocab_size=64)
    assert loader.random_model(cfg, device="cpu").dtype == torch.float32
