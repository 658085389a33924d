"""Graders for the chapter 03 problem set (solutions/03_paged_blocks.ipynb).

    ch03.check_block_tables(BlockTables)     # (a) block pool + block tables: allocate, append,
                                             #     fork with copy-on-write, free
    ch03.check_slot_mapping(slot_mapping)    # (b) token positions -> physical slots
    ch03.check_paged_gather(paged_gather)    # (c) Triton puzzle: gather one sequence's K rows
                                             #     through its block table

The references are minillm's own `cache.blocks.BlockManager` (a), the slot formula of
`BlockManager.slot_mapping` (b) and plain torch indexing of the block pool (c). Exercise (c)
runs the learner's Triton kernel on CPU tensors, so the kernel must have been defined with
TRITON_INTERPRET=1 set (the problem set's first cell does that); every case is tiny.
"""
from __future__ import annotations

import random
from collections import defaultdict
from typing import Optional

import torch

from ..cache.blocks import BlockManager
from .core import Check, Exercise, Problem
from .hints import one_fit


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# =========================================================================== (a) block tables

_STATE = ("tables", "lengths", "refcounts", "free_blocks")


def _state(bt):
    missing = [name for name in _STATE if not hasattr(bt, name)]
    if missing:
        raise Problem(f"your object has no attribute(s) {', '.join(missing)}; keep the four "
                      "attributes that __init__ creates (tables, lengths, refcounts, "
                      "free_blocks) up to date, the grader reads them")
    return ({s: list(t) for s, t in bt.tables.items()}, dict(bt.lengths), list(bt.refcounts),
            list(bt.free_blocks))


def _invariants(bt, num_blocks: int, where: str) -> None:
    """Raise Problem naming the first broken invariant of the pool and its tables."""
    tables, lengths, refcounts, free = _state(bt)
    bs = bt.block_size
    if set(tables) != set(lengths):
        raise Problem(f"{where}: tables holds sequences {sorted(tables)} but lengths holds "
                      f"{sorted(lengths)}; add and remove both together")
    for s, table in tables.items():
        want = _ceil(lengths[s], bs)
        if len(table) != want:
            raise Problem(f"{where}: sequence {s} holds {lengths[s]} tokens in {len(table)} "
                          f"blocks; with block_size {bs} it needs ceil({lengths[s]}/{bs}) = "
                          f"{want}")
        bad = [b for b in table if not (isinstance(b, int) and 0 <= b < num_blocks)]
        if bad:
            raise Problem(f"{where}: sequence {s}'s table holds {bad}, not block ids in "
                          f"0..{num_blocks - 1}")
    holders = defaultdict(int)
    for table in tables.values():
        for b in table:
            holders[b] += 1
    for b in range(num_blocks):
        if refcounts[b] != holders[b]:
            effect = ("a count too high never reaches 0, so the block leaks"
                      if refcounts[b] > holders[b] else
                      "a count too low frees the block while a table still uses it")
            raise Problem(f"{where}: block {b} is in {holders[b]} table(s) but its refcount is "
                          f"{refcounts[b]}; a refcount must count the tables that hold the block "
                          f"({effect})")
    if len(set(free)) != len(free):
        dup = sorted({b for b in free if free.count(b) > 1})
        raise Problem(f"{where}: blocks {dup} are in free_blocks more than once (freed twice?)")
    used_but_free = sorted(b for b in free if holders[b])
    if used_but_free:
        raise Problem(f"{where}: blocks {used_but_free} are in free_blocks while a table still "
                      "uses them; a block goes back only when its refcount reaches 0")
    leaked = sorted(b for b in range(num_blocks) if not holders[b] and b not in set(free))
    if leaked:
        raise Problem(f"{where}: blocks {leaked} are in no table and not in free_blocks: they "
                      "leaked (a block whose refcount reaches 0 must go back to the free list)")


def _sharing(tables: dict) -> list:
    """Which (sequence, index) positions share a block, independent of the block ids."""
    where = defaultdict(list)
    for s, table in tables.items():
        for i, b in enumerate(table):
            where[b].append((s, i))
    return sorted(sorted(v) for v in where.values())


