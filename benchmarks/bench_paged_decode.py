"""Benchmark: minillm's Triton paged decode attention against three baselines.

    (a) its plain-PyTorch twin (minillm.kernels.reference), the same paged cache;
    (b) SDPA (torch.nn.functional.scaled_dot_product_attention) over contiguous K/V of equal
        lengths: what decode costs when no paging indirection exists at all;
    (c) FlexAttention's paged attention: torch.compile'd flex_attention over the same pool,
        laid out [1, KVH, slots, D], with a BlockMask built from the same block tables. Flex's
        decode kernel needs a power-of-two GQA group, so for SmolLM2 (group 3) each group's
        query heads are folded into the query length (q [B, KVH, group, D], no GQA).

For each shape it records the median time per call and the achieved bandwidth, K/V bytes read
per call / time, beside a device copy bandwidth measured in the same run (a large
`dst.copy_(src)`, counted as bytes read + bytes written). Shapes: SmolLM2 geometry (9 q / 3 kv
heads, head_dim 64) and Llama-3-8B geometry (32 / 8, 128); batch 1, 16, 64, 256; context 128,
1024, 4096 (every sequence at the same length, so SDPA has a contiguous twin); block 16, plus
the Triton kernel again at block 128; bfloat16.

    python benchmarks/bench_paged_decode.py            # full sweep, needs CUDA
    python benchmarks/bench_paged_decode.py --smoke    # seconds: a tiny shape, any device

Writes benchmarks/results/paged_decode_<device>_<date>.json (device, date, versions, command,
copy bandwidth, one row per shape and method, and the targets below checked) and a PNG plot
with the same name. --smoke writes to a temporary folder unless --out-dir is given, and on CPU
runs the Triton kernel through Triton's interpreter: its timings say nothing about a GPU.

Targets (GPU): >= 80% of copy bandwidth where the K/V read per call is >= 400 MB; >= 1.0x
FlexAttention paged; within 1.1x of SDPA on contiguous K/V; block 16 within 5% of block 128.
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import platform
import re
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

GEOMETRIES = {"smollm2-135m": (9, 3, 64), "llama-3-8b": (32, 8, 128)}   # (H, KVH, D)
BATCHES = (1, 16, 64, 256)
CONTEXTS = (128, 1024, 4096)
BLOCK_SIZE, COMPARE_BLOCK_SIZE = 16, 128
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="one tiny shape (CPU: reference + Triton interpreter); seconds")
    p.add_argument("--out-dir", type=Path, default=None,
                   help=f"where the JSON and PNG go (default {RESULTS}; --smoke: a temp dir)")
    p.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    p.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    p.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    p.add_argument("--no-twin", action="store_true", help="skip the (slow) PyTorch twin")
    p.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    p.add_argument("--tag", default="", help="suffix for the output names (partial sweeps)")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- inputs
def build_case(num_heads, num_kv_heads, head_dim, batch, context, block_size, dtype, device,
               seed=0):
    """Equal-length sequences, held both contiguously (for SDPA) and paged (shuffled blocks).

    q, k and v are drawn before anything that depends on block_size, so two block sizes with
    the same seed hold the same numbers."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, num_heads, head_dim, generator=g, device=device, dtype=dtype)
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    shape = (batch, context, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g, device=device, dtype=dtype)        # [B, L, KVH, D]
    v = torch.randn(shape, generator=g, device=device, dtype=dtype)
    order = torch.randperm(num_blocks, generator=g, device=device)          # scattered blocks
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)        # [B, blocks]
    pad = blocks_per_seq * block_size - context
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, device=device,
                          dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    for src, dst in ((k, k_cache), (v, v_cache)):
        padded = torch.nn.functional.pad(src, (0, 0, 0, 0, 0, pad))          # [B, blocks*bs, ...]
        dst[block_tables.flatten().long()] = padded.view(
            batch * blocks_per_seq, block_size, num_kv_heads, head_dim)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                seq_lens=seq_lens, scale=head_dim ** -0.5)


def kv_bytes(case) -> int:
    """K and V bytes a decode call must read: every real token of every sequence."""
    kvh, d = case["k_cache"].shape[2:]
    tokens = int(case["seq_lens"].sum())
    return 2 * tokens * kvh * d * case["k_cache"].element_size()


