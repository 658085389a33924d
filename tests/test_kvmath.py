"""minillm.kvmath: KV bytes per token, weights, and the VRAM capacity planner.

Expected numbers are worked out by hand in the comments (2 x layers x kv_heads x head_dim x
bytes), and the formula is checked against the bytes real caches hold: transformers' own
DynamicCache and minillm's ContiguousKVCache.
"""
import math

import pytest
import torch
import transformers
from hypothesis import given, settings, strategies as st

from minillm import configs, kvmath
from minillm.cache.contiguous import ContiguousKVCache
from minillm.configs import ModelConfig
from minillm.loader import to_hf_config
from minillm.model import Transformer


def tiny(num_heads=8, num_kv_heads=8, num_layers=4, head_dim=16, **kw) -> ModelConfig:
    return ModelConfig(name="tiny", vocab_size=64, hidden_size=num_heads * head_dim,
                       intermediate_size=64, num_layers=num_layers, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim,
                       max_position_embeddings=256, **kw)


# --- bytes per token of published models ---------------------------------------------------

@pytest.mark.parametrize("name, expected", [
    ("llama-2-70b", 327_680),      # 2 x 80 x 8 x 128 x 2
    ("llama-3-8b", 131_072),       # 2 x 32 x 8 x 128 x 2 = 128 KiB
    ("llama-3-70b", 327_680),      # same attention shape as Llama-2-70B
    ("llama-3.1-405b", 516_096),   # 2 x 126 x 8 x 128 x 2
    ("llama-2-7b", 524_288),       # MHA: 2 x 32 x 32 x 128 x 2
    ("mistral-7b", 131_072),       # 2 x 32 x 8 x 128 x 2
    ("qwen2.5-7b", 57_344),        # 2 x 28 x 4 x 128 x 2
    ("smollm2-135m", 23_040),      # 2 x 30 x 3 x 64 x 2
    ("deepseek-v3", 70_272),       # MLA: 61 x (512 + 64) x 2, no factor 2 for K and V
])
def test_bf16_bytes_per_token(name, expected):
    assert kvmath.kv_bytes_per_token(configs.get(name), "bfloat16") == expected


def test_llama3_8b_is_128_kib():
    assert kvmath.kv_bytes_per_token(configs.get("llama-3-8b")) == 128 * 1024


@pytest.mark.parametrize("name", configs.names())
def test_dtypes_scale_bytes(name):
    cfg = configs.get(name)
    bf16 = kvmath.kv_bytes_per_token(cfg, "bf16")
    assert kvmath.kv_bytes_per_token(cfg, "fp16") == bf16
    assert kvmath.kv_bytes_per_token(cfg, "float16") == bf16
    assert kvmath.kv_bytes_per_token(cfg, "fp32") == 2 * bf16
    assert 2 * kvmath.kv_bytes_per_token(cfg, "fp8") == bf16
    assert 2 * kvmath.kv_bytes_per_token(cfg, "int8") == bf16


def test_torch_dtypes_and_case_accepted():
    cfg = configs.get("llama-3-8b")
    assert kvmath.kv_bytes_per_token(cfg, torch.bfloat16) == 131_072
    assert kvmath.kv_bytes_per_token(cfg, torch.float32) == 262_144
    assert kvmath.kv_bytes_per_token(cfg, torch.float8_e4m3fn) == 65_536
    assert kvmath.kv_bytes_per_token(cfg, torch.int8) == 65_536
    assert kvmath.kv_bytes_per_token(cfg, "BF16") == 131_072


@pytest.mark.parametrize("bad", ["bf17", "float64x", "", "int3", 2, None])
def test_unknown_dtype_raises(bad):
    with pytest.raises(ValueError, match="unknown dtype"):
        kvmath.kv_bytes_per_token(configs.get("llama-3-8b"), bad)


# --- MHA / GQA / MQA / MLA on a small custom config ---------------------------------------------

