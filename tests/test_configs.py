"""minillm.configs: the presets match the published config.json files and model sizes.

The tables below were copied by hand from each model's Hugging Face `config.json` (DeepSeek-V3:
config.json and arXiv:2412.19437) and from the parameter count its Hub page reports. They are
typed out again here, not read from minillm.configs, so a wrong number in either place fails.
"""
import math

import pytest
import torch
import transformers

from minillm import configs, kvmath
from minillm.configs import ModelConfig
from minillm.loader import to_hf_config
from minillm.model import Transformer

# name: (num_hidden_layers, hidden_size, intermediate_size, num_attention_heads,
#        num_key_value_heads, head_dim, vocab_size, max_position_embeddings, tie_word_embeddings)
PUBLISHED_SHAPES = {
    "smollm2-135m":   (30, 576, 1536, 9, 3, 64, 49152, 8192, True),
    "llama-2-7b":     (32, 4096, 11008, 32, 32, 128, 32000, 4096, False),
    "llama-2-70b":    (80, 8192, 28672, 64, 8, 128, 32000, 4096, False),
    "llama-3-8b":     (32, 4096, 14336, 32, 8, 128, 128256, 8192, False),
    "llama-3-70b":    (80, 8192, 28672, 64, 8, 128, 128256, 8192, False),
    "llama-3.1-405b": (126, 16384, 53248, 128, 8, 128, 128256, 131072, False),
    "mistral-7b":     (32, 4096, 14336, 32, 8, 128, 32768, 32768, False),
    "qwen2.5-7b":     (28, 3584, 18944, 28, 4, 128, 152064, 131072, False),
    "deepseek-v3":    (61, 7168, 18432, 128, 128, 192, 129280, 163840, False),
}

# Parameter counts as the Hub pages report them (safetensors metadata).
PUBLISHED_PARAMS = {
    "smollm2-135m": 134.5e6,
    "llama-2-7b": 6.74e9,
    "llama-2-70b": 68.98e9,
    "llama-3-8b": 8.03e9,
    "llama-3-70b": 70.6e9,
    "llama-3.1-405b": 405.9e9,
    "llama-3.2-1b": 1.24e9,
    "mistral-7b": 7.25e9,
    "qwen2.5-7b": 7.62e9,
    "qwen2.5-0.5b": 0.494e9,
}

DENSE = [c.name for c in configs.all_configs() if c.attention != "mla"]


def test_required_presets_exist_with_sources():
    for name in list(PUBLISHED_SHAPES) + ["llama-3.2-1b", "qwen2.5-0.5b"]:
        cfg = configs.get(name)
        assert cfg.name == name
        assert "config.json" in cfg.source, f"{name}: source should name the config.json it copies"
        assert cfg.published_params, f"{name}: published_params missing"


@pytest.mark.parametrize("name", list(PUBLISHED_SHAPES))
def test_shapes_match_published_config(name):
    cfg = configs.get(name)
    got = (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
           cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.max_position_embeddings,
           cfg.tie_word_embeddings)
    assert got == PUBLISHED_SHAPES[name]


def test_deepseek_v3_latent_sizes():
    cfg = configs.get("deepseek-v3")
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim) == (512, 64, 128)
    assert cfg.attention == "mla"
    with pytest.raises(ValueError, match="MLA"):
        Transformer(cfg)


def test_llama31_rope_scaling():
    s = configs.get("llama-3.1-405b").rope_scaling
    assert s["rope_type"] == "llama3" and s["factor"] == 8.0
    assert s["original_max_position_embeddings"] == 8192
    assert configs.get("llama-3.2-1b").rope_scaling["factor"] == 32.0


def test_qwen_has_qkv_bias_llama_does_not():
    assert configs.get("qwen2.5-7b").attention_bias
    assert not configs.get("llama-3-8b").attention_bias


