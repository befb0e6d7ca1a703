"""The prefix-aware waiting-queue policy on SGLang's own scheduler objects.

:class:`TTSPolicyState` is attached to a scheduler's ``SchedulePolicy`` (``policy.sgl_tts``); the
plugin's hook on ``SchedulePolicy.calc_priority`` then calls :meth:`TTSPolicyState.order` instead of
SGLang's policy. The order, for any queue length (SGLang's ``lpm`` falls back to FCFS above 128
waiting requests):

1. **aged** requests first: a normal or boosted request that has waited ``max_wait`` seconds or
   more goes before everything else, oldest first (so no request waits much longer than
   ``max_wait`` plus the time FCFS would make it wait: see docs/SCHEDULER_PLUGIN.md);
2. then buckets: the request class (boosted, normal, speculative: speculative requests thus only
   get slots no normal request can use), and within a class SGLang's ``priority`` when the server
   runs ``--enable-priority-scheduling`` (its sign convention: ``--schedule-low-priority-values-first``),
   and with ``--tts-admission search`` the search (first seen first: an older search's requests
   before a newer one's, aged requests too);
3. within a bucket, :func:`~sgl_tts.plugin.scheduling.ordering.family_order`: siblings (one search, depth and
   parent) contiguous, families and siblings in the greedy longest-shared-prefix order with the key
   (search group in first-seen order, depth, parent beam, beam), anchored on the last request of the
   running batch; each bucket continues from the last request of the one before;
4. a normal or boosted request that shares at least ``dedup_tokens`` uncached tokens with the
   request placed before it, or (in the first round after it formed) with a request of the last
   prefill batch (whose prefill may not be in the radix cache yet: SGLang's overlap scheduler forms
   round t+1 before round t's results are processed), is **deferred**: placed after the others (before speculative ones), and the plugin's
   ``PrefillAdder`` hook stops admission at the first deferred request, so one request prefills the
   shared prefix and the others reuse it from the radix cache next round.

Cost: each request's tag, key and token bytes are cached on the request (until its output grows
or :func:`set_class` changes it) and read back in C; the order is redone only when the queue
changed, and then incrementally: the buckets keep their families (:class:`~sgl_tts.plugin.scheduling.ordering.
FamilyWalk`) from round to round, so arrivals and admissions touch only their families and the order
of the families' prefixes. The deferral check matches the radix cache once per run of requests
sharing a prefix, not at all while the cache is unchanged, and after insertions only for the
requests it deferred. ``docs/benchmarks/plugin_costs.md`` has the figures.

Untagged requests (no sgl-tts metadata) are each their own family and group, in arrival order.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import operator
import time
import weakref
from typing import AbstractSet, Any, Callable, Sequence

from sgl_tts.plugin.scheduling import residency
from sgl_tts.plugin.scheduling.ordering import FamilyWalk, WalkMemo, as_bytes, common_prefix
from sgl_tts.plugin.settings import TTSSettings
from sgl_tts.protocol import SearchTag

CLASS_RANK = {"boosted": 0, "normal": 1, "speculative": 2}
SPECULATIVE = CLASS_RANK["speculative"]
DEFERRED = "_sgl_tts_deferred"   # attribute set on a Req deferred this round
INFO = "_sgl_tts_info"           # a Req's cached RequestInfo
SINCE = "_sgl_tts_since"         # (output length, time) a Req started waiting, for aging
MAX_GROUPS = 100_000             # first-seen ranks kept (oldest forgotten first)

# C-level getters: a round over thousands of waiting requests maps these instead of looping in Python
_SERIAL = operator.attrgetter("serial")
_SINCE_OF = operator.attrgetter("since")
_INFO_OF, _REQ_OF = operator.itemgetter(0), operator.itemgetter(1)


def tag_of(req: Any) -> SearchTag | None:
    """The sgl-tts search tag of an SGLang ``Req``: from ``sampling_params.custom_params``, else from
    its rid (:meth:`SearchTag.request_id`; a request that came through sglang-router, which drops
    ``custom_params``)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    try:
        if isinstance(params, dict) and "tts_group" in params:
            return SearchTag.from_custom_params(params)
        return SearchTag.from_rid(getattr(req, "rid", None))
    except Exception:   # e.g. {"tts_depth": Infinity} from a client: untagged, never a scheduler crash
        return None


