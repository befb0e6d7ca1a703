"""Locality under memory pressure (issue 32; seed 002's locality-aware beam grouping on SGLang's radix
cache): keep resident what the waiting queue needs next, and admit first what is resident.

SGLang's radix cache evicts least-recently-used leaves. In a step-wise search that is the wrong rule
under pressure: when a step starts, every waiting family's parent path was last touched at the end of
the previous step, so it is *older* than the outputs of the families that already ran this step, and
LRU throws away exactly the prefixes still needed (a family then recomputes its whole path), while
the outputs of pruned beams and finished families stay. The ``locality`` policy (``--tts-policy
locality``: ``prefix-aware`` plus what follows) changes two things (a third with ``--tts-locality-rules
families``), only while the KV pool is under pressure (less than :data:`PRESSURE_FREE` of it free):

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
3. **Whole families, without evicting a later family's prefix** (``--tts-locality-rules families``,
   :class:`Admission`): while anything runs, a family is admitted only when all of it fits in the KV
   that can be had without evicting a node marked for it or a request after it (its own marked path
   is locked once it is admitted), and no later member of it is admitted when it alone would need
   such a node. "Fits" counts what each request may write, as SGLang's budget does, except that the
   running requests reserve all their remaining tokens, not SGLang's expected share of them (what
   they write beyond it would evict a waiting prefix as they decode). Otherwise admission stops for
   the round (SGLang's "no token": it tries again when a running request ends and frees or unlocks
   KV). With nothing running and nothing admitted yet the request goes to SGLang as before, so
   nothing can wait forever; a family larger than the pool less the marked nodes is held to the
   per-request check only (it could never fit whole). With this rule the three act also while the
   free KV less what the running and waiting requests may still write is under
   :data:`PRESSURE_FREE` of the pool (:func:`outgrown`): admission decides what is evicted later.

Nothing is locked: SGLang's admission budget still counts every marked node as evictable, so a
request that needs the room gets it (the farthest-needed prefix goes first) and nothing can
deadlock. Neither rule changes what a request generates, only which KV is kept and the admission
order. Without pressure the order is ``prefix-aware``'s, and no node is marked (no cost).
"""

from __future__ import annotations

import dataclasses
from array import array
from typing import Any, Sequence

from sgl_tts.plugin import internals

NEED = "_sgl_tts_need"      # a radix node's (epoch, rank of the first waiting request that needs it)
PRESSURE_FREE = 0.25        # under pressure: less than this share of the KV pool is free


class QueueAwareEviction:
    """An SGLang eviction strategy (``get_priority(node)``, smaller evicted first) that wraps the
    tree's own: nodes marked in the current epoch (:func:`mark_needed`) rank after every unmarked
    node, the one needed last first."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.epoch = 0
        self.marks: list = []   # the last epoch's (rank, node) pairs, in rank order

    def get_priority(self, node: Any) -> tuple:
        need = getattr(node, NEED, None)
        if need is not None and need[0] == self.epoch:
            return (1, -need[1])
        return (0, self.inner.get_priority(node))


def install(tree: Any) -> QueueAwareEviction | None:
    """Wrap ``tree``'s eviction strategy (once); ``None`` for a cache without one (chunk caches,
    a disabled radix cache), where the policy then only reorders. A radix tree without its
    ``eviction_strategy`` (an SGLang that renamed it) is refused
    (:class:`~sgl_tts.plugin.internals.MissingInternals`), not run without rule 1."""
    internals.check_object(tree, internals.LOCALITY)
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
    instead of matching every family again. A tree without them (an SGLang that renamed them: the
    count would stand still while the cache lets go of KV) is refused
    (:class:`~sgl_tts.plugin.internals.MissingInternals`); a cache that is no radix tree (a chunk
    cache) has no ``_delete_leaf`` to count, and needs none."""
    if getattr(tree, EVICTIONS, None) is not None:
        return
    internals.check_object(tree, internals.POLICY)
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
    delete_leaf = getattr(tree, "_delete_leaf", None)   # required on a radix tree (checked above)
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