def test_mha_gqa_mqa_on_custom_config():
    mha, gqa, mqa = tiny(num_kv_heads=8), tiny(num_kv_heads=2), tiny(num_kv_heads=1)
    assert (mha.attention, gqa.attention, mqa.attention) == ("mha", "gqa", "mqa")
    assert kvmath.kv_bytes_per_token(mha, "fp32") == 2 * 4 * 8 * 16 * 4 == 4096
    assert kvmath.kv_bytes_per_token(gqa, "fp32") == 2 * 4 * 2 * 16 * 4 == 1024
    assert kvmath.kv_bytes_per_token(mqa, "fp32") == 2 * 4 * 1 * 16 * 4 == 512
    # every variant has the same MHA equivalent: the query heads did not change
    for cfg in (mha, gqa, mqa):
        assert kvmath.mha_equivalent_bytes_per_token(cfg, "fp32") == 4096


def test_mla_on_custom_config():
    cfg = tiny(num_layers=3, kv_lora_rank=32, qk_rope_head_dim=8)
    assert cfg.attention == "mla"
    assert kvmath.kv_bytes_per_token(cfg, "bf16") == 3 * (32 + 8) * 2
    assert kvmath.kv_bytes_per_token(cfg, "fp8") == 3 * (32 + 8)


def test_mla_sits_between_mqa_and_gqa8_at_head_dim_128():
    # DeepSeek-V2 paper, table 1: MLA caches (d_c + d_rope) = 4.5 d_h per layer, like GQA with
    # 2.25 groups: more than MQA (2 d_h), less than GQA-8 (16 d_h).
    base = configs.get("llama-3-8b")
    mla = base.with_(kv_lora_rank=512, qk_rope_head_dim=64)
    mqa = base.with_(num_kv_heads=1)
    b = kvmath.kv_bytes_per_token
    assert b(mqa) < b(mla) < b(base)
    assert b(mla) / b(mqa) == 2.25


def test_mha_equivalents_of_published_models():
    assert kvmath.mha_equivalent_bytes_per_token(configs.get("llama-2-70b")) == 2_621_440  # 2.5 MiB
    # DeepSeek-V3 decompressed: 61 layers x 128 heads x (192 key + 128 value) x 2 bytes
    assert kvmath.mha_equivalent_bytes_per_token(configs.get("deepseek-v3")) == 61 * 128 * 320 * 2


def test_fractional_bytes_round_up():
    cfg = tiny(num_layers=1, kv_lora_rank=3, qk_rope_head_dim=0)      # 3 elements per token
    assert kvmath.kv_bytes_per_token(cfg, "int4") == 2                # 1.5 bytes -> 2
    assert kvmath.kv_bytes_per_token(configs.get("llama-3-8b"), "int4") == 32_768


# --- the formula against real cache tensors ------------------------------------------------

class RecordingCache(ContiguousKVCache):
    """A contiguous cache that also counts the k/v elements the model hands it."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.written = 0

    def attend(self, layer, q, k, v):
        self.written += k.numel() + v.numel()                  # k, v [B, T, KVH, D]
        return super().attend(layer, q, k, v)


@pytest.mark.parametrize("kv_heads", [8, 2, 1])
def test_model_writes_formula_elements(kv_heads):
    cfg = tiny(num_kv_heads=kv_heads)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    B, T = 2, 5
    cache = RecordingCache(cfg, batch_size=B, max_len=16)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (B, T)), cache=cache)
    assert cache.written == kvmath.kv_elements_per_token(cfg) * B * T


@pytest.mark.parametrize("kv_heads", [8, 2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_formula_matches_transformers_dynamic_cache(kv_heads, dtype):
    """transformers' Llama keeps k/v [B, KVH, T, D] per layer: its bytes must match."""
    cfg = tiny(num_kv_heads=kv_heads, num_layers=2)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(to_hf_config(cfg)).to(dtype).eval()
    B, T = 2, 7
    with torch.no_grad():
        out = ref(torch.randint(0, cfg.vocab_size, (B, T)), use_cache=True)
    cache = out.past_key_values
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert held == kvmath.kv_bytes_per_token(cfg, dtype) * B * T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contiguous_cache_nbytes_smollm2(dtype):
    cfg = configs.get("smollm2-135m")
    cache = ContiguousKVCache(cfg, batch_size=2, max_len=24, dtype=dtype)
    assert cache.nbytes == kvmath.kv_bytes_per_token(cfg, dtype) * 2 * 24