def request_class(req: Any) -> str:
    tag = tag_of(req)
    return tag.cls if tag is not None else "normal"


def tokens_of(req: Any) -> bytes:
    return as_bytes(req.origin_input_ids) + as_bytes(req.output_ids)


@dataclasses.dataclass(slots=True)
class RequestInfo:
    """What the order needs of one waiting request, computed once per request and output length."""

    serial: int          # unique per (request, output length, class change): the queue's identity
    out_len: int
    rank: int            # class rank (CLASS_RANK)
    key: tuple           # (group rank, depth, parent, beam, rid)
    family: tuple        # siblings share it
    seq: bytes           # prompt + output so far, 8 bytes per token
    since: float         # when the policy first saw it waiting (aging)


@dataclasses.dataclass
class _Plan:
    """The last computed order, reused while the queue and the anchor's first pick are unchanged."""

    sig: tuple                   # serials of the queue as written back + aged serials
    reqs: list                   # the walk (aged first, then the buckets), before deferral
    infos: list
    shared_prev: list[int]       # tokens shared with the request before in the walk
    first_deferrable: int        # walk positions before it are aged (never deferred)
    anchor_rid: Any = None
    anchor_len: int = 0
    anchor_best: int = 0         # the longest prefix any waiting request shares with the anchor
    segments: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # the buckets' walk ranges
    cand_version: int = -2       # the deferral candidates below are for this last-prefill batch (-1: none)
    cand_pos: list[int] = dataclasses.field(default_factory=list)    # positions the check looks at
    cand_keys: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # (serial, tokens shared)


_NO_INFO = RequestInfo(-1, -1, 0, (), (), b"", float("inf"))   # read where a request has none yet


def tree_fingerprint(tree: Any) -> Any:
    """Changes whenever the radix cache's content can have changed: SGLang's ``TreeNode`` counter
    grows with every node created (insertions, splits, a reset) and the cached size shrinks with
    every eviction. ``None`` (never equal) for a cache without these fields."""
    root = getattr(tree, "root_node", None)
    counter = getattr(type(root), "counter", None)
    if counter is None or not hasattr(tree, "evictable_size_"):
        return object()
    return (counter, tree.evictable_size_ + getattr(tree, "protected_size_", 0), id(root))


class SortedSeqs:
    """The waiting requests' sequences in sorted order, kept from one re-sort to the next: a round
    after a few arrivals and admissions inserts and removes those (bisection) instead of sorting the
    whole queue again."""

    def __init__(self):
        self.seqs: list[bytes] = []
        self._serials: dict[int, bytes] = {}

    def update(self, infos: Sequence[RequestInfo], serials: AbstractSet[int]) -> list[bytes]:
        """The sorted sequences of ``infos``, whose serials are ``serials`` (the list is kept: do not
        change it)."""
        known = self._serials
        gone = known.keys() - serials
        new = serials - known.keys()
        if len(gone) + len(new) > len(serials) // 4:   # most of it changed: sorting is cheaper
            self._serials = known = {f.serial: f.seq for f in infos}
            self.seqs = sorted(known.values())
            return self.seqs
        for serial in gone:   # (an equal sequence of another request is as good: the content is what counts)
            del self.seqs[bisect.bisect_left(self.seqs, known.pop(serial))]
        if new:
            for f in infos:
                if f.serial in new:
                    known[f.serial] = f.seq
                    bisect.insort(self.seqs, f.seq)
        return self.seqs


