"""The fp8 KV cache (chapter 09): kv_cache_dtype="fp8" stores one byte per value.

Kernels: store_kv's bytes equal torch's own fp8 rounding of x / scale (saturated), in the twin,
the batched CPU path and the Triton kernel (under TRITON_INTERPRET=1 on a CPU); the paged decode
and prefill attention over an fp8 pool equal plain fp32 attention over the dequantized keys and
values, whichever implementation runs. Engine: the pool's bytes halve against the model's
16-bit dtype (blocks per GB double), greedy outputs with fp8 KV are the same under every
scheduling mode (chunked prefill, preemption by recompute and swap, prefix caching,
speculation) as one request at a time, and a pool poisoned with NaN bytes changes nothing (no
block is read before it is written). Bad input: an unknown kv_cache_dtype, or fp8 on a torch
without float8, is a ValueError naming the fix.
"""
import sys
from pathlib import Path

import pytest
import torch

import minillm.kernels as K
from minillm import LLM
from minillm.cache import paged
from minillm.cache.paged import PagedKVCache, SimplePagedKVCache, resolve_kv_cache_dtype
from minillm.engine import LLMEngine
from minillm.engine.model_runner import kv_blocks_for_memory
from minillm.kernels import batched, kv_quant, reference

sys.path.insert(0, str(Path(__file__).parent))
from test_engine_modes import make_workload, run_engine, tiny_model  # noqa: E402
from test_kernels import DEVICE, lengths_for, paged_kv, prefill_batch  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
KVH, D = 2, 32
pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- store_kv
@pytest.mark.parametrize("impl", ["reference", "torch", "triton"])
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("k_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_kv_fp8_bytes_equal_torch_rounding(impl, fp8, k_dtype):
    g = torch.Generator().manual_seed(0)
    num_blocks, bs = 5, 4
    slots = torch.tensor([3, 17, -1, 0, 9, 19], device=DEVICE)      # paged_kv's device
    k = (torch.randn(len(slots), KVH, D, generator=g) * 30).to(DEVICE, k_dtype)
    v = (torch.randn(len(slots), KVH, D, generator=g) * 30).to(DEVICE, k_dtype)
    k[0, 0, 0], v[1, 1, 1] = 1e6, -1e6                     # far past the format's largest value
    k_scale, v_scale = 0.25, 2.0
    kc = torch.zeros(num_blocks, bs, KVH, D, dtype=fp8, device=DEVICE)
    vc = torch.zeros_like(kc)
    if impl == "torch":
        plan = batched.plan_store(batched.Plan([]), slots)
        batched.store_kv(plan, k, v, kc, vc, k_scale, v_scale)
    else:
        K.store_kv(k, v, kc, vc, slots, impl=impl, k_scale=k_scale, v_scale=v_scale)
    m = torch.finfo(fp8).max
    for t, s in enumerate(slots.tolist()):                  # the definition, token by token
        blk, off = divmod(s, bs) if s >= 0 else (None, None)
        if s < 0:
            continue
        want_k = (k[t].float() / k_scale).clamp(-m, m).to(fp8)
        want_v = (v[t].float() / v_scale).clamp(-m, m).to(fp8)
        assert torch.equal(kc[blk, off].view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(vc[blk, off].view(torch.uint8), want_v.view(torch.uint8))
    assert kc.float().abs().max() == m and vc.float().abs().max() == m   # saturated, not NaN
    written = torch.zeros(num_blocks * bs, dtype=torch.bool, device=DEVICE)
    written[slots[slots >= 0]] = True
    assert not kc.view(-1, KVH, D)[~written].float().any()           # nothing else touched


# ----------------------------------------------------------------------------- attention
def fp8_pool(lens, block_size, fp8=E4M3, scale=0.5, seed=0):
    """paged_kv's pool (NaN outside the sequences) quantized to fp8, and its dequantized fp32
    twin: attention over the fp8 pool must equal fp32 attention over the twin."""
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv(lens, block_size, seed=seed)
    kq = kv_quant.quantize(k_cache * 3, fp8, scale)
    vq = kv_quant.quantize(v_cache * 3, fp8, scale * 2)
    return (kq, vq, kv_quant.dequantize(kq, scale), kv_quant.dequantize(vq, scale * 2),
            tables, seq_lens, dict(k_scale=scale, v_scale=scale * 2))


TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("impl,split", [("reference", None), ("torch", None),
                                        ("triton", False), ("triton", True)])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_decode_over_fp8_equals_fp32_over_dequantized(impl, split, q_dtype):
    bs, group = 16, 3
    lens = lengths_for(bs) + ([133] if split else [])
    kq, vq, kf, vf, tables, seq_lens, scales = fp8_pool(lens, bs)
    q = torch.randn(len(lens), KVH * group, D, device=DEVICE).to(q_dtype)
    want = reference.paged_decode_attention(q.float(), kf, vf, tables, seq_lens, D ** -0.5)
    kw = dict(split_kv=split, partition_size=64 if split else None) if impl == "triton" else {}
    out = K.paged_decode_attention(q, kq, vq, tables, seq_lens, D ** -0.5, impl=impl,
                                   **scales, **kw)
    assert out.dtype == q_dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), want, **TOL[q_dtype])


