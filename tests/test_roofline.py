"""minillm.roofline: FLOP and byte counts against independent counts, and the roofline math."""
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import minillm
from minillm import configs, kvmath, roofline
from minillm.cache.contiguous import ContiguousKVCache

TINY = configs.get("smollm2-135m").with_(
    name="tiny", num_layers=2, hidden_size=64, intermediate_size=96, num_heads=4,
    num_kv_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=64)


def counted_flops(fn) -> int:
    """FLOPs of the matmuls fn() runs, as PyTorch's own FlopCounterMode counts them."""
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("cfg", [TINY, TINY.with_(tie_word_embeddings=False, attention_bias=True),
                                 TINY.with_(num_kv_heads=4)],
                         ids=["tied-gqa", "untied-bias", "mha"])
def test_matmul_params_match_the_linear_layers_of_a_real_model(cfg):
    model, _ = minillm.load_model(cfg, weights="random", device="cpu")
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert roofline.matmul_params(cfg) == linear


def test_hand_count_of_the_tiny_config():
    # per layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12288; MLP 3 x 64 x 96 = 18432
    # two layers + output head 100 x 64 = 6400
    assert roofline.matmul_params(TINY) == 2 * (12288 + 18432) + 6400
    # one decode token after 5 cached: keys seen = 6 per query, 4 x 16 FLOPs per key,
    # 4 heads, 2 layers
    assert roofline.attention_flops(TINY, num_tokens=1, context=5) == 2 * 4 * 4 * 16 * 6
    # causal prefill of 3 tokens: queries see 1 + 2 + 3 keys
    assert (roofline.attention_flops(TINY, num_tokens=3, context=0, batch=2)
            == 2 * 2 * 4 * 4 * 16 * 6)


@pytest.fixture
def useful_flops_only(monkeypatch):
    # the model's useful FLOPs, counted on F.linear: on a CPU minillm.model.Linear sends one row
    # in as two (twice the arithmetic for the same weight reads), and its oneDNN packed product
    # is an op the FLOP counter does not know
    monkeypatch.setattr(minillm.model.Linear, "SKINNY_ROWS", range(0))
    monkeypatch.setattr(minillm.model.Linear, "PREPACK", False)
    # and the attention through its einsum twin: the FLOP counter has no formula for PyTorch's
    # fused CPU attention kernel (it would count 0), but counts the twin's two einsums
    monkeypatch.setattr(minillm.cache.contiguous, "fused_causal_attention",
                        minillm.model.causal_attention)


@pytest.mark.parametrize("batch,context", [(1, 4), (3, 7), (2, 20)])
def test_decode_flops_match_flop_counter_on_a_random_model(batch, context, useful_flops_only):
    model, _ = minillm.load_model(TINY, weights="random", device="cpu")
    cache = ContiguousKVCache(TINY, batch, context + 1)
    cache.seq_len = context                          # what is in the cache does not change FLOPs
    ids = torch.randint(0, TINY.vocab_size, (batch, 1))
    assert (counted_flops(lambda: model(ids, cache=cache))
            == roofline.forward_flops(TINY, 1, context, batch))


@pytest.mark.parametrize("last_only", [False, True])
def test_prefill_flops_match_flop_counter_up_to_the_masked_half(last_only, useful_flops_only):
    # minillm's reference attention computes the full T x T score matrix and masks the upper
    # half; forward_flops counts only the causal (useful) half. Add the masked half back.
    B, T = 2, 9
    model, _ = minillm.load_model(TINY, weights="random", device="cpu")
    ids = torch.randint(0, TINY.vocab_size, (B, T))
    counted = counted_flops(lambda: model(ids, last_only=last_only))
    full_attention = B * TINY.num_layers * TINY.num_heads * 4 * TINY.head_dim * T * T
    ours = (roofline.forward_flops(TINY, T, 0, B, last_only=last_only)
            - roofline.attention_flops(TINY, T, 0, B) + full_attention)
    assert counted == ours


def test_flops_scale_with_tokens_and_bytes_with_batch_only_through_kv():
    cfg = configs.get("llama-3-8b")
    # matmul FLOPs are linear in tokens; attention adds a term that grows with context
    f1, f2 = roofline.forward_flops(cfg, 1, 0), roofline.forward_flops(cfg, 2, 0)
    assert 1.99 < f2 / f1 < 2.01
    assert roofline.forward_flops(cfg, 1, 4000) > roofline.forward_flops(cfg, 1, 0)
    # weights are read once per step, whatever the batch: only the KV traffic grows with it
    kv = kvmath.kv_bytes_per_token(cfg, "bfloat16")
    b1 = roofline.bytes_moved(cfg, batch=1, num_tokens=1, context=100)
    b4 = roofline.bytes_moved(cfg, batch=4, num_tokens=1, context=100)
    assert b4 - b1 == 3 * 101 * kv
    assert b1 == (kvmath.weight_bytes(cfg, "bfloat16") - cfg.vocab_size * cfg.hidden_size * 2
                  + 101 * kv)
    # fp32 doubles every byte
    assert (roofline.bytes_moved(cfg, 2, 1, 100, "float32")
            == 2 * roofline.bytes_moved(cfg, 2, 1, 100, "bf16"))
    # a separate KV dtype changes only the KV part
    fp8kv = roofline.bytes_moved(cfg, 1, 1, 100, "bf16", kv_dtype="fp8")
    assert b1 - fp8kv == 101 * kv // 2


