"""The decoder against transformers' own implementation of the same weights (CPU, fp32)."""
import copy
import io
import pickle

import pytest
import torch
import transformers

import minillm
from minillm import configs, kvmath
from minillm.configs import ModelConfig
from minillm.loader import (bundled_checkpoint, load_state_dict, random_model, to_hf_config,
                            to_hf_state_dict)
from minillm.model import apply_rope, rope_inv_freq, rotate_half

TOL = 1e-3


@pytest.fixture(scope="module")
def bundled():
    model, tok = minillm.load_model("smollm2-135m", device="cpu")
    return model, tok


@pytest.fixture(scope="module")
def hf_bundled():
    # transformers loads the converted checkpoint itself: its own code, the same weights.
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(bundled_checkpoint()), dtype=torch.float32).eval()


PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village by the sea,"]


def test_bundled_logits_match_transformers(bundled, hf_bundled):
    model, tok = bundled
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ours, ref = model(ids), hf_bundled(ids).logits
        assert ours.shape == ref.shape == (1, ids.shape[1], model.config.vocab_size)
        diff = (ours - ref).abs().max().item()
        assert diff <= TOL, f"{prompt!r}: max |diff| {diff}"


def test_bundled_batched_logits_match_transformers(bundled, hf_bundled):
    model, _ = bundled
    ids = torch.randint(0, model.config.vocab_size, (3, 17),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(ids) - hf_bundled(ids).logits).abs().max().item()
    assert diff <= TOL


@pytest.mark.parametrize("shape", [(1, 1), (4, 1), (2, 1), (1, 3), (1, 5), (2, 4), (12, 1), (3, 7)])
def test_bundled_skinny_batches_match_transformers(bundled, hf_bundled, shape):
    # decode-step shapes: minillm.model.Linear's transposed product (1-2 rows) and packed one.
    model, _ = bundled
    ids = torch.randint(0, model.config.vocab_size, shape,
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (model(ids) - hf_bundled(ids).logits).abs().max().item()
    assert diff <= TOL


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(1,), (2,), (3,), (4,), (5,), (8,), (9,), (13,), (16,), (128,),
                                  (129,), (1, 4), (2, 2), (4, 1), (3, 5), (0,)])
def test_linear_orientation_matches_f_linear(bias, lead):
    torch.manual_seed(0)
    layer = minillm.model.Linear(24, 40, bias=bias)
    x = torch.randn(*lead, 24)
    out = layer(x)
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert out.shape == ref.shape == (*lead, 40)
    assert out.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("skinny, few", [("swap", "packed"), ("linear", "linear"),
                                         ("packed", "packed"), ("swap", "linear")])
@pytest.mark.parametrize("bias", [False, True])
def test_every_few_row_product_matches_f_linear(skinny, few, bias):
    torch.manual_seed(0)
    layer = minillm.model.Linear(24, 40, bias=bias)
    layer.skinny, layer.few = skinny, few
    for lead in [(1,), (2,), (1, 2), (2, 1), (3,), (1, 3), (3, 1)]:
        x = torch.randn(*lead, 24)
        with torch.no_grad():
            out = layer(x)
        assert out.shape == (*lead, 40) and out.is_contiguous()
        torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)


def _tiny_model():
    return minillm.load_model(configs.get("smollm2-135m").with_(
        name="tiny", num_layers=3, hidden_size=64, intermediate_size=128, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=300, tie_word_embeddings=False),
        weights="random", device="cpu")[0]


