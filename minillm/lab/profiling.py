"""Where a step's time goes (chapter 12): profile engine steps and split them into GEMM time
and everything else.

    engine = decode_engine(model, batch=1, context=64)   # `batch` requests, prompts prefilled
    prof = profile_steps(engine, steps=10)                # torch.profiler over 10 decode steps
    prof.step_ms, prof.gemm_ms, prof.other_ms, prof.ops_per_step
    op_table(prof)                                        # the heaviest ops, per step
    skeleton_config(model.config)                         # the same step, arithmetic taken away
    with step_parts(engine) as parts: ...                 # forward / drafting / the rest, per step
    time_outside_gemms(engine, steps=10)                  # a clock on the products: (step ms,
                                                          # ms outside them), compiled steps too

`step_ms` is the wall time of a step measured WITHOUT the profiler (it adds a few microseconds
to every op); `gemm_ms` is the profiler's self time of the matrix products (`GEMM_OPS`), and
`other_ms = step_ms - gemm_ms`: norms, rope, attention, indexing, Python, the scheduler.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace


from ..engine.llm_engine import LLMEngine
from ..sampling import SamplingParams

# matrix products as the CPU profiler names them (fp32/bf16 GEMMs, the packed ones of
# minillm.model.Linear, and the int8 / int4 kernels)
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int4pack_mm_for_cpu",
            "aten::_weight_int8pack_mm", "mkldnn::_linear_pointwise", "mkl::_mkl_linear")


@dataclass
class StepProfile:
    step_ms: float                  # wall time of one step, no profiler
    gemm_ms: float                  # profiler self time of GEMM_OPS per step
    ops_per_step: float             # torch ops (aten::, mkldnn::) called per step, all of them
    steps: int
    rows: list = field(default_factory=list)   # [(op name, calls per step, self ms per step)]

    @property
    def other_ms(self) -> float:
        return self.step_ms - self.gemm_ms


def decode_engine(model, batch: int, context: int, max_new_tokens: int = 512,
                  **engine_args) -> LLMEngine:
    """An engine holding `batch` requests whose `context`-token prompts are already prefilled,
    so every further step is a decode step of `batch` rows."""
    engine = LLMEngine(model, None, max_num_seqs=max(batch, 1),
                       max_num_batched_tokens=max(2048, batch * context), **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    vocab = model.config.vocab_size
    for i in range(batch):
        prompt = [(7 * i + 13 * t) % vocab for t in range(context)]
        engine.add_request(f"r{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for reqs in engine.groups.values() for r in reqs):
        engine.step()
    return engine


def skeleton_config(cfg, width: int = 64):
    """`cfg` with its arithmetic taken away: the same layers, heads and code path (so the same
    ops, kernel calls and Python per step), at widths where every product and norm costs next
    to nothing (hidden size `width`, head size 8, a 512-token vocabulary). A decode step of
    this model (random weights) measures what a step costs whatever its arithmetic: the
    dispatch, Python and scheduling floor of an eager engine on this machine."""
    return replace(cfg, name=f"{cfg.name}-skeleton", hidden_size=width,
                   intermediate_size=2 * width, head_dim=8, vocab_size=512, published_params=None)


def same_products(skeleton, model) -> None:
    """Give each Linear of `skeleton` the few-row products `tune_skinny` chose for the layer of
    the same name in `model` (`skinny`, `few`): the skeleton's tiny shapes would time their own
    winners, and different products are different ops (the swapped product adds a cat and a
    transpose)."""
    from ..model import Linear
    chosen = {n: (m.skinny, m.few) for n, m in model.named_modules() if isinstance(m, Linear)}
    for n, m in skeleton.named_modules():
        if isinstance(m, Linear):
            m.skinny, m.few = chosen[n]


def time_steps(engine: LLMEngine, steps: int) -> float:
    """Median wall time of `steps` engine steps, ms."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


class gemm_calls:
    """A clock on the products, not a profiler: within it, the wall time spent inside the
    library calls that multiply by the weights is summed into `seconds`, their number into
    `calls`. A step's time minus it is the time outside the products, whatever ran the rest:
    eager ops, a compiled graph's fused kernels (the profiler charges those a record each, so
    it is no clock for a compiled step), Python. fp32 / bf16 models (the int8 / int4 kernels
    are not timed); not thread-safe.

    Which calls: minillm.model.Linear's products on packed weights (`mkldnn._linear_pointwise`,
    `mkl._mkl_linear`, made at run time in eager steps and in compiled ones alike), and

    - eager steps (`compiled=False`): torch.mm, torch.addmm, F.linear;
    - compiled steps (`compiled=True`): the library products a graph calls itself
      (`extern_kernels.mm` / `.addmm`, where Inductor sends torch.mm, F.linear, ...). torch.mm
      & co. are left alone: a graph that traced them guards on them, and replacing them would
      recompile every such graph. Enter it after the step has compiled.

        with gemm_calls() as g:
            engine.step()
        g.seconds, g.calls            # what the step spent in its products, and how many
        time_outside_gemms(engine, steps=10)   # (median step ms, median ms outside products)
    """

    def __init__(self, compiled: bool = False):
        import torch
        import torch.nn.functional as F
        self.seconds, self.calls = 0.0, 0
        self._sites = [(torch.ops.mkldnn, "_linear_pointwise"), (torch.ops.mkl, "_mkl_linear")]
        if compiled:
            from torch._inductor.select_algorithm import extern_kernels
            self._sites += [(extern_kernels, "mm"), (extern_kernels, "addmm")]
        else:
            self._sites += [(torch, "mm"), (torch, "addmm"), (F, "linear")]

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed

    def __enter__(self):
        self._saved = [getattr(obj, name) for obj, name in self._sites]
        for (obj, name), fn in zip(self._sites, self._saved):
            setattr(obj, name, self._timed(fn))
        return self

    def __exit__(self, *exc):
        for (obj, name), fn in zip(self._sites, self._saved):
            setattr(obj, name, fn)


