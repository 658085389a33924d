"""Chapter 06 graders are themselves tested: the solution passes, the unfilled exercise fails, and
planted bugs (a key for the partial block, unchained keys, an ignored salt, Python's per-process
hash(), digits run together, keys that depend on later tokens, a LIFO or O(n) free
queue, a revival that leaves the block in the queue, a hit that covers the whole prompt, counts
tokens of a partial block or skips a missing block) are caught with a message that names the
mistake. The references are checked against minillm's own prefix cache."""
import random
import re
from collections import OrderedDict
from pathlib import Path

import nbformat
from grader_contract import LIMIT, contract_tests, planted_bug_tests

from minillm.cache.prefix import PrefixCachingBlockManager, hash_block_tokens
from minillm.grading import ch06, grade
from minillm.grading.policy import reference_use

NOTEBOOK = "06_prefix_caching.ipynb"
ROOT = Path(__file__).resolve().parents[1]
FUNCTIONS = {"block_keys": ch06.BLOCK_KEYS, "num_cached_tokens": ch06.NUM_CACHED}
GRADED = {**FUNCTIONS, "FreeBlockQueue": ch06.FREE_QUEUE}

(test_solution_scores_full_marks, test_unfilled_exercise_fails_every_check,
 test_solution_cells_hold_the_marked_solution) = contract_tests(NOTEBOOK, FUNCTIONS, min_checks=5)


# the contract for the one exercise that is a class (grader_contract looks for `def name(`)
def cell_from_notebook(path, name):
    """The one code cell defining `class name` or `def name(`, executed alone: (object, source)."""
    nb = nbformat.read(str(path), as_version=4)
    pattern = re.compile(rf"^(class {re.escape(name)}\b|def {re.escape(name)}\s*\()", re.MULTILINE)
    cells = [c.source for c in nb.cells if c.cell_type == "code" and pattern.search(c.source)]
    assert len(cells) == 1, f"{path}: {len(cells)} cells define {name}"
    namespace = {"__name__": "notebook_cell"}
    exec(compile(cells[0], f"<{path.name}: {name}>", "exec"), namespace)
    return namespace[name], cells[0]


def solution(name):                  # loaders test_grading_transcript.py uses for this chapter
    return cell_from_notebook(ROOT / "solutions" / NOTEBOOK, name)[0]


def stub(name):
    return cell_from_notebook(ROOT / "exercises" / NOTEBOOK, name)[0]


def test_free_queue_solution_full_marks_stub_fails_markers_present():
    solution_cls, src = cell_from_notebook(ROOT / "solutions" / NOTEBOOK, "FreeBlockQueue")
    result = grade(ch06.FREE_QUEUE, solution_cls, time_limit=LIMIT)
    assert result.full_marks and result.max >= 5, str(result)
    assert "### BEGIN SOLUTION" in src and "### END SOLUTION" in src
    stub_cls, stub_src = cell_from_notebook(ROOT / "exercises" / NOTEBOOK, "FreeBlockQueue")
    result = grade(ch06.FREE_QUEUE, stub_cls, time_limit=LIMIT)
    assert result.score == 0, str(result)
    assert all("not written yet" in m for m in result.messages), result.messages
    assert "### BEGIN SOLUTION" not in stub_src


def test_solutions_and_exercises_raise_no_policy_flag():
    """The defining cells use xxhash and the standard library, not minillm."""
    for folder in ("solutions", "exercises"):
        nb = nbformat.read(str(ROOT / folder / NOTEBOOK), as_version=4)
        assert all(reference_use(nb, e) is None for e in ch06.EXERCISES), folder


def test_chapter_lists_its_exercises_for_batch_grading():
    assert ch06.EXERCISES == (ch06.BLOCK_KEYS, ch06.FREE_QUEUE, ch06.NUM_CACHED)
    assert [e.id for e in ch06.EXERCISES] == ["ch06.block_keys", "ch06.free_block_queue",
                                              "ch06.num_cached_tokens"]


# ------------------------------------------------------------------ the references themselves

def test_reference_keys_are_the_engines_keys():
    """The keys the engine's cache registers for a prompt are the reference's, in order."""
    bm = PrefixCachingBlockManager(8, 4)
    ids = list(range(30, 45))
    bm.allocate("a", len(ids))
    bm.cache_full_blocks("a", len(ids), lambda s, e: ids[s:e], "t")
    got = [bm.pool.block_entry[b].key for b in bm.block_table("a")[:3]]
    assert got == ch06.reference_block_keys(ids, 4, "t")


def test_reference_hit_length_is_the_engines_lookup():
    rng = random.Random(0)
    for _ in range(30):
        bs = rng.choice([1, 2, 4])
        bm = PrefixCachingBlockManager(200, bs)
        seqs = [[rng.randrange(3) for _ in range(rng.randint(1, 20))] for _ in range(3)]
        for i, s in enumerate(seqs):
            bm.allocate(i, len(s), bm.find_cached_blocks(s))
            bm.cache_full_blocks(i, len(s), lambda a, b, s=s: s[a:b])
        prompt = [rng.randrange(3) for _ in range(rng.randint(1, 20))]
        cached = ch06._cache_of(*seqs, bs=bs)
        assert ch06.reference_num_cached_tokens(prompt, cached, bs) == \
            len(bm.find_cached_blocks(prompt)) * bs


# ------------------------------------------------------------------ planted bugs