def _copies(result) -> list:
    """append()'s return value as a list of (src, dst) pairs; None counts as no copy."""
    if result is None:
        return []
    try:
        return [tuple(int(x) for x in pair) for pair in result]
    except (TypeError, ValueError):
        raise Problem(f"append returned {result!r}; return a list of (src, dst) block pairs "
                      "([] when nothing was copied)") from None


def _allocate_counts(cls):
    for bs, n in ((16, 1), (16, 15), (16, 16), (16, 17), (16, 32), (16, 33), (4, 9), (1, 5)):
        bt = cls(20, bs)
        bt.allocate(0, n)
        tables, _, refcounts, free = _state(bt)
        got, want = len(tables.get(0, [])), _ceil(n, bs)
        if got != want:
            hint = (" (an exact multiple fills its last block completely: no extra block)"
                    if n % bs == 0 and got == want + 1 else "")
            raise Problem(f"allocate(0, {n}) with block_size {bs} built a table of {got} "
                          f"blocks; expected ceil({n}/{bs}) = {want}{hint}")
        if len(free) != 20 - want:
            raise Problem(f"allocate(0, {n}) with block_size {bs} left {len(free)} of 20 blocks "
                          f"free; expected {20 - want}")
        _invariants(bt, 20, f"after allocate(0, {n}) with block_size {bs}")


def _append_counts(cls):
    bs, bt = 4, cls(12, 4)
    bt.allocate(0, 3)
    for n in range(3, 17):
        before = len(_state(bt)[0][0])
        copies = _copies(bt.append(0))
        got, want = len(_state(bt)[0][0]), _ceil(n + 1, bs)
        if got != want:
            rule = ("the last block was full, so the new token needs a new block"
                    if n % bs == 0 else
                    f"the last block still had {bs - n % bs} free slot(s); take a new block only "
                    "when the last one is full (tokens % block_size == 0)")
            raise Problem(f"growing sequence 0 from {n} to {n + 1} tokens (block_size {bs}) "
                          f"went from {before} to {got} blocks; expected {want}: {rule}")
        if copies:
            raise Problem(f"append returned copies {copies} for a sequence that shares nothing; "
                          "copy only a shared, partly filled last block")
        _invariants(bt, 12, f"after growing sequence 0 to {n + 1} tokens")


def _fork_shares(cls):
    bt = cls(10, 16)
    bt.allocate(0, 40)                                      # 3 blocks, the last holds 8 tokens
    parent = _state(bt)[0][0]
    bt.fork(0, 1)
    bt.fork(0, 2)
    tables, lengths, refcounts, free = _state(bt)
    if len(free) != 7:
        raise Problem(f"two forks of a 3-block sequence left {len(free)} of 10 blocks free; "
                      "expected 7: a fork shares the parent's blocks and takes no new one")
    for child in (1, 2):
        if tables.get(child) != parent:
            raise Problem(f"fork(0, {child}) gave the child table {tables.get(child)}; expected "
                          f"the parent's own blocks {parent}")
        if lengths.get(child) != 40:
            raise Problem(f"fork(0, {child}) set the child's length to {lengths.get(child)}; "
                          "expected the parent's 40 tokens")
    wrong = {b: refcounts[b] for b in parent if refcounts[b] != 3}
    if wrong:
        raise Problem(f"after two forks the refcounts of the shared blocks are {wrong}; expected "
                      "3 each (the parent and two children hold them)")
    _invariants(bt, 10, "after fork(0, 1) and fork(0, 2)")