def test_tune_skinny_times_each_shape_once_and_gives_all_its_layers_the_winner(monkeypatch):
    monkeypatch.setattr(minillm.model, "_SKINNY_CHOICE", {})
    timed = []
    fastest = {"linear": 1.0, "swap": 2.0, "packed": 3.0}

    def fake(layers, repeats, max_bytes):
        timed.append(tuple(layers[0].weight.shape))
        odd = len(timed) % 2
        return {"skinny": ("linear" if odd else "packed", fastest),
                "few": ("packed" if odd else "linear", fastest)}
    monkeypatch.setattr(minillm.model, "_time_few_rows", fake)
    model = _tiny_model()                                   # load_model tunes on a CPU
    by_shape = {}
    for m in model.modules():
        if isinstance(m, minillm.model.Linear):
            by_shape.setdefault(tuple(m.weight.shape), set()).add((m.skinny, m.few))
    assert sorted(timed) == sorted(by_shape) and len(timed) == 5   # qkv, o, gate_up, down, head
    assert all(len(v) == 1 for v in by_shape.values())      # one choice per shape
    assert {c for v in by_shape.values() for c in v} == {("linear", "packed"),
                                                         ("packed", "linear")}
    again = _tiny_model()                                    # the same process: no new timing
    assert len(timed) == 5
    assert ([(m.skinny, m.few) for m in again.modules() if isinstance(m, minillm.model.Linear)]
            == [(m.skinny, m.few) for m in model.modules() if isinstance(m, minillm.model.Linear)])


def test_tune_skinny_measures_the_products_at_one_and_three_rows(monkeypatch):
    monkeypatch.setattr(minillm.model, "_SKINNY_CHOICE", {})
    model = _tiny_model()                                   # tuned (timed) as it loads
    choices = minillm.model.tune_skinny(model)
    assert len(choices) == 5
    for by_rule in choices.values():
        assert set(by_rule) == {"skinny", "few"}
        for rule, paths in (("skinny", {"swap", "linear", "packed"}),
                            ("few", {"linear", "packed"})):
            choice, ms = by_rule[rule]
            assert set(ms) == paths and all(t > 0 for t in ms.values())
            assert ms[choice] == min(ms.values())
    for m in model.modules():             # timing left no packed copy behind where it lost
        if isinstance(m, minillm.model.Linear) and "packed" not in (m.skinny, m.few):
            assert "_packed" not in m.__dict__
    monkeypatch.setattr(minillm.model.Linear, "FEW_ROWS", range(0))
    monkeypatch.setattr(minillm.model, "_SKINNY_CHOICE", {})
    assert all(set(c) == {"skinny"} for c in minillm.model.tune_skinny(_tiny_model()).values())
    monkeypatch.setattr(minillm.model.Linear, "SKINNY_ROWS", range(0))
    assert minillm.model.tune_skinny(_tiny_model()) == {}    # no few-row rule: nothing to time


def test_linear_picks_its_cpu_product_by_rows_dtype_and_grad(monkeypatch):
    calls = []
    real_mm, real_packed = torch.mm, torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(("mm", b.shape[1])) or real_mm(a, b))
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, *a: calls.append(("packed", x.shape[0])) or real_packed(x, *a))
    fp32 = "packed"                                          # fp32's packed product: oneDNN,
    if minillm.model.mkl_preferred_here():                   # or MKL's (Intel CPUs)
        fp32, real_mkl = "mkl", torch.ops.mkl._mkl_linear
        monkeypatch.setattr(torch.ops.mkl, "_mkl_linear",
                            lambda x, *a: calls.append(("mkl", x.shape[0])) or real_mkl(x, *a))
    layer = minillm.model.Linear(8, 16, bias=False)
    with torch.no_grad():
        for rows in (1, 2, 3, 64):
            layer(torch.randn(rows, 8))
    assert calls == [("mm", 2), ("mm", 2), (fp32, 3), (fp32, 64)]   # one row as two
    layer.few = "linear"                                     # tuned: F.linear at 3 rows
    with torch.no_grad():
        layer(torch.randn(3, 8))
        layer(torch.randn(4, 8))
    assert calls[4:] == [(fp32, 4)]                          # 3 rows took F.linear
    del calls[4:]
    layer(torch.randn(4, 8))                                 # autograd records it: F.linear
    layer.weight.requires_grad_(False)
    layer(torch.randn(4, 8, requires_grad=True))             # a frozen layer, but x wants grad
    assert len(calls) == 4
    layer.weight.requires_grad_(True)
    bf16_packs = torch.ops.mkldnn._is_mkldnn_bf16_supported()   # oneDNN multiplies bf16 here
    with torch.no_grad():
        layer.to(torch.bfloat16)(torch.randn(2, 8, dtype=torch.bfloat16))
        assert calls[4:] == ([("packed", 2)] if bf16_packs  # bf16: packed at every row count,
                             else [])                        # F.linear where oneDNN cannot
        monkeypatch.setattr(minillm.model.Linear, "SKINNY_ROWS", range(0))
        monkeypatch.setattr(minillm.model.Linear, "PREPACK", False)
        layer.float()(torch.randn(1, 8))
    assert len(calls) == 4 + bf16_packs                      # both off: F.linear


