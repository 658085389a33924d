"""Graders for the chapter 06 problem set (solutions/06_prefix_caching.ipynb).

    ch06.check_block_keys(block_keys)               # (a) chained keys of a prompt's full blocks
    ch06.check_free_block_queue(FreeBlockQueue)     # (b) LRU free queue with revival on a hit
    ch06.check_num_cached_tokens(num_cached_tokens) # (c) the hit-length rule

References: (a) is graded by properties, not against one recipe: any stable hash whose keys are
equal exactly when the salted prefixes up to the block are equal passes (minillm's own
`cache.prefix.hash_block_tokens` chained over full blocks is one such design); (b) the
orders `PrefixCachingBlockPool`'s free queue produces, written out case by case; (c)
`PrefixCachingBlockManager.find_cached_blocks`'s rule, full blocks up to the first miss and never
the last token.
"""
from __future__ import annotations

import builtins
import random

from ..cache.prefix import hash_block_tokens, num_cacheable_blocks
from .core import Check, Exercise, Problem


# =========================================================================== (a) block keys
#
# The learner designs the key. Any stable hash passes if it has the properties the cache needs:
# one key per FULL block; block i's keys of two prompts are equal exactly when their salted
# token prefixes up to the end of block i are equal (so the key chains the parent); the same
# input gives the same keys in every process (no per-process hash seed).

def reference_block_keys(token_ids, block_size, cache_salt=None):
    """minillm's own keys (cache.prefix.hash_block_tokens chained over full blocks): one design
    that passes; tests check that the engine registers exactly these."""
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                   cache_salt)
        keys.append(parent)
    return keys


