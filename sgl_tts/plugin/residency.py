"""Locality under memory pressure (issue 32; seed 002's locality-aware beam grouping on SGLang's radix
cache): keep resident what the waiting queue needs next, and admit first what is resident.

SGLang's radix cache evicts least-recently-used leaves. In a step-wise search that is the wrong rule
under pressure: when a step starts, every waiting family's parent path was last touched at the end of
the previous step, so it is *older* than the outputs of the families that already ran this step, and
LRU throws away exactly the prefixes still needed (a family then recomputes its whole path), while
the outputs of pruned beams and finished families stay. The ``locality`` policy (``--tts-policy
locality``: ``prefix-aware`` plus what follows) changes two things, only while the KV pool is under
pressure (less than :data:`PRESSURE_FREE` of it free):

1. **Eviction by next use** (:class:`QueueAwareEviction`, the tree's eviction strategy): a radix node
   on the cached path of a waiting request is evicted only after every node no waiting request needs
   (those go in SGLang's own order, LRU by default), and among the needed ones the node needed last
   in the waiting order goes first: Belady's rule with the queue's order as the oracle of next use.
   A family's shared prefix thus stays resident until its children are admitted (then SGLang's own
   lock holds it while they run).
2. **Resident families first**: the prefix-aware walk is split, stably, into families whose input is
   in the cache (fewer than ``dedup_tokens`` tokens to compute) and the others, resident ones first:
   a family that must recompute its path anyway goes after those that need nothing recomputed, so
   its prefill does not evict a resident family's prefix before that family runs.

Nothing is locked: SGLang's admission budget still counts every marked node as evictable, so a
request that needs the room gets it (the farthest-needed prefix goes first) and nothing can
deadlock. Neither rule changes what a request generates, only which KV is kept and the admission
order. Without pressure the order is ``prefix-aware``'s, and no node is marked (no cost).
"""

from __future__ import annotations

from array import array
from typing import Any, Sequence

NEED = "_sgl_tts_need"      # a radix node's (epoch, rank of the first waiting request that needs it)
PRESSURE_FREE = 0.25        # under pressure: less than this share of the KV pool is free


class QueueAwareEviction:
    """An SGLang eviction strategy (``get_priority(node)``, smaller evicted first) that wraps the
    tree's own: nodes marked in the current epoch (:func:`mark_needed`) rank after every unmarked
    node, the one needed last first."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.epoch = 0

    def get_priority(self, node: Any) -> tuple:
        need = getattr(node, NEED, None)
        if need is not None and need[0] == self.epoch:
            return (1, -need[1])
        return (0, self.inner.get_priority(node))


def install(tree: Any) -> QueueAwareEviction | None:
    """Wrap ``tree``'s eviction strategy (once); ``None`` for a cache without one (chunk caches,
    a disabled radix cache), where the policy then only reorders."""
    strategy = getattr(tree, "eviction_strategy", None)
    if strategy is None or getattr(tree, "disable", False) or not hasattr(tree, "match_prefix"):
        return None
    if not isinstance(strategy, QueueAwareEviction):
        strategy = tree.eviction_strategy = QueueAwareEviction(strategy)
    return strategy


EVICTIONS = "sgl_tts_evictions"   # on a tree cache: how many times it let go of cached KV so far


def count_evictions(tree: Any) -> None:
    """Count what ``tree`` lets go of (once per tree): each ``evict`` call that freed KV and each
    node its ``_delete_leaf`` removes (SGLang's session release frees nodes that way, outside
    ``evict``). The instance's methods wrap the class's, hooks included. Between two equal counts
    the cache only gained content (insertions and node splits keep every cached token), so a prefix
    that was wholly cached still is: the deferral check keeps such matches across a cache change
    instead of matching every family again."""
    if getattr(tree, EVICTIONS, None) is not None or not callable(getattr(tree, "evict", None)):
        return
    setattr(tree, EVICTIONS, 0)

    def bump() -> None:
        setattr(tree, EVICTIONS, getattr(tree, EVICTIONS) + 1)

    evict = tree.evict

    def counting_evict(*args: Any, **kwargs: Any) -> Any:
        result = evict(*args, **kwargs)
        if int(getattr(result, "num_tokens_evicted", 1) or 0):   # a result without the field: count it
            bump()
        return result

    tree.evict = counting_evict
    delete_leaf = getattr(tree, "_delete_leaf", None)
    if callable(delete_leaf):
        def counting_delete_leaf(*args: Any, **kwargs: Any) -> Any:
            bump()
            return delete_leaf(*args, **kwargs)

        tree._delete_leaf = counting_delete_leaf


def under_pressure(tree: Any) -> bool:
    """Less than :data:`PRESSURE_FREE` of the tree's KV pool is free (cheap: two reads)."""
    allocator = getattr(tree, "token_to_kv_pool_allocator", None)
    size = getattr(allocator, "size", 0) if allocator is not None else 0
    if not size:
        return False
    return allocator.available_size() < PRESSURE_FREE * size


def match(tree: Any, seq: bytes, extra_key: Any = None) -> tuple[Any, int]:
    """The deepest radix node on ``seq``'s cached path and the tokens cached (SGLang's own match;
    it refreshes the path's access time and may split a node, as SGLang's ``lpm`` does each round)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    ids = array("q")
    ids.frombytes(seq)
    result = tree.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=ids, extra_key=extra_key)))
    return result.last_device_node, len(result.device_indices)


def mark_needed(strategy: QueueAwareEviction, root: Any, nodes: Sequence[Any]) -> int:
    """Start an epoch and mark each node of ``nodes`` (in the order they are needed: ``nodes[i]`` is
    the deepest cached node of the i-th waiting request, ``None`` for nothing cached) and its
    ancestors with the rank of the first request that needs it. Returns the nodes marked."""
    strategy.epoch += 1
    epoch = strategy.epoch
    marked = 0
    for rank, node in enumerate(nodes):
        while node is not None and node is not root:
            need = getattr(node, NEED, None)
            if need is not None and need[0] == epoch:
                break   # marked by an earlier request, and so are its ancestors
            setattr(node, NEED, (epoch, rank))
            marked += 1
            node = node.parent
    return marked


def resident_first(families: Sequence[Any], uncached: Sequence[int], threshold: int) -> list[int]:
    """Positions of a walk reordered so that the families (runs of equal ``families`` entries) whose
    every member has fewer than ``threshold`` uncached tokens come first, each part in walk order."""
    runs: list[tuple[int, int]] = []
    start = 0
    for pos in range(1, len(families) + 1):
        if pos == len(families) or families[pos] != families[start]:
            runs.append((start, pos))
            start = pos
    resident: list[int] = []
    others: list[int] = []
    for lo, hi in runs:
        part = resident if all(uncached[p] < threshold for p in range(lo, hi)) else others
        part.extend(range(lo, hi))
    return resident + others


__all__ = ["EVICTIONS", "NEED", "PRESSURE_FREE", "QueueAwareEviction", "count_evictions", "install", "mark_needed", "match",
           "resident_first", "under_pressure"]
