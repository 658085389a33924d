"""Published model configurations (chapter 01).

Every preset copies the numbers from the model's own `config.json` (or its technical report for
DeepSeek-V3); `source` names where they come from so a learner can check them.
`published_params` is the size the model's Hugging Face page reports (the safetensors count),
e.g. 8.03B for Llama-3-8B, so `minillm.kvmath.param_count` can be checked against it. The decoder in
`minillm.model` builds any preset whose `attention` is "mha", "gqa" or "mqa"; MLA presets
(DeepSeek-V3) are here for KV-cache arithmetic only.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int            # query heads
    num_kv_heads: int         # key/value heads (== num_heads: MHA, 1: MQA, in between: GQA)
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None   # {"rope_type": "llama3", "factor": ..., ...} or None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False          # Qwen2 puts a bias on q, k and v
    arch: str = "llama"                   # "llama" | "qwen2" | "mistral" | "deepseek_v3"
    # Multi-head latent attention (DeepSeek-V2/V3): the cache holds one compressed latent of
    # kv_lora_rank values plus a shared rotary key of qk_rope_head_dim values per token and layer.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0                   # MLA: value head size when it differs from head_dim
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    source: str = ""
    published_params: Optional[float] = None   # as the model card states it, for a sanity check

    def __post_init__(self):
        sizes = dict(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                     intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                     num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                     head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings)
        for field_name, value in sizes.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.name}: {field_name} must be a positive integer, "
                                 f"got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads}); each KV head serves a whole "
                             "group of query heads")
        for field_name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{self.name}: {field_name} must be an integer >= 0, "
                                 f"got {value!r}")

    @property
    def attention(self) -> str:
        if self.kv_lora_rank:
            return "mla"
        if self.num_kv_heads == self.num_heads:
            return "mha"
        if self.num_kv_heads == 1:
            return "mqa"
        return "gqa"

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def with_(self, **changes) -> "ModelConfig":
        """A copy with some fields changed, e.g. `cfg.with_(num_layers=2)` for a small test."""
        return replace(self, **changes)


_PRESETS: dict[str, ModelConfig] = {}


def _add(cfg: ModelConfig) -> None:
    _PRESETS[cfg.name] = cfg


_LLAMA3_SCALING_8 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA3_SCALING_32 = dict(_LLAMA3_SCALING_8, factor=32.0)

_add(ModelConfig(
    name="smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    source="HuggingFaceTB/SmolLM2-135M-Instruct config.json", published_params=134.5e6))
_add(ModelConfig(
    name="llama-2-7b", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
    num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096,
    rope_theta=10000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    source="meta-llama/Llama-2-7b-hf config.json", published_params=6.74e9))
_add(ModelConfig(
    name="llama-2-70b", vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_layers=80,
    num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=4096,
    rope_theta=10000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    source="meta-llama/Llama-2-70b-hf config.json", published_params=68.98e9))
_add(ModelConfig(
    name="llama-3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
    rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
    source="meta-llama/Meta-Llama-3-8B config.json", published_params=8.03e9))
_add(ModelConfig(
    name="llama-3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
    num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
    rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
    source="meta-llama/Meta-Llama-3-70B config.json", published_params=70.6e9))
_add(ModelConfig(
    name="llama-3.1-405b", vocab_size=128256, hidden_size=16384, intermediate_size=53248,
    num_layers=126, num_heads=128, num_kv_heads=8, head_dim=128,
    max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING_8,
    rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
    source="meta-llama/Llama-3.1-405B config.json", published_params=405.9e9))
_add(ModelConfig(
    name="llama-3.2-1b", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
    num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, max_position_embeddings=131072,
    rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING_32, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
    source="meta-llama/Llama-3.2-1B config.json", published_params=1.24e9))
_add(ModelConfig(
    name="mistral-7b", vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-5, arch="mistral", bos_token_id=1, eos_token_id=2,
    source="mistralai/Mistral-7B-v0.3 config.json (no sliding window)", published_params=7.25e9))
_add(ModelConfig(
    name="qwen2.5-7b", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
    num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, max_position_embeddings=131072,
    rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=True, arch="qwen2",
    bos_token_id=151643, eos_token_id=151643,
    source="Qwen/Qwen2.5-7B config.json (model card: 7.61B)", published_params=7.62e9))
_add(ModelConfig(
    name="qwen2.5-0.5b", vocab_size=151936, hidden_size=896, intermediate_size=4864,
    num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, max_position_embeddings=32768,
    rope_theta=1000000.0, rms_norm_eps=1e-6, attention_bias=True, tie_word_embeddings=True,
    arch="qwen2", bos_token_id=151643, eos_token_id=151643,
    source="Qwen/Qwen2.5-0.5B config.json", published_params=0.494e9))
_add(ModelConfig(
    # Multi-head latent attention: 128 heads, but the cache stores one 512-value latent plus a
    # 64-value rotary key per token and layer, shared by every head.
    name="deepseek-v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    num_layers=61, num_heads=128, num_kv_heads=128, head_dim=192,
    max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6, arch="deepseek_v3",
    kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128, bos_token_id=0, eos_token_id=1,
    # head_dim 192 = qk_nope_head_dim 128 + qk_rope_head_dim 64 (query/key); values use 128.
    # 671B is the technical report's total (37B active per token); the Hub's 685B adds the
    # multi-token-prediction module.
    source="deepseek-ai/DeepSeek-V3 config.json and technical report (arXiv:2412.19437)",
    published_params=671e9))


def names() -> list[str]:
    """Names of every preset, in the order they were added."""
    return list(_PRESETS)


def get(name: str) -> ModelConfig:
    """The preset called `name` (case-insensitive)."""
    key = name.lower()
    if key not in _PRESETS:
        raise ValueError(f"unknown model config {name!r}; known presets: {', '.join(_PRESETS)}")
    return _PRESETS[key]


def all_configs() -> list[ModelConfig]:
    return list(_PRESETS.values())