def _keys(block_keys, ids, bs, salt=None):
    got = block_keys(list(ids), bs) if salt is None else block_keys(list(ids), bs, salt)
    try:
        got = list(got)
    except TypeError:
        raise Problem(f"block_keys returned {type(got).__name__}; return a list with one key "
                      "per full block") from None
    for k in got:
        try:
            hash(k)
        except TypeError:
            raise Problem(f"a key is a {type(k).__name__}, which cannot index a dict; return "
                          "ints, bytes, strings or tuples") from None
        if k != k:
            raise Problem("a key is NaN, which is not even equal to itself: a cache lookup "
                          "could never find it; return ints, bytes, strings or tuples")
    return got


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _one_key_per_full_block(block_keys):
    for n, bs in [(0, 4), (3, 4), (4, 4), (7, 4), (16, 16), (17, 16), (40, 16), (5, 1)]:
        got = _keys(block_keys, _ids(n, n), bs)
        if len(got) != n // bs:
            extra = " (you gave the partly filled last block a key: only full blocks get one)" \
                if len(got) == -(-n // bs) else ""
            raise Problem(f"{n} tokens in blocks of {bs}: you returned {len(got)} keys, "
                          f"expected {n // bs}, one per FULL block{extra}")
    a = _keys(block_keys, _ids(10, 5), 4)
    if len(set(a)) != len(a):
        raise Problem("two blocks of one prompt got the same key, but their prefixes differ "
                      "(block 1's prefix is longer): their K/V differ, their keys must too")
    b = _keys(block_keys, _ids(10, 5)[:8] + [0, 0], 4)
    if a != b:
        raise Problem("changing a token of the partly filled last block changed a full block's "
                      "key; a block's key depends only on the tokens up to its end")


def _keys_chain_the_parent(block_keys):
    a, b = [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8, 9, 9, 9, 9]
    ka, kb = _keys(block_keys, a, 4), _keys(block_keys, b, 4)
    if ka[0] == kb[0]:
        raise Problem("blocks [1,2,3,4] and [5,6,7,8] got the same key; different tokens must "
                      "give different keys")
    if ka[1] == kb[1]:
        raise Problem("you hashed every block on its own: [1,2,3,4 | 9,9,9,9] and "
                      "[5,6,7,8 | 9,9,9,9] got the same key for their second block, but its K/V "
                      "differ (they depend on the first block); block i's key must chain the key "
                      "of block i-1 (its parent) with its own tokens")


def _family(seed):
    """Prompts with structured sharing: a base, one-token changes in every block, the same later
    blocks after another first block, extensions, and unrelated prompts."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3, 4, 8])
    base = [rng.randrange(50) for _ in range(bs * rng.randint(3, 6) + rng.randrange(bs))]
    fam = [base, base + [rng.randrange(50) for _ in range(2 * bs)]]
    for j in range(len(base) // bs):
        p = list(base)
        p[j * bs + rng.randrange(bs)] += 1 + rng.randrange(49)
        fam.append(p)
    fam.append([x + 1 for x in base[:bs]] + base[bs:])
    fam += [[rng.randrange(50) for _ in range(len(base))] for _ in range(2)]
    return fam, bs


def _equal_iff_same_prefix(block_keys):
    for seed in range(12):
        fam, bs = _family(seed)
        keys = [_keys(block_keys, p, bs) for p in fam]
        for x in range(len(fam)):
            for y in range(x + 1, len(fam)):
                for i in range(min(len(keys[x]), len(keys[y]))):
                    same_prefix = fam[x][:(i + 1) * bs] == fam[y][:(i + 1) * bs]
                    if (keys[x][i] == keys[y][i]) == same_prefix:
                        continue
                    where = f"blocks of {bs}, block {i}"
                    if same_prefix:
                        raise Problem(f"{where}: two prompts with the same first {(i + 1) * bs} "
                                      "tokens got different keys; a key may depend only on the "
                                      "salt and the tokens up to the end of its block")
                    block_same = fam[x][i * bs:(i + 1) * bs] == fam[y][i * bs:(i + 1) * bs]
                    why = ("its own tokens are equal but an earlier block differs: chain the "
                           "parent's key" if block_same else
                           "a one-token difference inside the block left the key unchanged")
                    raise Problem(f"{where}: different prefixes got the same key ({why})")


def _token_boundaries(block_keys):
    pairs = [([1, 23, 4, 5], [12, 3, 4, 5]), ([1, 2, 3, 4], [4, 3, 2, 1]),
             ([0, 0, 0, 1], [0, 0, 1, 0]), ([7, 7, 7, 7], [7, 7, 7, 8])]
    for a, b in pairs:
        if _keys(block_keys, a, 4) == _keys(block_keys, b, 4):
            raise Problem(f"blocks {a} and {b} got the same key: the key must encode each token "
                          "id and its position (e.g. fixed-width bytes per token, or a separator "
                          "that cannot occur in a token), not a sum, a set or digits run together")


def _salt_separates(block_keys):
    ids, bs = _ids(9, 3), 4
    plain, salted = _keys(block_keys, ids, bs), _keys(block_keys, ids, bs, "tenant-a")
    other = _keys(block_keys, ids, bs, "tenant-b")
    if salted == plain:
        raise Problem("cache_salt='tenant-a' gave the same keys as no salt; mix the salt into "
                      "the first block's key (the chain carries it on), or two tenants share "
                      "(and can time) each other's cache")
    if any(a == b for a, b in zip(salted, other)) or any(a == b for a, b in zip(salted, plain)):
        raise Problem("a block kept its key under a different salt; every key must change with "
                      "the salt (mix it into the first block: the chain carries it to the rest)")
    if salted != _keys(block_keys, ids, bs, "tenant-a"):
        raise Problem("the same salt and tokens gave different keys on two calls")


def _no_process_seeded_hash(block_keys):
    """Python's hash() of a str, bytes or tuple of them is seeded per process (PYTHONHASHSEED),
    so keys built on it differ between a server's processes and across restarts. The check runs
    the learner's function while hash() answers as another process's seed would (its value
    XOR a constant): keys that move depend on hash(). It runs in the learner's process, so the
    batch grader replays it from the transcript like every other check."""
    calls = [([3, 1, 4, 1, 5, 9, 2, 6, 5], 4), ([3, 1, 4, 1, 5, 9, 2, 6, 5], 4, "tenant-a"),
             (list(range(20)), 8, "t")]
    here = [_keys(block_keys, *c) for c in calls]
    if here != [_keys(block_keys, *c) for c in calls]:
        raise Problem("two calls with the same arguments gave different keys")
    flat = [k for keys in here for k in keys]
    if len(set(flat)) != len(flat):
        raise Problem("different salted prefixes gave equal keys")
    original = builtins.hash
    builtins.hash = lambda obj: original(obj) ^ 0x5DEECE66D     # another process's seed
    try:
        moved = [_keys(block_keys, *c) for c in calls]
    finally:
        builtins.hash = original
    if moved != here:
        raise Problem("the keys depend on Python's hash(), which is seeded per process (and "
                      "hash(None) followed the address of None before Python 3.12): another "
                      "process or a restart would compute other keys. Use a real hash function, "
                      "e.g. hashlib.sha256 or xxhash")


BLOCK_KEYS = Exercise("ch06.block_keys", "block_keys", (
    Check("one key per full block, none for a partial one", _one_key_per_full_block),
    Check("each key chains its parent's key", _keys_chain_the_parent),
    Check("keys are equal exactly when the prefixes up to the block are equal",
          _equal_iff_same_prefix),
    Check("token boundaries and order are part of the key", _token_boundaries),
    Check("cache_salt changes every key", _salt_separates),
    Check("the keys do not depend on Python's per-process hash()", _no_process_seeded_hash),
))


def check_block_keys(block_keys, time_limit=None):
    return BLOCK_KEYS.check(block_keys, time_limit)


# =========================================================================== (b) free queue

def _size(q):
    n = q.num_free_blocks
    if not isinstance(n, int):
        raise Problem(f"num_free_blocks is {n!r}; it must be an int (how many blocks are free)")
    return n


def _drain(q, limit=10_000):
    out = []
    while _size(q) and len(out) < limit:
        out.append(q.popleft())
    return out


def _lru_order(FreeBlockQueue):
    q = FreeBlockQueue()
    for b in (3, 1, 2):
        q.append(b)
    if _size(q) != 3:
        raise Problem(f"after appending 3 blocks num_free_blocks is {_size(q)}")
    got = _drain(q)
    if got == [2, 1, 3]:
        raise Problem("blocks appended 3, 1, 2 came out 2, 1, 3: you took the most recently "
                      "freed block; take the LEAST recently used one (the head)")
    if got != [3, 1, 2]:
        raise Problem(f"blocks appended 3, 1, 2 came out {got}, expected 3, 1, 2 (oldest first)")


def _revival_removes_from_the_middle(FreeBlockQueue):
    q = FreeBlockQueue()
    for b in range(5):
        q.append(b)
    q.remove(2)                                     # a prefix hit takes block 2 back
    size = _size(q)
    got = _drain(q)
    if 2 in got:
        raise Problem(f"block 2 was still handed out after remove(2) (order {got}): a block "
                      "revived by a hit is in use and must leave the free queue")
    if size != 4:
        raise Problem(f"after remove(2) on 5 blocks num_free_blocks is {size}, expected 4")
    if got != [0, 1, 3, 4]:
        raise Problem(f"after remove(2) the blocks came out {got}, expected [0, 1, 3, 4]")


def _freed_again_goes_to_the_tail(FreeBlockQueue):
    q = FreeBlockQueue()
    for b in (0, 1, 2):
        q.append(b)
    q.remove(0)
    q.append(0)                                     # used, then freed again: most recent
    got = _drain(q)
    if got != [1, 2, 0]:
        raise Problem(f"append 0,1,2; remove(0); append(0) gave {got}, expected [1, 2, 0]: a "
                      "block freed again is the most recently used")


def _errors(FreeBlockQueue):
    q = FreeBlockQueue()
    try:
        q.popleft()
    except ValueError:
        pass
    except Exception as e:
        raise Problem(f"popleft() on an empty queue raised {type(e).__name__}; raise ValueError "
                      "(out of KV blocks)") from None
    else:
        raise Problem("popleft() on an empty queue returned instead of raising ValueError")
    q.append(1)
    try:
        q.remove(7)
    except ValueError:
        pass
    except Exception as e:
        raise Problem(f"remove(7) of a block not in the queue raised {type(e).__name__}; raise "
                      "ValueError") from None
    else:
        raise Problem("remove(7) of a block not in the queue did not raise ValueError")
    if _size(q) != 1:
        raise Problem("a failed remove changed num_free_blocks")


def _random_operations_match_an_lru_queue(FreeBlockQueue):
    rng = random.Random(11)
    q, ref, log = FreeBlockQueue(), [], []
    for _step in range(300):
        op = rng.random()
        if op < 0.45 or not ref:
            b = rng.choice([b for b in range(40) if b not in ref] or [None])
            if b is None:
                continue
            q.append(b)
            ref.append(b)
            log.append(f"append({b})")
        elif op < 0.75:
            b = rng.choice(ref)
            q.remove(b)
            ref.remove(b)
            log.append(f"remove({b})")
        else:
            got, want = q.popleft(), ref.pop(0)
            log.append("popleft()")
            if got != want:
                raise Problem(f"after {len(log)} random operations (last ones: "
                              f"{', '.join(log[-4:])}) popleft returned {got}, expected {want}")
        if _size(q) != len(ref):
            raise Problem(f"after {', '.join(log[-3:])}: num_free_blocks is {_size(q)}, "
                          f"expected {len(ref)}")


FREE_QUEUE = Exercise("ch06.free_block_queue", "FreeBlockQueue", (
    Check("popleft takes the least recently freed block", _lru_order),
    Check("remove (a hit) takes a block out of the middle", _revival_removes_from_the_middle),
    Check("a block freed again goes to the tail", _freed_again_goes_to_the_tail),
    Check("empty popleft and unknown remove raise ValueError", _errors),
    Check("300 random operations match an LRU queue", _random_operations_match_an_lru_queue),
))


def check_free_block_queue(FreeBlockQueue, time_limit=None):
    return FREE_QUEUE.check(FreeBlockQueue, time_limit)


# =========================================================================== (c) hit length

def reference_num_cached_tokens(prompt, cached_prefixes, block_size):
    n = 0
    for i in range(1, num_cacheable_blocks(len(prompt), block_size) + 1):
        if tuple(prompt[:i * block_size]) not in cached_prefixes:
            break
        n = i * block_size
    return n


def _cache_of(*seqs, bs):
    """What a chained-key cache holds after these sequences: every full-block prefix."""
    return {tuple(s[:i * bs]) for s in seqs for i in range(1, len(s) // bs + 1)}


def _expect(fn, prompt, cache, bs, want, what, hint=""):
    got = fn(list(prompt), set(cache), bs)
    if got != want:
        raise Problem(f"{what}: you returned {got}, expected {want}{hint}")


def _full_blocks_only(fn):
    a = list(range(100, 140))
    cache = _cache_of(a, bs=16)
    _expect(fn, a[:5] + list(range(200, 235)), cache, 16, 0,
            "a prompt sharing only its first 5 tokens with a cached 40-token sequence, blocks "
            "of 16", "; only FULL blocks are reused and 5 tokens do not fill one")
    got = fn(a[:20] + list(range(300, 320)), set(cache), 16)
    if got == 20:
        raise Problem("a prompt sharing 20 tokens: you returned 20; only the first FULL block "
                      "(16 tokens) can be reused")
    if got != 16:
        raise Problem(f"a prompt sharing 20 tokens with blocks of 16: you returned {got}, "
                      "expected 16")


def _last_token_always_computed(fn):
    a = list(range(32))
    cache = _cache_of(a, bs=16)
    got = fn(list(a), set(cache), 16)
    if got == 32:
        raise Problem("the same 32-token prompt again (2 full cached blocks): you returned 32, "
                      "but the last token must be computed to get its logits; expected 16")
    if got != 16:
        raise Problem(f"the same 32-token prompt again: you returned {got}, expected 16")
    _expect(fn, a[:17], cache, 16, 16, "a 17-token prefix of a cached sequence")
    _expect(fn, a[:16], cache, 16, 0, "a 16-token prompt whose one block is cached")
    _expect(fn, a[:1], cache, 16, 0, "a 1-token prompt")


def _stops_at_the_first_miss(fn):
    a = list(range(48))
    cache = _cache_of(a, bs=16) - {tuple(a[:16])}    # block 0's prefix evicted, deeper ones not
    got = fn(a + [99], set(cache), 16)
    if got != 0:
        raise Problem(f"block 0's prefix is not cached but blocks 1 and 2's are: you returned "
                      f"{got}, expected 0; a hit is a prefix, it stops at the first missing block")


def _block_size_one(fn):
    a = [5, 6, 7, 8, 9]
    cache = _cache_of(a, bs=1)
    _expect(fn, a, cache, 1, 4, "block_size 1, the same 5-token prompt again (every token is a "
                                "block; all but the last come from the cache)")
    _expect(fn, a[:3] + [0, 0], cache, 1, 3, "block_size 1, a prompt sharing 3 tokens")


def _matches_reference_on_random_cases(fn):
    rng = random.Random(7)
    for _trial in range(40):
        bs = rng.choice([1, 2, 4, 8])
        base = [rng.randrange(3) for _ in range(rng.randint(0, 30))]
        others = [[rng.randrange(3) for _ in range(rng.randint(1, 30))] for _ in range(2)]
        cache = _cache_of(base, *others, bs=bs)
        head = base[:rng.randint(0, len(base))]                   # drawn first, as before
        prompt = head + [rng.randrange(3) for _ in range(rng.randint(1, 8))]
        want = reference_num_cached_tokens(prompt, cache, bs)
        got = fn(list(prompt), set(cache), bs)
        if got != want:
            raise Problem(f"prompt {prompt}, block_size {bs}, cached prefixes of {base} and "
                          f"{others}: you returned {got}, expected {want}")


NUM_CACHED = Exercise("ch06.num_cached_tokens", "num_cached_tokens", (
    Check("only full blocks are reused", _full_blocks_only),
    Check("the last prompt token is always computed", _last_token_always_computed),
    Check("the hit stops at the first missing block", _stops_at_the_first_miss),
    Check("block size 1: token-granular hits", _block_size_one),
    Check("matches minillm on random prompts", _matches_reference_on_random_cases),
))


def check_num_cached_tokens(num_cached_tokens, time_limit=None):
    return NUM_CACHED.check(num_cached_tokens, time_limit)


EXERCISES = (BLOCK_KEYS, FREE_QUEUE, NUM_CACHED)
