"""GPU microbenchmark: the int4 dequant-GEMM (minillm/kernels/int4_gemm.py) against a bf16 F.linear.

For each decoder weight shape of a model (default: the bundled SmolLM2-135M; `--model
llama-3.2-1b` for the issue's 1B target) and each row count M (default 1, 16, 64), it times

    bf16   F.linear(x_bf16 [M, K], W_bf16 [N, K])                 2 bytes per weight
    int4   int4_gemm(x_bf16, qweight [N, K/2], scales, zeros, g)  0.5 byte + 8 bytes per group

with as many copies of each weight as the model has layers, called in turn, so the weights come
from HBM as in a real decode step (one 576 x 576 weight alone sits in the 50 MB L2 cache and
hides what int4 saves). Reported per shape and M: microseconds per call, the weight bytes per
call over that time (GB/s), and bf16 time / int4 time (> 1: int4 is faster). Before timing, the
kernel's output is checked against the dequantize-then-multiply twin.

    python benchmarks/bench_int4_gemm.py                       # writes benchmarks/results/
    python benchmarks/bench_int4_gemm.py --model llama-3.2-1b --rows 1 4 16 64

It needs a CUDA GPU; on a CPU it refuses (the kernel would run in Triton's interpreter, whose
times say nothing about a GPU).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from minillm import configs  # noqa: E402
from minillm.engine.cuda_graphs import cuda_graph_capture  # noqa: E402
from minillm.quant.linear import int4_linear_ref  # noqa: E402
from minillm.quant.rtn import pack_int4, quantize_int4  # noqa: E402


def shapes(cfg) -> dict:
    """{name: (N, K)} of one decoder layer's products (q/k/v fused, gate/up fused)."""
    h, d = cfg.hidden_size, cfg.head_dim
    return {"qkv_proj": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h),
            "o_proj": (h, cfg.num_heads * d),
            "gate_up_proj": (2 * cfg.intermediate_size, h),
            "down_proj": (h, cfg.intermediate_size)}


