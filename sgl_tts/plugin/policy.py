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
   runs ``--enable-priority-scheduling`` (its sign convention: ``--schedule-low-priority-values-first``);
3. within a bucket, :func:`~sgl_tts.plugin.ordering.family_order`: siblings (one search, depth and
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
or :func:`set_class` changes it); the sort is redone only when the queue changed; the deferral
check matches the radix cache once per run of requests sharing a prefix, and not at all while the
cache is unchanged. ``docs/benchmarks/ordering_cost.md`` has the figures.

Untagged requests (no sgl-tts metadata) are each their own family and group, in arrival order.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import time
from typing import Any, Callable, Sequence

from sgl_tts.plugin import residency
from sgl_tts.plugin.ordering import WalkMemo, as_bytes, common_prefix, family_order
from sgl_tts.plugin.settings import TTSSettings
from sgl_tts.protocol import SearchTag

logger = logging.getLogger(__name__)

CLASS_RANK = {"boosted": 0, "normal": 1, "speculative": 2}
SPECULATIVE = CLASS_RANK["speculative"]
DEFERRED = "_sgl_tts_deferred"   # attribute set on a Req deferred this round
INFO = "_sgl_tts_info"           # a Req's cached RequestInfo
SINCE = "_sgl_tts_since"         # (output length, time) a Req started waiting, for aging
MAX_GROUPS = 100_000             # first-seen ranks kept (oldest forgotten first)


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
    prefill_version: int = -2    # shared_last computed for this last-prefill batch (-1: none)
    shared_last: list[int] = dataclasses.field(default_factory=list)
    segments: list[tuple[int, int]] = dataclasses.field(default_factory=list)   # the buckets' walk ranges


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

    def update(self, infos: Sequence[RequestInfo]) -> list[bytes]:
        """The sorted sequences of ``infos`` (the list is kept: do not change it)."""
        now = {f.serial: f.seq for f in infos}
        gone = [seq for serial, seq in self._serials.items() if serial not in now]
        new = [seq for serial, seq in now.items() if serial not in self._serials]
        if len(gone) + len(new) > len(now) // 4:   # most of it changed: sorting is cheaper
            self.seqs = sorted(now.values())
        else:
            for seq in gone:   # (an equal sequence of another request is as good: the content is what counts)
                del self.seqs[bisect.bisect_left(self.seqs, seq)]
            for seq in new:
                bisect.insort(self.seqs, seq)
        self._serials = now
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
        self.walks = WalkMemo()                    # each family's prefix and walk
        self._sorted = SortedSeqs()                # the waiting sequences, sorted
        self._matched: dict[tuple[int, int], int] = {}   # (request serial, prefix length) -> cached tokens
        self._matched_fp: Any = None               # the radix cache's fingerprint they were matched on
        self._matched_evictions: Any = None        # and its eviction count (residency.count_evictions)
        # policy "locality" (sgl_tts.plugin.residency): the tree's eviction strategy, set by enable()
        self.residency: residency.QueueAwareEviction | None = None
        self._local: tuple | None = None           # (base plan, tree node counter, local plan)
        self.local_rounds = 0                      # rounds ordered under pressure

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
        return info

    # ------------------------------------------------------------------------------ order
    def order(self, policy: Any, waiting_queue: list, running_batch: Any = None) -> None:
        """Sort ``waiting_queue`` in place (SGLang's ``calc_priority`` contract)."""
        self.rounds += 1
        self.last_queue_len = len(waiting_queue)
        if not waiting_queue:
            self.last_deferred = self.last_aged = 0
            return
        infos = [self.info(r) for r in waiting_queue]
        max_wait = self.settings.max_wait
        aged: list[int] = []
        if max_wait is not None:
            now = self.clock()
            aged = [i for i, f in enumerate(infos) if f.rank != SPECULATIVE and now - f.since >= max_wait]
        anchor_req = None
        if running_batch is not None and getattr(running_batch, "reqs", None):
            anchor_req = running_batch.reqs[-1]
        sig = (tuple(f.serial for f in infos), tuple(infos[i].serial for i in aged))
        plan = self._plan
        if plan is None or plan.sig != sig or not self._anchor_still_valid(plan, anchor_req):
            plan = self._plan = self._make_plan(policy, waiting_queue, infos, aged, anchor_req)
        base = plan
        if self.residency is not None:
            plan = self._local_plan(policy, base)
        # the last prefill batch counts only in the first round after it formed: then its prefill
        # may still be in flight (overlap); later it is in the radix cache or was evicted, and
        # waiting on it again would stall the queue
        fresh, self._prefill_fresh = self._prefill_fresh, False
        deferred = self._deferred_positions(policy, plan, fresh)
        ordered: list = []
        later: list = []
        spec: list = []
        for pos, (req, info) in enumerate(zip(plan.reqs, plan.infos)):
            is_deferred = pos in deferred
            setattr(req, DEFERRED, is_deferred)
            if is_deferred:
                later.append(req)
            elif info.rank == SPECULATIVE and pos >= plan.first_deferrable:
                spec.append(req)
            else:
                ordered.append(req)
        self.last_deferred = len(later)
        self.last_aged = plan.first_deferrable
        waiting_queue[:] = ordered + later + spec
        # what the next round receives if nothing was admitted and nothing arrived
        base.sig = (tuple(getattr(r, INFO).serial for r in waiting_queue), sig[1])

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
        walk: list[int] = sorted(aged, key=lambda i: (infos[i].since, infos[i].key))
        shared: list[int] = []
        prev = anchor
        for i in walk:
            shared.append(common_prefix(prev, infos[i].seq) if prev is not None else 0)
            prev = infos[i].seq
        first_deferrable = len(walk)
        aged_set = set(aged)
        sign = getattr(policy, "priority_sign", 1) if getattr(policy, "enable_priority_scheduling", False) else 0
        buckets: dict[tuple, list[int]] = {}
        for i, f in enumerate(infos):
            if i in aged_set:
                continue
            prio = 0
            if sign:
                p = getattr(queue[i], "priority", None)
                prio = 0 if p is None else p * sign
            buckets.setdefault((f.rank, prio), []).append(i)
        segments: list[tuple[int, int]] = []
        for bucket in sorted(buckets):
            idx = buckets[bucket]
            local, local_shared = family_order([infos[i].seq for i in idx], [infos[i].key for i in idx],
                                               [infos[i].family for i in idx], prev, self.walks)
            segments.append((len(walk), len(walk) + len(idx)))
            walk.extend(idx[j] for j in local)
            shared.extend(local_shared)
            prev = infos[walk[-1]].seq
        plan = _Plan(sig=(), reqs=[queue[i] for i in walk], infos=[infos[i] for i in walk],
                     shared_prev=shared, first_deferrable=first_deferrable, segments=segments)
        if anchor is not None:
            plan.anchor_rid, plan.anchor_len = anchor_req.rid, len(anchor) // 8
            everything = self._sorted.update(infos)   # the longest prefix is shared with a neighbour
            at = bisect.bisect_left(everything, anchor)
            plan.anchor_best = max((common_prefix(anchor, everything[j]) for j in (at - 1, at)
                                    if 0 <= j < len(everything)), default=0)
        return plan

    def _local_plan(self, policy: Any, base: _Plan) -> _Plan:
        """Policy ``locality``: under KV pressure, ``base`` with resident families first, and the
        radix nodes the waiting requests need marked in that order (:mod:`sgl_tts.plugin.residency`);
        ``base`` itself without pressure. Reused while the plan and the tree's nodes are unchanged."""
        tree = policy.tree_cache
        if not residency.under_pressure(tree):
            return base
        self.local_rounds += 1
        counter = type(tree.root_node).counter
        memo = self._local
        if memo is not None and memo[0] is base and memo[1] == counter:
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
            order.extend(lo + j for j in residency.resident_first(families[lo:hi], uncached[lo:hi],
                                                                  self.settings.dedup_tokens))
        residency.mark_needed(self.residency, tree.root_node, [nodes[i] for i in order])
        local = base
        if order != list(range(len(order))):
            infos = [base.infos[i] for i in order]
            shared = [base.shared_prev[0] if order[0] == 0 else 0]
            shared.extend(common_prefix(a.seq, b.seq) for a, b in zip(infos, infos[1:]))
            local = _Plan(sig=(), reqs=[base.reqs[i] for i in order], infos=infos, shared_prev=shared,
                          first_deferrable=base.first_deferrable, segments=base.segments)
        self._local = (base, type(tree.root_node).counter, local)   # after matching (it can split)
        return local

    def _deferred_positions(self, policy: Any, plan: _Plan, fresh: bool) -> set[int]:
        """Walk positions deferred this round (see the module docstring, 4.); ``fresh``: the last
        prefill batch formed after the previous round."""
        dedup = self.settings.dedup_tokens
        tree = getattr(policy, "tree_cache", None)
        if tree is None or getattr(tree, "disable", False):
            return set()
        version = self.prefill_version if fresh else -1
        if plan.prefill_version != version:
            plan.prefill_version = version
            plan.shared_last = [self._shared_with_last_prefill(f.seq) if fresh and f.rank != SPECULATIVE else 0
                                for f in plan.infos]
        page = max(1, int(getattr(tree, "page_size", 1) or 1))
        fp = tree_fingerprint(tree)
        evictions = getattr(tree, residency.EVICTIONS, None)
        if fp != self._matched_fp:
            if (evictions is not None and evictions == self._matched_evictions and isinstance(fp, tuple)
                    and isinstance(self._matched_fp, tuple) and fp[2] == self._matched_fp[2]):
                # nothing evicted since (the same root): a wholly cached prefix still is, only a
                # partial match can have grown (an admission round at 2,000 waiting: ~5 ms less)
                self._matched = {k: hit for k, hit in self._matched.items() if hit >= k[1]}
            else:
                self._matched = {}
        elif len(self._matched) > 4 * len(plan.reqs) + 64:   # requests long gone: keep this queue's
            serials = {f.serial for f in plan.infos}
            self._matched = {k: v for k, v in self._matched.items() if k[0] in serials}
        matched = self._matched
        deferred: set[int] = set()
        carry_pos, carry_len, carry_hit = -1, 0, 0   # the last position matched, its prefix length, its hit
        for pos in range(plan.first_deferrable, len(plan.reqs)):
            info = plan.infos[pos]
            if info.rank == SPECULATIVE:
                continue
            s = max(plan.shared_prev[pos], plan.shared_last[pos])
            s -= s % page   # the radix cache holds (and matches) whole pages only
            if s < dedup:
                continue
            hit = matched.get((info.serial, s))
            if hit is None:
                if carry_pos == pos - 1 and plan.shared_prev[pos] >= s and s <= carry_len:
                    # the same prefix as the request before (it shares at least s tokens with it)
                    hit = min(carry_hit, s)
                else:
                    hit = self._cached_tokens(tree, plan.reqs[pos], info.seq, s)
                matched[(info.serial, s)] = hit
            carry_pos, carry_len, carry_hit = pos, s, hit
            if s - hit >= dedup:
                deferred.add(pos)
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
        if state is not None and settings.policy == "locality":
            state.residency = residency.install(policy.tree_cache)
    return state