# ----------------------------------------------------------------------------- methods
def sdpa_fn(case):
    import torch.nn.functional as F
    q = case["q"][:, :, None, :]                                     # [B, H, 1, D]
    k = case["k"].transpose(1, 2).contiguous()                       # [B, KVH, L, D]
    v = case["v"].transpose(1, 2).contiguous()
    gqa = q.shape[1] != k.shape[1]
    return lambda: F.scaled_dot_product_attention(q, k, v, scale=case["scale"],
                                                  enable_gqa=gqa)[:, :, 0]


def flex_fn(case, compiled: bool):
    """FlexAttention over the same pool and block tables (see the module docstring)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    q, k_cache, v_cache = case["q"], case["k_cache"], case["v_cache"]
    tables, seq_lens = case["block_tables"], case["seq_lens"]
    num_blocks, block_size, kvh, d = k_cache.shape
    batch, num_heads, _ = q.shape
    group = num_heads // kvh
    device = q.device
    # flex's layout: one long "sequence" of slots per KV head, [1, KVH, num_blocks * bs, D]
    k_flex = k_cache.permute(2, 0, 1, 3).reshape(1, kvh, num_blocks * block_size, d)
    v_flex = v_cache.permute(2, 0, 1, 3).reshape(1, kvh, num_blocks * block_size, d)
    fold = group & (group - 1) != 0           # flex decode wants a power-of-two group
    q_flex = q.view(batch, kvh, group, d) if fold else q[:, :, None, :]
    q_len = q_flex.shape[2]

    max_blocks = tables.shape[1]
    logical = torch.full((batch, num_blocks), -1, dtype=torch.int32, device=device)
    logical.scatter_(1, tables.long(), torch.arange(max_blocks, dtype=torch.int32,
                                                    device=device).expand(batch, -1).contiguous())

    def mask_mod(b, h, q_idx, kv_idx):        # physical slot -> logical position -> visible?
        logical_block = logical[b, kv_idx // block_size]
        position = logical_block * block_size + kv_idx % block_size
        return (logical_block >= 0) & (position < seq_lens[b])

    # whole blocks skip mask_mod ("full"); the last, partly filled block goes through it
    num_full = (seq_lens // block_size).long()
    full_idx = torch.zeros(batch, 1, 1, num_blocks, dtype=torch.int32, device=device)
    full_idx[:, 0, 0, :max_blocks] = tables
    part_idx = torch.zeros_like(full_idx)
    part_idx[:, 0, 0, 0] = tables.gather(1, num_full.clamp(max=max_blocks - 1)[:, None])[:, 0]
    has_part = (seq_lens % block_size != 0).to(torch.int32).view(batch, 1, 1)
    extra = {}
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters:
        extra["compute_q_blocks"] = False                    # forward only: skip the transpose
    block_mask = BlockMask.from_kv_blocks(
        has_part, part_idx, num_full.to(torch.int32).view(batch, 1, 1), full_idx,
        BLOCK_SIZE=(128, block_size), mask_mod=mask_mod,
        seq_lengths=(q_len, num_blocks * block_size), **extra)
    if compiled:
        # every shape compiles anew; never let dynamo fall back to eager flex (which builds the
        # full score matrix) after its default 8 recompiles: raise instead
        torch._dynamo.config.recompile_limit = 1000
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    attend = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def run():
        with warnings.catch_warnings():    # eager flex (smoke only) warns that it is unfused
            warnings.filterwarnings("ignore", message=".*without torch.compile.*")
            out = attend(q_flex, k_flex, v_flex, block_mask=block_mask, scale=case["scale"],
                         enable_gqa=not fold and group > 1)
        return out.reshape(batch, num_heads, d) if fold else out[:, :, 0]
    return run


def time_ms(fn, device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    start = time.perf_counter()                               # CPU smoke: one plain run (the
    fn()                                                      # correctness call warmed it up)
    return (time.perf_counter() - start) * 1e3


def copy_bandwidth_gbps(device, nbytes=1 << 30) -> float:
    """Bytes read + bytes written per second by a large device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / ms / 1e6


