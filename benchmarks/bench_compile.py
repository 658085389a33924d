"""Benchmark: what torch.compile buys on a CPU decode step's products (chapter 12).

A decode step's time outside attention is, per layer: the output projection, a residual add,
the RMSNorm, the fused gate/up product, SiLU * up, the down product, a residual add. This times
that half-layer over all 30 layers of the bundled model, one row (batch-1 decode) and more,
four ways side by side in one process:

    eager_f_linear     the half-layer written with F.linear (what nn.Linear does)
    eager_minillm      the same through the model's own modules (minillm.model.Linear: 1-4 rows
                       as a (W @ x^T)^T product, one row sent as two)
    compiled_f_linear  torch.compile (Inductor, default mode) of the F.linear version
    compiled_minillm   torch.compile of the modules version

The weights are passed as arguments, so one compiled graph serves every layer (no recompiles).
Attention is left out on purpose: it needs the paged KV cache, whose Python bookkeeping breaks
a graph. Same outputs up to float rounding (max |diff| recorded).

    python benchmarks/bench_compile.py --rows 1 4 16 --out benchmarks/results/compile_cpu_x.json

Run it on a quiet machine (/work/bin/quiet-run) with 2 threads; compile time is recorded too.

`--engine` measures the whole decode step instead, in the engine, the way vLLM compiles a model:
in pieces split at attention. Each decoder layer runs two compiled pieces (RMSNorm + QKV + rope;
output projection + residual + RMSNorm + MLP + residual) with the paged attention eager between
them (its block tables are read on the host). Both pieces are compiled once and shared by the 30
layers (their weights are graph inputs). Eager and compiled rounds alternate, each round on a
fresh engine prefilled to `--context` tokens, so that every round decodes the same positions
(`timed_positions` in the record; rounds one after another on one engine would each attend
over more keys than the last); the record holds the median step of each, the first compiled
step (the compile), a profile of the compiled step, and whether eager and compiled decoding
give the same greedy tokens.

    python benchmarks/bench_compile.py --engine --batch 1 16 --out benchmarks/results/x.json

`--engine --whole` compiles the engine's way instead (`LLM(enforce_eager=False)` on a CPU,
minillm/engine/compiled.py): the whole forward one graph, the products traced (those on packed
weights one op each), attention traced in decode steps, so nothing splits it; `--dtype
bfloat16` for a bf16 model. Its rounds add four systems: the same graph with Inductor's C++
wrapper (`cpp_wrapper`: its time outside the products estimated, its step less the products
clocked in the same round, since the clock cannot see calls made from C++; an estimate the
products' spread between steps swamps, chapter 12), with Dynamo's guards
on the model kept (`model_guards`: every parameter checked before each call, as before they
were skipped), with every product an opaque op again (`opaque_products`: `Linear.TRACED` off)
and with attention the opaque op too (`opaque_attention`: the graph before either was traced,
its model guards skipped; `--variants` names the ones to time, none for eager and compiled
only). Every round also clocks
the products' calls (`lab.profiling.gemm_calls`): the record's `*_outside_gemm_ms` is a
step's time outside them, the profiler's split being no clock for a compiled step.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")   # no compile workers competing
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import minillm  # noqa: E402
from bench_step_profile import cpu_model  # noqa: E402


def half_f_linear(x, h, o_w, norm_w, gate_up_w, down_w, eps: float):
    """x residual [M, C], h attention output [M, C] -> the layer's output [M, C]."""
    x = x + F.linear(h, o_w)
    n = F.rms_norm(x, x.shape[-1:], norm_w, eps)
    gate, up = F.linear(n, gate_up_w).chunk(2, dim=-1)                # [M, I] each
    return x + F.linear(F.silu(gate) * up, down_w)


