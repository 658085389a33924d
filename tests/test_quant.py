"""minillm.quant (chapter 09): RTN formats, packed-kernel layers against their plain-PyTorch
twins, GPTQ against RTN, the engine with quantized weights against sequential generation, bad
input. Tiny random models; the bundled model is not loaded here (~10 s in all)."""
import pytest
import torch
import torch.nn as nn

import minillm
from minillm import SamplingParams, configs
from minillm.loader import random_model
from minillm.quant import onednn_order
from minillm.quant import (Int4Linear, Int8Linear, check_quantization, decoder_linears,
                           quantize_model, weight_bytes)
from minillm.quant.gptq import gptq_quantize, gptq_quantize_model
from minillm.quant.linear import int4_linear_ref, int8_linear_ref
from minillm.quant.rtn import (dequantize_int4, dequantize_int8, pack_int4, quantize_int4,
                               quantize_int8, unpack_int4)

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed=0):
    cfg = configs.get("smollm2-135m").with_(
        name="tiny", num_layers=2, hidden_size=128, intermediate_size=256, num_heads=4,
        num_kv_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=128,
        eos_token_id=None, bos_token_id=None)
    return random_model(cfg, "cpu", torch.float32, seed=seed, std=0.3)


def test_int8_rtn_error_is_at_most_half_a_step():
    w = torch.randn(64, 96) * torch.logspace(-2, 1, 64)[:, None]       # rows of very different size
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (64,)
    err = (dequantize_int8(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()
    assert (q.abs().amax(dim=1) == 127).all()                          # each row uses its range


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_rtn_error_zero_points_and_range(group_size):
    torch.manual_seed(0)
    w = torch.randn(16, 128) + 0.5                                     # not centred on zero
    w[3, 5] = 20.0                                                     # one outlier
    q, scale, zero = quantize_int4(w, group_size)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scale.shape == zero.shape == (16, 128 // group_size)
    deq = dequantize_int4(q, scale, zero)
    step = scale.repeat_interleave(group_size, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-5).all()
    # the step is (max - min) / 15, not max|w| / 7.5 or max / 15
    g = w.reshape(16, -1, group_size)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    torch.testing.assert_close(scale, (hi - lo) / 15)
    assert (dequantize_int4(zero[:, :, None].expand(-1, -1, group_size).reshape(16, 128)
                            .to(torch.uint8), scale, zero) == 0).all()   # zero is exact
    # the outlier widens only its own group's step
    assert scale[3, 0] > 3 * scale[3, 1]


def test_pack_int4_nibble_order_and_round_trip():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.tolist() == [[0x21, 0x0F]]                           # column 2j in the low nibble
    q = torch.randint(0, 16, (8, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_kernel_matches_twin(rows, bias):
    torch.manual_seed(rows)
    lin = nn.Linear(128, 96, bias=bias)
    ql = Int8Linear(lin)
    x = torch.randn(2, rows, 128)
    out = ql(x)
    assert ql.use_kernel and out.shape == (2, rows, 96) and out.dtype == x.dtype
    ref = int8_linear_ref(x, ql.qweight, ql.scale, ql.bias)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=2e-2)       # bf16 activations
    assert (ref - lin(x)).abs().max() < 0.05 * lin(x).abs().max()       # and near the fp32 layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_kernel_expands_once_from_the_crossover(monkeypatch, dtype):
    """Below the crossover aten's int8 kernel (bf16 activations); from it on one expansion of
    the weight into `dtype` and one product; the fp32 expansion computes the kernel's numbers
    (bf16 activations and scales, bf16 out), so a batch and a single row agree."""
    calls = []
    real = torch.ops.aten._weight_int8pack_mm
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm",
                        lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    monkeypatch.setattr(Int8Linear, "EXPAND_DTYPE", dtype)
    ql = Int8Linear(torch.nn.Linear(64, 32, bias=False))
    got, start = ql.expansion()
    assert got == dtype and start == (ql.DEQUANT_ROWS if dtype == torch.bfloat16
                                      else ql.DEQUANT_ROWS_FP32)
    rows = (1, start - 1, start, 100)
    with torch.no_grad():
        for m in rows:
            x = torch.randn(m, 64)
            out = ql(x)
            torch.testing.assert_close(out, int8_linear_ref(x, ql.qweight, ql.scale),
                                       atol=3e-2, rtol=2e-2)
            if dtype == torch.float32:                       # the kernel's numbers, any rows
                kernel = real(x.to(torch.bfloat16), ql.qweight, ql.scale_bf16).float()
                torch.testing.assert_close(out, kernel, atol=1e-6, rtol=2 ** -8)  # 1 bf16 ulp
    assert calls == [1, start - 1]                           # the packed kernel below only


@pytest.mark.parametrize("native", [True, False])
def test_int8_expansion_follows_the_cpus_bf16(monkeypatch, native):
    """bf16 from DEQUANT_ROWS where the CPU multiplies bf16 natively; fp32 from
    DEQUANT_ROWS_FP32 where torch would emulate bf16 (several times slower than fp32)."""
    from minillm.quant import linear
    monkeypatch.setattr(linear, "_native_bf16", lambda: native)
    want = ((torch.bfloat16, Int8Linear.DEQUANT_ROWS) if native
            else (torch.float32, Int8Linear.DEQUANT_ROWS_FP32))
    assert Int8Linear.expansion() == want


needs_onednn_order = pytest.mark.skipif(not onednn_order.available(),
                                        reason="no oneDNN bf16 packing in this torch/CPU")


@needs_onednn_order
@pytest.mark.parametrize("n,k", [(96, 128), (37, 64), (960, 576), (3, 34)])
def test_onednn_order_expands_into_a_packed_weight(n, k):
    """int8 values stored in oneDNN's packed order, expanded into the scratch packed weight,
    multiply like the plain bf16 matrix; the same values in the plain order do not."""
    torch.manual_seed(n + k)
    perm = onednn_order.order(n, k)
    assert perm is not None and int((perm > 0).sum()) == n * k             # a permutation
    assert onednn_order.order(1 << 12, 1 << 12) is None                    # MAX_ENTRIES: plain
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    x = torch.randn(5, k).to(torch.bfloat16)
    ref = x.float() @ q.float().T                                           # fp32 twin
    out = onednn_order.product(x, onednn_order.pack_int8(q), n, k)
    assert out.shape == (5, n) and out.dtype == torch.bfloat16
    atol = 1e-3 * float(ref.abs().max())
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=1e-2)     # bf16 output
    wrong = onednn_order.product(x, onednn_order.pack_int8(q.flip(0)), n, k).float()
    assert not torch.allclose(wrong, ref, atol=atol, rtol=1e-2)            # rows swapped: trips


@needs_onednn_order
def test_int8_layer_uses_the_packed_order_and_follows_its_weight(monkeypatch):
    calls = []
    real = onednn_order.product
    monkeypatch.setattr(onednn_order, "product", lambda x, *a: calls.append(x.shape[0])
                        or real(x, *a))
    torch.manual_seed(0)
    monkeypatch.setattr(Int8Linear, "EXPAND_DTYPE", torch.bfloat16)    # (what the order is for)
    ql = Int8Linear(nn.Linear(64, 48, bias=True))
    x = torch.randn(ql.DEQUANT_ROWS + 3, 64)
    with torch.no_grad():
        out = ql(x)
        plain = Int8Linear.PACKED_ORDER
        monkeypatch.setattr(Int8Linear, "PACKED_ORDER", False)
        torch.testing.assert_close(out, ql(x), atol=1e-2, rtol=1e-2)   # the plain expansion
        monkeypatch.setattr(Int8Linear, "PACKED_ORDER", plain)
        assert calls == [x.shape[0]]
        ql.qweight.neg_()                               # an in-place update is read next call
        torch.testing.assert_close(ql(x), int8_linear_ref(x, ql.qweight, ql.scale, ql.bias),
                                   atol=3e-2, rtol=2e-2)
    import copy
    assert "_packed_q" in ql.__dict__ and "_packed_q" not in copy.deepcopy(ql).__dict__
    traced = torch.compile(ql, backend="eager", fullgraph=True)     # a trace: the plain path
    with torch.no_grad():
        n, out = len(calls), traced(x)
        assert len(calls) == n                              # no scratch inside a trace
        torch.testing.assert_close(out, ql(x), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 4, 33])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_kernel_matches_twin(rows, group_size):
    torch.manual_seed(rows + group_size)
    lin = nn.Linear(256, 80, bias=True)
    ql = Int4Linear(lin, group_size)
    x = torch.randn(rows, 256)
    out = ql(x)
    q = unpack_int4(ql.qweight)
    ref = int4_linear_ref(x, q, ql.qscale, ql.zero, ql.bias)
    torch.testing.assert_close(out, ref, atol=5e-2, rtol=2e-2)
    ql.use_kernel = False                                              # the twin path itself
    torch.testing.assert_close(ql(x), ref)


@pytest.mark.parametrize("native", [True, False])
def test_int4_expands_into_fp32_from_the_crossover_where_bf16_is_emulated(monkeypatch, native):
    """Without native bf16, from DEQUANT_ROWS_FP32 rows on one fp32 expansion of the weight and
    one product, with the kernel's numbers (within one bf16 rounding); below it, and on a CPU
    with native bf16, aten's int4 kernel."""
    from minillm.quant import linear
    monkeypatch.setattr(linear, "_native_bf16", lambda: native)
    calls = []
    real = torch.ops.aten._weight_int4pack_mm_for_cpu
    monkeypatch.setattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu",
                        lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    torch.manual_seed(3)
    ql = Int4Linear(nn.Linear(256, 96, bias=True), 64)
    start = ql.DEQUANT_ROWS_FP32
    assert [ql.expands(m) for m in (1, start - 1, start)] == [False, False, not native]
    with torch.no_grad():
        for m in (1, start - 1, start, start + 37):
            x = torch.randn(m, 256)
            out = ql(x)
            ref = int4_linear_ref(x, unpack_int4(ql.qweight), ql.qscale, ql.zero, ql.bias)
            torch.testing.assert_close(out, ref, atol=5e-2, rtol=2e-2)
            kernel = real(x.to(torch.bfloat16), ql.packed, 64, ql.scales_and_zeros).float()
            torch.testing.assert_close(ql.kernel(x).float(), kernel, atol=1e-4, rtol=2 ** -7)
    kernel_rows = (1, start - 1, start, start + 37) if native else (1, start - 1)
    assert calls == [m for m in kernel_rows for _ in "ab"]  # ql(x), then ql.kernel(x)


def test_int4_expansion_equals_the_kernel_bit_for_bit_almost_everywhere():
    """The expansion is (q - 8) * scale + zero in fp32 from the kernel's own bf16 scale and
    zero: a planted nibble swap or a zero point off by one shows at once."""
    torch.manual_seed(4)
    ql = Int4Linear(nn.Linear(576, 960, bias=False), 64)
    x = torch.randn(70, 576)
    kernel = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), ql.packed, 64,
                                                        ql.scales_and_zeros)
    assert (ql.expanded_product(x) == kernel).float().mean() > 0.999


