"""Group abort: one ``/abort_request`` with a search group's rid prefix aborts all of its requests.

SGLang's scheduler aborts every waiting and running request whose rid *starts with* the aborted rid
(and frees their KV through its normal finish path), but 0.5.15's tokenizer manager drops an abort
whose rid is not itself a live request. The plugin's hook on ``TokenizerManager.abort_request`` turns
an abort of a group prefix ``tts/<group>/`` into one abort per live request of that group, each of
which takes SGLang's own path: nothing is left queued or running, and no KV is leaked.
"""

from __future__ import annotations

GROUP_PREFIX = "tts/"


def group_prefix(group: str) -> str:
    """The rid prefix of every request of a search group (see :class:`sgl_tts.tts_request.SearchTag`)."""
    if not group or "/" in group:
        raise ValueError(f"a search group must be a non-empty id without '/', got {group!r}")
    return f"{GROUP_PREFIX}{group}/"


def abort_request(original, self, rid: str = "", abort_all: bool = False, *args, **kwargs):
    """AROUND hook: a ``tts/<group>/`` prefix aborts each live request of the group."""
    if abort_all or not rid or not rid.startswith(GROUP_PREFIX) or not rid.endswith("/"):
        return original(self, rid, abort_all, *args, **kwargs)
    for live in [r for r in list(self.rid_to_state) if r.startswith(rid)]:
        original(self, live, False, *args, **kwargs)
    return None


__all__ = ["GROUP_PREFIX", "abort_request", "group_prefix"]