def half_minillm(x, h, layer):
    """The same half-layer through the model's modules."""
    x = x + layer.self_attn.o_proj(h)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def systems(model):
    eps = model.config.rms_norm_eps
    weights = [(L.self_attn.o_proj.weight, L.post_attention_layernorm.weight,
                L.mlp.gate_up_proj.weight, L.mlp.down_proj.weight) for L in model.layers]
    comp_f = torch.compile(half_f_linear, dynamic=False)
    comp_m = torch.compile(half_minillm, dynamic=False)

    def stack(fn, per_layer):
        def run(x, h):
            for item in per_layer:
                x = fn(x, h, *item) if isinstance(item, tuple) else fn(x, h, item)
            return x
        return run

    with_eps = [w + (eps,) for w in weights]
    return {"eager_f_linear": stack(half_f_linear, with_eps),
            "eager_minillm": stack(half_minillm, list(model.layers)),
            "compiled_f_linear": stack(comp_f, with_eps),
            "compiled_minillm": stack(comp_m, list(model.layers))}


def seconds(fn, x, h, repeats, rounds=3):
    """The best of `rounds` averages of `repeats` calls."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn(x, h)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best


class piecewise_compiled:
    """Within this context every decoder layer's forward runs two torch.compile'd pieces with
    the attention (cache.attend) eager between them; the class's forward is put back after."""

    def __init__(self, dynamic: bool = False):
        from minillm.model import Block

        def pre(block, x, cos, sin):                     # x [B, T, C] -> q, k, v
            return block.self_attn.project(block.input_layernorm(x), cos, sin)

        def post(block, x, a):                           # x residual, a attention out [B, T, H, D]
            x = x + block.self_attn.o_proj(a.flatten(2))
            return x + block.mlp(block.post_attention_layernorm(x))

        cpre, cpost = torch.compile(pre, dynamic=dynamic), torch.compile(post, dynamic=dynamic)

        def forward(block, x, cos, sin, cache=None):
            if cache is None:
                raise ValueError("piecewise_compiled runs engine steps (a paged cache)")
            q, k, v = cpre(block, x, cos, sin)
            return cpost(block, x, cache.attend(block.self_attn.layer_idx, q, k, v))

        self.cls, self.forward, self.saved = Block, forward, None

    def __enter__(self):
        from minillm.model import Linear
        # Inductor cannot lower the product on Linear's hand-packed weight (its own packing
        # needs `freezing`): that product stays eager, a break in the piece; a 1-3 row fp32
        # product in plain ops ((W @ x^T)^T or F.linear, whichever tune_skinny picked) is
        # compiled with the rest
        plain, eager = Linear.forward, torch.compiler.disable(Linear.forward)

        def forward(lin, x):
            rows = x.numel() // x.shape[-1]
            traced = x.dtype == torch.float32 and (
                (rows in Linear.SKINNY_ROWS and lin.skinny != "packed")
                or (rows in Linear.FEW_ROWS and lin.few == "linear"))
            return plain(lin, x) if traced else eager(lin, x)

        self.saved = self.cls.forward, plain
        self.cls.forward, Linear.forward = self.forward, forward
        return self

    def __exit__(self, *exc):
        from minillm.model import Linear
        self.cls.forward, Linear.forward = self.saved


class whole_compiled:
    """Within this context `engine` runs every step that samples through one torch.compile'd
    graph of the whole forward: the engine's own
    enforce_eager=False path on a CPU (minillm/engine/compiled.py), swapped in and out."""

    def __init__(self, engine):
        from minillm.engine.compiled import CompiledStep
        self.runner = engine.runner
        self.compiled = CompiledStep(engine.runner.model, engine.runner.cache)

    def __enter__(self):
        self.saved, self.runner.graphs = self.runner.graphs, self.compiled
        return self

    def __exit__(self, *exc):
        self.runner.graphs = self.saved


# --whole: the engine's compiled step with parts of it as they were before, timed beside it
WHOLE_VARIANTS = ("cpp_wrapper",            # Inductor's C++ wrapper (compiled.CPP_WRAPPER)
                  "model_guards",           # Dynamo's guards on the model kept
                  "opaque_products",        # Linear.TRACED off: every product an opaque op
                  "opaque_attention")       # ... and attention the opaque op too


@functools.lru_cache(maxsize=None)
def variant_functions(name: str):
    """The step's two functions compiled another way: `model_guards`, with Dynamo's guards on
    the model kept (every parameter, packed copy and module attribute checked before each
    call); `cpp_wrapper`, with Inductor's C++ wrapper."""
    from minillm.engine import compiled
    kw = {name: True}
    return compiled._compile(compiled._forward, **kw), compiled._compile(compiled._decode, **kw)