def set_class(scheduler: Any, group: str, cls: str, beams: Sequence[int] | None = None,
              depth: int | None = None, priority: int | None = None) -> int:
    """Change the class (and, if given, SGLang's ``priority``) of a search group's waiting and
    running requests (all, or those at ``depth`` / with a beam in ``beams``), e.g. boost the subtree
    MCTS is about to expand. Returns how many requests changed. Takes effect at the next round.
    A priority needs a server started with ``--enable-priority-scheduling`` (it orders requests of
    one class; without the flag SGLang ignores priorities)."""
    from sgl_tts.protocol import CLASSES

    if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority is not None and not getattr(scheduler, "enable_priority_scheduling", False):
        raise ValueError("a priority needs a server started with --enable-priority-scheduling "
                         "(without it SGLang ignores priorities); use cls='boosted' instead")
    if cls not in CLASSES:
        raise ValueError(f"unknown request class {cls!r}; choose one of {', '.join(CLASSES)}")
    wanted = None if beams is None else {int(b) for b in beams}
    changed = 0
    running = getattr(getattr(scheduler, "running_batch", None), "reqs", None) or []
    for req in list(scheduler.waiting_queue) + list(running):
        tag = tag_of(req)
        if tag is None or tag.group != group:
            continue
        if (wanted is not None and tag.beam not in wanted) or (depth is not None and tag.depth != depth):
            continue
        if not isinstance(req.sampling_params.custom_params, dict):   # tagged by its rid alone
            req.sampling_params.custom_params = tag.custom_params()
        req.sampling_params.custom_params["tts_class"] = cls
        if priority is not None:
            req.priority = priority
        if hasattr(req, INFO):
            delattr(req, INFO)   # its class (and so the queue's order) changed
        changed += 1
    return changed


