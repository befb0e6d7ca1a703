"""Dynamic prefix-aware ordering (FlashTTS §4.2) as a pure function of token sequences and keys.

Given the waiting requests' token sequences and a stable key per request (search group, depth, parent
beam, beam), :func:`prefix_aware_order` returns an admission order that

- keeps the **greedy invariant**: each next request shares the longest prefix possible with the one
  before it (the first, with ``anchor``: the last admitted sequence) among those not yet placed;
- breaks every tie by the key, so siblings of one parent stay together and parents keep the order
  their keys give them across iterations (a retracted request comes back to the same place);
- works for any queue length: sequences are compared as bytes (C ``memcmp``), sorted once, and the
  order is a walk of the trie their longest common prefixes form (O(n log n) comparisons).

The walk: leaves are the sequences; an internal node is a longest common prefix of some of them, its
children ordered by the smallest key below each. From the start leaf the walk climbs to the nearest
ancestor that still has unplaced leaves and places them depth first. The next leaf therefore always
shares the deepest prefix still available: the greedy invariant, by construction.
"""

from __future__ import annotations

from array import array
from typing import Any, Sequence


def as_bytes(tokens: Sequence[int] | array) -> bytes:
    """Token ids as bytes (8 per token), so prefix comparisons run in C."""
    arr = tokens if isinstance(tokens, array) and tokens.typecode == "q" else array("q", tokens)
    return arr.tobytes()


def common_prefix(a: bytes, b: bytes) -> int:
    """Length in tokens of the longest common prefix of two token byte strings (binary search over
    slice equality: O(log n) memcmp calls)."""
    lo, hi = 0, min(len(a), len(b)) // 8
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid * 8] == b[:mid * 8]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Node:
    __slots__ = ("depth", "children", "leaf", "key", "parent", "todo")

    def __init__(self, depth: int, leaf: int = -1):
        self.depth, self.leaf = depth, leaf
        self.children: list[_Node] = []
        self.key: Any = None
        self.parent: _Node | None = None
        self.todo = 0


def prefix_aware_order(seqs: Sequence[bytes], keys: Sequence[Any], anchor: bytes | None = None
                       ) -> list[int]:
    """Indices of ``seqs`` in admission order (see the module docstring). ``keys`` must be mutually
    comparable; ``anchor`` (optional) is the sequence admitted last, which the first pick continues."""
    n = len(seqs)
    if n != len(keys):
        raise ValueError("seqs and keys must have the same length")
    if n == 0:
        return []
    by_seq = sorted(range(n), key=lambda i: (seqs[i], keys[i]))
    root = _Node(0)
    stack = [root]
    leaves: dict[int, _Node] = {}
    for j, i in enumerate(by_seq):
        leaf = _Node(-1, i)
        leaf.key = keys[i]
        leaves[i] = leaf
        stack[-1].children.append(leaf)
        if j == n - 1:
            break
        d = common_prefix(seqs[i], seqs[by_seq[j + 1]])  # shared with the next leaf
        last = leaf
        while stack[-1].depth > d:      # close the intervals deeper than that
            last = stack.pop()
        if stack[-1].depth < d:         # open one at depth d around the last child
            node = _Node(d)
            stack[-1].children.pop()
            node.children.append(last)
            stack[-1].children.append(node)
            stack.append(node)
    _finish(root)
    if anchor is None:
        start = leaves[min(range(n), key=lambda i: keys[i])]
    else:  # the greedy first pick: the longest prefix shared with the anchor, then the key
        start = leaves[min(range(n), key=lambda i: (-common_prefix(seqs[i], anchor), keys[i]))]
    order: list[int] = []
    node: _Node | None = start
    while node is not None:  # climb to the nearest ancestor with unplaced leaves, place them
        if node.todo:
            _place(node, order)
        node = node.parent
    return order


def _finish(root: _Node) -> None:
    """Parents, subtree minimum keys and unplaced-leaf counts; children sorted by minimum key."""
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if node.leaf >= 0:
            node.todo = 1
            continue
        if not done:
            stack.append((node, True))
            for c in node.children:
                c.parent = node
                stack.append((c, False))
            continue
        node.children.sort(key=lambda c: c.key)
        node.key = node.children[0].key
        node.todo = sum(c.todo for c in node.children)


def _place(node: _Node, order: list[int]) -> None:
    """Append every unplaced leaf below ``node``, depth first with children by key, and update
    the unplaced counts above it."""
    count = 0
    stack = [node]
    while stack:
        cur = stack.pop()
        if cur.todo == 0:
            continue
        cur.todo = 0
        if cur.leaf >= 0:
            order.append(cur.leaf)
            count += 1
        else:
            stack.extend(reversed(cur.children))
    up = node.parent
    while up is not None:
        up.todo -= count
        up = up.parent


__all__ = ["as_bytes", "common_prefix", "prefix_aware_order"]