def guard_checks(step, engine, repeats: int = 200) -> dict:
    """Dynamo's check before a call, timed alone: the guards of the graph that runs the
    engine's next decode step (its arguments captured on the way), for the step's function
    and for model_guards' one: {system: (guard lines, microseconds a check)}."""
    captured = []
    fn = step.decode_fn
    step.decode_fn = lambda *a: (captured.append(a), fn(*a))[1]
    try:
        engine.step()
    finally:
        step.decode_fn = fn
    if not captured:
        raise RuntimeError("the step did not run the traced decode graph")
    out = {}
    for name, f in (("compiled", fn), ("model_guards", variant_functions("model_guards")[1])):
        code = f._torchdynamo_orig_callable.__code__
        f_locals = dict(zip(code.co_varnames[:code.co_argcount], captured[0]))
        fits = [e.guard_manager for e in torch._dynamo.eval_frame._debug_get_cache_entry_list(code)
                if e.guard_manager.check(f_locals)]
        if not fits:
            raise RuntimeError(f"no graph of {name} fits the step")
        t0 = time.perf_counter()
        for _ in range(repeats):
            fits[0].check(f_locals)
        out[name] = (len(str(fits[0]).splitlines()),
                     round((time.perf_counter() - t0) / repeats * 1e6, 1))
    return out


@contextlib.contextmanager
def variant(step, name: str):
    """Within it, the CompiledStep `step` runs as `name` (WHOLE_VARIANTS)."""
    from minillm.model import Linear
    saved = step.traced_attention, Linear.TRACED, step.switches, step.fn, step.decode_fn
    if name in ("model_guards", "cpp_wrapper"):
        step.fn, step.decode_fn = variant_functions(name)
    else:
        Linear.TRACED = False
        step.traced_attention = saved[0] and name != "opaque_attention"
        step._pick_functions()                      # (the functions for Linear.TRACED off)
    try:
        yield
    finally:
        (step.traced_attention, Linear.TRACED, step.switches, step.fn,
         step.decode_fn) = saved