def _cow_partial(cls):
    bt = cls(10, 16)
    bt.allocate(0, 40)                                      # 3 blocks, the last holds 8 tokens
    bt.fork(0, 1)
    parent = _state(bt)[0][0]
    copies = _copies(bt.append(1))                          # the child writes token 41
    tables, _, refcounts, free = _state(bt)
    child = tables[1]
    if tables[0] != parent:
        raise Problem(f"appending to the child changed the parent's table from {parent} to "
                      f"{tables[0]}; copy-on-write replaces the WRITER's block")
    if child[-1] == parent[-1]:
        raise Problem(f"after fork, appending token 41 to the child wrote into its last block "
                      f"{parent[-1]}, which it shares with the parent (refcount "
                      f"{refcounts[parent[-1]]}) and which holds only 8 of 16 tokens: the "
                      "parent's KV would be overwritten. Copy a shared, partly filled last block "
                      "first (copy-on-write)")
    if child[:-1] != parent[:-1]:
        raise Problem(f"the child's table became {child}; only its last block may change, the "
                      f"full blocks {parent[:-1]} stay shared")
    if len(free) != 6:
        raise Problem(f"copy-on-write left {len(free)} of 10 blocks free; expected 6 (3 shared "
                      "blocks + 1 copy in use)")
    if copies != [(parent[-1], child[-1])]:
        raise Problem(f"append returned {copies}; expected [({parent[-1]}, {child[-1]})], the "
                      "(src, dst) pair whose KV contents the caller must copy")
    if refcounts[parent[-1]] != 1 or any(refcounts[b] != 2 for b in parent[:-1]):
        raise Problem(f"after copy-on-write the refcounts are "
                      f"{ {b: refcounts[b] for b in parent + [child[-1]]} }; expected 2 for the "
                      f"still-shared {parent[:-1]} and 1 for {parent[-1]} and {child[-1]}")
    copies = _copies(bt.append(0))                          # the parent writes token 41
    tables, _, _, free = _state(bt)
    if copies or tables[0] != parent or len(free) != 6:
        raise Problem(f"the parent's last block {parent[-1]} is no longer shared (refcount 1), "
                      f"so appending to the parent must write in place; it returned {copies} "
                      f"and changed the table to {tables[0]}")
    _invariants(bt, 10, "after copy-on-write")


def _full_block_stays_shared(cls):
    bt = cls(10, 16)
    bt.allocate(0, 32)                                      # exactly 2 full blocks
    bt.fork(0, 1)
    parent = _state(bt)[0][0]
    copies = _copies(bt.append(1))
    tables, _, refcounts, free = _state(bt)
    if copies:
        raise Problem(f"append copied {copies} although the shared last block was full; nobody "
                      "writes into a full block again, so it stays shared and the new token "
                      "starts a new block")
    if tables[1][:2] != parent or len(tables[1]) != 3:
        raise Problem(f"after fork of a 32-token sequence (block_size 16, parent table "
                      f"{parent}), the child's 33rd token gave it table {tables[1]}; expected "
                      f"{parent} + one new block")
    if any(refcounts[b] != 2 for b in parent) or len(free) != 7:
        raise Problem(f"refcounts {[refcounts[b] for b in parent]} for the shared full blocks "
                      f"and {len(free)} free blocks; expected [2, 2] and 7")
    _invariants(bt, 10, "after the child's 33rd token")


def _no_leaks(cls):
    nb = 16
    bt, ref = cls(nb, 4), BlockManager(nb, 4)
    steps = [("allocate", 0, 10), ("fork", 0, 1), ("append", 1), ("fork", 1, 2), ("append", 2),
             ("append", 2), ("append", 0), ("free", 0), ("append", 1), ("free", 2), ("free", 1)]
    for step in steps:
        _apply(bt, ref, step)
        label = _label(step)
        _invariants(bt, nb, f"after {label}")
        free = len(_state(bt)[3])
        if free != ref.num_free_blocks:
            raise Problem(f"after {label} {free} blocks are free; expected "
                          f"{ref.num_free_blocks}")
    tables, _, refcounts, free = _state(bt)
    if tables or len(free) != nb or any(refcounts):
        raise Problem(f"after freeing every sequence {len(free)} of {nb} blocks are free and "
                      f"the refcounts are {refcounts}; everything must be back")


def _apply(bt, ref, step):
    op, *args = step
    if op == "allocate":
        bt.allocate(*args)
        ref.allocate(*args)
    elif op == "append":
        bt.append(args[0])
        ref.allocate(args[0], ref.num_tokens(args[0]) + 1)
    elif op == "fork":
        bt.fork(*args)
        ref.fork(*args)
    else:
        bt.free(args[0])
        ref.free(args[0])


