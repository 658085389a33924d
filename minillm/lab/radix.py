"""A radix tree over token ids (chapter 06): SGLang's RadixAttention cache, in small.

Where the hash chain of `minillm.cache.prefix` indexes whole blocks, a radix tree indexes
TOKENS. Every cached sequence is a path from the root; an edge holds a run of tokens, and two
sequences share the edges of their common prefix and branch where they differ:

    root ── "You are a helpful assistant." ──┬── "What is 2+2?"
                                             └── "Name a prime." ── " Seven."

* `match_prefix(tokens)`: the longest cached PREFIX of tokens, at token granularity. Every
  reuse is a prefix match, exactly as with the hash chain: a token's K/V depends on all the
  tokens before it, so a run of tokens that reappears after a different prefix has different
  K/V and cannot be reused. The tree stores many prefixes compactly; it does not find
  arbitrary shared subsequences.
* `insert(tokens)`: add a sequence, splitting an edge where the new one leaves it.
* `lock(node)` / `unlock(node)`: a running request pins its path (lock_ref on every node up to
  the root) so eviction cannot take K/V it is reading.
* `evict(num_tokens)`: drop least-recently-used unlocked LEAVES until enough tokens are freed;
  a parent whose last child went becomes a leaf and may go next. Deepest-first, like the tail-
  first freeing of the hash chain.

Sizes are counted in tokens (one KV slot each). The engine runs on the hash chain; this tree is
the comparison of chapter 06. The structure follows SGLang's radix_cache.py; the code is our own.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Optional


class RadixNode:
    __slots__ = ("key", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple = (), parent: Optional["RadixNode"] = None):
        self.key = key                  # the run of token ids on the edge into this node
        self.children: dict = {}        # first token of the child's key -> child
        self.parent = parent
        self.lock_ref = 0               # running requests whose path goes through this node
        self.last_access = 0

    def __repr__(self) -> str:
        return (f"RadixNode({len(self.key)} tokens, {len(self.children)} children, "
                f"lock {self.lock_ref})")


def _common_length(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixCache:
    def __init__(self, capacity_tokens: Optional[int] = None):
        """capacity_tokens: when set, `insert` evicts unlocked leaves to stay within it."""
        self.root = RadixNode()
        self.root.lock_ref = 1          # the root is never evicted
        self.capacity_tokens = capacity_tokens
        self.total_tokens = 0
        self._clock = itertools.count(1)

    # --- lookup ----------------------------------------------------------------------------------
    def match_prefix(self, tokens, touch: bool = True) -> tuple[int, RadixNode]:
        """(length of the longest cached prefix of tokens, the node where it ends). An edge
        matched part-way is split so the returned node ends exactly at the match. touch=False
        only looks (no split, no LRU update): the returned node may then end past the match."""
        tokens = tuple(tokens)
        node, matched = self.root, 0
        if not touch:
            while matched < len(tokens) and tokens[matched] in node.children:
                child = node.children[tokens[matched]]
                n = _common_length(child.key, tokens[matched:])
                node, matched = child, matched + n
                if n < len(child.key):
                    break
            return matched, node
        now = next(self._clock)
        node.last_access = now
        while matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                break
            n = _common_length(child.key, tokens[matched:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, matched = child, matched + n
            if n < len(child.key):
                break
        return matched, node

    # --- insert --------------------------------------------------------------------------------
    def insert(self, tokens) -> int:
        """Cache the sequence tokens. Returns how many of its leading tokens were already there."""
        tokens = tuple(tokens)
        matched, node = self.match_prefix(tokens)
        rest = tokens[matched:]
        if rest:
            if self.capacity_tokens is not None:
                self.lock(node)                              # keep our own path meanwhile
                self.evict(self.total_tokens + len(rest) - self.capacity_tokens)
                self.unlock(node)
            child = RadixNode(rest, node)
            child.last_access = next(self._clock)
            node.children[rest[0]] = child
            self.total_tokens += len(rest)
        return matched

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Cut child's edge after n tokens: a new middle node takes the first n."""
        parent = child.parent
        mid = RadixNode(child.key[:n], parent)
        mid.lock_ref, mid.last_access = child.lock_ref, child.last_access
        parent.children[child.key[0]] = mid
        child.key = child.key[n:]
        child.parent = mid
        mid.children[child.key[0]] = child
        return mid

    # --- locks -----------------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not None:
            if node.lock_ref <= 0:
                raise ValueError("unlock without a matching lock")
            node.lock_ref -= 1
            node = node.parent

    # --- eviction -------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Drop least-recently-used unlocked leaves until num_tokens are freed (or nothing
        unlocked is left). Returns the tokens freed."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            self.total_tokens -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                yield node

    # --- sizes -----------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Nodes besides the root (the index's entries)."""
        count, stack = 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

    @property
    def evictable_tokens(self) -> int:
        total, stack = 0, list(self.root.children.values())
        while stack:
            node = stack.pop()
            total += len(node.key) if node.lock_ref == 0 else 0
            stack.extend(node.children.values())
        return total

    def sequences(self) -> list:
        """Every root-to-leaf path, as token tuples (for tests and pictures)."""
        out, stack = [], [(self.root, ())]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.key
            if not node.children and node is not self.root:
                out.append(path)
            stack.extend((c, path) for c in node.children.values())
        return sorted(out)


__all__ = ["RadixCache", "RadixNode"]
