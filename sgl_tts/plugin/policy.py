"""The prefix-aware waiting-queue policy on SGLang's own scheduler objects.

:class:`TTSPolicyState` is attached to a scheduler's ``SchedulePolicy`` (``policy.sgl_tts``); the
plugin's hook on ``SchedulePolicy.calc_priority`` then calls :meth:`TTSPolicyState.order` instead of
SGLang's policy. The order, for any queue length (SGLang's ``lpm`` falls back to FCFS above 128
waiting requests):

1. request classes: boosted requests first, then normal ones, then speculative ones (which thus only
   get slots no normal request can use);
2. within a class, :func:`~sgl_tts.plugin.ordering.prefix_aware_order` over each request's tokens
   (prompt + output so far) with the key (search group in first-seen order, depth, parent beam,
   beam), anchored on the last request of the running batch (the latest admission);
3. a normal or boosted request that shares at least ``dedup_tokens`` uncached tokens with the
   request before it is deferred: placed after the others, and the plugin's ``PrefillAdder`` hook
   stops admission at the first deferred request, so one sibling prefills the shared prefix and the
   others reuse it from the radix cache next round.

Untagged requests (no sgl-tts metadata) are each their own group, in arrival order.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Sequence

from sgl_tts.plugin.ordering import as_bytes, common_prefix, prefix_aware_order
from sgl_tts.plugin.settings import TTSSettings
from sgl_tts.tts_request import SearchTag

logger = logging.getLogger(__name__)

CLASS_RANK = {"boosted": 0, "normal": 1, "speculative": 2}
DEFERRED = "_sgl_tts_deferred"   # attribute set on a Req deferred this round
MAX_GROUPS = 100_000             # first-seen ranks kept (oldest forgotten first)


def tag_of(req: Any) -> SearchTag | None:
    """The sgl-tts search tag of an SGLang ``Req`` (from ``sampling_params.custom_params``)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return SearchTag.from_custom_params(params) if isinstance(params, dict) else None


def request_class(req: Any) -> str:
    tag = tag_of(req)
    return tag.cls if tag is not None else "normal"


def tokens_of(req: Any) -> bytes:
    return as_bytes(req.origin_input_ids) + as_bytes(req.output_ids)


