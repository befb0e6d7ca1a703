"""Search metadata a TTS program attaches to each generation request (read by the scheduler plugin).

A program tags every request with its search group, its depth (search iteration), the index of its
parent beam at the previous depth, its own beam index and its class, through SGLang's
``sampling_params.custom_params`` (``sgl_tts.gen(..., custom_params=...)``); the request's ``rid``
(:meth:`SearchTag.request_id`, which repeats the tag) and ``priority`` travel beside it. The sgl-tts
scheduler plugin (``--tts-policy prefix-aware``) orders a search's requests by these fields:
siblings together, parents in their previous order.
Stock SGLang ignores the fields, so tagged programs run unchanged on any server.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Mapping

#: request classes: boosted requests go first, speculative ones only into free slots
CLASSES = ("normal", "speculative", "boosted")
KEYS = ("tts_group", "tts_depth", "tts_parent", "tts_beam", "tts_class")
RID_TAG = "#tag="   # where a request id carries its tag (SearchTag.request_id)


@dataclasses.dataclass(frozen=True)
class SearchTag:
    """Where a request sits in a search.

    Attributes:
        group: the search's id (one program run); a group abort addresses it.
        depth: the search iteration (step index) the request generates.
        parent: the parent beam's index at ``depth - 1`` (its position in the previous iteration;
            ``-1`` at the root).
        beam: this request's beam index at ``depth``.
        cls: ``normal``, ``speculative`` or ``boosted``.
        ordinal: its place among its parent's children (what its sampling seed is keyed by), when
            that differs from ``beam``: a speculative request is a child before it has a beam index.
    """

    group: str
    depth: int = 0
    parent: int = -1
    beam: int = 0
    cls: str = "normal"
    ordinal: int | None = None

    def __post_init__(self):
        if self.cls not in CLASSES:
            raise ValueError(f"unknown request class {self.cls!r}; choose one of {', '.join(CLASSES)}")
        if not self.group or "/" in self.group:
            raise ValueError(f"a search group must be a non-empty id without '/', got {self.group!r}")

    def custom_params(self) -> dict[str, Any]:
        params = {"tts_group": self.group, "tts_depth": self.depth, "tts_parent": self.parent,
                  "tts_beam": self.beam, "tts_class": self.cls}
        if self.ordinal is not None:
            params["tts_ordinal"] = self.ordinal
        return params

    def rid(self, attempt: str = "") -> str:
        """This place's rid prefix, ``tts/<group>/<depth>/<beam>`` (``attempt`` appended: repeated
        requests at one place, e.g. rollouts); :meth:`request_id` makes a unique rid from it."""
        return f"tts/{self.group}/{self.depth}/{self.beam}" + (f"/{attempt}" if attempt else "")

    def request_id(self, attempt: str = "", *, prefix: str | None = None) -> str:
        """A unique request id for this tag: ``prefix`` (by default :meth:`rid` and ``/``, so group
        and depth aborts find it), a random part, then the tag itself after ``#tag=``. The scheduler
        plugin reads the tag from there when ``custom_params`` did not arrive: sglang-router 0.3.2
        forwards the rid but drops ``sampling_params.custom_params``."""
        head = prefix if prefix is not None else self.rid(attempt) + "/"
        fields = [self.depth, self.parent, self.beam, self.cls] + ([self.ordinal] if self.ordinal is not None else [])
        return f"{head}{uuid.uuid4().hex[:8]}{RID_TAG}{','.join(map(str, fields))}"

    @classmethod
    def from_rid(cls, rid: Any) -> "SearchTag | None":
        """The tag a :meth:`request_id` carries (``tts/<group>/...#tag=depth,parent,beam,class[,ordinal]``),
        or ``None`` for any other rid."""
        if not isinstance(rid, str) or not rid.startswith("tts/") or RID_TAG not in rid:
            return None
        group = rid.split("/", 2)[1]
        fields = rid.rsplit(RID_TAG, 1)[1].split(",")
        if len(fields) not in (4, 5):
            return None
        try:
            return cls(group, int(fields[0]), int(fields[1]), int(fields[2]), fields[3],
                       int(fields[4]) if len(fields) == 5 else None)
        except ValueError:   # a malformed number or class: an untagged request, never an error
            return None

    @classmethod
    def from_custom_params(cls, params: Mapping[str, Any] | None) -> "SearchTag | None":
        """The tag in a request's ``custom_params``, or ``None`` for an untagged request."""
        if not params or "tts_group" not in params:
            return None
        try:
            return cls(str(params["tts_group"]), int(params.get("tts_depth", 0)),
                       int(params.get("tts_parent", -1)), int(params.get("tts_beam", 0)),
                       str(params.get("tts_class", "normal")),
                       None if params.get("tts_ordinal") is None else int(params["tts_ordinal"]))
        except (TypeError, ValueError):
            return None


def new_group() -> str:
    """A fresh search group id."""
    return uuid.uuid4().hex[:12]


__all__ = ["CLASSES", "KEYS", "RID_TAG", "SearchTag", "new_group"]
