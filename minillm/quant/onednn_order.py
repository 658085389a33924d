"""int8 weights kept in oneDNN's packed order, so that expanding them gives a packed bf16 weight.

From `Int8Linear.DEQUANT_ROWS` rows on, an int8 layer expands its weight to bf16 and runs one
bf16 product (aten's int8 kernel expands the weight again for every row). Which bf16 product
matters: oneDNN's on a weight it has packed into its own blocked layout beforehand (what
`model.Linear` does for bf16 weights) ran SmolLM2's 30 decoder layers at 16 rows in 15.3 ms on
the course's AMD CPU, against 24 ms for the same product on the plain [N, K] matrix (2 threads,
a scratch microbenchmark; in the engine: `bench_quant.py engine` and `packed_order`, chapter
09). Packing is a reorder, too
slow to repeat every step. But a reorder only moves elements: the packed layout is a fixed
permutation of the matrix's N * K entries (plus padding). So the int8 values are stored once in
that order, and each step's int8 -> bf16 conversion writes them straight into a packed bf16
weight that oneDNN reads as if it had packed it. One such scratch weight per shape (and thread)
serves every layer of that shape, so the bf16 bytes stay in the cache instead of in memory.

The permutation is read off oneDNN itself, on the machine that runs (the layout depends on the
CPU's instructions): pack a few bf16 matrices whose entries are the base-256 digits of
1 + each entry's flat index (bf16 holds the integers 0..256 exactly), read the packed buffers
back, and reassemble the indices; 0 marks padding. The result is checked to hold every index
exactly once, else this path is off and the layer multiplies the plain expansion.

This reaches into the packed tensor's buffer (`torch.ops.mkldnn.data_ptr` and `_nbytes`, which
Inductor uses to save such tensors): `available()` says whether this torch has them.
"""
from __future__ import annotations

import ctypes
import functools
import threading

import torch


def available() -> bool:
    """Whether this torch can pack bf16 weights for oneDNN and expose the packed buffer."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "data_ptr")
            and hasattr(mkldnn, "_nbytes") and mkldnn._is_mkldnn_bf16_supported())


def _pack(w):                                   # [N, K] bf16 -> oneDNN's packed (opaque) tensor
    with torch.no_grad(), torch.inference_mode(False):
        return torch.ops.mkldnn._reorder_linear_weight(w, None)


def _buffer(packed):
    """The packed tensor's bytes as a flat bf16 tensor (a view: `packed` must outlive it)."""
    nbytes = torch.ops.mkldnn._nbytes(packed)
    raw = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    with torch.inference_mode(False):          # written in place inside and outside inference
        return torch.frombuffer(raw, dtype=torch.bfloat16)


# The largest weight given a packed order: three base-256 digits cover it, and its permutation
# (kept per shape, 4 bytes an entry) stays small next to the weight. SmolLM2's decoder weights
# have at most 1.8 M entries; its 28 M-entry LM head, quantized to int8, expands plainly (the
# permutation alone would be 113 MB).
MAX_ENTRIES = 1 << 24


@functools.lru_cache(maxsize=None)
def order(n: int, k: int):
    """For each bf16 slot of the packed [n, k] weight, 1 + the flat index of the entry it holds
    (0: padding), as int32; None for a weight of MAX_ENTRIES entries or more, or if the reorder
    is not a permutation of the entries."""
    if n * k >= MAX_ENTRIES:
        return None
    index = torch.arange(1, n * k + 1, dtype=torch.int32)
    out = None
    digit = 0
    while 256 ** digit <= n * k:
        packed = _pack(((index // 256 ** digit) % 256).to(torch.bfloat16).view(n, k))
        part = _buffer(packed).to(torch.int32) * 256 ** digit    # copied before packed goes
        out = part if out is None else out + part
        digit += 1
    counts = torch.bincount(out, minlength=n * k + 1)
    if out.numel() < n * k or not bool((counts[1:] == 1).all()):
        return None
    return out


def pack_int8(q):
    """q [N, K] int8 -> the same values in oneDNN's packed order (a flat int8 tensor), or None
    where `order` found no permutation."""
    perm = order(*q.shape)
    if perm is None:
        return None
    return torch.cat((q.new_zeros(1), q.reshape(-1)))[perm.long()]


class _Scratch(threading.local):
    weights = None                               # (n, k) -> (packed bf16 weight, its buffer)


_SCRATCH = _Scratch()


def product(x, packed_q, n: int, k: int):
    """x [M, K] bf16 @ (the int8 weight whose packed order is `packed_q`, as bf16)^T -> [M, N]
    bf16: expand into this thread's scratch packed weight of that shape, then oneDNN's product."""
    if _SCRATCH.weights is None:
        _SCRATCH.weights = {}
    if (n, k) not in _SCRATCH.weights:
        packed = _pack(torch.zeros(n, k, dtype=torch.bfloat16))
        _SCRATCH.weights[n, k] = packed, _buffer(packed)
    packed, buffer = _SCRATCH.weights[n, k]
    buffer.copy_(packed_q)                                        # int8 -> bf16, in place
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
