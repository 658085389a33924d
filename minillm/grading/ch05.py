"""Graders for the chapter 05 problem set (solutions/05_chunked_prefill.ipynb).

    ch05.check_step_metadata(step_metadata)              # (a) flatten a step into cu_seqlens_q,
                                                         #     positions and seq_lens
    ch05.check_prefill_attention(paged_prefill_attention)  # (b) the paged prefill kernel: ragged
                                                         #     causal chunks over a block pool

(a) step_metadata(spans) -> {"cu_seqlens_q": [...], "positions": [...], "seq_lens": [...]} for
spans [(num_computed, num_new)]. The reference writes out the rules `engine.ModelRunner.prepare`
follows; tests/test_grading_ch05.py checks that both give the same tensors.

(b) paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale)
-> out [T, H, D], what `minillm.kernels.paged_prefill_attention` computes: every sequence's new
queries are its LAST q_len tokens, so query i sits at position seq_len - q_len + i and sees the
keys up to there (the context-shifted causal mask of a chunked prefill), read from the pool
through the sequence's block table. The reference is minillm's kernel twin
(`impl="reference"`); tests/test_grading_ch05.py checks it against plain per-sequence
scaled_dot_product_attention.

Every case is small, seeded and on the CPU; no model runs.
"""
from __future__ import annotations

import math
import random
from numbers import Integral
from typing import Optional

import torch

from .. import kernels
from ..cache.paged import build_step_metadata
from .core import Check, Exercise, Problem, expect_value_error
from .hints import one_fit


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


# =========================================================================== (a) step metadata

_FIELDS = ("cu_seqlens_q", "positions", "seq_lens")


def reference_metadata(spans) -> dict:
    """The engine's own rule, `minillm.cache.paged.build_step_metadata` (what the model runner
    hands the paged cache): sequence b computes positions [c, c + n) of its tokens; its queries
    are rows cu[b] : cu[b + 1] of the flat batch; it attends over c + n keys."""
    meta = build_step_metadata(spans)
    return {"cu_seqlens_q": meta.cu_seqlens_q.tolist(), "positions": meta.positions.tolist(),
            "seq_lens": meta.seq_lens.tolist()}


def _as_int_list(value, name: str, what: str) -> list:
    if hasattr(value, "tolist") and hasattr(value, "dim"):          # a torch tensor
        if value.dim() != 1 or value.is_floating_point():
            raise Problem(f"{what}: {name} is a tensor of shape {list(value.shape)} and dtype "
                          f"{value.dtype}; expected a list of ints (or a 1-D integer tensor)")
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(_is_int(x) for x in value):
        raise Problem(f"{what}: {name} is {type(value).__name__} {str(value)[:60]}; expected a "
                      "list of ints")
    return [int(x) for x in value]


def _call_metadata(fn, spans) -> dict:
    what = f"spans={list(spans)}"
    out = fn([tuple(s) for s in spans])
    if not isinstance(out, dict) or any(k not in out for k in _FIELDS):
        keys = sorted(out) if isinstance(out, dict) else type(out).__name__
        raise Problem(f"{what}: you returned {keys}; return a dict with the keys "
                      "'cu_seqlens_q', 'positions' and 'seq_lens'")
    return {k: _as_int_list(out[k], k, what) for k in _FIELDS}


def _variants(spans) -> dict:
    """The metadata the common mistakes produce, field by field: [(value, explanation)]."""
    new = [n for _, n in spans]
    cum = [sum(new[:i + 1]) for i in range(len(new))]
    cum_lens = [sum(c + n for c, n in spans[:i + 1]) for i in range(len(spans))]
    return {
        "cu_seqlens_q": [
            (cum, "the leading 0 is missing: sequence b owns rows cu_seqlens_q[b] : "
                  "cu_seqlens_q[b + 1], so the list starts at 0 and has one entry more than "
                  "there are sequences"),
            ([0] + cum_lens, "you summed seq_lens (cached tokens included); the rows of q are "
                             "only this step's new tokens, so add up num_new"),
            ([0] + new, "these are the new-token counts themselves; cu_seqlens_q is their "
                        "running sum"),
        ],
        "positions": [
            ([p for c, n in spans for p in range(c + 1, c + n + 1)],
             "off by one: positions are 0-based, so the first new token of a sequence that has "
             "num_computed tokens cached sits at position num_computed"),
            ([p for c, n in spans for p in range(n)],
             "the positions restart at 0 for every sequence; a chunk after the first, and a "
             "decode, continue where the cache ends (RoPE needs each token's true position)"),
            ([p for c, n in spans for p in range(c, n)],
             "range(num_computed, num_new) mixes a start with a length; the new tokens are "
             "positions num_computed .. num_computed + num_new - 1"),
        ],
        "seq_lens": [
            (new, "these count only the new tokens; seq_lens is every key the sequence attends "
                  "over: the cached ones plus this step's (their K/V are stored before "
                  "attention runs)"),
            ([c for c, _ in spans], "these count only the cached tokens; this step's own tokens "
                                    "are keys too (each query sees itself), so add num_new"),
            ([c + n - 1 for c, n in spans], "one short: seq_lens is num_computed + num_new"),
        ],
    }