# ----------------------------------------------------------------------------- the sweep
def run_shape(K, geometry, batch, context, dtype, device, twin, flex, compiled):
    num_heads, num_kv_heads, head_dim = GEOMETRIES[geometry]
    rows = []
    case = build_case(num_heads, num_kv_heads, head_dim, batch, context, BLOCK_SIZE, dtype,
                      device)
    nbytes = kv_bytes(case)
    args = (case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
            case["scale"])
    expect = K.reference.paged_decode_attention(*args).float()
    from minillm.kernels import paged_decode
    sms = paged_decode.num_sms(device)
    partition = paged_decode.choose_partition_size(batch, num_kv_heads,
                                                   case["block_tables"].shape[1] * BLOCK_SIZE,
                                                   sms)
    # "triton" lets the split-KV rule choose; the other variant is timed too, to judge the rule
    other = "triton_split" if partition is None else "triton_single"
    methods = {
        "triton": lambda: K.paged_decode_attention(*args, impl="triton", check_values=False),
        other: lambda: K.paged_decode_attention(*args, impl="triton", check_values=False,
                                                split_kv=partition is None),
        "sdpa_contiguous": sdpa_fn(case),
    }
    if twin:
        methods["twin"] = lambda: K.reference.paged_decode_attention(*args)
    if flex:
        methods["flex_paged"] = flex_fn(case, compiled)
    base = dict(geometry=geometry, num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, batch=batch, context=context, dtype=str(dtype)[6:],
                kv_bytes=nbytes, auto_partition_size=partition)
    for method, fn in methods.items():
        try:
            err = (fn().float() - expect).abs().max().item()
            ms = time_ms(fn, device)
            rows.append(dict(base, method=method, block_size=BLOCK_SIZE, ms=ms,
                             gbps=nbytes / ms / 1e6, max_abs_err_vs_twin=err))
        except Exception as exc:                              # record, keep sweeping
            rows.append(dict(base, method=method, block_size=BLOCK_SIZE,
                             error=f"{type(exc).__name__}: {str(exc)[:300]}"))
    del case, methods
    # the same Triton kernel over 128-token blocks
    case = build_case(num_heads, num_kv_heads, head_dim, batch, context, COMPARE_BLOCK_SIZE,
                      dtype, device)
    args = (case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
            case["scale"])
    fn = lambda: K.paged_decode_attention(*args, impl="triton", check_values=False)
    err = (fn().float() - expect).abs().max().item()                # same q, k, v as above
    ms = time_ms(fn, device)
    rows.append(dict(base, method="triton", block_size=COMPARE_BLOCK_SIZE, ms=ms,
                     gbps=nbytes / ms / 1e6, max_abs_err_vs_twin=err))
    return rows


def check_targets(rows, copy_gbps):
    """The four GPU targets, each with its worst case over the sweep."""
    def ms(r, method, block=BLOCK_SIZE):
        for x in rows:
            if (x["geometry"], x["batch"], x["context"], x["method"], x["block_size"]) == \
                    (r["geometry"], r["batch"], r["context"], method, block) and "ms" in x:
                return x["ms"]
        return None

    triton = [r for r in rows if r["method"] == "triton" and r["block_size"] == BLOCK_SIZE
              and "ms" in r]
    out = {}
    big = [r["gbps"] / copy_gbps for r in triton if r["kv_bytes"] >= 400e6]
    out["bandwidth_vs_copy_where_kv_ge_400MB"] = dict(target=">= 0.80",
                                                      worst=min(big, default=None))
    flex = [ms(r, "flex_paged") / r["ms"] for r in triton if ms(r, "flex_paged")]
    out["speedup_vs_flex_paged"] = dict(target=">= 1.0", worst=min(flex, default=None))
    sdpa = [r["ms"] / ms(r, "sdpa_contiguous") for r in triton if ms(r, "sdpa_contiguous")]
    out["time_vs_sdpa_contiguous"] = dict(target="<= 1.10", worst=max(sdpa, default=None))
    blk = [r["ms"] / ms(r, "triton", COMPARE_BLOCK_SIZE) for r in triton
           if ms(r, "triton", COMPARE_BLOCK_SIZE)]
    out["block16_time_vs_block128"] = dict(target="<= 1.05", worst=max(blk, default=None))
    limits = {"bandwidth_vs_copy_where_kv_ge_400MB": (0.80, 1), "speedup_vs_flex_paged": (1.0, 1),
              "time_vs_sdpa_contiguous": (1.10, -1), "block16_time_vs_block128": (1.05, -1)}
    for key, (limit, sign) in limits.items():
        worst = out[key]["worst"]
        out[key]["met"] = None if worst is None else bool(sign * (worst - limit) >= 0)
    return out