def test_quantize_model_replaces_every_decoder_linear_and_shrinks_the_weights():
    model = tiny_model()
    before = weight_bytes(model)
    n_linear = len(decoder_linears(model))
    assert n_linear == 2 * 4                                            # qkv, o, gate_up, down
    quantize_model(model, "int8")
    assert not decoder_linears(model)                                  # no nn.Linear left inside
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == n_linear
    layer_fp32 = sum(p.nbytes for p in tiny_model().layers.parameters() if p.dim() == 2)
    layer_int8 = sum(m.weight_bytes() for m in model.modules() if isinstance(m, Int8Linear))
    assert layer_int8 < 0.27 * layer_fp32
    assert weight_bytes(model) < before


@pytest.mark.parametrize("quantization", ["int8", "int4", "int4_expand"])
def test_engine_with_quantized_weights_matches_sequential_generation(quantization, monkeypatch):
    """The engine's batched greedy tokens on the quantized model == the chapter-00 loop's, one
    prompt at a time, on the same quantized model. int4_expand: int4 whose batched prefill
    expands into fp32 (from 8 rows here) while the loop's prompts take the kernel."""
    if quantization == "int4_expand":
        monkeypatch.setattr(Int4Linear, "EXPAND", True)
        monkeypatch.setattr(Int4Linear, "DEQUANT_ROWS_FP32", 8)
        quantization = "int4"
    model = tiny_model()
    llm = minillm.LLM((model, None), quantization=quantization, block_size=8, num_kv_blocks=64)
    assert isinstance(model.layers[0].mlp.down_proj, (Int8Linear, Int4Linear))
    prompts = [[(7 * i + j) % 256 for j in range(3 + 4 * i)] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        seq = minillm.generate(model, None, torch.tensor(p), max_new_tokens=10,
                               sampling=SamplingParams(temperature=0.0, ignore_eos=True))
        assert o.token_ids == seq


def test_gptq_beats_rtn_on_the_layer_output():
    """Correlated inputs (as real activations are: mostly in a low-dimensional subspace): GPTQ's
    output error is well below RTN's (about 0.15x here; asserted below 0.4x)."""
    torch.manual_seed(0)
    K, N = 128, 64
    X = torch.randn(512, 32) @ torch.randn(32, K) + 0.3 * torch.randn(512, K)   # [n, K]
    W = torch.randn(N, K)
    H = 2 * X.t() @ X / len(X)
    rtn = dequantize_int4(*quantize_int4(W, 32))
    gq = dequantize_int4(*gptq_quantize(W, H, 32))
    e_rtn = ((X @ (W - rtn).t()) ** 2).mean()
    e_gptq = ((X @ (W - gq).t()) ** 2).mean()
    assert e_gptq < 0.4 * e_rtn, (float(e_gptq), float(e_rtn))


def test_gptq_model_quantizes_all_linears_and_fits_its_calibration_set_better():
    """On a random model only the calibration text has a meaning to fit (the real model's held-out
    comparison is benchmarks/bench_quant.py's quality table)."""
    model, ref = tiny_model(), tiny_model()
    cal = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    gptq_quantize_model(model, cal, group_size=32)
    assert not decoder_linears(model)
    assert all(m.group_size == 32 for m in model.modules() if isinstance(m, Int4Linear))
    ids = cal
    with torch.no_grad():
        p, q = ref(ids).log_softmax(-1), model(ids).log_softmax(-1)
        rtn = quantize_model(tiny_model(), "int4", 32)(ids).log_softmax(-1)
    kl = lambda a: float((p.exp() * (p - a)).sum(-1).mean())          # noqa: E731
    assert kl(q) < kl(rtn)


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="unknown quantization 'fp4'.*'int8', 'int4'"):
        check_quantization("fp4")
    with pytest.raises(ValueError, match="unknown quantization"):
        minillm.LLM((tiny_model(), None), quantization="awq4")
    with pytest.raises(ValueError, match="unknown quantization"):
        minillm.load_model("smollm2-135m", weights="random", quantization="int3")
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_model(tiny_model(), "int4", group_size=48)
    odd = tiny_model()
    odd.layers[0].mlp.down_proj = nn.Linear(96, 128, bias=False)      # 96 = 3 x 32, not 64
    with pytest.raises(ValueError, match="does not divide the layer's 96 input features"):
        quantize_model(odd, "int4", group_size=64)
    assert type(odd.layers[0].self_attn.o_proj).__name__ == "Linear"   # nothing half-changed