def _metadata_cases(cases, fields=_FIELDS):
    def check(fn):
        for spans in cases:
            got = _call_metadata(fn, spans)
            want = reference_metadata(spans)
            for name in fields:
                if got[name] == want[name]:
                    continue
                hint = one_fit(got[name], _variants(spans)[name], expected=want[name])
                raise Problem(f"spans={list(spans)}: {name} is {got[name]}, expected "
                              f"{want[name]}" + (f"; {hint}" if hint else ""))
    return check


def _metadata_errors(fn):
    for spans, why in (([(0, 4), (5, 0)], "a span with num_new = 0 computes nothing"),
                       ([(-1, 3)], "num_computed cannot be negative"),
                       ([(3, 1), (0, -2)], "num_new cannot be negative")):
        expect_value_error(lambda: fn(list(spans)), f"spans={spans} ({why})",
                           "raise ValueError that names the bad span")


def _random_spans(seed: int, n: int):
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        spans = []
        for _ in range(rng.randint(1, 6)):
            kind = rng.random()
            if kind < 0.5:
                spans.append((rng.randint(1, 300), 1))                       # decode
            elif kind < 0.75:
                spans.append((0, rng.randint(1, 64)))                        # first chunk
            else:
                spans.append((rng.randint(1, 300), rng.randint(2, 64)))      # later chunk
        cases.append(spans)
    return cases


_MIXED = [[(7, 1), (0, 4), (12, 1)], [(5, 1), (3, 1), (13, 13)]]

STEP_METADATA = Exercise("ch05.step_metadata", "step_metadata", (
    Check("cu_seqlens_q starts at 0 and has one entry more than there are sequences",
          _metadata_cases([[(0, 5)], [(7, 1), (0, 4), (12, 1)]], ("cu_seqlens_q",))),
    Check("cu_seqlens_q is the running sum of the new tokens",
          _metadata_cases([[(10, 3), (0, 4), (20, 1)], [(100, 2), (50, 1), (0, 6)]],
                          ("cu_seqlens_q",))),
    Check("positions continue where each sequence's cache ends (a later chunk, a decode)",
          _metadata_cases([[(16, 8)], [(5, 1), (3, 1), (13, 13)]], ("positions",))),
    Check("seq_lens count the cached tokens and this step's new ones",
          _metadata_cases([[(16, 8)], [(7, 1), (0, 4), (12, 1)]], ("seq_lens",))),
    Check("a decode-only step: one row per sequence, at position num_computed",
          _metadata_cases([[(12, 1), (3, 1), (40, 1)]])),
    Check("an empty step: cu_seqlens_q == [0], no positions, no seq_lens",
          _metadata_cases([[]])),
    Check("a bad span raises ValueError", _metadata_errors),
    Check("agrees with minillm's model runner on 200 random mixed steps",
          _metadata_cases(_MIXED + _random_spans(7, 200))),
))


def check_step_metadata(step_metadata, time_limit: Optional[float] = None):
    """Grade exercise (a): step_metadata([(num_computed, num_new), ...]) ->
    {"cu_seqlens_q": [...], "positions": [...], "seq_lens": [...]}."""
    return STEP_METADATA.check(step_metadata, time_limit)




# =========================================================================== (b) prefill attention