class TTSPolicyState:
    """Per-scheduler state of the prefix-aware policy: settings, group ranks, the cached plan and
    the last order's statistics."""

    def __init__(self, settings: TTSSettings, *, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.clock = clock
        self._group_rank: dict[str, int] = {}
        self._counter = itertools.count()
        self._serials = itertools.count()
        self._plan: _Plan | None = None
        self.last_prefill: list[bytes] = []   # sorted token bytes of the last prefill batch
        self.prefill_version = 0
        self._prefill_fresh = False           # no order() since that batch formed
        self.last_deferred = 0
        self.last_queue_len = 0
        self.last_aged = 0
        self.rounds = 0      # order() calls
        self.sorts = 0       # of which re-sorted the queue
        # carried from one re-sort to the next, so that a round after a few arrivals or admissions
        # recomputes only what changed (the order is the one a fresh state computes)
        self.walks = WalkMemo()                    # each family's walk
        self._buckets: dict[tuple, FamilyWalk] = {}   # (class rank, priority) -> its requests' families
        self._members: dict[int, tuple[tuple, tuple]] = {}   # serial -> (bucket, (info, request))
        self._bucket_sign: Any = None              # the priority sign the buckets were filled with
        self._deferred_now: list = []              # requests whose DEFERRED flag is set
        # the last round's requests: id() -> their info, and the requests themselves (held, so no
        # other request can take one of those ids while it is a key); see _infos
        self._known: dict[int, RequestInfo] = {}
        self._held: list = []
        self._sorted = SortedSeqs()                # the waiting sequences, sorted
        self._matched: dict[tuple[int, int], int] = {}   # (request serial, prefix length) -> cached tokens,
        self._matched_deferred: dict[tuple[int, int], int] = {}   # split by the decision they gave
        self._matched_fp: Any = None               # the radix cache's fingerprint they were matched on
        self._matched_evictions: Any = None        # and its eviction count (residency.count_evictions)
        # policy "locality" (sgl_tts.plugin.scheduling.residency), set by enable(): the tree's eviction strategy
        # (rule 1, eviction by next use) and whether resident families go first (rule 2)
        self.residency: residency.QueueAwareEviction | None = None
        self.resident_first = False
        self._local: tuple | None = None           # (base plan, tree node counter, local plan, admission)
        self.local_rounds = 0                      # rounds ordered under pressure
        # rule 3 (whole families, --tts-locality-rules families): set by enable(); this round's table
        # (None without pressure) and the admissions it stopped so far
        self.whole_families = False
        self.admission: residency.Admission | None = None
        self.holds = 0
        _STATES.add(self)                          # so that forget() reaches it

    # ------------------------------------------------------------------------- per request
    def group_rank(self, group: str) -> int:
        rank = self._group_rank.get(group)
        if rank is None:
            if len(self._group_rank) >= MAX_GROUPS:
                for old in list(self._group_rank)[:MAX_GROUPS // 10]:
                    del self._group_rank[old]
            rank = self._group_rank[group] = next(self._counter)
        return rank

    def info(self, req: Any) -> RequestInfo:
        """The request's cached :class:`RequestInfo` (recomputed when its output grew, e.g. after
        a retraction, or after :func:`set_class` dropped it)."""
        info = getattr(req, INFO, None)
        out_len = len(req.output_ids)
        if info is not None and info.out_len == out_len:
            return info
        tag = tag_of(req)
        rid = str(req.rid)
        if tag is None:
            key = (self.group_rank("rid:" + rid), 0, 0, 0, rid)
            family, rank = ("rid", rid), CLASS_RANK["normal"]
        else:
            key = (self.group_rank(tag.group), tag.depth, tag.parent, tag.beam, rid)
            family, rank = (tag.group, tag.depth, tag.parent), CLASS_RANK.get(tag.cls, 1)
        waiting = getattr(req, SINCE, None)
        if waiting is None or waiting[0] != out_len:   # new, or back after a retraction
            waiting = (out_len, self.clock())
            setattr(req, SINCE, waiting)
        since = waiting[1]
        info = RequestInfo(next(self._serials), out_len, rank, key, family, tokens_of(req), since)
        setattr(req, INFO, info)
        if not hasattr(req, DEFERRED):   # every waiting request has the flag; order() sets the deferred
            setattr(req, DEFERRED, False)
        return info

    # ------------------------------------------------------------------------------ order
    def order(self, policy: Any, waiting_queue: list, running_batch: Any = None) -> None:
        """Sort ``waiting_queue`` in place (SGLang's ``calc_priority`` contract)."""
        self.rounds += 1
        self.last_queue_len = len(waiting_queue)
        if not waiting_queue:
            self.last_deferred = self.last_aged = 0
            self._known, self._held = {}, []
            self._clear_deferred()
            return
        infos, ids = self._infos(waiting_queue)
        self._known, self._held = dict(zip(ids, infos)), waiting_queue[:]   # (written back: the same requests)
        max_wait = self.settings.max_wait
        aged: list[int] = []
        if max_wait is not None:
            now = self.clock()
            if now - min(map(_SINCE_OF, infos)) >= max_wait:   # (one C-level pass when nobody is that old)
                aged = [i for i, f in enumerate(infos) if f.rank != SPECULATIVE and now - f.since >= max_wait]
        anchor_req = None
        if running_batch is not None and getattr(running_batch, "reqs", None):
            anchor_req = running_batch.reqs[-1]
        sig = (tuple(map(_SERIAL, infos)), tuple(infos[i].serial for i in aged))
        plan = self._plan
        if plan is None or plan.sig != sig or not self._anchor_still_valid(plan, anchor_req):
            plan = self._plan = self._make_plan(policy, waiting_queue, infos, aged, anchor_req)
        base = plan
        if self.residency is not None or self.resident_first:
            plan = self._local_plan(policy, base, running_batch)
        # the last prefill batch counts only in the first round after it formed: then its prefill
        # may still be in flight (overlap); later it is in the radix cache or was evicted, and
        # waiting on it again would stall the queue
        fresh, self._prefill_fresh = self._prefill_fresh, False
        deferred = self._deferred_positions(policy, plan, fresh)
        self._clear_deferred()
        if deferred:
            later = [plan.reqs[pos] for pos in sorted(deferred)]
            for req in later:
                setattr(req, DEFERRED, True)
            self._deferred_now = later
            # deferred requests go after the others, before the speculative ones (the last bucket)
            spec_from = next((lo for lo, hi in plan.segments if plan.infos[lo].rank == SPECULATIVE), len(plan.reqs))
            keep = [pos for pos in range(len(plan.reqs)) if pos not in deferred]
            split = bisect.bisect_left(keep, spec_from)
            written = keep[:split] + sorted(deferred) + keep[split:]
            waiting_queue[:] = [plan.reqs[pos] for pos in written]
            order_serials = tuple(plan.infos[pos].serial for pos in written)
        else:
            waiting_queue[:] = plan.reqs
            order_serials = tuple(map(_SERIAL, plan.infos))
        self.last_deferred = len(deferred)
        self.last_aged = plan.first_deferrable
        # what the next round receives if nothing was admitted and nothing arrived
        base.sig = (order_serials, sig[1])

    def _infos(self, queue: list) -> tuple[list[RequestInfo], list[int]]:
        """Each request's :class:`RequestInfo` and the requests' ids, looked up in C by id without
        touching the requests (reading 2,000 requests' attributes cost ~1.3 ms a round on the 2-core
        Xeon, their memory cold after the scheduler's other work). A request of the last round's
        queue has not run since unless it was retracted or re-classed, and both drop it here
        (:func:`forget`); the held references keep its id from being reused by another. Only the
        others (new, back, re-classed) go through :meth:`info`, which checks their output length."""
        ids = list(map(id, queue))
        infos = list(map(self._known.get, ids))
        for i in itertools.compress(range(len(queue)), map(operator.is_, infos, itertools.repeat(None))):
            infos[i] = self.info(queue[i])
        return infos, ids

    def forget(self, req: Any) -> None:
        """Drop what this state cached of ``req``: it ran (a retraction brings it back with more
        output) or its class changed."""
        self._known.pop(id(req), None)

    def _clear_deferred(self) -> None:
        for req in self._deferred_now:
            setattr(req, DEFERRED, False)
        self._deferred_now = []

    def _anchor_still_valid(self, plan: _Plan, anchor_req: Any) -> bool:
        """The anchor picks the first request; a running request's sequence only grows, and a
        growth can change its longest shared prefix only if a waiting request shared all of it."""
        if anchor_req is None or plan.anchor_rid is None:
            return anchor_req is None and plan.anchor_rid is None
        return anchor_req.rid == plan.anchor_rid and plan.anchor_best < plan.anchor_len

    def _make_plan(self, policy: Any, queue: list, infos: list[RequestInfo], aged: list[int],
                   anchor_req: Any) -> _Plan:
        self.sorts += 1
        self.walks.next_round()
        anchor = None
        if anchor_req is not None:
            anchor = tokens_of(anchor_req)
        # aged: oldest first, or the oldest search's first (--tts-admission search; key[0]: its rank)
        by_search = self.settings.by_search
        walk: list[tuple] = [(infos[i], queue[i]) for i in sorted(
            aged, key=lambda i: (infos[i].key[0] if by_search else 0, infos[i].since, infos[i].key))]
        shared: list[int] = []
        prev = anchor
        for info, _ in walk:
            shared.append(common_prefix(prev, info.seq) if prev is not None else 0)
            prev = info.seq
        first_deferrable = len(walk)
        sign = getattr(policy, "priority_sign", 1) if getattr(policy, "enable_priority_scheduling", False) else 0
        serials = dict(zip(map(_SERIAL, infos), range(len(infos))))   # serial -> queue position
        segments: list[tuple[int, int]] = []
        for bucket in self._fill_buckets(queue, infos, serials, aged, sign):
            items, local_shared = bucket.order(prev)
            segments.append((len(walk), len(walk) + len(items)))
            walk.extend(items)
            shared.extend(local_shared)
            prev = items[-1][0].seq
        plan = _Plan(sig=(), reqs=list(map(_REQ_OF, walk)), infos=list(map(_INFO_OF, walk)),
                     shared_prev=shared, first_deferrable=first_deferrable, segments=segments)
        if anchor is not None:
            plan.anchor_rid, plan.anchor_len = anchor_req.rid, len(anchor) // 8
            everything = self._sorted.update(infos, serials.keys())   # the longest prefix is shared with a neighbour
            at = bisect.bisect_left(everything, anchor)
            plan.anchor_best = max((common_prefix(anchor, everything[j]) for j in (at - 1, at)
                                    if 0 <= j < len(everything)), default=0)
        return plan

    def _fill_buckets(self, queue: list, infos: list[RequestInfo], serials: dict[int, int], aged: list[int],
                      sign: int) -> list[FamilyWalk]:
        """The non-aged requests' buckets (class rank, priority) in order, each a :class:`FamilyWalk`
        of their families. The buckets are kept across rounds: a round adds the requests that arrived
        (or came back, or changed class) and removes those that left or aged, so an admission round
        touches only the families that changed."""
        if len(serials) != len(infos):   # a request twice in the queue: build afresh, keep nothing
            walks: dict[tuple, FamilyWalk] = {}
            aged_set = set(aged)
            for i, f in enumerate(infos):
                if i not in aged_set:
                    walks.setdefault(self._bucket_of(queue[i], f, sign), FamilyWalk(self.walks)).add(
                        (f, queue[i]), f.seq, f.key, f.family)
            return [walks[b] for b in sorted(walks)]
        if sign != self._bucket_sign:
            self._buckets, self._members, self._bucket_sign = {}, {}, sign
        buckets, members = self._buckets, self._members
        wanted = serials.keys() - {infos[i].serial for i in aged}
        for serial in members.keys() - wanted:
            bucket, item = members.pop(serial)
            info = item[0]
            buckets[bucket].remove(item, info.key, info.family)
            if not len(buckets[bucket]):
                del buckets[bucket]
        for i in sorted(serials[serial] for serial in wanted - members.keys()):   # in queue order
            f, req = infos[i], queue[i]
            bucket, item = self._bucket_of(req, f, sign), (f, req)
            members[f.serial] = (bucket, item)
            walks = buckets.get(bucket)
            if walks is None:
                walks = buckets[bucket] = FamilyWalk(self.walks)
            walks.add(item, f.seq, f.key, f.family)
        return [buckets[b] for b in sorted(buckets)]

    def _bucket_of(self, req: Any, info: RequestInfo, sign: int) -> tuple[int, ...]:
        """(class rank, priority), and with ``--tts-admission search`` the search's first-seen rank:
        each search its own bucket, the oldest first."""
        prio = 0
        if sign:
            p = getattr(req, "priority", None)
            prio = 0 if p is None else p * sign
        return (info.rank, prio, info.key[0]) if self.settings.by_search else (info.rank, prio)

    def _local_plan(self, policy: Any, base: _Plan, running_batch: Any = None) -> _Plan:
        """Policy ``locality``: under KV pressure, ``base`` with resident families first, and the
        radix nodes the waiting requests need marked in that order (:mod:`sgl_tts.plugin.scheduling.residency`);
        ``base`` itself without pressure. With one rule alone (``--tts-locality-rules``) the other
        is left out: ``base``'s order with its nodes marked, or resident families first unmarked.
        Reused while the plan and the tree's nodes are unchanged."""
        tree = policy.tree_cache
        self.admission = None
        if not residency.under_pressure(tree) and not (
                self.whole_families and residency.outgrown(tree, residency.new_tokens(base.reqs) + residency.new_tokens(
                    getattr(running_batch, "reqs", None) or ()))):
            return base
        self.local_rounds += 1
        counter = type(tree.root_node).counter
        memo = self._local
        if memo is not None and memo[0] is base and memo[1] == counter:
            self.admission = memo[3]
            if self.admission is not None:
                self.admission.protected = None   # locks may have changed since: summed again when read
            return memo[2]
        found: dict[bytes, tuple[Any, int]] = {}
        nodes, uncached = [], []
        for req, info in zip(base.reqs, base.infos):
            hit = found.get(info.seq)
            if hit is None:
                hit = found[info.seq] = residency.match(tree, info.seq, getattr(req, "extra_key", None))
            nodes.append(hit[0])
            uncached.append(len(info.seq) // 8 - hit[1])
        order = list(range(base.first_deferrable))   # aged requests keep their places
        families = [f.family for f in base.infos]
        for lo, hi in base.segments:
            if self.resident_first:
                order.extend(lo + j for j in residency.resident_first(families[lo:hi], uncached[lo:hi],
                                                                      self.settings.dedup_tokens))
            else:
                order.extend(range(lo, hi))
        if self.residency is not None:
            residency.mark_needed(self.residency, tree.root_node, [nodes[i] for i in order])
        local = base
        if order != list(range(len(order))):
            infos = [base.infos[i] for i in order]
            shared = [base.shared_prev[0] if order[0] == 0 else 0]
            shared.extend(common_prefix(a.seq, b.seq) for a, b in zip(infos, infos[1:]))
            local = _Plan(sig=(), reqs=[base.reqs[i] for i in order], infos=infos, shared_prev=shared,
                          first_deferrable=base.first_deferrable, segments=base.segments)
        if self.whole_families and self.residency is not None:
            self.admission = residency.admission_table(tree, self.residency.marks, local.reqs, local.infos,
                                                       local.shared_prev, [uncached[i] for i in order])
        self._local = (base, type(tree.root_node).counter, local, self.admission)   # after matching (it can split)
        return local

    def holds_back(self, adder: Any, req: Any) -> bool:
        """Rule 3 (``--tts-locality-rules families``) on the request SGLang is about to admit
        (:meth:`~sgl_tts.plugin.scheduling.residency.Admission.holds_back`); counted in ``holds``."""
        if self.admission is None or not self.admission.holds_back(adder, req):
            return False
        self.holds += 1
        return True

    def _deferred_positions(self, policy: Any, plan: _Plan, fresh: bool) -> set[int]:
        """Walk positions deferred this round (see the module docstring, 4.); ``fresh``: the last
        prefill batch formed after the previous round."""
        dedup = self.settings.dedup_tokens
        tree = getattr(policy, "tree_cache", None)
        if tree is None or getattr(tree, "disable", False):
            return set()
        version = self.prefill_version if fresh else -1
        page = max(1, int(getattr(tree, "page_size", 1) or 1))
        if plan.cand_version != version:
            # the positions to check and the prefix each would share: with the request placed before
            # it or (in a fresh round) with the last prefill batch, in whole pages (the radix cache
            # holds and matches whole pages only); speculative requests are never deferred
            plan.cand_version = version
            first = plan.first_deferrable
            if not fresh and page == 1:
                # the common case, in C: the speculative requests are the last buckets (the highest
                # class rank), and the aged ones, first, are never speculative
                spec_from = next((lo for lo, _ in plan.segments if plan.infos[lo].rank == SPECULATIVE), len(plan.infos))
                shared = plan.shared_prev
                plan.cand_pos = list(itertools.compress(range(first, spec_from), map(
                    operator.ge, itertools.islice(shared, first, spec_from), itertools.repeat(dedup))))
                plan.cand_keys = list(zip(map(_SERIAL, map(plan.infos.__getitem__, plan.cand_pos)),
                                          map(shared.__getitem__, plan.cand_pos)))
            else:
                pairs = zip(range(first, len(plan.infos)), plan.infos[first:], plan.shared_prev[first:])
                if fresh:
                    cands = [(pos, f.serial, s - s % page) for pos, f, prev in pairs if f.rank != SPECULATIVE
                             and (s := max(prev, self._shared_with_last_prefill(f.seq))) - s % page >= dedup]
                else:
                    cands = [(pos, f.serial, prev - prev % page) for pos, f, prev in pairs
                             if f.rank != SPECULATIVE and prev - prev % page >= dedup]
                plan.cand_pos = [c[0] for c in cands]
                plan.cand_keys = [(c[1], c[2]) for c in cands]
        fp = tree_fingerprint(tree)
        evictions = getattr(tree, residency.EVICTIONS, None)
        if fp != self._matched_fp:
            if (evictions is not None and evictions == self._matched_evictions and isinstance(fp, tuple)
                    and isinstance(self._matched_fp, tuple) and fp[2] == self._matched_fp[2]):
                # nothing evicted since (the same root): a match can only have grown, so a request
                # not deferred (fewer than dedup tokens missing) stays so, and its stale hit carried to
                # the next request (min(hit, s) there) leaves that one's decision unchanged too; only
                # deferred ones are matched again (an admission round at 2,000 waiting: ~9 ms less)
                self._matched_deferred = {}
            else:
                self._matched, self._matched_deferred = {}, {}
        elif len(self._matched) + len(self._matched_deferred) > 4 * len(plan.reqs) + 64:
            serials = {f.serial for f in plan.infos}   # requests long gone: keep this queue's
            self._matched = {k: v for k, v in self._matched.items() if k[0] in serials}
            self._matched_deferred = {k: v for k, v in self._matched_deferred.items() if k[0] in serials}
        matched, matched_deferred = self._matched, self._matched_deferred
        positions, keys = plan.cand_pos, plan.cand_keys
        hits = list(map(matched.get, keys))
        deferred: set[int] = set()
        if None in hits:
            for k in itertools.compress(range(len(hits)), map(operator.is_, hits, itertools.repeat(None))):
                pos, key = positions[k], keys[k]
                s = key[1]
                hit = matched_deferred.get(key)
                if hit is None:
                    if k and positions[k - 1] == pos - 1 and plan.shared_prev[pos] >= s and s <= keys[k - 1][1]:
                        # the same prefix as the request before (it shares at least s tokens with it)
                        hit = min(hits[k - 1], s)
                    else:
                        hit = self._cached_tokens(tree, plan.reqs[pos], plan.infos[pos].seq, s)
                hits[k] = hit
                if s - hit >= dedup:   # (only these are deferred: every other hit is in matched)
                    deferred.add(pos)
                    matched_deferred[key] = hit
                else:
                    matched[key] = hit
        self._matched_fp = tree_fingerprint(tree)   # after matching (a match can split a node)
        self._matched_evictions = evictions
        return deferred

    def _shared_with_last_prefill(self, seq: bytes) -> int:
        """Tokens ``seq`` shares with the request of the last prefill batch it shares most with
        (among sorted sequences, the longest common prefix is with a neighbour)."""
        last = self.last_prefill
        if not last:
            return 0
        at = bisect.bisect_left(last, seq)
        best = 0
        for j in (at - 1, at):
            if 0 <= j < len(last):
                best = max(best, common_prefix(last[j], seq))
        return best

    @staticmethod
    def _cached_tokens(tree: Any, req: Any, seq: bytes, length: int) -> int:
        """Tokens of ``seq[:length]`` in the radix cache (SGLang's own prefix match)."""
        return residency.match(tree, seq[:length * 8], getattr(req, "extra_key", None))[1]

    # ---------------------------------------------------------------------- prefill batch
    def on_prefill_batch(self, reqs: Sequence[Any]) -> None:
        """The requests of the prefill batch just formed: until the next one, waiting requests are
        also checked against them (their prefill may not be in the radix cache yet)."""
        self.last_prefill = sorted(tokens_of(r) for r in reqs)
        self.prefill_version += 1
        self._prefill_fresh = True


def enable(policy: Any, settings: TTSSettings) -> TTSPolicyState | None:
    """Attach the prefix-aware policy to an SGLang ``SchedulePolicy`` (``None`` when off). The
    policy's tree cache carries it too: the batch-level hooks (retraction) find it there."""
    state = TTSPolicyState(settings) if settings.active else None
    policy.sgl_tts = state
    if policy.tree_cache is not None:
        policy.tree_cache.sgl_tts_policy = state
        if state is not None:
            residency.count_evictions(policy.tree_cache)
        if state is not None and settings.evicts_by_next_use:
            state.residency = residency.install(policy.tree_cache)
        if state is not None:
            state.resident_first = settings.resident_first
            state.whole_families = settings.admits_whole_families
    return state


def calc_priority(original, self, waiting_queue, running_batch=None, *args, **kwargs):
    """AROUND hook on ``SchedulePolicy.calc_priority``: the prefix-aware order when enabled on this
    policy object, SGLang's own otherwise."""
    state = getattr(self, "sgl_tts", None)
    if state is None:
        return original(self, waiting_queue, running_batch, *args, **kwargs)
    return state.order(self, waiting_queue, running_batch)


def add_one_req(original, self, req, *args, **kwargs):
    """AROUND hook on ``PrefillAdder.add_one_req``: a request the policy deferred this round stops
    admission (it and everything after it wait for the next round); so does one that the locality
    policy's whole-family rule holds back (:meth:`TTSPolicyState.holds_back`)."""
    if getattr(req, DEFERRED, False):
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.OTHER
    state = getattr(self.tree_cache, "sgl_tts_policy", None)
    if state is not None and state.admission is not None and state.holds_back(self, req):
        from sglang.srt.managers.schedule_policy import AddReqResult

        # something runs: SGLang's "no token" (it tries again when a request ends); only this round's
        # admissions: stop the round without marking the batch full
        return AddReqResult.NO_TOKEN if getattr(self.running_batch, "reqs", None) else AddReqResult.OTHER
    return original(self, req, *args, **kwargs)


def forget_on_retract(result, req, *args, **kwargs):
    """AFTER hook on ``Req.reset_for_retract`` (every retraction path of SGLang 0.5.15: decode
    retraction, ``retract_all`` for a pause, disaggregated prefill): the request comes back to the
    waiting queue with more output, so its cached :class:`RequestInfo` goes (the order reads the
    infos of requests that stayed in the queue without checking their output)."""
    forget(req)
    return result


_STATES: "weakref.WeakSet[TTSPolicyState]" = weakref.WeakSet()   # every live state (one per scheduler)


def forget(req: Any) -> None:
    """Drop ``req``'s cached info everywhere: on the request and in every policy state's last round."""
    req.__dict__.pop(INFO, None)
    for state in _STATES:
        state.forget(req)


def fill_matched_prefixes(original, self, *args, **kwargs):
    """AROUND hook on ``SchedulerLoadInquirer.get_num_waiting_uncached_tokens`` (``/v1/loads``, load
    snapshots): with the prefix-aware policy, each waiting request's ``num_matched_prefix_tokens`` is
    matched against the radix cache first, as SGLang's ``lpm`` policy fills it at schedule time (the
    prefix-aware order does not need it, so it is filled when read, not every round)."""
    scheduler = LOAD_INQUIRERS.get(id(self))
    if scheduler is not None and getattr(scheduler.policy, "sgl_tts", None) is not None:
        from sglang.srt.managers.schedule_policy import match_prefix_for_req

        tree = scheduler.tree_cache
        if tree is not None and not getattr(tree, "disable", False):
            for req in scheduler.waiting_queue:
                match_prefix_for_req(tree, req)
    return original(self, *args, **kwargs)


LOAD_INQUIRERS: dict[int, Any] = {}   # id(scheduler.load_inquirer) -> scheduler, this process


__all__ = ["CLASS_RANK", "RequestInfo", "TTSPolicyState", "add_one_req", "calc_priority", "enable",
           "fill_matched_prefixes", "forget", "forget_on_retract", "request_class", "tag_of", "tokens_of",
           "tree_fingerprint"]