def outgrown(tree: Any, demand: int) -> bool:
    """Rule 3's pressure: the tree's free KV less ``demand`` (the new tokens the running and waiting
    requests may still write) is under :data:`PRESSURE_FREE` of the pool. A queue that will fill the
    pool is pressure before the pool is full: admission then decides what gets evicted later."""
    allocator = getattr(tree, "token_to_kv_pool_allocator", None)
    size = getattr(allocator, "size", 0) if allocator is not None else 0
    return bool(size) and allocator.available_size() - demand < PRESSURE_FREE * size


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
    marks = strategy.marks = []
    for rank, node in enumerate(nodes):
        while node is not None and node is not root:
            need = getattr(node, NEED, None)
            if need is not None and need[0] == epoch:
                break   # marked by an earlier request, and so are its ancestors
            setattr(node, NEED, (epoch, rank))
            marks.append((rank, node))
            node = node.parent
    return len(marks)


def protected_suffix(marks: Sequence[tuple[int, Any]], length: int) -> list[int]:
    """``out[r]``: the tokens of the nodes of ``marks`` (``(rank, node)`` pairs, as :func:`mark_needed`
    records them) first needed at rank ``r`` or later that SGLang could evict now (unlocked), for
    ``r`` in ``0..length``. A marked node that a later match split (SGLang's match of a request's
    input ends one token short, and splits the node there) has lost the front of its tokens to a new
    unmarked parent: those count with the node's rank."""
    out = [0] * (length + 1)
    for rank, node in marks:   # (ranks are positions of the order: below length)
        while node is not None and node.parent is not None:
            if node.lock_ref == 0 and node.key is not None:
                out[rank] += len(node.key)
            node = node.parent
            if getattr(node, NEED, None) is not None:
                break   # the next marked ancestor (a split's new parent carries no mark)
    for r in range(length - 1, -1, -1):
        out[r] += out[r + 1]
    return out


@dataclasses.dataclass
class Admission:
    """Rule 3's table for one order of the waiting queue (positions in the marking order).

    Attributes:
        at: ``id(request)`` -> (its position, its family's first position, the KV tokens the
            family's members after the first need: their uncached tokens less what each shares
            with the one before it, plus SGLang's reservation for their new tokens and a page).
        marks: the ``(rank, node)`` pairs the order marked (:func:`mark_needed`).
        length: positions in the order.
        pool: the KV pool's size in tokens.
    """

    at: dict[int, tuple[int, int, int]]
    marks: list
    length: int
    pool: int
    protected: list[int] | None = None   # protected_suffix(marks, length), once per round

    def protected_from(self, pos: int) -> int:
        """Evictable tokens first needed by the request at position ``pos`` or a later one (those of
        earlier positions are locked once they are admitted; the request's own are locked when it is)."""
        if self.protected is None:
            self.protected = protected_suffix(self.marks, self.length)
        return self.protected[min(pos, self.length)]

    def need(self, req: Any, total: int) -> tuple[int, int] | None:
        """What admitting ``req`` must find without evicting a cached prefix that it or a request after
        it needs: ``total`` (SGLang's own estimate for it: uncached tokens, reserved new tokens, a
        page), plus the rest of its family when it is the family's first waiting member and the whole
        family could fit in the pool at all; and those protected tokens. ``None``: not in this order."""
        entry = self.at.get(id(req))
        if entry is None:
            return None
        pos, lo, rest = entry
        protect = self.protected_from(pos)
        if pos == lo and rest and total + rest < self.pool - protect:
            total += rest
        return total, protect

    def holds_back(self, adder: Any, req: Any) -> bool:
        """Whether ``req``, which SGLang's ``PrefillAdder`` is about to admit (its prefix just matched),
        or, as its family's first waiting member, its whole family, needs KV that only evicting a
        cached prefix marked for it or a later request would free, while something runs or was
        admitted this round."""
        if not adder.can_run_list and not getattr(adder.running_batch, "reqs", None):
            return False   # nothing would free KV for it: SGLang decides
        total = len(req.full_untruncated_fill_ids) - len(req.prefix_indices) + new_tokens((req,), adder.page_size)
        need = self.need(req, total)
        if need is None:
            return False
        # SGLang's budget reserves only new_token_ratio of the running requests' remaining tokens (it
        # expects early stops); what they may still write beyond that would evict a waiting prefix
        # as they decode, so here they reserve all of it (once per round: the running batch is fixed)
        unreserved = getattr(adder, UNRESERVED, None)
        if unreserved is None:
            unreserved = new_tokens(getattr(adder.running_batch, "reqs", None) or (), page=0) * (
                1.0 - float(getattr(adder, "new_token_ratio", 1.0) or 0.0))
            setattr(adder, UNRESERVED, unreserved)
        return need[0] >= adder.rem_total_tokens - unreserved - need[1]