@pytest.mark.parametrize("name", [c.name for c in configs.all_configs() if c.attention != "mla"])
def test_contiguous_cache_nbytes_presets_on_meta(name):
    cfg = configs.get(name)
    cache = ContiguousKVCache(cfg, batch_size=3, max_len=min(4096, cfg.max_position_embeddings),
                              dtype=torch.bfloat16, device="meta")
    assert cache.nbytes == kvmath.kv_bytes_per_sequence(cfg, cache.max_len, "bf16") * 3


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(1, 6), kv_heads=st.integers(1, 4), group=st.integers(1, 4),
       head_dim=st.sampled_from([4, 8, 16, 64]), batch=st.integers(1, 3),
       max_len=st.integers(1, 40), dtype=st.sampled_from([torch.float32, torch.bfloat16,
                                                          torch.float16]))
def test_contiguous_cache_nbytes_random_configs(layers, kv_heads, group, head_dim, batch,
                                                max_len, dtype):
    cfg = tiny(num_layers=layers, num_heads=kv_heads * group, num_kv_heads=kv_heads,
               head_dim=head_dim)
    cache = ContiguousKVCache(cfg, batch_size=batch, max_len=max_len, dtype=dtype)
    assert cache.nbytes == kvmath.kv_bytes_per_token(cfg, dtype) * batch * max_len


# --- per sequence, weights ------------------------------------------------------------------

def test_per_sequence():
    cfg = configs.get("llama-2-70b")
    assert kvmath.kv_bytes_per_sequence(cfg, 4096) == 327_680 * 4096 == 1_342_177_280
    assert kvmath.kv_bytes_per_sequence(cfg, 4096, "fp8") == 671_088_640
    assert kvmath.kv_bytes_per_sequence(cfg, 0) == 0
    with pytest.raises(ValueError, match="seq_len"):
        kvmath.kv_bytes_per_sequence(cfg, -1)


def test_weight_bytes():
    cfg = configs.get("llama-3-8b")
    assert kvmath.weight_bytes(cfg, "bf16") == 2 * 8_030_261_248
    assert kvmath.weight_bytes(cfg, "int8") == 8_030_261_248
    assert kvmath.weight_bytes(cfg, "fp32") == 4 * 8_030_261_248
    assert kvmath.weight_bytes(cfg, "int4") == 8_030_261_248 // 2
    assert kvmath.weight_bytes(configs.get("deepseek-v3"), "fp8") == 671 * 10**9


# --- the capacity planner, checked by hand arithmetic ---------------------------------------

def test_plan_llama3_8b_on_h100():
    plan = kvmath.plan_capacity("H100-SXM-80GB", configs.get("llama-3-8b"), "bf16", "bf16",
                                gpu_memory_utilization=0.9, context_len=4096)
    # 0.9 x 80e9 = 72e9 usable; weights 2 x 8,030,261,248; the rest is KV.
    assert plan.usable_bytes == 72_000_000_000
    assert plan.weight_bytes == 16_060_522_496
    assert plan.kv_pool_bytes == 72_000_000_000 - 16_060_522_496 == 55_939_477_504
    assert plan.kv_bytes_per_token == 131_072
    assert plan.max_tokens == 426_784          # floor(55,939,477,504 / 131,072)
    assert plan.max_seqs == 104                # floor(426,784 / 4096)
    assert plan.fits


def test_plan_fp8_kv_doubles_tokens():
    cfg = configs.get("llama-3-8b")
    bf16 = kvmath.plan_capacity("H100-SXM-80GB", cfg, kv_dtype="bf16")
    fp8 = kvmath.plan_capacity("H100-SXM-80GB", cfg, kv_dtype="fp8")
    assert fp8.kv_pool_bytes == bf16.kv_pool_bytes
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert fp8.max_tokens == 853_568 == 2 * bf16.max_tokens    # 55,939,477,504 // 65,536


