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

import bisect
from array import array
from typing import Any, Callable, Sequence


def as_bytes(tokens: Sequence[int] | array) -> bytes:
    """Token ids as bytes (8 per token), so prefix comparisons run in C."""
    arr = tokens if isinstance(tokens, array) and tokens.typecode == "q" else array("q", tokens)
    return arr.tobytes()


def common_prefix(a: bytes, b: bytes) -> int:
    """Length in tokens of the longest common prefix of two token byte strings (binary search over
    ``startswith``: O(log n) memcmp calls; ``b``'s prefixes are memoryview slices, never copies,
    which halves the cost on 1,500-token sequences)."""
    lo, hi = 0, min(len(a), len(b)) // 8
    view = memoryview(b)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(view[:mid * 8]):
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


def prefix_aware_order(seqs: Sequence[bytes], keys: Sequence[Any], anchor: bytes | None = None,
                       lcp: Callable[[bytes, bytes], int] = common_prefix) -> list[int]:
    """Indices of ``seqs`` in admission order (see the module docstring). ``keys`` must be mutually
    comparable; ``anchor`` (optional) is the sequence admitted last, which the first pick continues;
    ``lcp``: :func:`common_prefix` or a cache of it (:class:`PrefixCache`)."""
    return ordered_walk(seqs, keys, anchor, lcp, with_shared=False)[0]