UNRESERVED = "_sgl_tts_unreserved"   # on a PrefillAdder: the running tokens its budget leaves out


def new_tokens(reqs: Sequence[Any], page: int = 1) -> int:
    """The new tokens ``reqs`` may still write, each capped as SGLang caps it, plus ``page`` each."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    return sum(min(max(r.sampling_params.max_new_tokens - len(r.output_ids), 0), CLIP_MAX_NEW_TOKENS) + page
               for r in reqs)


def admission_table(tree: Any, marks: list, reqs: Sequence[Any], infos: Sequence[Any], shared_prev: Sequence[int],
                    uncached: Sequence[int]) -> "Admission":
    """Rule 3's :class:`Admission` for an order just marked (``marks``): its requests, their infos
    (``seq``: token bytes, ``family``), the tokens each shares with the one before and its uncached
    tokens."""
    page = max(1, int(getattr(tree, "page_size", 1) or 1))
    news = [new_tokens((r,), page) for r in reqs]
    lengths = [len(f.seq) // 8 for f in infos]
    families = [f.family for f in infos]
    rest = family_rest(families, lengths, uncached, shared_prev, news)
    at = {id(reqs[i]): (i, lo, rest[lo]) for lo, hi in family_runs(families) for i in range(lo, hi)}
    pool = int(getattr(tree.token_to_kv_pool_allocator, "size", 0) or 0)
    return Admission(at, marks, len(families), pool)


def family_rest(families: Sequence[Any], lengths: Sequence[int], uncached: Sequence[int],
                shared_prev: Sequence[int], new_tokens: Sequence[int]) -> list[int]:
    """For each position of an order whose families are runs of equal ``families`` entries: at a
    family's first position, the KV tokens its later members need (each member's uncached tokens
    less those it shares with the member before it, which that one's prefill caches, at least one,
    plus ``new_tokens``, its reservation); 0 elsewhere."""
    rest = [0] * len(families)
    for lo, hi in family_runs(families):
        for i in range(lo + 1, hi):
            cached = lengths[i] - uncached[i]
            # (at least one token: SGLang computes a request's last input token even when cached)
            rest[lo] += max(1, uncached[i] - max(0, min(shared_prev[i], lengths[i]) - cached)) + new_tokens[i]
    return rest


def family_runs(families: Sequence[Any]) -> list[tuple[int, int]]:
    """The ``(first, end)`` positions of each run of equal ``families`` entries (a family in an order)."""
    runs: list[tuple[int, int]] = []
    start = 0
    for pos in range(1, len(families) + 1):
        if pos == len(families) or families[pos] != families[start]:
            runs.append((start, pos))
            start = pos
    return runs


def resident_first(families: Sequence[Any], uncached: Sequence[int], threshold: int) -> list[int]:
    """Positions of a walk reordered so that the families (runs of equal ``families`` entries) whose
    every member has fewer than ``threshold`` uncached tokens come first, each part in walk order."""
    resident: list[int] = []
    others: list[int] = []
    for lo, hi in family_runs(families):
        part = resident if all(uncached[p] < threshold for p in range(lo, hi)) else others
        part.extend(range(lo, hi))
    return resident + others


__all__ = ["EVICTIONS", "NEED", "PRESSURE_FREE", "Admission", "QueueAwareEviction", "admission_table",
           "count_evictions", "family_rest", "family_runs", "install", "mark_needed", "match", "new_tokens", "outgrown",
           "protected_suffix", "resident_first", "under_pressure"]