def plot(rows, copy_gbps, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    geometries = sorted({r["geometry"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(len(geometries), len(contexts), squeeze=False,
                             figsize=(4.2 * len(contexts), 3.4 * len(geometries)))
    series = [("triton", BLOCK_SIZE), ("triton", COMPARE_BLOCK_SIZE), ("flex_paged", BLOCK_SIZE),
              ("sdpa_contiguous", BLOCK_SIZE), ("twin", BLOCK_SIZE)]
    for i, geo in enumerate(geometries):
        for j, ctx in enumerate(contexts):
            ax = axes[i][j]
            for method, block in series:
                pts = sorted((r["batch"], r["gbps"]) for r in rows
                             if (r["geometry"], r["context"], r["method"], r["block_size"])
                             == (geo, ctx, method, block) and "gbps" in r)
                if pts:
                    label = method if method != "triton" else f"triton (block {block})"
                    ax.plot(*zip(*pts), marker="o", label=label)
            if copy_gbps:
                ax.axhline(copy_gbps, color="gray", ls="--", label="copy (read+write)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{geo}, context {ctx}", fontsize=9)
            ax.set_xlabel("batch")
            ax.set_ylabel("K/V GB/s")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("bench_paged_decode.py: the full sweep needs a CUDA GPU and none was found; "
              "its numbers would mean nothing on CPU. Run with --smoke to check that the script "
              "works (a tiny shape through the reference and Triton's interpreter).",
              file=sys.stderr)
        return 2
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernels are first imported
    import triton
    import minillm.kernels as K

    device = torch.device("cuda" if cuda else "cpu")
    device_name = torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu"
    today = datetime.date.today().isoformat()
    if args.smoke:
        dtype = torch.float32
        shapes = [("smollm2-135m", 2, 40)]
    else:
        dtype = torch.bfloat16
        shapes = [(g, b, c) for g in args.geometries for c in args.contexts for b in args.batches]

    copy_gbps = copy_bandwidth_gbps(device, 1 << 30) if cuda else None
    rows = []
    for geometry, batch, context in shapes:
        rows += run_shape(K, geometry, batch, context, dtype, device, twin=not args.no_twin,
                          flex=not args.no_flex, compiled=cuda and not args.smoke)
        done = rows[-1]
        print(f"{done['geometry']:>14} B={batch:<4} L={context:<5} " + "  ".join(
            f"{r['method']}@{r['block_size']}={r['ms']:.3f}ms" if "ms" in r
            else f"{r['method']}: {r['error'][:60]}"
            for r in rows if (r["batch"], r["context"], r["geometry"])
            == (batch, context, done["geometry"])), flush=True)

    result = dict(
        benchmark="paged_decode", smoke=args.smoke, device=device_name, date=today,
        versions=dict(torch=torch.__version__, triton=triton.__version__,
                      cuda=torch.version.cuda, python=platform.python_version()),
        command=shlex.join(["python"] + sys.argv) if argv is None else shlex.join(argv),
        triton_interpreter=not cuda, copy_gbps=copy_gbps,
        note=("copy_gbps counts bytes read + bytes written; gbps = K/V bytes read / time; "
              "CPU smoke timings run Triton's interpreter and say nothing about a GPU"),
        rows=rows,
        targets=check_targets(rows, copy_gbps) if cuda and not args.smoke else None,
    )
    out_dir = args.out_dir or (Path(tempfile.mkdtemp(prefix="bench_")) if args.smoke else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"paged_decode_{slug(device_name) if cuda else 'cpu'}_{today}"
    stem += "_smoke" if args.smoke else ""
    if not args.smoke and set(args.geometries) != set(GEOMETRIES):
        stem += "_" + "_".join(args.geometries)                # a partial sweep: its own file
    stem += f"_{slug(args.tag)}" if args.tag else ""
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=1))
    title = f"paged decode, {device_name}, {today}"
    if not cuda:
        title += " (smoke run through Triton's interpreter: not a performance number)"
    plot(rows, copy_gbps, out_dir / f"{stem}.png", title)
    if result["targets"]:
        for key, t in result["targets"].items():
            print(f"target {key}: {t['target']}, worst {t['worst']}, met={t['met']}")
    bad = [r for r in rows if r.get("max_abs_err_vs_twin", 0) > (2e-2 if dtype != torch.float32
                                                                  else 1e-4)]
    print(f"wrote {out_dir / stem}.json and .png")
    if bad:
        print(f"{len(bad)} rows differ from the twin beyond tolerance", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