def set_internal_state(original, self, recv_req, *args, **kwargs):
    """AROUND hook on ``Scheduler.set_internal_state``: ``{"tts_set_class": {...}}`` (SGLang's
    ``/set_internal_state`` route) calls :func:`set_class` on this scheduler; anything else is
    SGLang's own."""
    command = getattr(recv_req, "server_args", None) or {}
    if set(command) != {"tts_set_class"}:
        return original(self, recv_req, *args, **kwargs)
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput

    try:
        changed = set_class(self, **command["tts_set_class"])
    except (TypeError, ValueError, OverflowError) as exc:
        logger.warning("sgl-tts: tts_set_class rejected: %s", exc)
        return SetInternalStateReqOutput(updated=False, server_args={"tts_set_class": {"error": str(exc)}})
    return SetInternalStateReqOutput(updated=True, server_args={"tts_set_class": {"requests": changed}})


async def set_internal_state_reply(original, self, obj, *args, **kwargs):
    """AROUND hook on ``TokenizerManager.set_internal_state`` (HTTP side): for a ``tts_set_class``
    command, return each scheduler's ``{"updated", "server_args"}`` (SGLang 0.5.15 returns only the
    ``updated`` flags, dropping the count :func:`set_internal_state` sends back)."""
    command = getattr(obj, "server_args", None) or {}
    if set(command) != {"tts_set_class"}:
        return await original(self, obj, *args, **kwargs)
    self.auto_create_handle_loop()
    responses = await self.set_internal_state_communicator(obj)
    return [{"updated": bool(r.updated), "server_args": r.server_args} for r in responses]


def calc_priority(original, self, waiting_queue, running_batch=None, *args, **kwargs):
    """AROUND hook on ``SchedulePolicy.calc_priority``: the prefix-aware order when enabled on this
    policy object, SGLang's own otherwise."""
    state = getattr(self, "sgl_tts", None)
    if state is None:
        return original(self, waiting_queue, running_batch, *args, **kwargs)
    return state.order(self, waiting_queue, running_batch)


def add_one_req(original, self, req, *args, **kwargs):
    """AROUND hook on ``PrefillAdder.add_one_req``: a request the policy deferred this round stops
    admission (it and everything after it wait for the next round)."""
    if getattr(req, DEFERRED, False):
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.OTHER
    return original(self, req, *args, **kwargs)


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
           "fill_matched_prefixes", "request_class", "set_class", "set_internal_state",
           "set_internal_state_reply", "tag_of", "tokens_of", "tree_fingerprint"]