def gpu_seconds(fn, repeats: int) -> float:
    """Median of `repeats` timings (CUDA events) of ONE replay of a CUDA graph that recorded
    fn(): the GPU's time for the launches in fn, not Python's. (Timing fn() itself measured the
    host: a Triton launch costs tens of microseconds of Python, longer than a small kernel
    runs, and the first recorded run of this benchmark reported that instead of the kernels.)"""
    fn()                                     # compile, settle the allocator
    replay, _ = cuda_graph_capture(fn, torch.cuda.graph_pool_handle())   # the engine's capture
    replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def time_shape(n, k, rows, copies, group_size, repeats, int4_gemm, config=None):
    w = torch.randn(n, k, device="cuda") * 0.02                            # [N, K]
    q, scale, zero = quantize_int4(w, group_size)
    packed = pack_int4(q)                                                  # [N, K/2]
    x = torch.randn(max(rows), k, device="cuda", dtype=torch.bfloat16)
    got = int4_gemm(x, packed, scale, zero, group_size).float()
    want = int4_linear_ref(x.float(), q, scale, zero)
    err = float((got - want).abs().max() / want.abs().max())
    if err > 2e-2:
        raise SystemExit(f"int4_gemm disagrees with its twin on {n}x{k}: relative error {err:.3g}")
    bf16 = [w.to(torch.bfloat16) for _ in range(copies)]
    int4 = [(packed.clone(), scale.clone(), zero.clone()) for _ in range(copies)]
    results = []
    for m in rows:
        xm = x[:m].contiguous()
        t_bf16 = gpu_seconds(lambda: [F.linear(xm, wb) for wb in bf16], repeats) / copies
        t_int4 = gpu_seconds(lambda: [int4_gemm(xm, p, s, z, group_size, **(config or {}))
                                      for p, s, z in int4], repeats) / copies
        bytes_bf16 = bf16[0].nbytes
        bytes_int4 = sum(t.nbytes for t in int4[0])
        results.append(dict(rows=m, us_bf16=t_bf16 * 1e6, us_int4=t_int4 * 1e6,
                            gbps_bf16=bytes_bf16 / t_bf16 / 1e9,
                            gbps_int4=bytes_int4 / t_int4 / 1e9,
                            speedup=t_bf16 / t_int4, max_rel_err=err))
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=configs.names())
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    p.add_argument("--copies", type=int, default=None, help="default: the model's layer count")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/...)")
    p.add_argument("--sweep", action="store_true",
                   help="time every kernel configuration (block_n, num_warps, num_stages, "
                        "split-K on or off) at the first of --rows; rows per configuration")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_int4_gemm times a GPU kernel and needs a CUDA GPU (torch "
                         f"{torch.__version__} sees none). On a CPU the int4 layers run "
                         "PyTorch's packed kernels: time those with benchmarks/bench_quant.py.")
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    from minillm.kernels.int4_gemm import int4_gemm
    cfg = configs.get(args.model)
    copies = args.copies or cfg.num_layers
    record = dict(benchmark="int4_gemm", model=args.model, group_size=args.group_size,
                  copies=copies, repeats=args.repeats, device_name=torch.cuda.get_device_name(),
                  capability=list(torch.cuda.get_device_capability()),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=" ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
                  torch=torch.__version__, triton=triton.__version__,
                  python=platform.python_version(), load_before=os.getloadavg()[0], rows=[])
    print(f"{record['device_name']}, {args.model}, group {args.group_size}, {copies} copies; "
          "us per call (bf16 F.linear | int4 kernel), bf16 time / int4 time")
    if args.sweep:
        return sweep(args, cfg, copies, record, int4_gemm)
    for name, (n, k) in shapes(cfg).items():
        for r in time_shape(n, k, args.rows, copies, args.group_size, args.repeats, int4_gemm):
            record["rows"].append(dict(shape=name, N=n, K=k, **r))
            print(f"{name:>13} {n:>6}x{k:<6} M={r['rows']:<3} {r['us_bf16']:8.1f} | "
                  f"{r['us_int4']:8.1f} us  {r['gbps_bf16']:6.0f} | {r['gbps_int4']:6.0f} GB/s"
                  f"  x{r['speedup']:.2f}")
    return save(args, record)


def sweep(args, cfg, copies, record, int4_gemm):
    """Every configuration on every shape at M = rows[0]: the sum of int4 times over the
    shapes (one layer's products) per configuration, fastest first."""
    import itertools
    m = args.rows[0]
    configs_tried = [dict(block_n=bn, num_warps=w, num_stages=st, split_k=sk)
                     for bn, w, st, sk in itertools.product((32, 64, 128), (4, 8), (2, 3, 4),
                                                            (None, 1))]
    totals = []
    for c in configs_tried:
        total_int4 = total_bf16 = 0.0
        for name, (n, k) in shapes(cfg).items():
            r = time_shape(n, k, [m], copies, args.group_size, args.repeats, int4_gemm, c)[0]
            total_int4, total_bf16 = total_int4 + r["us_int4"], total_bf16 + r["us_bf16"]
            record["rows"].append(dict(shape=name, N=n, K=k, config=c, **r))
        totals.append(dict(config=c, rows=m, us_int4_layer=total_int4,
                           us_bf16_layer=total_bf16, speedup=total_bf16 / total_int4))
        print(f"{c}  M={m}: int4 {total_int4:7.1f} us per layer, bf16 {total_bf16:7.1f}, "
              f"x{total_bf16 / total_int4:.2f}", flush=True)
    record["sweep"] = sorted(totals, key=lambda t: t["us_int4_layer"])
    print("fastest:", record["sweep"][0])
    return save(args, record)


def save(args, record):
    record["load_after"] = os.getloadavg()[0]
    gpu = record["device_name"].replace("NVIDIA ", "").replace(" ", "-").lower()
    out = Path(args.out) if args.out else (
        ROOT / "benchmarks" / "results" /
        f"int4_gemm_{gpu}_{args.model}_{datetime.date.today():%Y%m%d}.json")
    out.write_text(json.dumps(record, indent=1))
    print("wrote", out)
    return record


if __name__ == "__main__":
    main()