def test_plan_70b_int8_on_one_h100():
    # The seeds' design example: ~70 GB of int8 weights, a few GB held back, ~8 GB of KV.
    plan = kvmath.plan_capacity("H100-SXM-80GB", configs.get("llama-2-70b"), "int8", "bf16",
                                gpu_memory_utilization=1.0, reserved_bytes=3 * 10**9,
                                context_len=1024)
    assert plan.weight_bytes == 68_976_648_192
    assert plan.kv_pool_bytes == 80 * 10**9 - 68_976_648_192 - 3 * 10**9 == 8_023_351_808
    assert plan.max_tokens == 24_485           # 8,023,351,808 // 327,680
    assert plan.max_seqs == 23                 # 24,485 // 1024


def test_plan_weights_that_do_not_fit():
    plan = kvmath.plan_capacity("H100-SXM-80GB", configs.get("llama-3.1-405b"), "bf16")
    assert plan.kv_pool_bytes == 0 and plan.max_tokens == 0 and plan.max_seqs == 0
    assert not plan.fits


def test_plan_tensor_parallel():
    plan = kvmath.plan_capacity("H100-SXM-80GB", configs.get("llama-3.1-405b"), "fp8", "bf16",
                                context_len=8192, num_gpus=8)
    # 8 x 72e9 usable - 405,853,388,800 fp8 weights = 170,146,611,200 bytes of KV in total
    assert plan.usable_bytes == 576_000_000_000
    assert plan.kv_pool_bytes == 170_146_611_200
    assert plan.max_tokens == 329_680          # // 516,096
    assert plan.max_seqs == 40                 # // 8192
    assert plan.gpu == "8x H100-SXM-80GB"


def test_plan_custom_gpu_and_reserve():
    gpu = kvmath.GPU("toy", memory_bytes=10_000, bandwidth=1.0, bf16_flops=1.0)
    cfg = tiny()                                # 2 x 4 x 8 x 16 = 1024 elements per token
    weights = kvmath.param_count(cfg) * 4
    plan = kvmath.plan_capacity(gpu, cfg, "fp32", "fp32", gpu_memory_utilization=1.0,
                                context_len=1, reserved_bytes=0)
    assert plan.kv_pool_bytes == max(0, 10_000 - weights)
    big = kvmath.GPU("big", memory_bytes=10**9, bandwidth=1.0, bf16_flops=1.0)
    p0 = kvmath.plan_capacity(big, cfg, "fp32", "fp32", 0.5, context_len=100)
    p1 = kvmath.plan_capacity(big, cfg, "fp32", "fp32", 0.5, context_len=100,
                              reserved_bytes=4096 * 10)
    assert p0.kv_pool_bytes == 500_000_000 - weights
    assert p0.max_tokens - p1.max_tokens == 10  # 40,960 reserved bytes = 10 tokens of 4096


@pytest.mark.parametrize("util", [0, -0.1, 1.01, 1.5, float("nan")])
def test_plan_bad_utilisation_raises(util):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kvmath.plan_capacity("H100-SXM-80GB", configs.get("llama-3-8b"),
                             gpu_memory_utilization=util)


@pytest.mark.parametrize("kwargs, match", [
    (dict(weight_dtype="bf17"), "unknown dtype"),
    (dict(kv_dtype="e5m2"), "unknown dtype"),
    (dict(context_len=0), "context_len"),
    (dict(context_len=100.5), "context_len"),
    (dict(context_len=8193), "exceeds llama-3-8b's context of 8192"),
    (dict(reserved_bytes=-1), "reserved_bytes"),
    (dict(num_gpus=0), "num_gpus"),
])
def test_plan_bad_input_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvmath.plan_capacity("H100-SXM-80GB", configs.get("llama-3-8b"), **kwargs)


def test_unknown_gpu_raises_with_names():
    with pytest.raises(ValueError, match="H100-SXM-80GB"):
        kvmath.plan_capacity("H1000", configs.get("llama-3-8b"))


def test_gpu_table_datasheet_values():
    h100 = kvmath.get_gpu("H100-SXM-80GB")
    assert h100.memory_bytes == 80 * 10**9
    assert math.isclose(h100.bandwidth, 3.35e12) and math.isclose(h100.bf16_flops, 989e12)
    assert kvmath.get_gpu("H200-SXM-141GB").memory_bytes == 141 * 10**9