@pytest.mark.skipif(not minillm.model.mkl_packs_here(), reason="this torch has no MKL")
@pytest.mark.parametrize("bias", [False, True])
def test_linear_mkl_pack_serves_any_number_of_rows(monkeypatch, bias):
    """MKL packs an fp32 weight once, told to expect MKL_PACK_ROWS rows; the copy must give
    F.linear's numbers at every row count, below, at and above the hint, and for a weight too
    small to fill one of MKL's blocks."""
    torch.manual_seed(0)
    monkeypatch.setattr(minillm.model.Linear, "MKL", True)   # forced, whatever the vendor
    for n, k in ((16, 8), (37, 19), (960, 576)):
        layer = minillm.model.Linear(k, n, bias=bias)
        layer.skinny = layer.few = "packed"                  # the packed product at 1-3 rows too
        hint = minillm.model.MKL_PACK_ROWS
        with torch.no_grad():
            assert layer.prepacked() is not None and layer._packed_for == "mkl"
            for rows in (1, 2, 3, 4, 5, 16, hint - 1, hint, hint + 1, 100):
                x = torch.randn(rows, k)
                torch.testing.assert_close(layer(x), torch.nn.functional.linear(
                    x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
            y = layer(torch.randn(2, 3, k))                  # [..., K] batches flatten to rows
            assert y.shape == (2, 3, n)
            monkeypatch.setattr(minillm.model.Linear, "MKL", False)   # switched off: packed
            layer(torch.randn(4, k))                                 # again, for oneDNN
            assert layer._packed_for == "onednn"
            monkeypatch.setattr(minillm.model.Linear, "MKL", True)


def test_mkl_is_the_default_on_intel_cpus_only(monkeypatch):
    """Linear.MKL = None decides by the CPU: MKL's packed copy on an Intel CPU with MKL's
    packed GEMM, oneDNN's anywhere else (and without MKL, whatever the vendor)."""
    import builtins
    real_open = builtins.open
    for vendor, packs, expected in (("GenuineIntel", True, True), ("AuthenticAMD", True, False),
                                    ("GenuineIntel", False, False)):
        minillm.model.mkl_preferred_here.cache_clear()
        monkeypatch.setattr(minillm.model, "mkl_packs_here", lambda p=packs: p)
        monkeypatch.setattr(builtins, "open", lambda path, *a, v=vendor, **kw: (
            io.StringIO(f"processor\t: 0\nvendor_id\t: {v}\n") if path == "/proc/cpuinfo"
            else real_open(path, *a, **kw)))
        assert minillm.model.mkl_preferred_here() is expected, vendor
        monkeypatch.setattr(builtins, "open", real_open)
    minillm.model.mkl_preferred_here.cache_clear()
    monkeypatch.undo()
    assert minillm.model.Linear.MKL is None


def test_linear_packs_again_when_its_weight_changes():
    torch.manual_seed(0)
    layer = minillm.model.Linear(8, 16, bias=True)
    x = torch.randn(5, 8)
    with torch.no_grad():
        first = layer.prepacked()
        assert layer.prepacked() is first                    # made once per weight version
        layer.weight.copy_(torch.randn(16, 8))               # in place: a new version
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight,
                                                                        layer.bias))
        layer.weight = torch.nn.Parameter(torch.randn(16, 8))  # another tensor
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight,
                                                                        layer.bias))
    assert "_packed" not in layer.state_dict()
    twin = copy.deepcopy(layer)                              # e.g. a bf16 copy of a used model
    assert "_packed" not in twin.__dict__
    with torch.no_grad():
        torch.testing.assert_close(twin(x), layer(x))
    assert pickle.loads(pickle.dumps(layer)).prepacked() is not None


