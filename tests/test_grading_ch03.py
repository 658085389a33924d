"""Chapter 03 graders are themselves tested: the solution passes, the unfilled exercise fails
every check, and planted bugs (leaked block, off-by-one block count, no copy-on-write, wrong slot
offset, a gather that ignores the block table, ...) are caught with a specific message.

The learner code is read from the real notebooks. Exercise 3 is a Triton kernel, so its cell is
executed with TRITON_INTERPRET=1 (Triton reads the variable when the kernel is decorated) and
with its source registered in linecache, as IPython does, so the interpreter can read it.
"""
import linecache
import os
import re
from pathlib import Path

import pytest

from minillm.grading import ch03, grade
from minillm.grading.make_exercises import render

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "03_paged_blocks.ipynb"
EXERCISE = ROOT / "exercises" / "03_paged_blocks.ipynb"
LIMIT = 60          # generous: a loaded 2-core CI machine must never time out a correct solution

GRADED = {"BlockTables": ch03.BLOCK_TABLES, "slot_mapping": ch03.SLOT_MAPPING,
          "paged_gather": ch03.PAGED_GATHER}


def cell_source(path, name: str) -> str:
    """The one code cell of notebook `path` that defines `class name` or `def name(`."""
    import nbformat
    nb = nbformat.read(str(path), as_version=4)
    pattern = re.compile(rf"^(class {re.escape(name)}\b|def {re.escape(name)}\s*\()", re.MULTILINE)
    cells = [c.source for c in nb.cells if c.cell_type == "code" and pattern.search(c.source)]
    assert len(cells) == 1, f"{path}: {len(cells)} cells define {name}"
    return cells[0]


_counter = [0]


def load(source: str, name: str, interpret: bool = True):
    """Execute a cell's source like a notebook would and return `name` from it."""
    _counter[0] += 1
    filename = f"<ch03-cell-{_counter[0]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        namespace = {"__name__": "notebook_03"}
        exec(compile(source, filename, "exec"), namespace)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return namespace[name]


def solution(name):
    return load(cell_source(SOLUTION, name), name)


def stub(name):
    return load(cell_source(EXERCISE, name), name)


def with_lines_replaced(name, *pairs):
    """The solution cell with some lines replaced (a planted bug in the learner's own text)."""
    source = cell_source(SOLUTION, name)
    for old, new in pairs:
        assert old in source, f"{old!r} is no longer in the solution of {name}"
        source = source.replace(old, new)
    return load(source, name)


# ------------------------------------------------------------------ solution passes, stub fails

@pytest.mark.parametrize("name", GRADED)
def test_solution_scores_full_marks(name):
    result = grade(GRADED[name], solution(name), time_limit=LIMIT)
    assert result.full_marks, str(result)
    assert result.max >= 5


@pytest.mark.parametrize("name", GRADED)
def test_unfilled_exercise_fails_every_check(name):
    result = grade(GRADED[name], stub(name), time_limit=LIMIT)
    assert result.score == 0, str(result)
    assert all("not written yet" in m for m in result.messages), result.messages


def test_exercise_notebook_is_generated_from_the_solution():
    assert EXERCISE.read_text(encoding="utf-8") == render(SOLUTION), \
        "run: python -m minillm.grading.make_exercises solutions exercises"
    for name in GRADED:
        assert "### BEGIN SOLUTION" in cell_source(SOLUTION, name)
        assert "### BEGIN SOLUTION" not in cell_source(EXERCISE, name)


def test_checks_are_listed_for_batch_grading():
    assert ch03.EXERCISES == (ch03.BLOCK_TABLES, ch03.SLOT_MAPPING, ch03.PAGED_GATHER)


# ------------------------------------------------------------------ planted bugs: BlockTables
# Each bug is the solution class with one method replaced by a plausible wrong version.