def keys_with_partial_block(token_ids, block_size, cache_salt=None):
    keys, parent = [], None
    for i in range(-(-len(token_ids) // block_size)):
        block = token_ids[i * block_size:(i + 1) * block_size]
        parent = hash_block_tokens(parent, block, cache_salt)
        keys.append(parent)
    return keys


def keys_unchained(token_ids, block_size, cache_salt=None):
    return [hash_block_tokens(None, token_ids[i * block_size:(i + 1) * block_size], cache_salt)
            for i in range(len(token_ids) // block_size)]


def keys_ignore_salt(token_ids, block_size, cache_salt=None):
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(parent)
    return keys


def keys_off_by_one(token_ids, block_size, cache_salt=None):
    keys, parent = [], None
    for i in range(max(0, len(token_ids) // block_size - 1)):
        block = token_ids[i * block_size:(i + 1) * block_size]
        parent = hash_block_tokens(parent, block, cache_salt)
        keys.append(parent)
    return keys


def keys_python_hash(token_ids, block_size, cache_salt=None):
    """Chained, salted, but Python's hash() of a str: seeded per process (PYTHONHASHSEED)."""
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash(f"{parent}|{cache_salt}|{token_ids[i * block_size:(i + 1) * block_size]}")
        keys.append(parent)
    return keys


def keys_digits_run_together(token_ids, block_size, cache_salt=None):
    """Stable and chained, but the tokens are written as digits with no separator."""
    import hashlib
    keys, parent = [], str(cache_salt)
    for i in range(len(token_ids) // block_size):
        text = parent + "".join(map(str, token_ids[i * block_size:(i + 1) * block_size]))
        parent = hashlib.sha256(text.encode()).hexdigest()
        keys.append(parent)
    return keys


def keys_depend_on_the_whole_prompt(token_ids, block_size, cache_salt=None):
    """Every key also mixes in the prompt's length: equal prefixes no longer share keys."""
    return [(k, len(token_ids)) for k in ch06.reference_block_keys(token_ids, block_size,
                                                                    cache_salt)]


class LifoQueue:
    def __init__(self):
        self.d = OrderedDict()

    def append(self, b):
        self.d[b] = None

    def popleft(self):
        if not self.d:
            raise ValueError("empty")
        return self.d.popitem(last=True)[0]

    def remove(self, b):
        if b not in self.d:
            raise ValueError(b)
        del self.d[b]

    @property
    def num_free_blocks(self):
        return len(self.d)


class FrontAppendQueue(LifoQueue):
    """A freed block goes to the head: the most recently used block is evicted first."""

    def append(self, b):
        self.d[b] = None
        self.d.move_to_end(b, last=False)

    def popleft(self):
        if not self.d:
            raise ValueError("empty")
        return self.d.popitem(last=False)[0]


class ForgetfulRevivalQueue(LifoQueue):
    """FIFO, but a hit does not take the block out of the queue."""

    def popleft(self):
        if not self.d:
            raise ValueError("empty")
        return self.d.popitem(last=False)[0]

    def remove(self, b):
        if b not in self.d:
            raise ValueError(b)


def hit_whole_prompt(prompt, cached_prefixes, block_size):
    n = 0
    for i in range(1, len(prompt) // block_size + 1):
        if tuple(prompt[:i * block_size]) not in cached_prefixes:
            break
        n = i * block_size
    return n


def hit_token_level(prompt, cached_prefixes, block_size):
    """Counts shared tokens of a partial block too (and never the last one)."""
    best = 0
    for p in cached_prefixes:
        n = 0
        while n < min(len(p), len(prompt) - 1) and p[n] == prompt[n]:
            n += 1
        best = max(best, n)
    return best


def hit_skips_misses(prompt, cached_prefixes, block_size):
    return sum(block_size for i in range(1, (len(prompt) - 1) // block_size + 1)
               if tuple(prompt[:i * block_size]) in cached_prefixes)


BUGS = [
    ("block_keys", keys_with_partial_block, "one key per full block", "partly filled last block"),
    ("block_keys", keys_unchained, "chains its parent", "hashed every block on its own"),
    ("block_keys", keys_unchained, "exactly when", "chain the parent"),
    ("block_keys", keys_python_hash, "per-process hash()", "seeded per process"),
    ("block_keys", keys_digits_run_together, "token boundaries", "digits run together"),
    ("block_keys", keys_depend_on_the_whole_prompt, "exactly when", "same first"),
    ("block_keys", keys_ignore_salt, "cache_salt", "same keys as no salt"),
    ("block_keys", keys_off_by_one, "one key per full block", "one per FULL block"),
    ("FreeBlockQueue", LifoQueue, "least recently freed", "most recently freed"),
    ("FreeBlockQueue", FrontAppendQueue, "freed again goes to the tail", "most recently used"),
    ("FreeBlockQueue", ForgetfulRevivalQueue, "out of the middle", "still handed out"),
    ("num_cached_tokens", hit_whole_prompt, "last prompt token", "must be computed"),
    ("num_cached_tokens", hit_token_level, "full blocks", "only FULL blocks"),
    ("num_cached_tokens", hit_skips_misses, "first missing block", "stops at the first missing"),
]

(test_planted_bug_is_caught_with_a_specific_message,
 test_every_exercise_has_at_least_two_planted_bugs) = planted_bug_tests(GRADED, BUGS)


def test_any_stable_design_passes_including_minillms_own_keys():
    """The block-key grader checks properties, not one recipe: minillm's xxh3 chain passes too."""
    assert grade(ch06.BLOCK_KEYS, ch06.reference_block_keys, time_limit=LIMIT).full_marks
