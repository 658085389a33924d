"""Bad input gets a ValueError that names the fix."""
import json

import pytest
import torch

import minillm
from minillm import configs
from minillm.configs import ModelConfig

TINY = ModelConfig(name="tiny", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                   num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=32)


@pytest.fixture(scope="module")
def tiny():
    model, _ = minillm.load_model(TINY, weights="random", device="cpu")
    return model


def test_unknown_model_lists_known_ones():
    with pytest.raises(ValueError) as e:
        minillm.load_model("gpt-5-nano")
    for name in ("smollm2-135m", "llama-3-8b", "qwen2.5-7b"):
        assert name in str(e.value)
    with pytest.raises(ValueError, match="known presets"):
        configs.get("llama-9")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*llama"):
        minillm.load_model(str(tmp_path))


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        minillm.load_model(str(tmp_path))


def test_pretrained_weights_of_a_preset_that_is_not_bundled():
    with pytest.raises(ValueError, match="weights='random'"):
        minillm.load_model("llama-3-8b")


def test_bad_weights_argument():
    with pytest.raises(ValueError, match="'pretrained' or 'random'"):
        minillm.load_model("smollm2-135m", weights="dummy")


def test_prompt_longer_than_context(tiny):
    with pytest.raises(ValueError, match="shorten the prompt"):
        minillm.generate(tiny, None, list(range(32)), max_new_tokens=1)
    with pytest.raises(ValueError, match="lower max_new_tokens to 2"):
        minillm.generate(tiny, None, list(range(30)), max_new_tokens=5)
    with pytest.raises(ValueError, match="context of 32"):
        tiny(torch.zeros(1, 40, dtype=torch.long))


def test_empty_prompt_and_bad_token_count(tiny):
    with pytest.raises(ValueError, match="empty"):
        minillm.generate(tiny, None, [], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        minillm.generate(tiny, None, [1, 2], max_new_tokens=0)


def test_text_prompt_without_tokenizer(tiny):
    with pytest.raises(ValueError, match="tokenizer"):
        minillm.generate(tiny, None, "hello", max_new_tokens=2)


def test_full_contiguous_cache(tiny):
    cache = minillm.cache.contiguous.ContiguousKVCache(TINY, batch_size=1, max_len=4)
    tiny(torch.zeros(1, 4, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="larger max_len"):
        tiny(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_invalid_sampling_in_generate(tiny):
    with pytest.raises(ValueError, match="top_p"):
        minillm.generate(tiny, None, [1], sampling=minillm.SamplingParams(top_p=2))