def engine_rows(model, batches, context: int, steps: int, rounds: int, check_tokens: int,
                whole: bool = False, variants=WHOLE_VARIANTS):
    from minillm.lab.profiling import (GEMM_OPS, decode_engine, gemm_calls, profile_steps,
                                       time_outside_gemms, time_steps)

    piecewise = None if whole else piecewise_compiled()
    variants = tuple(variants) if whole else ()

    @contextlib.contextmanager
    def running(engine, system: str):
        """`engine` runs as `system`: eager, compiled or one of the variants."""
        if system == "eager":
            yield
            return
        with (whole_compiled(engine) if whole else piecewise) as comp:
            if system == "compiled":
                yield
            else:
                with variant(comp.compiled, system):
                    yield

    def round_at_context(b: int, system: str) -> tuple:
        """(step ms, ms outside the products) of `steps` steps of `system` on a fresh engine
        prefilled to `context` tokens: every round of every system decodes the same positions.
        (Rounds taken one after another on one engine would each start further on, their
        attention over more keys than the round before: a drift that looks like the
        machine's, and a median that belongs to no stated context.)"""
        with torch.inference_mode(False):    # its pools plain tensors, as an engine's are
            engine = decode_engine(model, b, context, max_new_tokens=steps + 2)  # (else
        with torch.inference_mode(), running(engine, system):      # Dynamo recompiles)
            engine.step()                                    # an untimed first step
            return time_outside_gemms(     # (whole: the products traced into the graph)
                engine, steps, compiled=whole and system in ("compiled", "model_guards",
                                                             "cpp_wrapper"))

    rows = []
    for b in batches:
        engine = decode_engine(model, b, context, max_new_tokens=10 * steps + 64)
        comp = whole_compiled(engine) if whole else piecewise
        row = {"batch": b,            # the positions every timed round decodes, first and last
               "timed_positions": [context + 1, context + steps]}
        with torch.inference_mode():
            time_steps(engine, 2)
            with comp:
                t0 = time.perf_counter()
                engine.step()                                   # compiles this shape
                row["first_compiled_step_s"] = round(time.perf_counter() - t0, 2)
                for v in variants:                              # and the variants' graphs
                    with variant(comp.compiled, v):
                        t0 = time.perf_counter()
                        engine.step()
                        row[f"{v}_first_step_s"] = round(time.perf_counter() - t0, 2)
            by_system = {s: [] for s in ("eager", "compiled", *variants)}
            for _ in range(rounds):                    # alternate, each round afresh
                for s, times in by_system.items():
                    times.append(round_at_context(b, s))
            eager, eager_out = zip(*by_system["eager"])
            compiled, compiled_out = zip(*by_system["compiled"])
            others = {v: by_system[v] for v in variants}
            row["eager_step_ms"] = round(statistics.median(eager), 2)
            row["compiled_step_ms"] = round(statistics.median(compiled), 2)
            row["eager_rounds_ms"] = [round(t, 2) for t in eager]
            row["compiled_rounds_ms"] = [round(t, 2) for t in compiled]
            # time outside the products by a clock on their calls (lab.profiling.gemm_calls)
            row["eager_outside_gemm_ms"] = round(statistics.median(eager_out), 2)
            row["compiled_outside_gemm_ms"] = round(statistics.median(compiled_out), 2)
            row["eager_outside_gemm_rounds_ms"] = [round(t, 2) for t in eager_out]
            row["compiled_outside_gemm_rounds_ms"] = [round(t, 2) for t in compiled_out]
            for v, timed in others.items():
                row[f"{v}_step_ms"] = round(statistics.median(o[0] for o in timed), 2)
                row[f"{v}_rounds_ms"] = [round(o[0], 2) for o in timed]
                if v == "cpp_wrapper":    # the clock cannot see products called from C++:
                    est = [o[0] - (c - co) for o, c, co in      # its step less the products
                           zip(timed, compiled, compiled_out)]  # clocked in the same round
                    row[f"{v}_outside_gemm_est_ms"] = round(statistics.median(est), 2)
                    row[f"{v}_outside_gemm_est_rounds_ms"] = [round(t, 2) for t in est]
                    continue
                row[f"{v}_outside_gemm_ms"] = round(statistics.median(o[1] for o in timed), 2)
                row[f"{v}_outside_gemm_rounds_ms"] = [round(o[1], 2) for o in timed]
            if "model_guards" in variants:     # the guards' check alone, both ways
                with comp:
                    checks = guard_checks(comp.compiled, engine)
                for name, (lines, us) in checks.items():
                    row[f"{name}_guard_lines"], row[f"{name}_guard_check_us"] = lines, us
            if not engine.has_unfinished():
                raise RuntimeError("the engine ran out of tokens to decode: raise max_new_tokens")
            prof = profile_steps(engine, steps)
            with comp:
                cprof = profile_steps(engine, steps)
            if whole:     # the products by their clock (the profiler misses the ones a graph
                with gemm_calls() as g:                         # calls itself)
                    engine.step()
                with comp, gemm_calls(compiled=True) as gc:
                    engine.step()
                gemms = [g.calls, gc.calls]
                if not engine.has_unfinished():
                    raise RuntimeError("the engine ran out of tokens: raise max_new_tokens")
            else:         # (a traced decode attention adds two aten::bmm a layer: not products)
                gemms = [sum(c for n, c, _ in pr.rows if n in GEMM_OPS and n != "aten::bmm")
                         for pr in (prof, cprof)]
            if gemms[0] != gemms[1]:      # the runner retries a failed batch request by request
                raise RuntimeError(f"{gemms[1]:.0f} products per compiled step, {gemms[0]:.0f} "
                                   "eager: the compiled batched forward failed and the engine "
                                   "ran its requests one at a time")
            for name, pr in (("eager", prof), ("compiled", cprof)):
                row[f"{name}_profile"] = {"step_ms": round(pr.step_ms, 2),
                                          "gemm_ms": round(pr.gemm_ms, 2),
                                          "other_ms": round(pr.other_ms, 2),
                                          "ops_per_step": round(pr.ops_per_step)}
            # greedy tokens: two engines from the same prefilled state, eager and compiled
            a = decode_engine(model, b, context, max_new_tokens=check_tokens)
            c = decode_engine(model, b, context, max_new_tokens=check_tokens)
            while a.has_unfinished():
                a.step()
            with (whole_compiled(c) if whole else comp):
                while c.has_unfinished():
                    c.step()
            toks = [[r.output_token_ids for reqs in e.groups.values() for r in reqs]
                    for e in (a, c)]
            row["check_tokens"] = check_tokens
            row["same_greedy_tokens"] = toks[0] == toks[1]
        print(b, "seqs:", {k: v for k, v in row.items() if not isinstance(v, (list, dict))},
              flush=True)
        rows.append(row)
    return rows