def test_weight_read_skips_only_an_untied_input_embedding():
    tied = configs.get("smollm2-135m")
    assert roofline.weight_read_params(tied) == kvmath.param_count(tied)
    untied = configs.get("llama-2-7b")
    assert roofline.weight_read_params(untied) == kvmath.param_count(untied) - 32000 * 4096


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3-8b", "qwen2.5-7b"])
def test_decode_intensity_is_two_flops_per_weight_byte(name):
    cfg = configs.get(name)
    # batch 1, short context: ~2 FLOPs per parameter over (bytes per parameter)
    assert 0.45 < roofline.arithmetic_intensity(cfg, 1, 1, 16, "float32") < 0.55
    assert 0.9 < roofline.arithmetic_intensity(cfg, 1, 1, 16, "bfloat16") < 1.1
    # batching shares the weight read: intensity grows almost linearly with batch at short context
    i1 = roofline.arithmetic_intensity(cfg, 1, 1, 16, "bfloat16")
    i32 = roofline.arithmetic_intensity(cfg, 32, 1, 16, "bfloat16")
    assert 25 < i32 / i1 <= 32


def test_prefill_crosses_the_h100_ridge_and_decode_does_not():
    cfg = configs.get("llama-3-8b")
    h100 = kvmath.GPUS["H100-SXM-80GB"]
    ridge = roofline.ridge_point(h100.bandwidth, h100.bf16_flops)
    assert roofline.arithmetic_intensity(cfg, 1, 1, 1024, "bf16") < ridge / 100
    assert roofline.arithmetic_intensity(cfg, 1, 2048, 0, "bf16", last_only=True) > ridge


def test_ridge_and_attainable():
    assert roofline.ridge_point(2e12, 1e15) == 500.0
    h100 = kvmath.GPUS["H100-SXM-80GB"]
    assert math.isclose(roofline.ridge_point(h100.bandwidth, h100.bf16_flops), 989 / 3.35)
    assert roofline.attainable(10.0, 1e12, 1e15) == 1e13              # memory roof
    assert roofline.attainable(1e4, 1e12, 1e15) == 1e15               # compute roof
    assert roofline.attainable(500.0, 2e12, 1e15) == 1e15             # exactly at the ridge
    got = roofline.attainable(torch.tensor([1.0, 1e3, 1e5]), 1e12, 1e14)
    assert torch.equal(got, torch.tensor([1e12, 1e14, 1e14]))


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="positive"):
        roofline.ridge_point(0, 1e12)
    with pytest.raises(ValueError, match="at least 1"):
        roofline.forward_flops(TINY, 0)
    with pytest.raises(ValueError, match="context"):
        roofline.bytes_moved(TINY, 1, 1, -1)
    with pytest.raises(ValueError, match="repeats"):
        roofline.measure_bandwidth("cpu", 1024, repeats=0)
    with pytest.raises(ValueError, match="unknown dtype"):
        roofline.bytes_moved(TINY, dtype="float13")


def test_measurements_return_plausible_rates():
    bw = roofline.measure_bandwidth("cpu", nbytes=16 * 2**20, repeats=2)
    flops = roofline.measure_flops("cpu", n=256, repeats=2)
    # any machine running these tests copies faster than 100 MB/s and multiplies faster than
    # 100 MFLOP/s, and none is beyond 100 TB/s or 1 PFLOP/s on a CPU
    assert 1e8 < bw < 1e14
    assert 1e8 < flops < 1e15


def test_best_time_takes_the_minimum_after_a_warm_up():
    calls = []
    def fn():
        calls.append(1)
    t = roofline.best_time(fn, "cpu", repeats=3)
    assert len(calls) == 4 and 0 <= t < 0.1


def test_plot_roofline_draws_roof_ridge_and_points():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    roofline.plot_roofline(ax, 1e11, 1e12, "test",
                           points={"on roof": 1.0, "measured": (100.0, 5e11)})
    roof = ax.get_lines()[0]
    x, y = roof.get_xdata(), roof.get_ydata()
    assert y.max() == 1e12 and math.isclose(y[0], x[0] * 1e11)
    markers = [ln for ln in ax.get_lines() if ln.get_marker() == "o"]
    assert [(m.get_xdata()[0], m.get_ydata()[0]) for m in markers] == [(1.0, 1e11), (100.0, 5e11)]
    plt.close(fig)


def test_interleaved_times_calls_in_rounds():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = roofline.interleaved_times(fns, repeats=3)
    assert calls == list("abc") * 4                 # one warm-up round, then three timed rounds
    assert list(times) == list("abc") and all(len(t) == 3 and min(t) >= 0 for t in times.values())
    with pytest.raises(ValueError, match="repeats"):
        roofline.interleaved_times(fns, repeats=0)