def test_prepack_packs_every_cpu_linear_once():
    model, _ = minillm.load_model(configs.get("smollm2-135m").with_(
        name="tiny", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
        num_kv_heads=2, head_dim=16, vocab_size=256), weights="random", device="cpu")
    linears = [m for m in model.modules() if isinstance(m, minillm.model.Linear)]
    assert len(linears) == 4 * 2 + 1
    expected = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    assert minillm.model.prepack(model) == expected
    packed = [m.prepacked() for m in linears]
    minillm.model.prepack(model)                             # again: nothing is made twice
    assert all(a is m.prepacked() for a, m in zip(packed, linears))


def test_greedy_with_cache_matches_transformers_and_recompute(bundled, hf_bundled):
    model, tok = bundled
    for prompt in PROMPTS[:2]:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            ref = hf_bundled.generate(ids, max_new_tokens=20, do_sample=False,
                                      attention_mask=torch.ones_like(ids))
        ref_new = ref[0, ids.shape[1]:].tolist()
        cached = minillm.generate(model, tok, prompt, max_new_tokens=20)
        recompute = minillm.generate_no_cache(model, tok, prompt, max_new_tokens=20)
        assert cached == ref_new, prompt
        assert recompute == cached, prompt


def _hf_model(cfg: ModelConfig, seed: int):
    """transformers' model for `cfg` with weights large enough that a mistake shows in the
    logits."""
    torch.manual_seed(seed)
    hf_cfg = to_hf_config(cfg)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "mistral": transformers.MistralForCausalLM}[cfg.arch]
    hf = cls(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return hf


TINY = [
    # MHA, head_dim 32
    ModelConfig(name="tiny-mha", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=4, num_kv_heads=4, head_dim=32, max_position_embeddings=256),
    # GQA 3:1 (SmolLM2's ratio), head_dim 16, Llama-3 rope scaling, tied embeddings
    ModelConfig(name="tiny-gqa3", vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=3,
                num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                rope_theta=500000.0, tie_word_embeddings=True,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # MQA, head_dim 64 (head_dim * heads != hidden)
    ModelConfig(name="tiny-mqa", vocab_size=97, hidden_size=64, intermediate_size=64, num_layers=2,
                num_heads=4, num_kv_heads=1, head_dim=64, max_position_embeddings=256),
    # Qwen2: GQA 4:1 with q/k/v bias
    ModelConfig(name="tiny-qwen2", vocab_size=97, hidden_size=64, intermediate_size=96,
                num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
                rope_theta=1e6, rms_norm_eps=1e-6, attention_bias=True, arch="qwen2"),
    # Mistral: GQA 2:1
    ModelConfig(name="tiny-mistral", vocab_size=97, hidden_size=32, intermediate_size=64,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                max_position_embeddings=256, arch="mistral"),
]


@pytest.mark.parametrize("cfg", TINY, ids=[c.name for c in TINY])
def test_random_configs_match_transformers(cfg):
    hf = _hf_model(cfg, seed=1)
    model = load_state_dict(random_model(cfg, device="cpu", dtype=torch.float32), hf.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, ref = model(ids), hf(ids).logits
    assert ref.abs().max() > 1.0, "reference logits too small to tell models apart"
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"{cfg.name}: max |diff| {diff}"
    # greedy decoding with the KV cache matches transformers and the recompute loop
    prompt = ids[0, :7].tolist()
    with torch.no_grad():
        ref_ids = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              attention_mask=torch.ones(1, 7, dtype=torch.long),
                              eos_token_id=None, pad_token_id=0)[0, 7:].tolist()
    cached = minillm.generate(model, None, prompt, max_new_tokens=12)
    assert cached == ref_ids
    assert minillm.generate_no_cache(model, None, prompt, max_new_tokens=12) == cached


def test_local_checkpoint_directory(tmp_path):
    cfg = TINY[3]                                      # a Qwen2 checkpoint on disk
    hf = _hf_model(cfg, seed=3)
    hf.save_pretrained(tmp_path)
    model, tok = minillm.load_model(str(tmp_path), device="cpu")
    assert model.config.arch == "qwen2" and model.config.attention_bias
    assert tok is None                                 # no tokenizer files were saved
    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() <= TOL


def test_cache_steps_equal_full_forward():
    cfg = TINY[1]
    model = random_model(cfg, device="cpu", dtype=torch.float32, std=0.2)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    full = model(ids)
    cache = minillm.cache.contiguous.ContiguousKVCache(cfg, batch_size=2, max_len=12)
    parts = [model(ids[:, :5], cache=cache), model(ids[:, 5:9], cache=cache)]
    parts += [model(ids[:, t:t + 1], cache=cache) for t in range(9, 12)]
    assert cache.seq_len == 12
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_contiguous_cache_attention_equals_its_twin(dtype):
    """ContiguousKVCache.attend (fused SDPA, a mask only for several queries) against the
    readable causal_attention, GQA group 3, a prefix then chunks of 4 and 1 queries."""
    from minillm.model import causal_attention
    cfg = ModelConfig(name="g3", vocab_size=50, hidden_size=48, intermediate_size=64,
                      num_layers=1, num_heads=6, num_kv_heads=2, head_dim=8,
                      max_position_embeddings=64)
    cache = minillm.cache.contiguous.ContiguousKVCache(cfg, batch_size=2, max_len=16,
                                                       dtype=dtype)
    g = torch.Generator().manual_seed(7)
    ks, vs = [], []
    for T in (7, 4, 1):
        q = torch.randn(2, T, 6, 8, generator=g).to(dtype)
        k, v = (torch.randn(2, T, 2, 8, generator=g).to(dtype) for _ in range(2))
        start = cache.seq_len
        out = cache.attend(0, q, k, v)
        ks.append(k)
        vs.append(v)
        want = causal_attention(q, torch.cat(ks, 1), torch.cat(vs, 1), q_start=start)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), want.float(), **tol)
        cache.advance(T)


