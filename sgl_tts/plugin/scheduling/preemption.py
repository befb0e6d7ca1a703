"""Two-phase scheduling of speculative requests (seed 000 §4.1.2) inside SGLang's scheduler loop.

Speculative requests (class ``speculative``) run only in room normal work does not need:

- **stop when refused**: after SGLang formed a prefill batch, if a normal or boosted request was
  refused for lack of KV tokens or batch room (SGLang marks the running batch full), every running
  speculative request is marked to stop (:func:`after_prefill`). A request that waits for another
  reason (a deferred sibling, the per-round prefill budget, a ``/health_generate`` probe that fits)
  stops nothing;
- **a stop never hides a natural finish**: the mark is applied in ``Req.update_finish_state`` *after*
  SGLang's own checks (:func:`update_finish_state`): if the step's token ends the request (EOS, a stop
  token or string, ``max_new_tokens``) that finish is reported, trimmed as SGLang trims it; otherwise
  the request finishes with ``length`` and every token it generated, so a program sees a cut step it
  can continue;
- **retraction** (:func:`retract_decode`): under memory pressure speculative requests are retracted
  first (fewest output tokens first: the least work lost), then normal ones in SGLang's own order; a
  request that is being stopped is never retracted or re-queued (it ends at its next step anyway, and
  a retraction would re-prefill it in full after all normal work, only to finish it at once).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from sgl_tts.plugin.scheduling.policy import DEFERRED, request_class

logger = logging.getLogger(__name__)

STOP = "_sgl_tts_stop"   # set on a running speculative Req that must end at its next step


def stopping(req: Any) -> bool:
    return getattr(req, STOP, False)


def refused_normal_work(running_batch: Any, waiting_queue: Sequence[Any]) -> bool:
    """Whether a normal or boosted request is waiting because SGLang found no room for it this round
    (its admission loop marks the running batch full when a request gets no KV tokens or the batch
    has no request slot left), as opposed to a deferred sibling or the round's prefill budget."""
    if not getattr(running_batch, "batch_is_full", False):
        return False
    return any(not getattr(r, DEFERRED, False) and request_class(r) != "speculative" for r in waiting_queue)


def stop_speculative(running: Sequence[Any]) -> list:
    """Mark every running, unfinished speculative request to stop at its next step; returns them."""
    stopped = []
    for req in running:
        if request_class(req) == "speculative" and not req.finished() and not stopping(req):
            setattr(req, STOP, True)
            stopped.append(req)
    return stopped


def after_prefill(batch, scheduler, *args, **kwargs):
    """AFTER hook on ``Scheduler.get_new_batch_prefill`` (prefix-aware policy only): stop speculative
    work when normal work was refused for room; tell the policy which requests this prefill batch
    holds (see :meth:`~sgl_tts.plugin.scheduling.policy.TTSPolicyState.on_prefill_batch`)."""
    state = getattr(scheduler.policy, "sgl_tts", None)
    if state is None:
        return batch
    # --enable-mixed-chunk: SGLang mixed the running decode requests into the batch
    # (``decoding_reqs``) and emptied ``running_batch`` (its ``batch_is_full`` survives)
    decoding = (getattr(batch, "decoding_reqs", None) or []) if batch is not None else []
    if batch is not None:
        mixed = {id(r) for r in decoding}
        state.on_prefill_batch([r for r in batch.reqs if id(r) not in mixed])
    if refused_normal_work(scheduler.running_batch, scheduler.waiting_queue):
        running = list(getattr(scheduler.running_batch, "reqs", None) or []) + list(decoding)
        stopped = stop_speculative(running)
        if stopped:
            logger.debug("sgl-tts: stopping %d speculative requests: normal work was refused room",
                         len(stopped))
    # a deferral holds for the round that decided it: a later round that returns before ordering
    # (the batch is full) must see those requests as refused normal work
    for req in scheduler.waiting_queue:
        if getattr(req, DEFERRED, False):
            setattr(req, DEFERRED, False)
    return batch


def update_finish_state(original, self, *args, **kwargs):
    """AROUND hook on ``Req.update_finish_state``: SGLang's checks first; a stop mark ends the
    request only if they did not (``length``, with every generated token)."""
    result = original(self, *args, **kwargs)
    if getattr(self, STOP, False) and not self.finished():
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        self.finished_reason = FINISH_LENGTH(length=len(self.output_ids))
        self.finished_len = len(self.output_ids)
    return result


def retract_decode(original, self, server_args, *args, **kwargs):
    """AROUND hook on ``ScheduleBatch.retract_decode`` (prefix-aware policy only): retract until the
    next decode step fits, speculative requests first, never a request being stopped; if only such
    requests (or one request) are left and it still does not fit, SGLang's own retraction decides."""
    if getattr(self.tree_cache, "sgl_tts_policy", None) is None:
        # (speculative decoding too: SGLang 0.5.15's filter_batch keeps the draft inputs' rows with
        # their requests at any index, tests/test_plugin_live_modes.py)
        return original(self, server_args, *args, **kwargs)
    reqs = self.reqs

    def stock_key(i):   # SGLang's own retraction order: fewest output tokens, then longest prompt
        return (len(reqs[i].output_ids), -len(reqs[i].origin_input_ids))

    spec = sorted((i for i, r in enumerate(reqs) if not stopping(r) and request_class(r) == "speculative"),
                  key=stock_key)
    if not spec and not any(stopping(r) for r in reqs):
        return original(self, server_args, *args, **kwargs)
    normal = sorted((i for i, r in enumerate(reqs) if not stopping(r) and request_class(r) != "speculative"),
                    key=stock_key)
    keep = list(range(len(reqs)))
    retracted = []
    for i in spec + normal:
        if self.check_decode_mem(selected_indices=keep) or len(keep) == 1:
            break
        keep.remove(i)
        retracted.append(reqs[i])
        self.release_req(i, len(keep), server_args)
    fits = self.check_decode_mem(selected_indices=keep)
    self.filter_batch(keep_indices=keep)
    if not fits:   # only requests being stopped (or a single request) left: SGLang decides the rest
        more, ratio, aborted = original(self, server_args, *args, **kwargs)
        return retracted + list(more), ratio, aborted
    from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker

    return retracted, NewTokenRatioTracker.estimate_new_token_ratio_after_retract(self.reqs), []


__all__ = ["STOP", "after_prefill", "refused_normal_work", "retract_decode", "stop_speculative",
           "stopping", "update_finish_state"]