def bug_classes():
    Base = solution("BlockTables")

    class AllocateOffByOne(Base):            # one block too many for exact multiples
        def allocate(self, seq_id, num_tokens):
            need = num_tokens // self.block_size + 1
            if need > len(self.free_blocks):
                raise ValueError("out of blocks")
            self.tables[seq_id] = [self.free_blocks.popleft() for _ in range(need)]
            for b in self.tables[seq_id]:
                self.refcounts[b] = 1
            self.lengths[seq_id] = num_tokens

    class AllocateNotAtomic(Base):           # takes blocks one by one, raises half-way
        def allocate(self, seq_id, num_tokens):
            if seq_id in self.tables:
                raise ValueError("exists")
            table = self.tables.setdefault(seq_id, [])
            self.lengths[seq_id] = num_tokens
            for _ in range(-(-num_tokens // self.block_size)):
                if not self.free_blocks:
                    raise ValueError("out of blocks")
                b = self.free_blocks.popleft()
                self.refcounts[b] = 1
                table.append(b)

    class AppendOneEarly(Base):              # counts the new token before testing for room
        def append(self, seq_id):
            self.lengths[seq_id] += 1
            if self.lengths[seq_id] % self.block_size == 0:
                b = self.free_blocks.popleft()
                self.refcounts[b] = 1
                self.tables[seq_id].append(b)
            return []

    class NoCopyOnWrite(Base):               # writes into a shared last block
        def append(self, seq_id):
            if self.lengths[seq_id] % self.block_size == 0:
                b = self.free_blocks.popleft()
                self.refcounts[b] = 1
                self.tables[seq_id].append(b)
            self.lengths[seq_id] += 1
            return []

    class CopiesFullBlocks(Base):            # copy-on-write also for a full shared block
        def append(self, seq_id):
            table = self.tables[seq_id]
            copies = []
            if self.refcounts[table[-1]] > 1:
                src, dst = table[-1], self.free_blocks.popleft()
                self.refcounts[src] -= 1
                self.refcounts[dst] = 1
                table[-1] = dst
                copies.append((src, dst))
            if self.lengths[seq_id] % self.block_size == 0:
                b = self.free_blocks.popleft()
                self.refcounts[b] = 1
                table.append(b)
            self.lengths[seq_id] += 1
            return copies

    class CowLeaksSource(Base):              # copy-on-write forgets to drop the old reference
        def append(self, seq_id):
            table, n = self.tables[seq_id], self.lengths[seq_id]
            if n % self.block_size and self.refcounts[table[-1]] > 1:
                self.refcounts[table[-1]] += 1          # pretend: keeps the old count
            return Base.append(self, seq_id)

    class ForkCopies(Base):                  # the child gets fresh blocks: no sharing
        def fork(self, parent_id, child_id):
            n = len(self.tables[parent_id])
            self.tables[child_id] = [self.free_blocks.popleft() for _ in range(n)]
            for b in self.tables[child_id]:
                self.refcounts[b] = 1
            self.lengths[child_id] = self.lengths[parent_id]

    class FreeForgetsFreeList(Base):         # counts drop, blocks never come back
        def free(self, seq_id):
            for b in self.tables.pop(seq_id):
                self.refcounts[b] -= 1
            del self.lengths[seq_id]

    class FreeIgnoresRefcount(Base):         # returns shared blocks while others use them
        def free(self, seq_id):
            for b in self.tables.pop(seq_id):
                self.refcounts[b] = max(0, self.refcounts[b] - 1)
                if b not in self.free_blocks:
                    self.free_blocks.append(b)
            del self.lengths[seq_id]

    return {c.__name__: c for c in (AllocateOffByOne, AllocateNotAtomic, AppendOneEarly,
                                    NoCopyOnWrite, CopiesFullBlocks, CowLeaksSource, ForkCopies,
                                    FreeForgetsFreeList, FreeIgnoresRefcount)}


# ------------------------------------------------------------------ planted bugs: slot_mapping

def slot_ignores_table(block_table, start, end, block_size):
    return list(range(start, end))


def slot_no_offset(block_table, start, end, block_size):
    return [block_table[p // block_size] * block_size for p in range(start, end)]


def slot_no_scale(block_table, start, end, block_size):
    return [block_table[p // block_size] + p % block_size for p in range(start, end)]


def slot_end_inclusive(block_table, start, end, block_size):
    return [block_table[p // block_size] * block_size + p % block_size
            for p in range(start, min(end + 1, len(block_table) * block_size))]


def slot_no_bounds_check(block_table, start, end, block_size):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


# ------------------------------------------------------------------ planted bugs: paged_gather
# Each bug is the solution's kernel with one line changed.

SLOT_LINE = "slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE"
TABLE_LINE = "block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=is_real, other=0)"

GATHER_BUGS = {
    "gather_ignores_block_table": [(SLOT_LINE, "slot = pos.to(tl.int64)")],
    "gather_forgets_offset": [(SLOT_LINE, "slot = block.to(tl.int64) * BLOCK_SIZE")],
    "gather_reads_next_block": [(TABLE_LINE, TABLE_LINE.replace("pos // BLOCK_SIZE",
                                                                "pos // BLOCK_SIZE + 1"))],
    "gather_one_tile_only": [("pos = tl.program_id(0) * TILE + tl.arange(0, TILE)",
                              "pos = tl.arange(0, TILE)")],
}


# exercise, bug, a check it must fail, words its message must contain
BUGS = [
    ("BlockTables", "AllocateOffByOne", "allocate takes ceil", "exact multiple"),
    ("BlockTables", "AllocateNotAtomic", "running out of blocks", "BEFORE taking any"),
    ("BlockTables", "AppendOneEarly", "only when the last one is full", "free slot"),
    ("BlockTables", "NoCopyOnWrite", "copy-on-write", "Copy a shared, partly filled last block"),
    ("BlockTables", "CopiesFullBlocks", "full last block stays shared", "was full"),
    ("BlockTables", "CowLeaksSource", "no leaks", "leaks"),
    ("BlockTables", "ForkCopies", "fork shares every block", "takes no new one"),
    ("BlockTables", "FreeForgetsFreeList", "no leaks", "leaked"),
    ("BlockTables", "FreeIgnoresRefcount", "no leaks", "while a table still uses them"),
    ("slot_mapping", slot_ignores_table, "follow the block table", "block table was ignored"),
    ("slot_mapping", slot_no_offset, "inside one block", "offset p % block_size"),
    ("slot_mapping", slot_no_scale, "follow the block table", "not multiplied by block_size"),
    ("slot_mapping", slot_end_inclusive, "decode step", "excluding end"),
    ("slot_mapping", slot_no_bounds_check, "outside the table", "raise ValueError"),
    ("paged_gather", "gather_ignores_block_table", "follows the block table",
     "block table was ignored"),
    ("paged_gather", "gather_forgets_offset", "one full block", "offset p % BLOCK_SIZE"),
    ("paged_gather", "gather_reads_next_block", "scattered over the pool", "NEXT block"),
    ("paged_gather", "gather_one_tile_only", "several programs", "never written"),
]


def make_bug(name, bug):
    if callable(bug):
        return bug
    if name == "BlockTables":
        return bug_classes()[bug]
    return with_lines_replaced("paged_gather", *GATHER_BUGS[bug])


def bug_name(bug):
    return bug if isinstance(bug, str) else bug.__name__


@pytest.mark.parametrize("name, bug, check, words", BUGS,
                         ids=[f"{b[0]}-{bug_name(b[1])}" for b in BUGS])
def test_planted_bug_is_caught_with_a_specific_message(name, bug, check, words):
    result = grade(GRADED[name], make_bug(name, bug), time_limit=LIMIT)
    assert not result.full_marks, f"{bug_name(bug)} got full marks"
    failing = [m for m in result.messages if m.startswith(tuple(
        o.name for o in result.outcomes if check in o.name))]
    assert failing, f"no failed check matching {check!r}:\n{result}"
    assert any(words in m for m in failing), f"{words!r} missing from {failing}"


def test_every_exercise_has_at_least_two_planted_bugs():
    for name in GRADED:
        assert len({bug_name(b) for n, b, _, _ in BUGS if n == name}) >= 2, name


def test_a_kernel_that_raises_is_reported_with_its_own_error():
    kernel_bug = with_lines_replaced("paged_gather", (SLOT_LINE, "slot = block[0:2]"))
    result = grade(ch03.PAGED_GATHER, kernel_bug, time_limit=LIMIT)
    assert result.score == 0, str(result)
    assert all("your code raised" in m and "InterpreterError" not in m.split(":")[1]
               for m in result.messages), result.messages


def test_random_operations_never_run_the_reference_out_of_blocks():
    ops = ch03._random_ops(3, 24, 4, 160)
    kinds = {op[0] for op in ops}
    assert kinds == {"allocate", "append", "fork", "free"}   # every operation is exercised
    assert sum(op[0] == "fork" for op in ops) >= 10


def test_a_kernel_defined_without_the_interpreter_gets_told_how_to_fix_it():
    compiled = load(cell_source(SOLUTION, "paged_gather"), "paged_gather", interpret=False)
    result = grade(ch03.PAGED_GATHER, compiled, time_limit=LIMIT)
    assert result.score == 0, str(result)
    assert all("TRITON_INTERPRET" in m for m in result.messages), result.messages