@pytest.mark.parametrize("heads,kv_heads,tq", [(6, 2, 1), (6, 2, 3), (4, 4, 1), (8, 1, 1)])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("fold", [True, False])
def test_gqa_attention_equals_attention_over_repeated_kv_heads(heads, kv_heads, tq, masked, fold,
                                                               monkeypatch):
    """gqa_attention (one query: the query heads folded onto their KV head; or enable_gqa's
    way with FOLD_GQA off) against plain softmax attention with each KV head repeated for its
    group, ragged key masks included."""
    from minillm.model import gqa_attention
    monkeypatch.setattr(minillm.model, "FOLD_GQA", fold)
    g = torch.Generator().manual_seed(heads * 10 + tq)
    B, L, D = 3, 11, 8
    q = torch.randn(B, heads, tq, D, generator=g)
    k, v = (torch.randn(B, kv_heads, L, D, generator=g) for _ in range(2))
    mask = None
    if masked:                                       # sequence b sees its first 11 - 3b keys
        mask = (torch.arange(L)[None, :] < torch.tensor([11, 8, 5])[:, None])[:, None, None]
    out = gqa_attention(q, k, v, attn_mask=mask, scale=0.3)
    kr, vr = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("bhqd,bhkd->bhqk", q, kr) * 0.3
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    want = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), vr)
    assert out.shape == (B, heads, tq, D)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_random_presets_build_at_real_shapes():
    for name in configs.names():
        cfg = configs.get(name)
        if cfg.attention == "mla":
            with pytest.raises(ValueError, match="MLA"):
                minillm.load_model(name, weights="random", device="meta")
            continue
        model, _ = minillm.load_model(name, weights="random", device="meta")
        assert model.num_params() == kvmath.param_count(cfg), name


