"""The step compiled on a CPU (chapter 12): `LLM(enforce_eager=False)` where there is no GPU.

An eager step on a CPU pays for every op it runs: a few microseconds of Python and dispatch
each, thousands of ops a step (30 layers x the norms, the rotary embedding, SiLU * up, the
residual adds, the reshapes), besides the products and attention that do the arithmetic.
torch.compile (Inductor) traces the forward once and fuses that glue into a few generated C++
loops. Two things it must not trace into:

- **attention**, which reads and writes the paged KV cache through host-side bookkeeping (block
  tables, a per-step plan): it becomes ONE opaque op per layer, `minillm::attention(q, k, v,
  layer)`, whose eager body is the cache's own `attend`, reading the step's cache from a
  forward context set around the call. This is vLLM's shape: its `unified_attention` op finds
  the layer's cache in a forward context, and its compiler leaves the op alone;
- **the library's packed products.** `model.Linear` multiplies on the fastest kernel this
  machine measured: a weight prepacked once for oneDNN or MKL, or, for 1-3 rows, plain F.linear
  or the swapped product, chosen by timing. The compiler traces that forward like any other
  (the choice is made while tracing: the row count decides which graph), but a product on a
  packed copy it cannot lower: its own lowering of those library ops wants the weight frozen
  into the graph as a constant (`freezing`, one graph per model). So that product is ONE op,
  `minillm::packed_product(x, packed, w, bias, mkl)` (model.py), the packed copy an input of the
  graph; the rest (the swapped product, F.linear) becomes plain library calls from the graph.
  `quant.QuantLinear`'s int8 kernels stay opaque whole: `minillm::product(x, name)`, whose
  body is the layer's own eager forward (as every product was before: `Linear.TRACED = False`).
  An int4 layer's packed kernel is one aten op the graph calls itself, its casts to bf16 and
  back fused with the ops around it (`Int4Linear.TRACED`); where the layer would expand its
  weight (long prefills on a CPU without native bf16) it takes the opaque op too.

So the whole forward is one graph: embedding, rope lookup, 30 x (norm, [product], rope,
[attention], [product], residual, norm, [product], SiLU * up, [product], residual), norm,
[lm_head], with the bracketed ops library calls or opaque ops and everything between fused.

**A decode-only step traces its attention too** (`compiled_decode`, `_TracedDecodeCache`):
every sequence brings one query, so the step's attention is a gather and two small products
the compiler can generate: each layer writes its K/V into the pools (`index_copy_` into a
graph input, which the compiler keeps in place), gathers each sequence's keys through a
[B, L] table of slots made once per step (`kernels.batched.slot_table`), and masks the
slots past each sequence's end. Its per-layer Python (the opaque call, the cache's plan, the
checks) is gone; what that buys, against the same graph with the opaque op, is measured by
`bench_compile.py --engine --whole` (chapter 12). Prefill chunks, verification steps and fp8
pools keep the opaque op.

Shapes are dynamic: a step of any number of tokens reuses a graph, except that Inductor
specialises the size 1, so a step that samples one row and one that samples several get a
graph each (and a one-token step its own), and the products' choice by row count (1-2 rows,
3, more: `Linear.SKINNY_ROWS`, `FEW_ROWS`) is a guard, so a step of 2 or 3 tokens gets its own
graph too (each function keeps up to GRAPHS_PER_FUNCTION of them: past torch.compile's
default of 8 it would run eagerly without a word). The first step of each shape pays the
compile, tens of seconds on 2 cores: an engine that lives long amortises it, a short script
does not.

**Guards.** Before each call Dynamo checks that the graph still fits: every input's dtype,
shape and stride, and, with the model an argument, every parameter, packed copy and module
attribute the trace read, some 5,500 checks (about 0.3 ms of a 28 ms step on the course's AMD
CPU: `bench_compile.py --engine --whole`, chapter 12). The model does not change shape under an
engine, so its checks are skipped (`torch.compiler.skip_guard_on_all_nn_modules_unsafe`) and
`model_signature` stands for them: one compiled function per signature (types, config, dtypes,
shapes, product choices), so a model that traces differently never runs another's graph; the
checks left (30-70 us) are on the step's inputs, which pick the row class. vLLM goes further:
it compiles its model once with every guard dropped and never lets Dynamo trace it again (its
`TorchCompileGuardsStripWrapper`). The weights' values are not in the signature: an in-place
update or a new tensor of the same shape is read at the next call (its packed copy remade
first).

**A step that samples nothing** (a middle chunk of a long prompt) runs eagerly. Its graph would
end in an empty tensor, and the compiler, told that attention is a function of its inputs with
no side effects, would drop every layer: nothing it returns needs them, and the KV writes the
step exists for would never happen (chapter 12 shows it). Declaring the side effect is the
general fix (vLLM's attention op writes into an output buffer it declares mutated); skipping
such steps is the small one, and the only step shape it excludes.

The runner also leaves eager every step with a position past the context (the eager forward
raises its usual error) and everything after a compile failure (no C++ compiler, say; logged
once); `build_graph_runner` keeps engines whose drafter reads hidden states eager (forward
hooks do not run inside a compiled graph). In fp32 the greedy tokens equal the eager engine's
(tests/test_compiled.py; the benchmarks' runs); in bf16 the fused glue rounds once where the
eager ops round after each op, so near-ties can flip, as between bf16 and fp32.

`build_graph_runner` (cuda_graphs.py) returns a `CompiledStep` on a CPU with
enforce_eager=False. Measured by `benchmarks/bench_compile.py --engine --whole` (steps) and
`benchmarks/bench_engine.py` (`minillm_graphs`, `minillm_bf16_graphs`): chapter 12.
`CPP_WRAPPER = True` builds the graphs with Inductor's C++ wrapper instead of a Python one
(slower to compile; measured there too).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import types
import weakref
from typing import Optional

import torch

from ..cache.paged import PagedKVCache
from ..kernels.batched import slot_table
from ..model import tensor_version
from .cuda_graphs import decode_forward

logger = logging.getLogger(__name__)


class _Context(threading.local):
    """The forward context: the model and KV cache of the step this thread is running."""
    model = None
    cache = None


_STEP = _Context()
_PRODUCTS = weakref.WeakKeyDictionary()            # model -> {name: its product layer}


@contextlib.contextmanager
def forward_context(model, cache):
    """Within it, `minillm::product(x, name)` runs `model`'s layer `name` and
    `minillm::attention` calls `cache.attend` (vLLM's set_forward_context)."""
    saved = _STEP.model, _STEP.cache
    _STEP.model, _STEP.cache = model, cache
    try:
        yield
    finally:
        _STEP.model, _STEP.cache = saved


@torch.library.custom_op("minillm::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer `layer`'s paged attention (stores k, v and attends): the cache's own `attend`,
    q [1, T, H, D], k/v [1, T, KVH, D] -> [1, T, H, D]. The KV pools it writes are not inputs:
    the compiler keeps the op because later layers read its output (a graph whose result needs
    none of it drops it: see "a step that samples nothing" above)."""
    return _STEP.cache.attend(layer, q, k, v)


@attention.register_fake
def _(q, k, v, layer):
    return torch.empty_like(q)


@torch.library.custom_op("minillm::product", mutates_args=())
def product(x: torch.Tensor, name: str) -> torch.Tensor:
    """The forward context's model's layer `name` (e.g. "layers.0.mlp.down_proj"), its eager
    forward: x [..., K] -> [..., N]. Named by its place in the model, not by the object, so
    every model of one architecture shares the compiled graphs."""
    return _PRODUCTS[_STEP.model][name](x)


@product.register_fake
def _(x, name):
    return x.new_empty((*x.shape[:-1], _PRODUCTS[_STEP.model][name].out_features))


class _OpaqueCache:
    """What the traced layers see as their cache: attention goes through the opaque op (the
    real cache advances outside the graph, in CompiledStep.run)."""

    def attend(self, layer: int, q, k, v):
        return torch.ops.minillm.attention(q, k, v, layer)

    def advance(self, num_tokens: int) -> None:
        pass


def compiled_products(model) -> int:
    """Name each product layer of `model` (model.Linear, quant.QuantLinear) by its place, as
    its `opaque_name`: while torch.compile traces a QuantLinear (or a Linear with
    `Linear.TRACED` off), its forward calls `minillm::product(x, opaque_name)` instead of
    itself (never in eager mode); a Linear is traced itself. The layers keep
    the name (a string: the model still pickles and copies); another torch.compile of them must
    then run inside `forward_context(model, ...)`, where the op finds them. Returns the number
    of layers."""
    from ..model import Linear
    from ..quant.linear import QuantLinear
    layers = {name: m for name, m in model.named_modules()
              if isinstance(m, (Linear, QuantLinear))}
    for name, m in layers.items():
        m.opaque_name = name
    _PRODUCTS[model] = layers
    return len(layers)


_OPAQUE = _OpaqueCache()


class _TracedDecodeCache:
    """What the traced layers see as their cache in a decode-only step: paged attention in
    plain tensor ops that the compiler traces and fuses, no opaque call. Each layer writes its
    tokens' K/V into the pools with `index_copy_` and gathers every key through `key_slots`.

    The pools are the cache's own tensors, flattened to [layers * slots, KVH, D] and written
    whole (layer l's slot s is row l * slots + s): the compiler turns a write into a graph
    input into an in-place write. (Written through a per-layer view, the same code makes the
    compiler copy each layer's pool before writing into it: 60 pool copies a step.)

    q [1, B, H, D], k/v [1, B, KVH, D] -> [1, B, H, D]; slots [B] where each token's K/V goes,
    key_slots [B, L] where each sequence's keys are, visible [B, L] which of them are real."""

    def __init__(self, k_pool, v_pool, slots, key_slots, visible, num_layers: int,
                 scale: float):
        self.k_pool, self.v_pool, self.slots = k_pool, v_pool, slots
        self.key_slots, self.visible, self.scale = key_slots, visible, scale
        self.layer_rows = k_pool.shape[0] // num_layers            # slots per layer

    def attend(self, layer: int, q, k, v):
        B, L = self.key_slots.shape
        KVH, D = k.shape[2], k.shape[3]
        base = layer * self.layer_rows                           # this layer's row 0
        self.k_pool.index_copy_(0, self.slots + base, k[0])
        self.v_pool.index_copy_(0, self.slots + base, v[0])
        rows = self.key_slots.flatten() + base
        keys = self.k_pool.index_select(0, rows).view(B, L, KVH, D).float()
        values = self.v_pool.index_select(0, rows).view(B, L, KVH, D).float()
        qg = q[0].view(B, KVH, -1, D).float()                    # head folding: [B, KVH, G, D]
        s = torch.einsum("bkgd,blkd->bkgl", qg, keys) * self.scale          # [B, KVH, G, L]
        s = s.masked_fill(~self.visible[:, None, None, :], float("-inf"))
        o = torch.einsum("bkgl,blkd->bkgd", s.softmax(-1), values)          # [B, KVH, G, D]
        return o.reshape(q.shape).to(q.dtype)                               # [1, B, H, D]

    def advance(self, num_tokens: int) -> None:
        pass


def _forward(model, input_ids, positions, logits_rows):
    """Transformer.forward without its host-side checks (CompiledStep.run does them), through
    the opaque ops: input_ids [1, T], positions [1, T], logits_rows [S] -> logits [S, V]."""
    return decode_forward(model, input_ids, positions, _OPAQUE, logits_rows)


def _decode(model, input_ids, positions, logits_rows, k_pool, v_pool, slots, key_slots,
            visible):
    """A decode-only step with its attention traced (_TracedDecodeCache): the arguments of
    `_forward`, then the cache's pools flattened and the step's slots, key_slots, visible."""
    cfg = model.config
    cache = _TracedDecodeCache(k_pool, v_pool, slots, key_slots, visible, cfg.num_layers,
                               cfg.head_dim ** -0.5)
    return decode_forward(model, input_ids, positions, cache, logits_rows)


# Every row class (1, 2, 3, more tokens; one sampled row or several) a model runs gets its own
# graph of the same function, and past torch.compile's default of 8 graphs per function the
# function runs eagerly, without an error. Room for more, per function.
GRAPHS_PER_FUNCTION = 64


def model_signature(model) -> tuple:
    """What a trace of `model`'s forward depends on besides the step's inputs: its type and
    config, every module's type, plain attributes (a layer's product choice, its packed
    copy's library, eps, ...) and tensors' dtype, shape and layout, and the switches every
    trace reads (`_switches`: model.Linear's and CPP_WRAPPER). Models with the same signature
    share graphs (compiled_forward); the weights' values are not in it: they are inputs of the
    graph, read at every call."""
    def plain(v):
        return (isinstance(v, (bool, int, float, str, type(None), torch.dtype))
                or (isinstance(v, (tuple, range)) and all(plain(x) for x in v)))

    parts = [type(model), repr(getattr(model, "config", None)), _switches()]
    for name, m in model.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(m).items()
                             if k != "_packed_key" and plain(v)))
        tensors = tuple((k, t.dtype, tuple(t.shape), t.layout, t.device.type)
                        for k, t in (*m._parameters.items(), *m._buffers.items(),
                                     ("_packed", m.__dict__.get("_packed")))
                        if t is not None)
        parts.append((name, type(m), attrs, tensors))
    return tuple(parts)


# Inductor's C++ wrapper for the step's graphs: the generated code calls its kernels and the
# library from C++, not from a Python function of a few hundred lines a step. Off by default:
# it compiled about three times slower on the course's AMD CPU (the batch-16 graphs: 158 s
# against 48), and what it saves there is smaller than the products' spread between steps, so
# no clock here has measured it (bench_compile.py --engine --whole, system cpp_wrapper;
# chapter 12).
CPP_WRAPPER = False


def _switches() -> tuple:
    """The switches every trace reads: model.Linear's class switches, Int4Linear.TRACED and
    CPP_WRAPPER."""
    from ..model import Linear
    from ..quant.linear import Int4Linear
    return (Linear.TRACED, Linear.PREPACK, Linear.MKL, Linear.SKINNY_ROWS, Linear.FEW_ROWS,
            Int4Linear.TRACED, CPP_WRAPPER)


def _compile(fn, model_guards: bool = False, cpp_wrapper: bool = False):
    """torch.compile of a copy of `fn` with a code object of its own (Dynamo keeps a
    function's graphs, and counts them against its limit, on the code object), its guards on
    the model's modules skipped ("Guards" above: the signature that picked it stands for
    them; the graph still asserts each input's size and stride when it runs). `model_guards`
    keeps them (bench_compile.py's comparison); `cpp_wrapper`: Inductor's C++ wrapper."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)
    options = {} if model_guards else {
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if cpp_wrapper:
        options["cpp_wrapper"] = True
    return torch.compile(copy, dynamic=True, recompile_limit=GRAPHS_PER_FUNCTION,
                         options=options or None)


@functools.lru_cache(maxsize=None)
def _compiled(fn, signature: tuple):
    return _compile(fn, cpp_wrapper=CPP_WRAPPER)            # (CPP_WRAPPER: in the signature)


def compiled_decode(model):
    """`_decode` compiled for models like `model` (as compiled_forward)."""
    return _compiled(_decode, model_signature(model))


def compiled_forward(model):
    """`_forward` compiled for models like `model`, made once per process and model signature
    (`model_signature`): the model is an argument and its layers are named by place, so every
    engine on a model, and every model of the same architecture, dtype and layer kinds, share
    its graphs; another signature gets its own function."""
    return _compiled(_forward, model_signature(model))


class CompiledStep:
    """The model runner's seam on a CPU with enforce_eager=False: each step's forward through
    one torch.compile'd graph (see the module docstring). run() returns logits [S, V], or None
    when the step must run eagerly."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache
        self.limit = model.config.max_position_embeddings
        self.disabled: Optional[str] = None                  # why steps run eagerly now
        compiled_products(model)
        from ..model import Linear             # the packed copies the graphs read (made when
        self.packed = [m for m in _PRODUCTS[model].values()       # the runner started: prepack)
                       if isinstance(m, Linear) and m.has_packed()]
        self.weights = self._weight_versions()
        self._pick_functions()
        kv = cache.k.shape[-2:]
        self.pools = cache.k.view(-1, *kv), cache.v.view(-1, *kv)    # [layers * slots, KVH, D]
        # traced attention needs a pool in the model's dtype, unscaled (no fp8 here)
        self.traced_attention = (type(cache) is PagedKVCache and cache.k.dtype == model.dtype
                                 and cache.k_scale == cache.v_scale == 1.0)

    def run(self, step, scheduled) -> Optional[torch.Tensor]:
        if self.disabled is not None:
            return None
        meta = step.meta
        if len(step.logits_rows) == 0:                      # see "a step that samples nothing"
            return None
        if int(meta.positions.max()) >= self.limit:
            return None                                      # the eager forward says why
        if self.switches != _switches() or any(         # Linear's switches flipped, or a
                m._parameters["weight"] is not w or tensor_version(w) != v   # weight changed (a
                for m, w, v in self.weights):                # load, an in-place update)
            self._refresh()
        self.cache.set_step(meta)
        args = (self.model, step.input_ids, meta.positions[None], step.logits_rows)
        try:
            with forward_context(self.model, self.cache):
                if self._traced_decode(meta):
                    logits = self.decode_fn(*args, *self.pools, meta.slot_mapping,
                                            *slot_table(meta.block_tables, meta.seq_lens,
                                                       self.cache.block_size))
                else:
                    logits = self.fn(*args)
        except Exception as e:                  # noqa: BLE001 - a compiler failure: go eager
            if not _is_compiler_failure(e):
                raise
            self.disabled = f"torch.compile failed ({type(e).__name__}: {e})"
            logger.warning("enforce_eager=False: %s; steps run eagerly", self.disabled)
            return None
        self.cache.advance(meta.num_tokens)
        return logits

    def _pick_functions(self) -> None:
        """The compiled functions for this model's signature as it is now."""
        self.switches, signature = _switches(), model_signature(self.model)
        self.fn, self.decode_fn = _compiled(_forward, signature), _compiled(_decode, signature)

    def _refresh(self) -> None:
        """Make the packed copies again (the graphs read each layer's copy at every call) and
        take the functions that fit the model now."""
        for m in self.packed:
            m.prepacked()
        self.weights = self._weight_versions()
        self._pick_functions()

    def _weight_versions(self) -> list:
        """Each packed layer, its weight and the weight's version counter (checked before each
        step: ~15 us for 121 layers, where asking each layer, `prepacked`, takes ~0.2 ms)."""
        return [(m, w, tensor_version(w)) for m, w in
                ((m, m._parameters["weight"]) for m in self.packed)]

    def _traced_decode(self, meta) -> bool:
        """Whether this step's attention is traced (every sequence decodes one token whose
        slot is real) rather than the opaque op's."""
        return (self.traced_attention and meta.is_decode_only
                and bool((meta.slot_mapping >= 0).all()))


def _is_compiler_failure(e: Exception) -> bool:
    """A failure of torch.compile itself (Dynamo, Inductor, the C++ toolchain), not of the
    forward it compiles (those raise in eager mode too and are the caller's to report)."""
    from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException
    return isinstance(e, (BackendCompilerFailed, TorchDynamoException))