def test_lm_head_in_its_own_format_leaves_the_tied_embedding_alone():
    """int4 decoder layers with an int8 LM head (quantize_lm_head="int8"): the head is an
    Int8Linear whose product equals its twin's, the embedding table it was tied to is unchanged,
    and a format that is not one is refused naming the choices."""
    model = tiny_model()
    table = model.embed_tokens.weight.detach().clone()
    tied = model.lm_head.weight is model.embed_tokens.weight
    quantize_model(model, "int4", 32, quantize_lm_head="int8")
    assert tied and isinstance(model.lm_head, Int8Linear)
    kinds = {type(m) for m in model.layers.modules()}
    assert Int4Linear in kinds and nn.Linear not in kinds
    assert torch.equal(model.embed_tokens.weight, table)
    h = torch.randn(3, table.shape[1])
    torch.testing.assert_close(model.lm_head(h), int8_linear_ref(h, model.lm_head.qweight,
                                                                 model.lm_head.scale),
                               atol=5e-2, rtol=2e-2)
    same = quantize_model(tiny_model(), "int8", quantize_lm_head=True)
    assert isinstance(same.lm_head, Int8Linear)
    with pytest.raises(ValueError, match="quantize_lm_head must be True, False or one of"):
        quantize_model(tiny_model(), "int4", 32, quantize_lm_head="fp8")