def test_random_weights_are_seeded():
    a, _ = minillm.load_model(TINY[0], weights="random", device="cpu", seed=7)
    b, _ = minillm.load_model(TINY[0], weights="random", device="cpu", seed=7)
    c, _ = minillm.load_model(TINY[0], weights="random", device="cpu", seed=8)
    ids = torch.arange(10)[None]
    assert torch.equal(a(ids), b(ids))
    assert not torch.equal(a(ids), c(ids))


def test_small_random_preset_runs():
    model, tok = minillm.load_model("smollm2-135m", weights="random", device="cpu")
    # the bundled tokenizer serves random weights too
    assert tok is not None
    out = minillm.generate(model, tok, "hello", max_new_tokens=3,
                           sampling=minillm.SamplingParams(temperature=0.0, ignore_eos=True))
    assert len(out) == 3


def test_fused_projections_load_each_checkpoint_part_into_its_rows():
    cfg = TINY[3]                                      # GQA 4:1 with q/k/v bias
    hf = _hf_model(cfg, seed=6)
    model = load_state_dict(random_model(cfg, device="cpu", dtype=torch.float32), hf.state_dict())
    attn, hf_attn = model.layers[1].self_attn, hf.model.layers[1].self_attn
    x = torch.randn(3, cfg.hidden_size)
    q, k, v = attn.qkv_proj(x).split(attn.qkv_proj.output_sizes, dim=-1)
    for ours, ref in ((q, hf_attn.q_proj(x)), (k, hf_attn.k_proj(x)), (v, hf_attn.v_proj(x))):
        assert torch.allclose(ours, ref, atol=1e-5)
    gate, up = model.layers[1].mlp.gate_up_proj(x).chunk(2, dim=-1)
    assert torch.allclose(gate, hf.model.layers[1].mlp.gate_proj(x), atol=1e-5)
    assert torch.allclose(up, hf.model.layers[1].mlp.up_proj(x), atol=1e-5)
    # and back: the split-out weights are transformers' own, name for name
    back = to_hf_state_dict(model)
    ref = {k: v for k, v in hf.state_dict().items() if "rotary" not in k}
    assert back.keys() == ref.keys()
    assert all(torch.equal(back[k], ref[k]) for k in ref)


def test_fused_projection_refuses_a_part_of_the_wrong_shape():
    cfg = TINY[1]
    state = to_hf_state_dict(random_model(cfg, device="cpu", dtype=torch.float32))
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, cfg.hidden_size)
    with pytest.raises(ValueError, match="part 'k'"):
        load_state_dict(random_model(cfg, device="cpu", dtype=torch.float32), state)
    del state["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="missing.*k_proj"):
        load_state_dict(random_model(cfg, device="cpu", dtype=torch.float32), state)


def test_rope_tables_equal_the_angles_computed_per_call():
    cfg = TINY[1]                                      # llama3 frequency scaling too
    model = random_model(cfg, device="cpu", dtype=torch.float32)
    positions = torch.tensor([[0, 5, 63, 64, 511]])
    cos, sin = model.rope(positions)                   # [1, 5, 1, D]
    freqs = positions[..., None].float() * rope_inv_freq(cfg)         # [1, 5, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]
    assert torch.equal(cos, emb.cos())
    x = torch.randn(1, 5, 2, cfg.head_dim)
    assert torch.equal(apply_rope(x, cos, sin), x * emb.cos() + rotate_half(x) * emb.sin())


def test_random_bundled_shapes_never_send_for_the_real_model(monkeypatch, tmp_path):
    """Without the bundled GGUF and its converted copy (a bare GPU machine), a random-weight
    SmolLM2 builds with no tokenizer instead of asking the Hugging Face hub for the model."""
    import minillm.loader as loader
    monkeypatch.setattr(loader, "find_bundled_gguf", lambda: None)
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))

    def no_network(dest):
        raise AssertionError("random weights asked for the real model")
    monkeypatch.setattr(loader, "_convert_bundled", no_network)
    model, tok = minillm.load_model("smollm2-135m", weights="random", device="meta")
    assert tok is None and model.config.num_layers == 30