class TTSPolicyState:
    """Per-scheduler state of the prefix-aware policy: settings, group ranks, last order's stats."""

    def __init__(self, settings: TTSSettings):
        self.settings = settings
        self._group_rank: dict[str, int] = {}
        self._counter = itertools.count()
        self.last_deferred = 0
        self.last_queue_len = 0

    def group_rank(self, group: str) -> int:
        rank = self._group_rank.get(group)
        if rank is None:
            if len(self._group_rank) >= MAX_GROUPS:
                for old in list(self._group_rank)[:MAX_GROUPS // 10]:
                    del self._group_rank[old]
            rank = self._group_rank[group] = next(self._counter)
        return rank

    def key(self, req: Any) -> tuple:
        tag = tag_of(req)
        if tag is None:
            return (self.group_rank("rid:" + str(req.rid)), 0, 0, 0, str(req.rid))
        return (self.group_rank(tag.group), tag.depth, tag.parent, tag.beam, str(req.rid))

    def order(self, policy: Any, waiting_queue: list, running_batch: Any = None) -> None:
        """Sort ``waiting_queue`` in place (SGLang's ``calc_priority`` contract)."""
        from sglang.srt.managers.schedule_policy import match_prefix_for_req

        self.last_queue_len = len(waiting_queue)
        if not waiting_queue:
            return
        for req in waiting_queue:   # groups get their rank in arrival order
            self.key(req)
        anchor = None
        if running_batch is not None and getattr(running_batch, "reqs", None):
            anchor = tokens_of(running_batch.reqs[-1])
        by_class: dict[int, list] = {}
        for req in waiting_queue:
            by_class.setdefault(CLASS_RANK.get(request_class(req), 1), []).append(req)
        ordered, deferred = [], []
        for rank in sorted(by_class):
            reqs = by_class[rank]
            seqs = [tokens_of(r) for r in reqs]
            idx = prefix_aware_order(seqs, [self.key(r) for r in reqs], anchor)
            prev: bytes | None = None
            for i in idx:
                req, seq = reqs[i], seqs[i]
                setattr(req, DEFERRED, False)
                if prev is not None and rank < CLASS_RANK["speculative"] and not policy.tree_cache.disable:
                    shared = common_prefix(prev, seq)
                    if shared >= self.settings.dedup_tokens:
                        match_prefix_for_req(policy.tree_cache, req)
                        if shared - len(req.prefix_indices) >= self.settings.dedup_tokens:
                            setattr(req, DEFERRED, True)
                            deferred.append(req)
                            prev = seq
                            continue
                ordered.append(req)
                prev = seq
            if rank == CLASS_RANK["normal"] or (rank < CLASS_RANK["normal"] and
                                                CLASS_RANK["normal"] not in by_class):
                ordered.extend(deferred)   # before speculative requests: normal work comes first
                deferred = []
            anchor = seqs[idx[-1]]
        ordered.extend(deferred)
        self.last_deferred = sum(getattr(r, DEFERRED, False) for r in waiting_queue)
        waiting_queue[:] = ordered


def enable(policy: Any, settings: TTSSettings) -> TTSPolicyState | None:
    """Attach the prefix-aware policy to an SGLang ``SchedulePolicy`` (``None`` when off). The
    policy's tree cache carries it too: the batch-level hooks (retraction) find it there."""
    state = TTSPolicyState(settings) if settings.active else None
    policy.sgl_tts = state
    if policy.tree_cache is not None:
        policy.tree_cache.sgl_tts_policy = state
    return state


def retract_decode(original, self, server_args, *args, **kwargs):
    """AROUND hook on ``ScheduleBatch.retract_decode``: under memory pressure speculative requests
    go first (fewest output tokens first, the least work lost), one at a time until the next decode
    step fits; only if that is not enough does SGLang's own retraction take the rest."""
    if getattr(self.tree_cache, "sgl_tts_policy", None) is None:
        return original(self, server_args, *args, **kwargs)
    spec = [i for i, r in enumerate(self.reqs) if request_class(r) == "speculative"]
    if not spec or len(spec) == len(self.reqs):
        return original(self, server_args, *args, **kwargs)
    spec.sort(key=lambda i: (len(self.reqs[i].output_ids), -len(self.reqs[i].origin_input_ids)))
    keep = list(range(len(self.reqs)))
    retracted = []
    for i in spec:
        keep.remove(i)
        retracted.append(self.reqs[i])
        self.release_req(i, len(keep), server_args)
        if self.check_decode_mem(selected_indices=keep):
            break
    self.filter_batch(keep_indices=keep)
    if self.check_decode_mem():
        from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker

        return retracted, NewTokenRatioTracker.estimate_new_token_ratio_after_retract(self.reqs), []
    more, ratio, aborted = original(self, server_args, *args, **kwargs)
    return retracted + list(more), ratio, aborted


def preempt_speculative(running_batch: Any, waiting_queue: Sequence[Any]) -> list:
    """Two-phase scheduling (seed 000 §4.1.2): when a normal or boosted request waits, every running
    speculative request stops at its next step with what it has generated (finish reason
    ``length``, so a program sees a cut step it can continue). Returns the stopped requests."""
    if running_batch is None or not getattr(running_batch, "reqs", None):
        return []
    if not any(request_class(r) != "speculative" for r in waiting_queue):
        return []
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    stopped = []
    for req in running_batch.reqs:
        if request_class(req) == "speculative" and not req.finished() and req.to_finish is None:
            req.to_finish = FINISH_LENGTH(length=len(req.output_ids))
            stopped.append(req)
    return stopped


def set_class(scheduler: Any, group: str, cls: str, beams: Sequence[int] | None = None,
              depth: int | None = None, priority: int | None = None) -> int:
    """Change the class (and, if given, SGLang's ``priority``) of a search group's waiting and
    running requests (all, or those at ``depth`` / with a beam in ``beams``), e.g. boost the subtree
    MCTS is about to expand. Returns how many requests changed. Takes effect at the next round."""
    from sgl_tts.tts_request import CLASSES

    if priority is not None and not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
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
        req.sampling_params.custom_params["tts_class"] = cls
        if priority is not None:
            req.priority = priority
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
    except (TypeError, ValueError) as exc:
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


def before_prefill(scheduler, *args, **kwargs):
    """BEFORE hook on ``Scheduler.get_new_batch_prefill``: preempt speculative work when normal
    work waits (prefix-aware policy only)."""
    if getattr(scheduler.policy, "sgl_tts", None) is not None:
        stopped = preempt_speculative(scheduler.running_batch, scheduler.waiting_queue)
        if stopped:
            logger.debug("sgl-tts: stopped %d speculative requests for waiting normal work", len(stopped))
    return None


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


__all__ = ["CLASS_RANK", "TTSPolicyState", "add_one_req", "before_prefill", "calc_priority", "enable",
           "preempt_speculative", "request_class", "retract_decode", "set_class", "set_internal_state",
           "set_internal_state_reply",
           "tag_of", "tokens_of"]
