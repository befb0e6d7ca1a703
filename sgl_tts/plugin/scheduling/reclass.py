"""Re-classing a search group's requests on a running server (e.g. MCTS boosting the subtree it is
about to expand): :func:`set_class` on a scheduler, reached through SGLang's ``/set_internal_state``
route by the plugin's hooks on ``Scheduler.set_internal_state`` and
``TokenizerManager.set_internal_state`` (the client side is :meth:`sgl_tts.backends.control.ServerControl.set_class`)."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from sgl_tts.plugin.scheduling.policy import forget, tag_of

logger = logging.getLogger(__name__)


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
        forget(req)   # its class (and so the queue's order) changed
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


__all__ = ["set_class", "set_internal_state", "set_internal_state_reply"]