def _label(step) -> str:
    op, *args = step
    return f"{op}({', '.join(map(str, args))})"


def _random_ops(seed: int, num_blocks: int, block_size: int, n: int):
    """A seeded list of operations that never runs the reference out of blocks."""
    rng, ref, ops, next_id = random.Random(seed), BlockManager(num_blocks, block_size), [], 0
    while len(ops) < n:
        live = sorted(ref.tables)
        kind = rng.choice(["allocate", "append", "append", "append", "fork", "free"])
        if kind == "allocate" or not live:
            step = ("allocate", next_id, rng.randint(1, 3 * block_size))
            if not ref.can_allocate(next_id, step[2]):
                continue
            next_id += 1
        elif kind == "append":
            s = rng.choice(live)
            if not ref.can_allocate(s, ref.num_tokens(s) + 1):
                continue
            step = ("append", s)
        elif kind == "fork":
            step = ("fork", rng.choice(live), next_id)
            next_id += 1
        else:
            step = ("free", rng.choice(live))
        _apply(_NullTables(), ref, step)
        ops.append(step)
    return ops


class _NullTables:
    def allocate(self, *a): pass
    def append(self, *a): pass
    def fork(self, *a): pass
    def free(self, *a): pass


def _matches_reference(cls):
    nb, bs = 24, 4
    ops = _random_ops(3, nb, bs, 160)
    bt, ref = cls(nb, bs), BlockManager(nb, bs)
    for i, step in enumerate(ops):
        _apply(bt, ref, step)
        label = f"operation {i} ({_label(step)}) of a seeded random sequence"
        _invariants(bt, nb, f"after {label}")
        tables, lengths, _, free = _state(bt)
        if lengths != ref.lengths:
            raise Problem(f"after {label} the lengths are {lengths}; expected {ref.lengths}")
        if len(free) != ref.num_free_blocks:
            raise Problem(f"after {label} {len(free)} blocks are free; minillm's BlockManager "
                          f"has {ref.num_free_blocks} free")
        if _sharing(tables) != _sharing(ref.tables):
            raise Problem(f"after {label} the blocks are shared differently from minillm's "
                          f"BlockManager (yours {tables}, reference {ref.tables}, up to block "
                          "ids)")


def _expect_value_error(action, what: str) -> None:
    try:
        action()
    except ValueError:
        return
    except NotImplementedError:
        raise
    except Exception as exc:
        raise Problem(f"{what} raised {type(exc).__name__}: {exc}; raise ValueError with a "
                      "message that names the fix") from None
    raise Problem(f"{what} did not raise; raise ValueError (nothing may be silently dropped)")


def _unchanged(bt, before, what: str) -> None:
    if _state(bt) != before:
        raise Problem(f"{what} raised, but changed the state on the way (tables, lengths, "
                      "refcounts or free_blocks); check that enough blocks are free BEFORE "
                      "taking any")


def _errors(cls):
    bt = cls(4, 4)
    bt.allocate(0, 12)                                      # 3 blocks, 1 free
    before = _state(bt)
    _expect_value_error(lambda: bt.allocate(1, 8), "allocate(1, 8) with 1 free block")
    _unchanged(bt, before, "allocate(1, 8) with 1 free block")
    _expect_value_error(lambda: bt.allocate(0, 1), "allocate(0, 1) for an existing sequence")
    _unchanged(bt, before, "allocate(0, 1) for an existing sequence")
    bt.allocate(1, 4)                                       # 0 free; sequence 1's block is full
    before = _state(bt)
    _expect_value_error(lambda: bt.append(1), "append(1) with no free block left")
    _unchanged(bt, before, "append(1) with no free block left")
    bt = cls(3, 4)
    bt.allocate(0, 10)                                      # 3 blocks, last partly filled
    bt.fork(0, 1)
    before = _state(bt)
    _expect_value_error(lambda: bt.append(1), "append(1) needing a copy-on-write block with "
                                              "none free")
    _unchanged(bt, before, "append(1) needing a copy-on-write block with none free")