@pytest.mark.parametrize("impl", ["reference", "torch", "triton"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_paged_prefill_over_fp8_equals_fp32_over_dequantized(impl, q_dtype):
    bs, group = 8, 3
    pairs = prefill_batch(bs)
    kq, vq, kf, vf, tables, seq_lens, scales = fp8_pool([s for _, s in pairs], bs, fp8=E5M2)
    q_lens = [ql for ql, _ in pairs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEVICE)
    q = torch.randn(sum(q_lens), KVH * group, D, device=DEVICE).to(q_dtype)
    want = reference.paged_prefill_attention(q.float(), kf, vf, cu, seq_lens, tables, D ** -0.5)
    out = K.paged_prefill_attention(q, kq, vq, cu, seq_lens, tables, D ** -0.5, impl=impl,
                                    **scales)
    assert out.dtype == q_dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), want, **TOL[q_dtype])


def test_fp8_error_is_bounded_and_nonzero():
    """e4m3 keeps 3 mantissa bits: each stored value within 2^-4 relative (normal range), and
    the attention output moves, but little, against the unquantized pool."""
    x = torch.randn(4096) * 4
    rel = ((kv_quant.dequantize(kv_quant.quantize(x, E4M3)) - x).abs()
           / x.abs())[x.abs() > 2 ** -6]
    assert 0 < rel.max() <= 2 ** -4
    lens = lengths_for(16)
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv(lens, 16)
    q = torch.randn(len(lens), KVH, D, device=DEVICE)
    exact = reference.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, D ** -0.5)
    fp8 = reference.paged_decode_attention(q, kv_quant.quantize(k_cache, E4M3),
                                           kv_quant.quantize(v_cache, E4M3), tables, seq_lens,
                                           D ** -0.5)
    err = ((fp8 - exact).norm() / exact.norm()).item()        # relative RMS
    assert 1e-3 < err < 0.1


def test_kernel_scales_are_checked():
    lens = [3]
    k_cache, v_cache, tables, seq_lens, _, _ = paged_kv(lens, 4)
    q = torch.randn(1, KVH, D)
    with pytest.raises(ValueError, match="fp8 cache only"):
        K.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1, k_scale=2.0)
    kq = kv_quant.quantize(k_cache, E4M3)
    with pytest.raises(ValueError, match="positive finite"):
        K.paged_decode_attention(q, kq, kq, tables, seq_lens, 0.1, v_scale=0.0)
    with pytest.raises(ValueError, match="fp8 cache takes float32"):
        K.paged_decode_attention(q.to(torch.int32), kq, kq, tables, seq_lens, 0.1)


# ----------------------------------------------------------------------------- the pool
def test_fp8_pool_holds_one_byte_per_value_and_twice_the_blocks():
    model = tiny_model().to(torch.bfloat16)
    cfg = model.config
    bf16 = PagedKVCache(cfg, 8, 4, dtype=torch.bfloat16)
    fp8 = PagedKVCache(cfg, 8, 4, dtype=torch.bfloat16, kv_cache_dtype="fp8")
    values = 2 * cfg.num_layers * 8 * 4 * cfg.num_kv_heads * cfg.head_dim
    assert fp8.k.dtype == E4M3 and fp8.nbytes == values and bf16.nbytes == 2 * values
    blocks = {d: kv_blocks_for_memory(model, 16, 10 ** 6, d) for d in ("auto", "fp8")}
    per_block = {d: LLMEngine(model, None, num_kv_blocks=blocks[d], kv_cache_dtype=d)
                 .runner.cache.nbytes / blocks[d] for d in blocks}
    assert per_block["fp8"] * 2 == per_block["auto"]                # from the tensors' bytes
    assert abs(blocks["fp8"] - 2 * blocks["auto"]) <= 1              # same budget, twice the blocks


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def workload(model):
    """Prompts with shared prefixes (prefix caching has something to find), and what one
    request at a time with an fp8 pool generates from them."""
    prompts, max_tokens = make_workload(12, seed=7, max_prompt=30, max_out=12)
    prompts += [prompts[0][:20] + [5, 6, 7], prompts[0][:16] + [9]]
    max_tokens += [10, 10]
    alone = LLMEngine(model, None, num_kv_blocks=200, block_size=4, max_num_seqs=1,
                      enable_chunked_prefill=False, enable_prefix_caching=False,
                      kv_cache_dtype="fp8")
    outs, _ = run_engine(alone, prompts, max_tokens)
    return prompts, max_tokens, [outs[str(i)].token_ids for i in range(len(prompts))]


FP8_MODES = {
    "continuous_prefix_cache": dict(),
    "chunked_small_budget": dict(max_num_batched_tokens=12, max_num_seqs=8),
    "recompute_tiny_pool": dict(num_kv_blocks=16, block_size=4),
    "swap_tiny_pool": dict(num_kv_blocks=16, block_size=4, preemption="swap"),
    "ngram_speculation": dict(speculative_config=dict(method="ngram",
                                                      num_speculative_tokens=3)),
}