class _Step:
    """One call of paged_prefill_attention: a block pool, the sequences' tables, and the answer.

    spans: [(context, q_len)] per sequence: `context` keys came before this step (earlier chunks,
    or a decode's history) and the step brings `q_len` new queries, whose K/V are already stored.
    Every slot of the pool that no sequence owns, and the slots after seq_len in each sequence's
    last block, hold large stale values, so reading a slot through the wrong block changes the
    output a lot.
    """

    def __init__(self, label, spans, H=2, KVH=2, D=8, block_size=4, scatter=True, scale=None,
                 dtype=torch.float32, seed=0):
        self.label, self.spans, self.H, self.KVH, self.D = label, list(spans), H, KVH, D
        self.block_size, self.dtype = block_size, dtype
        self.scale = 1 / math.sqrt(D) if scale is None else scale
        g = torch.Generator().manual_seed(seed)
        used = [-(-(c + n) // block_size) for c, n in spans]              # blocks per sequence
        num_blocks = sum(used) + 3                                          # a few never used
        order = (torch.randperm(num_blocks, generator=g).tolist() if scatter
                 else list(range(num_blocks)))
        self.k_cache = 4 * torch.randn(num_blocks, block_size, KVH, D, generator=g) + 2
        self.v_cache = 4 * torch.randn(num_blocks, block_size, KVH, D, generator=g) - 3
        max_blocks = max(used, default=0) + 1                              # one padding column
        self.block_tables = torch.zeros(len(spans), max_blocks, dtype=torch.int32)
        self.keys, self.values = [], []                                     # per sequence
        for b, ((c, n), nb) in enumerate(zip(spans, used)):
            table = [order.pop(0) for _ in range(nb)]
            self.block_tables[b, :nb] = torch.tensor(table, dtype=torch.int32)
            k = torch.randn(c + n, KVH, D, generator=g)                     # [seq_len, KVH, D]
            v = torch.randn(c + n, KVH, D, generator=g)
            for p in range(c + n):                                    # store through the table
                self.k_cache[table[p // block_size], p % block_size] = k[p]
                self.v_cache[table[p // block_size], p % block_size] = v[p]
            self.keys.append(k)
            self.values.append(v)
        self.k_cache, self.v_cache = self.k_cache.to(dtype), self.v_cache.to(dtype)
        self.cu_seqlens_q = torch.tensor([0] + [sum(n for _, n in spans[:i + 1])
                                                for i in range(len(spans))], dtype=torch.int32)
        self.seq_lens = torch.tensor([c + n for c, n in spans], dtype=torch.int32)
        self.q = torch.randn(sum(n for _, n in spans), H, D, generator=g).to(dtype)   # [T, H, D]
        self.expected = kernels.paged_prefill_attention(
            self.q, self.k_cache, self.v_cache, self.cu_seqlens_q, self.seq_lens,
            self.block_tables, self.scale, impl="reference").float()

    def inputs(self):
        return (self.q, self.k_cache, self.v_cache, self.cu_seqlens_q, self.seq_lens,
                self.block_tables)

    def describe(self) -> str:
        heads = f"H={self.H}, KVH={self.KVH}" if self.H != self.KVH else f"H=KVH={self.H}"
        return (f"{self.label}: spans (context, q_len) {self.spans}, block_size {self.block_size}, "
                f"{heads}, D={self.D}, scale {self.scale:.4g}, block_tables "
                f"{self.block_tables.tolist()}")

    def run(self, fn):
        """The learner's output on fresh copies, and whether the inputs came back untouched."""
        copies = [t.clone() for t in self.inputs()]
        out = fn(*copies, self.scale)
        untouched = all(torch.equal(a, b) for a, b in zip(copies, self.inputs()))
        return out, untouched


def _attend_variant(step: _Step, mask="causal", keys="context", table="paged", tail="cut",
                    heads="grouped", scale="given") -> torch.Tensor:
    """The step computed with one known mistake, to name the mistake a learner's output matches."""
    out = torch.zeros(step.q.shape[0], step.H, step.D)
    bs, group = step.block_size, step.H // step.KVH
    row = 0
    pool_k = step.k_cache.float().flatten(0, 1)                       # [num_slots, KVH, D]
    pool_v = step.v_cache.float().flatten(0, 1)
    for b, (c, n) in enumerate(step.spans):
        seq_len = c + n
        length = -(-seq_len // bs) * bs if tail == "whole_blocks" else seq_len
        if table == "ignored":                                       # the pool read in order
            slots = torch.arange(length)
        else:
            blocks = step.block_tables[b, :-(-length // bs)].long()
            slots = (blocks[:, None] * bs + torch.arange(bs)[None, :]).flatten()[:length]
        k, v = pool_k[slots], pool_v[slots]                           # [length, KVH, D]
        first_key = c if keys == "new_only" else 0
        k, v = k[first_key:], v[first_key:]
        idx = torch.arange(step.H) % step.KVH if heads == "tiled" else torch.arange(step.H) // group
        k, v = k[:, idx], v[:, idx]                                   # [Tk, H, D]
        s = 1 / math.sqrt(step.D) if scale == "sqrt" else step.scale
        q = step.q[row:row + n].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * s               # [H, n, Tk]
        q_pos = torch.arange(length - n, length)[:, None]              # true: c .. c + n - 1
        if mask == "top_left":
            q_pos = torch.arange(n)[:, None]
        k_pos = torch.arange(first_key, first_key + k.shape[0])[None, :]
        if mask in ("causal", "top_left"):
            hidden = k_pos > q_pos
        elif mask == "hides_self":
            hidden = k_pos >= q_pos
        elif mask == "sees_next":
            hidden = k_pos > q_pos + 1
        else:
            hidden = torch.zeros_like(k_pos > q_pos)
        scores = scores.masked_fill(hidden, float("-inf"))
        out[row:row + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        row += n
    return out


_PREFILL_DIAGNOSES = [
    (dict(mask="top_left"), "it equals a mask that puts query i at position i instead of "
     "seq_len - q_len + i, so the context before the chunk is ignored (this is what "
     "scaled_dot_product_attention(..., is_causal=True) does with more keys than queries: "
     "its mask is aligned to the top left)"),
    (dict(mask="none"), "it equals attention with no causal mask: a query also sees the keys "
                        "after its own position"),
    (dict(mask="hides_self"), "it equals a mask where a query cannot see its own key; the query "
     "at position p sees keys 0 .. p (key_pos <= query_pos)"),
    (dict(mask="sees_next"), "it equals a mask shifted by one: each query also sees the next "
     "key; query i of the chunk sits at seq_len - q_len + i, not one later"),
    (dict(keys="new_only"), "it equals attention over this step's own keys only; the context "
     "(earlier chunks, a decode's history) is keys 0 .. seq_len - q_len - 1 of the same sequence "
     "and must be read from the cache too"),
    (dict(table="ignored"), "it equals reading the pool's slots in order (block 0, 1, 2, ...) "
     "instead of through the block table: token t of sequence b lives in block "
     "block_tables[b, t // block_size], row t % block_size"),
    (dict(tail="whole_blocks"), "it equals reading every slot of the last block and placing "
     "the queries at the end of them: the slots after seq_len hold stale values, and the last "
     "query sits at position seq_len - 1 (cut the gathered keys at seq_len)"),
    (dict(heads="tiled"), "it equals GQA with query head h reading KV head h % KVH; query heads "
     "come in consecutive groups, so head h reads KV head h // (H // KVH) (repeat_interleave, "
     "not repeat)"),
    (dict(scale="sqrt"), "it equals scaling the scores by 1/sqrt(head_dim) instead of the "
     "`scale` argument; use the scale you are given (models and kernels pass their own)"),
]


def _prefill_check(cases, tolerance=1e-4):
    def check(fn):
        for spec in cases:
            step = _Step(**spec)
            out, untouched = step.run(fn)
            where = step.describe()
            if not isinstance(out, torch.Tensor):
                raise Problem(f"{where}: you returned {type(out).__name__}; return a tensor "
                              f"[T, H, D] = {list(step.q.shape)}")
            if tuple(out.shape) != tuple(step.q.shape):
                raise Problem(f"{where}: you returned shape {list(out.shape)}; expected "
                              f"[T, H, D] = {list(step.q.shape)}, one row per query")
            if out.dtype != step.q.dtype:
                raise Problem(f"{where}: you returned {out.dtype}; return q's dtype "
                              f"({step.q.dtype}): compute in float32 if you like, then cast")
            if not untouched:
                raise Problem(f"{where}: your function modified its inputs; attention only "
                              "reads q, the cache and the tables")
            got = out.detach().float()
            if torch.allclose(got, step.expected, atol=tolerance, rtol=tolerance):
                continue
            if torch.isnan(got).any():
                t, h, _ = torch.nonzero(torch.isnan(got))[0].tolist()
                raise Problem(f"{where}: NaN at query row {t}, head {h}; a query whose keys "
                              "are all masked gives NaN (every query sees at least its own key)")
            bad = (got - step.expected).abs().amax(dim=(1, 2))                  # [T]
            t = int(bad.argmax())
            b = int(torch.searchsorted(step.cu_seqlens_q[1:], t, right=True))
            c, n = step.spans[b]
            msg = (f"{where}: row {t} (sequence {b}, query {t - int(step.cu_seqlens_q[b])} of "
                   f"{n}, at position {c + t - int(step.cu_seqlens_q[b])}) differs from causal "
                   f"attention by up to {float(bad[t]):.3g}")
            tol = max(tolerance, 1e-4)
            variants = [(_attend_variant(step, **v), s) for v, s in _PREFILL_DIAGNOSES]
            sentence = one_fit(got, variants,
                               expected=step.expected,
                               same=lambda a, b: torch.allclose(a, b, atol=tol, rtol=tol))
            raise Problem(msg + (f"; {sentence}" if sentence else ""))
    return check


def _random_steps(seed: int, n: int):
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        KVH = rng.choice([1, 2])
        spans = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.35:
                spans.append((rng.randint(1, 20), 1))                        # a decode
            elif kind < 0.65:
                spans.append((0, rng.randint(1, 12)))                        # a first chunk
            else:
                spans.append((rng.randint(1, 20), rng.randint(2, 12)))       # a later chunk
        cases.append(dict(label=f"random step {i}", spans=spans, H=KVH * rng.choice([1, 2, 3]),
                          KVH=KVH, D=rng.choice([4, 8]), block_size=rng.choice([1, 2, 4, 5]),
                          scale=rng.choice([None, 0.25]), seed=1000 + i))
    return cases


_ONE = dict(scatter=False)          # one sequence, blocks 0, 1, 2, ... in order, full blocks
PREFILL_ATTENTION = Exercise("ch05.prefill_attention", "paged_prefill_attention", (
    Check("a whole prompt (no context): query i sees keys 0 .. i",
          _prefill_check([dict(label="whole prompt", spans=[(0, 8)], seed=1, **_ONE)])),
    Check("a later chunk: query i sits at position seq_len - q_len + i and sees the context",
          _prefill_check([dict(label="second chunk", spans=[(8, 4)], seed=2, **_ONE),
                          dict(label="third chunk", spans=[(12, 8)], seed=3, **_ONE)])),
    Check("a decode (q_len = 1) sees every key of its sequence",
          _prefill_check([dict(label="decode", spans=[(11, 1)], seed=4, **_ONE)])),
    Check("keys are read through the block table (blocks scattered over the pool)",
          _prefill_check([dict(label="scattered blocks", spans=[(0, 8)], seed=5),
                          dict(label="scattered blocks", spans=[(4, 4)], seed=6)])),
    Check("a partly filled last block: the keys end, and the last query sits, at seq_len",
          _prefill_check([dict(label="partial last block", spans=[(0, 6)], seed=7, **_ONE),
                          dict(label="partial last block", spans=[(5, 2)], seed=8, **_ONE)])),
    Check("GQA: query head h reads KV head h // (H // KVH)",
          _prefill_check([dict(label="GQA", spans=[(0, 4)], H=8, KVH=2, seed=9, **_ONE),
                          dict(label="GQA", spans=[(4, 4)], H=6, KVH=2, seed=10, **_ONE)])),
    Check("a ragged batch: sequence b owns rows cu_seqlens_q[b] : cu_seqlens_q[b + 1]",
          _prefill_check([dict(label="mixed step", spans=[(5, 1), (0, 6), (9, 3), (2, 1)],
                               seed=11, **_ONE)])),
    Check("scores are scaled by the scale argument",
          _prefill_check([dict(label="given scale", spans=[(0, 4), (3, 2)], scale=0.2, seed=12,
                               **_ONE)])),
    Check("bfloat16 in, bfloat16 out, inputs untouched",
          _prefill_check([dict(label="bfloat16", spans=[(3, 1), (0, 5)], dtype=torch.bfloat16,
                               seed=13)], tolerance=3e-2)),
    Check("agrees with minillm's kernel twin on 30 random mixed steps",
          _prefill_check(_random_steps(17, 30))),
))


def check_prefill_attention(paged_prefill_attention, time_limit: Optional[float] = None):
    """Grade exercise (b): paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens,
    block_tables, scale) -> out [T, H, D]."""
    return PREFILL_ATTENTION.check(paged_prefill_attention, time_limit)


EXERCISES = (STEP_METADATA, PREFILL_ATTENTION)