def time_outside_gemms(engine: LLMEngine, steps: int, compiled: bool = False) -> tuple:
    """(median wall time of a step, median of its time outside the products), ms, over
    `steps` engine steps timed with `gemm_calls(compiled)` (True: steps of a compiled graph
    that traces its products, as the engine's enforce_eager=False on a CPU)."""
    walls, outside = [], []
    with gemm_calls(compiled) as g:
        for _ in range(steps):
            before = g.seconds
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
            outside.append(walls[-1] - (g.seconds - before))
    return tuple(1e3 * sorted(x)[len(x) // 2] for x in (walls, outside))


class step_parts:
    """Context manager: wall time of an engine's steps split into the model runner's forward,
    the proposer's drafting (chapter 07) and the rest (scheduling, sampling, bookkeeping),
    summed over every step taken inside. Wraps the three methods on this engine only (no
    class is touched) and restores them on exit.

        with step_parts(llm.engine) as parts:
            llm.generate(...)
        parts.ms_per_step()     # {"step": ..., "forward": ..., "propose": ..., "other": ...}
    """

    PARTS = {"step": (None, "step_outputs"), "forward": ("runner", "_forward"),
             "propose": (None, "_propose")}

    def __init__(self, engine: LLMEngine):
        self.engine, self.seconds, self.calls = engine, dict.fromkeys(self.PARTS, 0.0), {}

    def __enter__(self):
        for part, (attr, name) in self.PARTS.items():
            owner = self.engine if attr is None else getattr(self.engine, attr)
            setattr(owner, name, self._timed(part, getattr(owner, name)))
        return self

    def _timed(self, part: str, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - t0
                self.calls[part] = self.calls.get(part, 0) + 1
        return timed

    def __exit__(self, *exc):
        for attr, name in self.PARTS.values():
            owner = self.engine if attr is None else getattr(self.engine, attr)
            owner.__dict__.pop(name, None)               # the class's method again
        return False

    @property
    def steps(self) -> int:
        return self.calls.get("step", 0)

    def ms_per_step(self) -> dict:
        n = max(1, self.steps)
        out = {part: 1e3 * s / n for part, s in self.seconds.items()}
        out["other"] = out["step"] - out["forward"] - out["propose"]
        return out


def profile_steps(engine: LLMEngine, steps: int = 10, warmup: int = 3) -> StepProfile:
    """Time `steps` steps, then profile `steps` more and sum the ops' self times."""
    from torch.profiler import ProfilerActivity, profile

    time_steps(engine, warmup)
    step_ms = time_steps(engine, steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    rows, gemm_us, calls = [], 0.0, 0
    for e in prof.key_averages():
        if not e.key.startswith(("aten::", "mkldnn::", "mkl::")):   # torch's ops, not ranges
            continue
        calls += e.count
        rows.append((e.key, e.count / steps, e.self_cpu_time_total / 1e3 / steps))
        if e.key in GEMM_OPS:
            gemm_us += e.self_cpu_time_total
    rows.sort(key=lambda r: -r[2])
    return StepProfile(step_ms, gemm_us / 1e3 / steps, calls / steps, steps, rows)


def op_table(p: StepProfile, top: int = 12) -> str:
    """The heaviest ops of a profile, per step, as a text table."""
    lines = [f"{'op':36s} {'calls/step':>10s} {'self ms/step':>12s}"]
    lines += [f"{name:36s} {calls:10.0f} {ms:12.2f}" for name, calls, ms in p.rows[:top]]
    lines.append(f"step {p.step_ms:.1f} ms = GEMM {p.gemm_ms:.1f} ms + other {p.other_ms:.1f} ms;"
                 f" {p.ops_per_step:.0f} torch ops per step")
    return "\n".join(lines)


def predict_step(cfg, batch: int, context: int, dtype, bandwidth: float, flops: float,
                 num_ops: int, op_seconds: float) -> dict:
    """A decode step's time from three limits (chapter 12; problem set exercise 1):

        memory_s   = bytes the step moves (`roofline.bytes_moved`) / bandwidth
        compute_s  = FLOPs of the step (`roofline.forward_flops`, one token per sequence) / flops
        overhead_s = num_ops x op_seconds: the CPU's fixed cost per op (Python, dispatch, a
                     kernel launch), paid one op after another whatever the op's size
        step_s     = max(memory_s, compute_s) + overhead_s

    A GEMM's reads and arithmetic overlap (hence the max); the per-op cost does not overlap with
    them in an eager engine (hence the +). `limit` names the largest of the three terms."""
    from ..roofline import bytes_moved, forward_flops

    if bandwidth <= 0 or flops <= 0:
        raise ValueError(f"bandwidth and flops must be positive, got {bandwidth} and {flops}")
    if num_ops < 0 or op_seconds < 0:
        raise ValueError(f"num_ops and op_seconds must be >= 0, got {num_ops} and {op_seconds}")
    memory = bytes_moved(cfg, batch, 1, context, dtype) / bandwidth
    compute = forward_flops(cfg, 1, context, batch) / flops
    overhead = num_ops * op_seconds
    terms = {"memory": memory, "compute": compute, "overhead": overhead}
    return {"memory_s": memory, "compute_s": compute, "overhead_s": overhead,
            "step_s": max(memory, compute) + overhead, "limit": max(terms, key=terms.get)}