@pytest.mark.parametrize("name", DENSE)
def test_param_count_equals_meta_model_numel(name):
    cfg = configs.get(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    numel = sum(p.numel() for p in model.parameters())       # tied weights are counted once
    assert kvmath.param_count(cfg) == numel


@pytest.mark.parametrize("name", DENSE)
def test_param_count_equals_transformers_model(name):
    """transformers' own class for the architecture, built on the meta device."""
    cfg = configs.get(name)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "mistral": transformers.MistralForCausalLM}[cfg.arch]
    with torch.device("meta"):
        ref = cls(to_hf_config(cfg))
    assert kvmath.param_count(cfg) == sum(p.numel() for p in ref.parameters())


@pytest.mark.parametrize("name", DENSE)
def test_param_count_near_published_size(name):
    cfg = configs.get(name)
    count = kvmath.param_count(cfg)
    assert math.isclose(count, PUBLISHED_PARAMS[name], rel_tol=0.01), (name, count)
    assert math.isclose(cfg.published_params, PUBLISHED_PARAMS[name], rel_tol=1e-3)


def test_exact_counts_of_three_models():
    # Worked by hand: layers x (attention + MLP + 2 norms) + embeddings (+ lm_head) + final norm.
    assert kvmath.param_count(configs.get("llama-2-7b")) == 32 * (
        4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 32000 * 4096 + 4096
    assert kvmath.param_count(configs.get("llama-3-8b")) == 32 * (
        2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 2 * 128256 * 4096 + 4096
    assert kvmath.param_count(configs.get("smollm2-135m")) == 30 * (
        2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) + 49152 * 576 + 576


def test_attention_kinds():
    assert configs.get("llama-2-7b").attention == "mha"
    assert configs.get("llama-2-70b").attention == "gqa"
    assert configs.get("llama-2-70b").gqa_group == 8
    assert configs.get("smollm2-135m").gqa_group == 3
    mqa = configs.get("llama-3-8b").with_(num_kv_heads=1)
    assert mqa.attention == "mqa" and mqa.gqa_group == 32


def test_get_is_case_insensitive_and_unknown_name_lists_presets():
    assert configs.get("Llama-3-8B") is configs.get("llama-3-8b")
    with pytest.raises(ValueError, match="known presets: .*llama-3-8b"):
        configs.get("llama-9-8b")


def test_names_lists_every_preset():
    assert configs.names() == [c.name for c in configs.all_configs()]
    assert len(set(configs.names())) == len(configs.names())


def test_with_returns_changed_copy():
    cfg = configs.get("llama-3-8b")
    small = cfg.with_(num_layers=2)
    assert small.num_layers == 2 and cfg.num_layers == 32


@pytest.mark.parametrize("changes, match", [
    (dict(num_kv_heads=3), "multiple of num_kv_heads"),
    (dict(num_layers=0), "num_layers must be a positive integer"),
    (dict(head_dim=-64), "head_dim must be a positive integer"),
    (dict(num_heads=32.0), "num_heads must be a positive integer"),
    (dict(kv_lora_rank=-1), "kv_lora_rank"),
])
def test_invalid_config_raises(changes, match):
    with pytest.raises(ValueError, match=match):
        configs.get("llama-3-8b").with_(**changes)


def test_custom_config_needs_no_preset():
    cfg = ModelConfig(name="tiny", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=128)
    assert cfg.attention == "gqa" and cfg.gqa_group == 2


def test_building_transformers_configs_leaves_the_presets_unchanged():
    # transformers edits the rope_scaling dict it is handed; a preset's own dict must not change,
    # or every later use of the preset (kvmath, graders replaying a learner's answers) sees it
    import copy
    from minillm.loader import to_hf_config
    cfgs = [c for c in configs.all_configs() if c.rope_scaling and c.kv_lora_rank == 0]
    assert cfgs
    before = {c.name: copy.deepcopy(c.rope_scaling) for c in cfgs}
    for c in cfgs:
        to_hf_config(c)
    assert {c.name: c.rope_scaling for c in cfgs} == before
