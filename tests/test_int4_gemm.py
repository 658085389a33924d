"""The int4 dequant-GEMM (minillm/kernels/int4_gemm.py, chapter 09's GPU path) against its
plain-PyTorch twin (`quant.linear.int4_linear_ref`: dequantize, then multiply in fp32).

Without CUDA, tests/conftest.py sets TRITON_INTERPRET=1 and the kernel runs through Triton's
interpreter on CPU tensors (tiny shapes: about 17 s on 2 cores, 8 of them compiling the kernel
for sm_90 without a GPU). bf16 activations are tested too: the interpreter computes bf16
products wrongly, so the kernel upcasts there (`paged_decode.dot`), which gives the numbers a
GPU computes. test_gpu_engine_int4_matches_the_fp32_twin needs CUDA (make test-gpu runs it).
"""
import pytest
import torch
import torch.nn as nn

import minillm
from minillm import SamplingParams, configs
from minillm.kernels.int4_gemm import int4_gemm
from minillm.loader import random_model
from minillm.quant import Int4Linear, quantize_model, set_impl
from minillm.quant.linear import int4_linear_ref
from minillm.quant.rtn import dequantize_int4, pack_int4, quantize_int4, unpack_int4

pytestmark = pytest.mark.usefixtures("one_thread")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")   # make test-gpu: compiled


def quantized(N, K, group_size, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) + 0.2                          # [N, K], not centred
    q, scale, zero = quantize_int4(w, group_size)
    return q.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE)


def bf16_bound(x, q, scale, zero, ref):
    """|kernel - twin| allowed for bf16 activations: the kernel rounds each dequantized weight to
    bf16 (relative error <= 2^-9) and the output to bf16 (<= 2^-9 of |y|); twice both."""
    w = dequantize_int4(q, scale, zero)                                # [N, K] fp32
    return 2.0 ** -8 * (x.float().abs() @ w.abs().t() + ref.abs())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("M", [1, 3, 16, 20])
def test_kernel_matches_twin(M, group_size, dtype):
    N, K = 48 + 8 * (M % 3), 2 * group_size + 128                    # N not a tile multiple
    q, scale, zero = quantized(N, K, group_size, seed=M + group_size)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(DEVICE, dtype)
    out = int4_gemm(x, pack_int4(q), scale, zero, group_size)          # [M, N]
    assert out.shape == (M, N) and out.dtype == dtype
    ref = int4_linear_ref(x.float(), q, scale, zero)                   # fp32 twin
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)
    else:
        err = (out.float() - ref).abs()
        assert (err <= bf16_bound(x, q, scale, zero, ref)).all(), float(err.max())