def ordered_walk(seqs: Sequence[bytes], keys: Sequence[Any], anchor: bytes | None = None,
                 lcp: Callable[[bytes, bytes], int] = common_prefix, *, with_shared: bool = True
                 ) -> tuple[list[int], list[int]]:
    """:func:`prefix_aware_order` and, for each placed sequence, the tokens it shares with the one
    placed before it (with ``anchor`` for the first; 0 without one), read off the trie (an empty
    list when not ``with_shared``)."""
    n = len(seqs)
    if n != len(keys):
        raise ValueError("seqs and keys must have the same length")
    if n == 0:
        return [], []
    by_seq = sorted(range(n), key=lambda i: (seqs[i], keys[i]))
    root = _Node(0)
    stack = [root]
    leaves: dict[int, _Node] = {}
    for j, i in enumerate(by_seq):
        leaf = _Node(len(seqs[i]) // 8, i)
        leaf.key = keys[i]
        leaves[i] = leaf
        stack[-1].children.append(leaf)
        if j == n - 1:
            break
        d = lcp(seqs[i], seqs[by_seq[j + 1]])  # shared with the next leaf
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
    first_shared = 0
    if anchor is None:
        start = leaves[min(range(n), key=lambda i: keys[i])]
    else:  # the greedy first pick: the longest prefix shared with the anchor, then the key
        ordered = [seqs[i] for i in by_seq]
        at = bisect.bisect_left(ordered, anchor)   # the longest prefix is shared with a neighbour
        first_shared = max(common_prefix(anchor, ordered[j]) for j in (at - 1, at) if 0 <= j < n)
        prefix = anchor[:first_shared * 8]
        lo = bisect.bisect_left(ordered, prefix)   # the sequences starting with it: a contiguous run
        hi, top = lo, n
        while hi < top:
            mid = (hi + top) // 2
            if ordered[mid].startswith(prefix):
                hi = mid + 1
            else:
                top = mid
        start = leaves[min(by_seq[lo:hi], key=lambda i: keys[i])]
    order: list[int] = []
    node: _Node | None = start
    while node is not None:  # climb to the nearest ancestor with unplaced leaves, place them
        if node.todo:
            _place(node, order)
        node = node.parent
    if not with_shared:
        return order, []
    shared = [first_shared]
    for a, b in zip(order, order[1:]):
        shared.append(_lca_depth(leaves[a], leaves[b]))
    return order, shared


def _lca_depth(a: _Node, b: _Node) -> int:
    """Tokens two leaves share: the depth of their lowest common ancestor in the trie."""
    up = set()
    node: _Node | None = a.parent
    while node is not None:
        up.add(id(node))
        node = node.parent
    node = b.parent
    while node is not None and id(node) not in up:
        node = node.parent
    return node.depth if node is not None else 0


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


class WalkMemo:
    """What :func:`family_order` computed per family, kept from one scheduling round to the next so
    that a round after a few arrivals or admissions recomputes only the families that changed.

    A family's shared prefix is a function of its members' sequences, and its members' walk a
    function of their sequences, their keys and the sequence placed before them, so a stored result
    is reused only for the same arguments (bytes objects compare by identity first: a request's
    cached sequence makes the lookup cheap): the order is the one a fresh computation gives.
    Entries live until a round passes without using them (:meth:`next_round`). ``hits`` also counts
    the walks a :class:`FamilyWalk` family reused from its own last walk."""

    def __init__(self):
        self._now: dict = {}
        self._before: dict = {}
        self.hits = self.misses = 0

    def next_round(self) -> None:
        """Start a round: what the last round did not use is dropped."""
        self._before, self._now = self._now, {}

    def get(self, key: Any, compute) -> Any:
        value = self._now.get(key, _MISSING)
        if value is _MISSING:
            value = self._before.pop(key, _MISSING)
            if value is _MISSING:
                self.misses += 1
                value = compute()
            else:
                self.hits += 1
            self._now[key] = value
        else:
            self.hits += 1
        return value


_MISSING = object()


class PrefixCache(WalkMemo):
    """:func:`common_prefix` remembered per pair of sequences from one round to the next (the same
    families' prefixes are compared again every round; ``bytes`` cache their hash, and a lookup of
    the same objects compares by identity), with :class:`WalkMemo`'s lifetime: pairs a round did not
    use go at the next :meth:`next_round`."""

    def __call__(self, a: bytes, b: bytes) -> int:
        return self.get((a, b), lambda: common_prefix(a, b))


def family_order(seqs: Sequence[bytes], keys: Sequence[Any], families: Sequence[Any],
                 anchor: bytes | None = None, memo: WalkMemo | None = None) -> tuple[list[int], list[int]]:
    """:func:`prefix_aware_order` with **families kept contiguous**: requests with the same family
    id (siblings: one search, depth and parent) are placed one after another, whatever the other
    requests in the queue (e.g. a deeper request of an MCTS tree that shares more with one sibling
    than the siblings share with each other would otherwise be placed between them).

    Families are ordered greedily by their shared prefixes (the longest common prefix of their
    members, ties to the smallest key below), starting from the family that shares the most with
    ``anchor``; within a family, members are ordered greedily from the request placed before.
    Returns the order and, for each placed request, the tokens it shares with the sequence placed
    before it (the anchor for the first; 0 without one). ``memo`` (kept by the caller across rounds)
    reuses each family's walk when its arguments are the same (:class:`WalkMemo`)."""
    n = len(seqs)
    if not (n == len(keys) == len(families)):
        raise ValueError("seqs, keys and families must have the same length")
    walk = FamilyWalk(memo)
    for i in range(n):
        walk.add(i, seqs[i], keys[i], families[i])
    return walk.order(anchor)


class _Family:
    """One family of a :class:`FamilyWalk`: its members in key order, its shared prefix, and its last
    walk (reused while the members and the sequence placed before them are the same)."""

    __slots__ = ("keys", "seqs", "items", "_prefix", "_walk_prev", "_walk")

    def __init__(self):
        self.keys: list = []
        self.seqs: list[bytes] = []
        self.items: list = []
        self._prefix: bytes | None = None
        self._walk_prev: Any = _MISSING
        self._walk: tuple[list, list[int], bytes] | None = None

    def changed(self) -> None:
        self._prefix, self._walk_prev, self._walk = None, _MISSING, None

    def prefix(self) -> bytes:
        if self._prefix is None:   # the longest prefix of all members: that of the smallest and the largest
            self._prefix = self.seqs[0] if len(self.seqs) == 1 else _shared_prefix(self.seqs)
        return self._prefix

    def walk(self, prev: bytes | None, memo: WalkMemo | None) -> tuple[list, list[int], bytes]:
        """The members in walk order from ``prev``, the tokens each shares with the one before, and
        the last one's sequence."""
        if self._walk is not None and (prev is self._walk_prev or prev == self._walk_prev):
            if memo is not None:
                memo.hits += 1
            return self._walk
        if len(self.items) == 1:
            walk = (self.items, [common_prefix(prev, self.seqs[0]) if prev is not None else 0], self.seqs[0])
        else:
            seqs, keys = tuple(self.seqs), tuple(self.keys)
            compute = lambda: ordered_walk(seqs, keys, prev)   # noqa: E731
            local, shared = memo.get(("walk", seqs, keys, prev), compute) if memo is not None else compute()
            walk = ([self.items[j] for j in local], shared, seqs[local[-1]])
        self._walk_prev, self._walk = prev, walk
        return walk


class FamilyWalk:
    """:func:`family_order`'s input kept from one scheduling round to the next: items are added and
    removed as requests arrive and leave, and :meth:`order` recomputes only the families that changed
    (their prefix and walk) and the order of the families' prefixes. The order is the one
    :func:`family_order` gives on the same members (it is computed by this class)."""

    def __init__(self, memo: WalkMemo | None = None):
        self._fams: dict[Any, _Family] = {}
        self.memo = memo
        self._size = 0
        self._lcp = PrefixCache()   # the families' prefixes, compared again every round

    def __len__(self) -> int:
        return self._size

    def add(self, item: Any, seq: bytes, key: Any, family: Any) -> None:
        fam = self._fams.get(family)
        if fam is None:
            fam = self._fams[family] = _Family()
        at = bisect.bisect_right(fam.keys, key)
        fam.keys.insert(at, key)
        fam.seqs.insert(at, seq)
        fam.items.insert(at, item)
        fam.changed()
        self._size += 1

    def remove(self, item: Any, key: Any, family: Any) -> None:
        """Remove ``item`` (added with this ``key`` and ``family``; found by identity among equal keys)."""
        fam = self._fams[family]
        at = bisect.bisect_left(fam.keys, key)
        while fam.items[at] is not item:
            at += 1
        del fam.keys[at], fam.seqs[at], fam.items[at]
        if fam.items:
            fam.changed()
        else:
            del self._fams[family]
        self._size -= 1

    def order(self, anchor: bytes | None = None) -> tuple[list, list[int]]:
        """The items in :func:`family_order`'s order from ``anchor``, and the tokens each shares with
        the one placed before it (the anchor for the first; 0 without one)."""
        fams = list(self._fams.values())
        self._lcp.next_round()
        items: list = []
        shared: list[int] = []
        prev = anchor
        for f in prefix_aware_order([f.prefix() for f in fams], [f.keys[0] for f in fams], anchor, self._lcp):
            placed, placed_shared, prev = fams[f].walk(prev, self.memo)
            items.extend(placed)
            shared.extend(placed_shared)
        return items, shared


def _shared_prefix(seqs: Sequence[bytes]) -> bytes:
    """The longest prefix of all of ``seqs``: that of the smallest and the largest."""
    lo, hi = min(seqs), max(seqs)
    return lo[:common_prefix(lo, hi) * 8]


__all__ = ["FamilyWalk", "PrefixCache", "WalkMemo", "as_bytes", "common_prefix", "family_order", "ordered_walk", "prefix_aware_order"]