BLOCK_TABLES = Exercise("ch03.block_tables", "BlockTables", (
    Check("allocate takes ceil(num_tokens / block_size) blocks", _allocate_counts),
    Check("append takes a new block only when the last one is full", _append_counts),
    Check("fork shares every block: no new block, refcounts go up", _fork_shares),
    Check("copy-on-write: writing into a shared, partly filled last block copies it first",
          _cow_partial),
    Check("a shared full last block stays shared: the next token starts a new block",
          _full_block_stays_shared),
    Check("free gives back every block nobody else holds: no leaks, no early frees", _no_leaks),
    Check("agrees with minillm's BlockManager over 160 random operations", _matches_reference),
    Check("running out of blocks raises ValueError and changes nothing", _errors),
))


def check_block_tables(BlockTables, time_limit: Optional[float] = None):
    """Grade exercise (a): a class BlockTables(num_blocks, block_size) with allocate(seq_id,
    num_tokens), append(seq_id) -> [(src, dst)], fork(parent_id, child_id) and free(seq_id)."""
    return BLOCK_TABLES.check(BlockTables, time_limit)


# =========================================================================== (b) slot mapping

def _slots_ref(table, start, end, bs):
    return [table[p // bs] * bs + p % bs for p in range(start, end)]


_SLOT_VARIANTS = [
    (lambda t, p, bs: p, "they equal the logical positions themselves: the block table was "
                         "ignored; look up the physical block table[p // block_size]"),
    (lambda t, p, bs: t[p // bs] * bs, "each equals the first slot of its block: the offset "
                                       "p % block_size inside the block is missing"),
    (lambda t, p, bs: t[p // bs] + p % bs, "the block id was not multiplied by block_size: "
                                           "block b starts at slot b * block_size"),
    (lambda t, p, bs: t[p // bs] * bs + p, "the offset inside the block must be p % block_size, "
                                           "not the position p"),
    (lambda t, p, bs: t[p % len(t)] * bs + p % bs, "the block index must be p // block_size"),
]


def _as_ints(out):
    if isinstance(out, torch.Tensor):
        if out.dim() != 1 or out.is_floating_point():
            raise Problem(f"returned a tensor of shape {list(out.shape)} and dtype {out.dtype}; "
                          "expected a list of ints (or a 1-D integer tensor)")
        return [int(x) for x in out.tolist()]
    if not isinstance(out, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in out):
        raise Problem(f"returned {type(out).__name__} {str(out)[:80]}; expected a list of ints")
    return list(out)


def _slot_cases(cases):
    def check(fn):
        for table, start, end, bs in cases:
            what = (f"block_table={table}, block_size={bs}, positions {start} .. {end - 1}"
                    if end > start else f"block_table={table}, block_size={bs}, start = end = "
                    f"{start}")
            got = _as_ints(fn(list(table), start, end, bs))
            want = _slots_ref(table, start, end, bs)
            if got == want:
                continue
            if len(got) != len(want):
                raise Problem(f"{what}: returned {len(got)} slots, expected {len(want)}, one per "
                              "position from start up to but excluding end")
            alts = []
            for variant, sentence in _SLOT_VARIANTS:
                try:
                    alts.append(([variant(table, p, bs) for p in range(start, end)], sentence))
                except IndexError:
                    continue
            sentence = one_fit(got, alts, expected=want)
            if sentence:
                raise Problem(f"{what}: you returned {got}, expected {want}; {sentence}")
            i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            p = start + i
            raise Problem(f"{what}: you returned {got}, expected {want}; position {p} lives in "
                          f"block table[{p // bs}] = {table[p // bs]} at offset {p % bs}, slot "
                          f"{want[i]}")
    return check


def _slot_errors(fn):
    for table, start, end, bs, why in (
            ([3, 1], 0, 33, 16, "position 32 is beyond the 2 blocks x 16 tokens of the table"),
            ([3, 1], 30, 40, 16, "positions 32 .. 39 are beyond the table"),
            ([3, 1], -1, 4, 16, "a position cannot be negative"),
            ([3, 1], 5, 3, 16, "start is after end")):
        what = f"slot_mapping({table}, {start}, {end}, {bs}) ({why})"
        try:
            out = fn(list(table), start, end, bs)
        except ValueError:
            continue
        except NotImplementedError:
            raise
        except Exception as exc:
            raise Problem(f"{what} raised {type(exc).__name__}: {exc}; raise ValueError that "
                          "says which positions the table can hold") from None
        raise Problem(f"{what} returned {str(out)[:60]} instead of raising ValueError; a "
                      "position outside the table has no slot, so nothing may be returned")


SLOT_MAPPING = Exercise("ch03.slot_mapping", "slot_mapping", (
    Check("positions inside one block", _slot_cases([([5], 0, 10, 16)])),
    Check("positions across blocks follow the block table",
          _slot_cases([([7, 2, 9], 0, 40, 16), ([4, 0, 6, 1], 3, 29, 8)])),
    Check("a decode step: one position, the last one",
          _slot_cases([([7, 2, 9], 37, 38, 16), ([11, 3], 16, 17, 16)])),
    Check("other block sizes, 1 included",
          _slot_cases([([2, 0, 1], 2, 12, 4), ([9, 8, 7, 6, 5], 0, 5, 1),
                       ([1, 0], 5, 64, 32)])),
    Check("an empty range gives no slots", _slot_cases([([7, 2], 20, 20, 16)])),
    Check("positions outside the table raise ValueError", _slot_errors),
))


def check_slot_mapping(slot_mapping, time_limit: Optional[float] = None):
    """Grade exercise (b): slot_mapping(block_table, start, end, block_size) -> list of slots."""
    return SLOT_MAPPING.check(slot_mapping, time_limit)


# =========================================================================== (c) paged gather

class _GatherCase:
    def __init__(self, label, num_blocks, block_size, kv_heads, head_dim, table, seq_len, seed):
        self.label, self.seq_len, self.block_size = label, seq_len, block_size
        g = torch.Generator().manual_seed(seed)
        # every row distinct, so a row names the slot it came from
        self.cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
        self.table = torch.tensor(table, dtype=torch.int32)   # padded past the used blocks
        used = self.table[:_ceil(seq_len, block_size)].long()
        self.expected = self.cache[used].flatten(0, 1)[:seq_len]  # [seq_len, KVH, D]

    def describe(self) -> str:
        return (f"{self.label} (block_size {self.block_size}, seq_len {self.seq_len}, "
                f"block_table {self.table.tolist()})")


def _call_gather(fn, case):
    """Run the learner's launcher; unwrap the interpreter's error so a NotImplementedError (or
    any other error) in the kernel is reported as itself."""
    cache, table = case.cache.clone(), case.table.clone()
    try:
        out = fn(cache, table, case.seq_len)
    except Exception as exc:
        root = exc
        while type(root).__name__ == "InterpreterError" and root.__cause__ is not None:
            root = root.__cause__
        if root is not exc:
            raise root from None
        text = str(exc)
        if any(word in text.lower() for word in ("cuda", "pointer", "driver")):
            raise Problem(f"{case.describe()}: the kernel could not run on CPU tensors "
                          f"({type(exc).__name__}: {text[:160]}); set "
                          "os.environ['TRITON_INTERPRET'] = '1' before the cell that defines "
                          "the kernel (the problem set's first cell does) and re-run "
                          "both") from None
        raise
    return out, cache, table


def _first_bad_row(out, case) -> str:
    """Say which row is wrong and where in the pool its contents came from."""
    bs = case.block_size
    flat = case.cache.flatten(0, 1)                             # [num_slots, KVH, D]
    for p in range(case.seq_len):
        if torch.equal(out[p], case.expected[p]):
            continue
        block = int(case.table[p // bs])
        want = f"slot {block * bs + p % bs} (block table[{p // bs}] = {block}, offset {p % bs})"
        if torch.isnan(out[p]).all():
            return (f"row {p} was never written (still NaN); expected the K of {want}; check the "
                    "mask and that every program stores its TILE rows")
        hits = [s for s in range(flat.shape[0]) if torch.equal(out[p], flat[s])]
        if hits:
            s = hits[0]
            return (f"row {p} holds the K of slot {s} (block {s // bs}, offset {s % bs}); "
                    f"expected {want}")
        return f"row {p} matches no row of the pool; expected the K of {want}"
    return "the rows differ from the reference"


def _diagnose_gather(out, case) -> Optional[str]:
    bs, n = case.block_size, case.seq_len
    flat = case.cache.flatten(0, 1)
    table = case.table.long()
    pos = torch.arange(n)
    variants = [
        (flat[pos], "your rows equal slots 0 .. seq_len-1 of the pool: the block table was "
                    "ignored; the physical block of position p is block_table[p // BLOCK_SIZE]"),
        (flat[table[pos // bs] * bs], "each row equals the first row of its block: the offset "
                                      "p % BLOCK_SIZE inside the block is missing"),
    ]
    if (pos // bs + 1).max() < table.shape[0]:
        variants.append((flat[table[pos // bs + 1] * bs + pos % bs],
                         "each row comes from the NEXT block of the table: the logical block of "
                         "position p is p // BLOCK_SIZE"))
    return one_fit(out, variants, expected=case.expected, same=torch.equal) or None


def _gather_cases(specs):
    def check(fn):
        for spec in specs:
            case = _GatherCase(**spec)
            out, cache, table = _call_gather(fn, case)
            shape = list(case.expected.shape)
            if not isinstance(out, torch.Tensor) or list(out.shape) != shape:
                got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise Problem(f"{case.describe()}: returned {got}; expected a tensor {shape}")
            if not torch.equal(cache, case.cache) or not torch.equal(table, case.table):
                raise Problem(f"{case.describe()}: the kernel wrote into the pool or the block "
                              "table; it may only read them and write the output")
            if torch.equal(out, case.expected):
                continue
            why = _diagnose_gather(out, case) or _first_bad_row(out, case)
            raise Problem(f"{case.describe()}: {why}")
    return check


_ONE_BLOCK = dict(label="one full block", num_blocks=6, block_size=4, kv_heads=1, head_dim=4,
                  table=[3, 5], seq_len=4, seed=11)
_SCATTERED = dict(label="blocks scattered over the pool", num_blocks=12, block_size=4,
                  kv_heads=2, head_dim=4, table=[7, 2, 9, 0, 5, 1], seq_len=16, seed=12)
_PARTIAL = dict(label="a partly filled last block", num_blocks=12, block_size=4, kv_heads=2,
                head_dim=4, table=[6, 10, 1, 4, 8], seq_len=11, seed=13)
_MANY = dict(label="more tokens than one program's tile", num_blocks=16, block_size=8,
             kv_heads=1, head_dim=8, table=[12, 3, 15, 0, 9, 6], seq_len=37, seed=14)
_SIZES = [dict(label="block_size 1", num_blocks=10, block_size=1, kv_heads=1, head_dim=4,
               table=[9, 4, 0, 7, 2, 5, 3], seq_len=6, seed=15),
          dict(label="block_size 16", num_blocks=6, block_size=16, kv_heads=2, head_dim=8,
               table=[4, 1, 5], seq_len=21, seed=16)]

PAGED_GATHER = Exercise("ch03.paged_gather", "paged_gather", (
    Check("one full block", _gather_cases([_ONE_BLOCK])),
    Check("follows the block table to blocks scattered over the pool",
          _gather_cases([_SCATTERED])),
    Check("a partly filled last block: only seq_len rows are read and written",
          _gather_cases([_PARTIAL])),
    Check("more tokens than one program's tile (several programs)", _gather_cases([_MANY])),
    Check("other block sizes (1 and 16)", _gather_cases(_SIZES)),
))


def check_paged_gather(paged_gather, time_limit: Optional[float] = None):
    """Grade exercise (c): paged_gather(k_cache [num_blocks, block_size, KVH, D], block_table
    [max_blocks] int32, seq_len) -> [seq_len, KVH, D], through the learner's Triton kernel."""
    return PAGED_GATHER.check(paged_gather, time_limit)


EXERCISES = (BLOCK_TABLES, SLOT_MAPPING, PAGED_GATHER)