@pytest.mark.parametrize("mode", list(FP8_MODES))
def test_fp8_greedy_is_the_same_in_every_mode_and_reads_no_stale_byte(model, workload, mode):
    prompts, max_tokens, expected = workload
    kw = dict(num_kv_blocks=200, block_size=4, max_num_seqs=16, max_num_batched_tokens=64,
              kv_cache_dtype="fp8")
    kw.update(FP8_MODES[mode])
    engine = LLMEngine(model, None, **kw)
    cache = engine.runner.cache
    assert cache.k.dtype == E4M3
    for t in (cache.k, cache.v, cache.cpu_k, cache.cpu_v):
        t.view(torch.uint8).fill_(0x7F)       # e4m3 NaN: a slot read before written poisons
    outs, _ = run_engine(engine, prompts, max_tokens)
    for i, ref in enumerate(expected):
        assert outs[str(i)].token_ids == ref, f"{mode}: request {i} differs"
    bm = engine.block_manager
    assert bm.num_free_blocks == engine.num_kv_blocks
    if "tiny_pool" in mode:
        assert engine.num_preemptions > 0
    if mode == "continuous_prefix_cache":
        assert engine.prefix_cache_stats.hits > 0
    if mode == "ngram_speculation":
        assert engine.spec_decode_stats.num_draft_tokens > 0


def test_fp8_kv_changes_the_output_of_a_context_sensitive_model(model, workload):
    """The fp8 engine really runs on rounded K/V: against the fp32 pool some greedy token
    differs on this (deliberately sensitive, random) model, so the tests above compare fp8
    runs with fp8 runs, not fp32 with fp32."""
    prompts, max_tokens, expected = workload
    exact = LLMEngine(model, None, num_kv_blocks=200, block_size=4)
    outs, _ = run_engine(exact, prompts, max_tokens)
    assert any(outs[str(i)].token_ids != ref for i, ref in enumerate(expected))


# ----------------------------------------------------------------------------- bad input
def test_unknown_kv_cache_dtype_is_a_value_error_naming_the_choices(model):
    for bad in ("int8", "fp16", "float8"):
        with pytest.raises(ValueError, match="unknown kv_cache_dtype.*'auto'.*'fp8'"):
            LLM((model, None), kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        LLMEngine(model, None, kv_cache_dtype="fp4")


def test_fp8_without_float8_in_torch_is_a_value_error_naming_the_fix(model, monkeypatch):
    monkeypatch.setattr(paged, "fp8_supported", lambda: False)
    with pytest.raises(ValueError, match="lacks.*install torch >= 2.1.*kv_cache_dtype='auto'"):
        LLM((model, None), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="lacks"):
        SimplePagedKVCache(model.config, 4, 4, batch_size=1, kv_cache_dtype="fp8_e5m2")
    assert resolve_kv_cache_dtype("auto", torch.float32) == torch.float32   # auto still works


def test_e4m3_on_a_gpu_before_ada_is_a_value_error_naming_e5m2(monkeypatch):
    """Triton compiles fp8e4nv for compute capability >= 8.9 only (checked with
    minillm.kernels.compile_check for sm_80: "type fp8e4nv not supported")."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability >= 8.9.*'fp8_e5m2' or 'auto'"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16, "cuda")
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16, "cuda") == E5M2
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, "cuda") == E4M3


def test_llm_kv_cache_dtype_names():
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == E4M3
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) == E4M3
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) == E5M2
    assert resolve_kv_cache_dtype(None, torch.bfloat16) == torch.bfloat16


def test_fp8_kernels_compile_for_h100_without_spills():
    """The interpreter checks the arithmetic; this compiles the fp8-cache variants of all four
    kernels to a cubin for sm_90 (no GPU needed; minillm.kernels.compile_check)."""
    import json
    import os
    import subprocess
    code = ("import json, torch\n"
            "from minillm.kernels.compile_check import check\n"
            "print(json.dumps(check(90, torch.bfloat16, geometries=((9, 3, 64),),"
            " kv_dtype=torch.float8_e4m3fn)))\n")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert {r["kernel"] for r in rows} == {"_paged_decode_kernel", "_merge_partitions_kernel",
                                           "_paged_prefill_kernel", "_store_kv_kernel"}
    for r in rows:
        assert r["kv_dtype"] == "float8_e4m3fn" and r["stack_bytes"] == 0, r


def test_paged_log_probs_auto_equal_the_plain_forward(model):
    """bench_quant's KV quality reference (the paged path, fp32 pool) is the model itself."""
    from minillm.lab import quant_quality as qq
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    plain, paged_auto = qq.log_probs(model, ids), qq.paged_log_probs(model, ids, "auto")
    torch.testing.assert_close(paged_auto, plain, atol=1e-4, rtol=1e-4)
    assert (qq.paged_log_probs(model, ids, "fp8") - plain).abs().max() > 1e-3
