"""The sgl-tts scheduler plugin's control plane, client side: abort a search group's requests (or a
deeper rid prefix) and change their class, on a server or on every server behind a router. It sends
no generation and needs neither SGLang's frontend interpreter nor the served model's info, so a
job scheduler, a benchmark or an operator can hold one for any server."""

from __future__ import annotations

from typing import Any, Sequence

from sgl_tts.backends.connection import ServerConnection
from sgl_tts.backends.request import AbortLedger
from sgl_tts.protocol import group_prefix, is_group_prefix


class ServerControl:
    """Aborts and class changes (docs/SCHEDULER_PLUGIN.md) through ``connection``.

    ``ledger``: where an abort is recorded so that a request of the aborted prefix not sent yet is
    answered as aborted by the generation backend that shares it (:class:`AbortLedger`).
    """

    def __init__(self, connection: ServerConnection, ledger: AbortLedger | None = None):
        self.connection = connection
        self.ledger = ledger if ledger is not None else AbortLedger()

    def abort_group(self, group: str) -> None:
        """Abort every queued and running request of a search group (its requests' rids start with
        ``tts/<group>/``; needs the sgl-tts plugin on the server, see docs/SCHEDULER_PLUGIN.md)."""
        self.abort_prefix(group_prefix(group))

    def abort_prefix(self, prefix: str) -> None:
        """Abort every queued and running request whose rid starts with ``prefix``, a ``tts/<group>/``
        prefix or a deeper one ending in ``/`` (e.g. one speculative branch's; sgl-tts plugin)."""
        if not is_group_prefix(prefix):
            raise ValueError(f"an abort prefix must start with 'tts/<group>/' and end with '/', got {prefix!r}")
        self.ledger.record(prefix)   # its requests not sent yet are answered by the backend (AbortLedger)
        for url in self.connection.workers():   # a router does not pass /abort_request on: ask each server
            self.connection.check(self.connection.request("/abort_request", {"rid": prefix}, base=url), url)

    def set_class(self, group: str, cls: str, beams: Sequence[int] | None = None,
                  depth: int | None = None, priority: int | None = None) -> int:
        """Change the class (``normal``, ``speculative``, ``boosted``; and optionally SGLang's
        ``priority``) of a search group's waiting and running requests in one call, e.g. boost what
        MCTS expands next (sgl-tts plugin on the server). Returns how many requests the server's
        schedulers re-classed; a refused command raises ``ValueError`` with the server's reason, a
        server without the plugin ``RuntimeError``."""
        command: dict[str, Any] = {"group": group, "cls": cls}
        if beams is not None:
            command["beams"] = [int(b) for b in beams]
        if depth is not None:
            command["depth"] = int(depth)
        if priority is not None:
            command["priority"] = int(priority)
        base = self.connection.base_url
        answers = []
        for url in self.connection.workers():   # a router does not pass /set_internal_state on: ask each
            res = self.connection.request("/set_internal_state", {"server_args": {"tts_set_class": command}},
                                          base=url)
            self.connection.check(res, url)
            got = res.json()
            answers += got if isinstance(got, list) else [got]
        total = 0
        for out in answers:
            if not isinstance(out, dict):   # SGLang's bare flag: the plugin is not loaded there
                raise RuntimeError(f"{base} answered {out!r} to tts_set_class: is the sgl-tts "
                                   f"plugin loaded there (SGLANG_PLUGINS)?")
            info = (out.get("server_args") or {}).get("tts_set_class") or {}
            if "error" in info:
                raise ValueError(f"{base} refused the class change: {info['error']}")
            if not out.get("updated") or "requests" not in info:
                raise RuntimeError(f"{base} did not apply tts_set_class (is the sgl-tts plugin "
                                   f"loaded there?); it answered {out!r}")
            total += int(info["requests"])
        return total


__all__ = ["ServerControl"]