def test_kernel_reads_the_nibbles_in_pack_int4_order():
    """One nonzero weight at a time: the kernel must find it at its own column (a swapped nibble
    order or an off-by-one group index moves it)."""
    N, K, g = 16, 64, 32
    x = torch.eye(K, device=DEVICE)[:20]                               # row i picks column i
    for n, k in ((0, 0), (3, 1), (7, 33), (15, 63)):
        q = torch.full((N, K), 8, dtype=torch.uint8, device=DEVICE)
        q[n, k] = 13
        scale = torch.full((N, K // g), 0.5, device=DEVICE)
        zero = torch.full((N, K // g), 8.0, device=DEVICE)
        out = int4_gemm(x, pack_int4(q), scale, zero, g)               # [20, N]
        expect = torch.zeros(20, N, device=DEVICE)
        if k < 20:
            expect[k, n] = 2.5
        torch.testing.assert_close(out, expect)


def test_int4_linear_triton_impl_matches_its_twin_with_bias():
    torch.manual_seed(0)
    lin = nn.Linear(128, 48, bias=True).to(DEVICE)
    ql = Int4Linear(lin, 64)
    x = torch.randn(2, 3, 128, device=DEVICE)
    ql.impl = "triton"
    out = ql(x)
    assert out.shape == (2, 3, 48)
    ref = int4_linear_ref(x, unpack_int4(ql.qweight), ql.qscale, ql.zero, ql.bias)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-5)


def tiny_model():
    cfg = configs.get("smollm2-135m").with_(
        name="tiny", num_layers=2, hidden_size=128, intermediate_size=256, num_heads=4,
        num_kv_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=128,
        eos_token_id=None, bos_token_id=None)
    return random_model(cfg, DEVICE, torch.float32, seed=0, std=0.3)


def test_engine_greedy_tokens_with_the_triton_kernel_equal_the_twins():
    """The whole engine, every decoder linear on the Triton kernel (interpreted on a CPU): the
    same greedy tokens as the same quantized model on the plain-PyTorch twin."""
    model = quantize_model(tiny_model(), "int4", 32)
    llm = minillm.LLM((model, None), block_size=8, num_kv_blocks=32)
    prompts = [[(5 * i + j) % 256 for j in range(2 + 3 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    set_impl(model, "reference")
    want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    set_impl(model, "triton")
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_bad_input_names_the_fix():
    q, scale, zero = quantized(16, 128, 64, seed=0)
    packed = pack_int4(q)
    with pytest.raises(ValueError, match=r"K = 96 is not a multiple of group_size 64.*\[32\]"):
        int4_gemm(torch.randn(2, 96, device=DEVICE), packed[:, :48], scale[:, :1], zero[:, :1], 64)
    with pytest.raises(ValueError, match="group_size must be one of"):
        int4_gemm(torch.randn(2, 128, device=DEVICE), packed, scale, zero, 48)
    with pytest.raises(ValueError, match=r"qweight must be uint8 \[N, K/2\]"):
        int4_gemm(torch.randn(2, 128, device=DEVICE), q, scale, zero, 64)   # unpacked nibbles
    with pytest.raises(ValueError, match=r"x must be \[M, K\].*reshape"):
        int4_gemm(torch.randn(1, 2, 128, device=DEVICE), packed, scale, zero, 64)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        int4_gemm(torch.randn(2, 128, device=DEVICE).double(), packed, scale, zero, 64)
    with pytest.raises(ValueError, match=r"impl must be one of"):
        set_impl(tiny_model(), "cuda")
    ql = Int4Linear(nn.Linear(64, 16), 32)
    ql.use_kernel, ql.impl = False, "packed"                           # as if built on a GPU
    with pytest.raises(ValueError, match="quantize on the CPU"):
        ql(torch.randn(1, 64))


@cuda
def test_gpu_engine_int4_matches_the_fp32_twin():
    """On a GPU: the bundled architecture with random weights, int4, fp32 activations; greedy
    tokens with the Triton kernel == those with the plain-PyTorch twin, and the kernel is what
    ran (impl None picks it on CUDA)."""
    model, tok = minillm.load_model("smollm2-135m", weights="random", device="cuda",
                                    dtype=torch.float32, quantization="int4")
    layer = model.layers[0].mlp.down_proj
    assert isinstance(layer, Int4Linear) and layer.choose_impl(torch.device("cuda")) == "triton"
    llm = minillm.LLM((model, tok), block_size=16, num_kv_blocks=64)
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    set_impl(model, "reference")
    want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


COMPILE = """
import json, torch
from minillm.kernels import int4_gemm as k
from minillm.kernels.compile_check import compile_launch, resource_usage
rows = []
for dtype in (torch.bfloat16, torch.float32):
  for M in (1, 16, 64):
    for g in (32, 64, 128):
        N, K, meta = 1536, 576, dict(device="meta")
        x = torch.empty(M, K, dtype=dtype, **meta)
        qw = torch.empty(N, K // 2, dtype=torch.uint8, **meta)
        s = torch.empty(N, K // g, dtype=torch.float32, **meta)
        out = torch.empty(M, N, dtype=dtype, **meta)
        _, args, kwargs = k.launch(x, qw, s, s, out, g)
        rows.append(dict(M=M, g=g, dtype=str(dtype), **resource_usage(
            compile_launch(k._int4_gemm_kernel, args, kwargs, 90))))
print(json.dumps(rows))
"""


def test_kernel_compiles_for_h100_without_spills():
    """The interpreter never compiles; this does (Triton IR -> PTX -> cubin for sm_90 with the
    ptxas in Triton's wheel, no GPU needed): bf16 and fp32 activations, decode and prefill
    tiles, every group size."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True,
                         env=env, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(rows) == 18
    for r in rows:
        assert r["stack_bytes"] == 0, f"spills registers: {r}"
        assert r["shared_bytes"] <= 228 * 1024, r             # H100 shared memory per SM


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_benchmark_refuses_without_a_gpu():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_int4_gemm.py"
    spec = importlib.util.spec_from_file_location("bench_int4_gemm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit, match="needs a CUDA GPU.*bench_quant.py"):
        bench.main([])
    assert bench.shapes(configs.get("smollm2-135m")) == {
        "qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576),
        "down_proj": (576, 1536)}


@pytest.mark.parametrize("split_k", [1, 2, 3, 6])
def test_split_k_partials_add_up_to_the_twin(split_k):
    """K cut into split_k slices (fp32 partials, then one sum) gives the twin's product; a split
    that does not divide the K-tiles is refused."""
    N, K, g = 40, 6 * 32, 32                                           # 6 K-tiles of 32
    q, scale, zero = quantized(N, K, g, seed=split_k)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = int4_gemm(x, pack_int4(q), scale, zero, g, split_k=split_k)
    torch.testing.assert_close(out, int4_linear_ref(x, q, scale, zero), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="split_k=4 must divide the 6 K-tiles"):
        int4_gemm(x, pack_int4(q), scale, zero, g, split_k=4)


def test_split_k_aims_at_two_programs_per_sm():
    from minillm.kernels.int4_gemm import split_k_for
    assert split_k_for(tiles=32, k_tiles=32, sms=132) == 8           # want 9: largest divisor 8
    assert split_k_for(tiles=512, k_tiles=32, sms=132) == 1          # enough tiles already
    assert split_k_for(tiles=1, k_tiles=9, sms=132) == 9             # capped by the K-tiles


def test_override_applies_to_every_call_and_an_argument_wins(monkeypatch):
    from minillm.kernels import int4_gemm as k
    N, K, g = 40, 4 * 32, 32
    q, scale, zero = quantized(N, K, g, seed=5)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    want = int4_linear_ref(x, q, scale, zero)
    splits = []
    real = k.launch
    monkeypatch.setattr(k, "launch", lambda *a, **kw: (splits.append(a[6]), real(*a, **kw))[1])
    monkeypatch.setattr(k, "OVERRIDE", {"split_k": 2, "block_n": 32})
    torch.testing.assert_close(int4_gemm(x, pack_int4(q), scale, zero, g), want,
                               atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(int4_gemm(x, pack_int4(q), scale, zero, g, split_k=4), want,
                               atol=1e-4, rtol=1e-5)
    assert splits == [2, 4]
