"""Compile the Triton kernels for a GPU without having one, and report what the compiler made.

Triton's interpreter (the CPU tests) runs a kernel's Python line by line; it never compiles it,
so it cannot tell whether the GPU compiler accepts the kernel, or how many registers it needs.
Triton's Linux wheel ships NVIDIA's `ptxas`, so the whole pipeline (Triton IR -> PTX -> cubin)
runs on any machine. This module calls each launcher with "meta" tensors (shapes, no data),
catches the launch instead of running it, compiles that kernel for the target GPU, and reads
the cubin's resource usage: registers per thread, stack (spilled registers) and shared memory.

    python -m minillm.kernels.compile_check              # H100 (sm_90), bf16, two geometries
    python -m minillm.kernels.compile_check --arch 80 --dtype float16

Run it in a process WITHOUT TRITON_INTERPRET=1 (the kernels must be defined for compilation).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

from . import paged_decode, paged_prefill, store_kv_kernel

TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
                torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


class _Catch:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, grid, args, kwargs))


def capture_launches(call) -> list:
    """Run `call()` with every kernel replaced by a recorder; return the launches."""
    modules = {paged_decode: ("_paged_decode_kernel", "_merge_partitions_kernel"),
               paged_prefill: ("_paged_prefill_kernel",),
               store_kv_kernel: ("_store_kv_kernel",)}
    launches, saved = [], []
    for module, names in modules.items():
        for name in names:
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, _Catch(getattr(module, name), launches))
    try:
        call()
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)
    return launches


def compile_launch(kernel, args, kwargs, arch: int):
    """Compile one recorded launch the way Triton's runtime would specialise it."""
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    signature, constants, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if i >= len(args):                                   # a constexpr passed by keyword
            signature[name], constants[name] = "constexpr", kwargs[name]
            continue
        value = args[i]
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]          # torch allocations are aligned
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:                                     # the runtime specialises 1 away
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    return triton.compile(source, target=target, options=backend.parse_options(options).__dict__)


def resource_usage(compiled) -> dict:
    """Registers, stack (spills) and shared memory of a compiled kernel, from its cubin."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    usage = dict(re.findall(r"(REG|STACK):(\d+)", text))
    return dict(registers=int(usage["REG"]), stack_bytes=int(usage["STACK"]),
                shared_bytes=compiled.metadata.shared)


def check(arch: int = 90, dtype: torch.dtype = torch.bfloat16,
          geometries=((9, 3, 64), (32, 8, 128)), block_size: int = 16,
          kv_dtype: torch.dtype | None = None) -> list[dict]:
    """Compile every kernel variant for each (H, KVH, D) geometry; one dict per kernel.
    kv_dtype: the cache's dtype when it differs from q's (an fp8 cache, chapter 09)."""
    if paged_decode.interpreting():
        raise RuntimeError("TRITON_INTERPRET=1 is set: the kernels were defined for the "
                           "interpreter; run this in a process without it")
    rows = []
    for num_heads, num_kv_heads, head_dim in geometries:
        meta = dict(device="meta")
        k_cache = torch.empty(1024, block_size, num_kv_heads, head_dim, dtype=kv_dtype or dtype,
                              **meta)
        v_cache = torch.empty_like(k_cache)
        tables = torch.empty(4, 4096 // block_size, dtype=torch.int32, **meta)
        lens = torch.empty(4, dtype=torch.int32, **meta)
        q = torch.empty(4, num_heads, head_dim, dtype=dtype, **meta)
        q_ragged = torch.empty(100, num_heads, head_dim, dtype=dtype, **meta)
        cu = torch.empty(5, dtype=torch.int32, **meta)
        kv = torch.empty(10, num_kv_heads, head_dim, dtype=dtype, **meta)
        slots = torch.empty(10, dtype=torch.int64, **meta)
        calls = {
            "decode single-pass": lambda: paged_decode.paged_decode_triton(
                q, k_cache, v_cache, tables, lens, 0.1, split_kv=False),
            "decode split-KV": lambda: paged_decode.paged_decode_triton(
                q, k_cache, v_cache, tables, lens, 0.1, split_kv=True),
            "prefill": lambda: paged_prefill.paged_prefill_triton(
                q_ragged, k_cache, v_cache, cu, lens, tables, 0.1),
            "store_kv": lambda: store_kv_kernel.store_kv_triton(kv, kv, k_cache, v_cache, slots),
        }
        for variant, call in calls.items():
            for kernel, _grid, args, kwargs in capture_launches(call):
                compiled = compile_launch(kernel, args, kwargs, arch)
                rows.append(dict(variant=variant, kernel=kernel.__name__,
                                 geometry=(num_heads, num_kv_heads, head_dim),
                                 dtype=str(dtype)[6:], kv_dtype=str(k_cache.dtype)[6:],
                                 arch=arch, **resource_usage(compiled)))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 or 90")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--kv-dtype", default=None, choices=["float8_e4m3fn", "float8_e5m2"],
                   help="an fp8 cache (default: the cache has --dtype)")
    a = p.parse_args()
    kv = getattr(torch, a.kv_dtype) if a.kv_dtype else None
    for row in check(a.arch, getattr(torch, a.dtype), kv_dtype=kv):
        print(f"{row['variant']:20s} {row['kernel']:26s} H/KVH/D={row['geometry']} "
              f"{row['dtype']}/{row['kv_dtype']} sm_{row['arch']}: {row['registers']} registers, "
              f"{row['stack_bytes']} B stack (spills), {row['shared_bytes']} B shared")


if __name__ == "__main__":
    main()