def finish(args, load_before: float, rows: list, **fields) -> dict:
    """The record (what ran, where, when, how loaded, the command), written to --out."""
    record = {**fields, "model": "smollm2-135m", "dtype": args.dtype, "threads": args.threads,
              "device": cpu_model(), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
              "load_before": load_before, "load_after": os.getloadavg()[0],
              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--engine", action="store_true",
                   help="the whole decode step in the engine, compiled in pieces split at "
                        "attention (see the module docstring)")
    p.add_argument("--whole", action="store_true",
                   help="--engine: one graph per step instead, the engine's "
                        "enforce_eager=False on a CPU")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the model's dtype (bfloat16 needs native bf16 on the CPU)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="--engine: sequences")
    p.add_argument("--context", type=int, default=64, help="--engine: prompt tokens")
    p.add_argument("--steps", type=int, default=10, help="--engine: steps per timed round")
    p.add_argument("--rounds", type=int, default=3, help="--engine: eager/compiled rounds")
    p.add_argument("--check-tokens", type=int, default=32,
                   help="--engine: greedy tokens compared between eager and compiled")
    p.add_argument("--variants", nargs="*", default=list(WHOLE_VARIANTS),
                   choices=WHOLE_VARIANTS, help="--whole: the variants timed beside the "
                   "engine's graph (default all; none: eager and compiled only)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    model, _ = minillm.load_model("smollm2-135m", device="cpu",
                                  dtype=getattr(torch, args.dtype))
    if args.engine:
        rows = engine_rows(model, args.batch, args.context, args.steps, args.rounds,
                           args.check_tokens, whole=args.whole, variants=args.variants)
        what = ("decode steps in the engine, the whole forward one torch.compile'd graph "
                "(default mode, dynamic shapes), the products traced (on packed weights one op "
                "each), paged attention traced, Dynamo's guards on the model skipped "
                "(cpp_wrapper_*: the same graph with Inductor's C++ wrapper, its time outside "
                "the products estimated as its step less the products clocked in the Python-"
                "wrapper graph of the same round, the clock not seeing calls from C++; "
                "model_guards_*: the same graph with them kept; opaque_products_*: every "
                "product an opaque op; opaque_attention_*: attention an opaque op too)"
                if args.whole else
                "decode steps in the engine, each layer's two halves torch.compile'd "
                "(default mode, static shapes), paged attention eager between them")
        return finish(args, load_before, rows, benchmark="compile_engine", what=what,
                      context=args.context, steps=args.steps,
                      variants=args.variants if args.whole else [])
    C = model.config.hidden_size
    rows_out = []
    with torch.inference_mode():
        fns = systems(model)
        for m in args.rows:
            g = torch.Generator().manual_seed(m)
            x, h = torch.randn(m, C, generator=g), torch.randn(m, C, generator=g)
            ref = fns["eager_f_linear"](x, h)
            row = {"rows": m}
            for name, fn in fns.items():                               # compile first
                t0 = time.perf_counter()
                out = fn(x, h)                                         # compiles on first call
                row[f"{name}_first_call_s"] = round(time.perf_counter() - t0, 2)
                row[f"{name}_max_diff"] = float((out - ref).abs().max())
            for name, fn in fns.items():                               # then time, side by side
                row[f"{name}_ms"] = round(1e3 * seconds(fn, x, h, args.repeats), 2)
            print(m, "rows:", {k: v for k, v in row.items() if k.endswith("_ms")})
            rows_out.append(row)
    return finish(args, load_before, rows_out, benchmark="compile",
                  what="o_proj + residual + RMSNorm + gate_up + SiLU*up + down + residual, "
                       "30 layers, no attention")


if __name__ == "__main__":
    main()
