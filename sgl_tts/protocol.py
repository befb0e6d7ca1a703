"""The wire protocol between TTS programs and the sgl-tts scheduler plugin: its one home.

Client code (programs, pipeline, backends, the search service) and the plugin both import it; it
imports nothing of sgl-tts, torch or SGLang, so the plugin stays light in every scheduler process.

**Request ids.** Every tagged request's rid starts ``tts/<group>/<depth>/<place>/`` (:func:`rid_prefix`):
aborting the prefix ``tts/<group>/`` (:func:`group_prefix`) ends a whole search, a deeper prefix ending
in ``/`` (:func:`is_group_prefix`) one depth or one place. :meth:`SearchTag.request_id` appends a random
part and the tag after ``#tag=`` (:data:`RID_TAG`).

**Tags.** A program tags every request with its search group, its depth (search iteration), the index of its
parent beam at the previous depth, its own beam index and its class, through SGLang's
``sampling_params.custom_params`` (``sgl_tts.gen(..., custom_params=...)``); the request's ``rid``
(:meth:`SearchTag.request_id`, which repeats the tag) and ``priority`` travel beside it. The sgl-tts
scheduler plugin (``--tts-policy prefix-aware``) orders a search's requests by these fields:
siblings together, parents in their previous order.
Stock SGLang ignores the fields, so tagged programs run unchanged on any server.

**Step-pooled PRMs.** The plugin's PRM classes answer one row per step token they compute, and the
client aligns the rows to the same tokens: Qwen2.5-Math-PRM's :data:`QWEN_PRM_STEP_TOKEN` (an added
token) and the last token of Skywork's :data:`SKYWORK_PRM_STEP_TEXT`.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Mapping

#: request classes: boosted requests go first, speculative ones only into free slots
CLASSES = ("normal", "speculative", "boosted")
KEYS = ("tts_group", "tts_depth", "tts_parent", "tts_beam", "tts_class")
RID_TAG = "#tag="   # where a request id carries its tag (SearchTag.request_id)
GROUP_PREFIX = "tts/"   # every tagged rid starts with it
QWEN_PRM_STEP_TOKEN = "<extra_0>"   # Qwen2.5-Math-PRM scores at this token after each step
SKYWORK_PRM_STEP_TEXT = "\n"        # Skywork-o1-Open-PRM closes each step (line) with it and scores there
#: their ids in the Qwen2.5 vocabulary: where a checkpoint served without its tokenizer (a real config
#: with random weights, a benchmark's word tokenizer apart) pools, and where its client puts them
STEP_POOLED_DEFAULT_IDS = {"Qwen2ForProcessRewardModel": 151651, "Qwen2ForPrmModel": 198}


def check_group(group: str) -> str:
    """``group`` if it can name a search group (non-empty, no ``/``), else ``ValueError``."""
    if not isinstance(group, str) or not group or "/" in group:
        raise ValueError(f"a search group must be a non-empty id without '/', got {group!r}")
    return group


def group_prefix(group: str) -> str:
    """The rid prefix of every request of a search group: ``tts/<group>/``."""
    return f"{GROUP_PREFIX}{check_group(group)}/"


def rid_prefix(group: str, depth: int, *places: object) -> str:
    """The rid prefix of the requests of ``group`` at ``depth`` (and below ``places``, each one path
    part): ``tts/<group>/<depth>/<place>/.../``, what a depth or place abort sends."""
    return group_prefix(group) + "".join(f"{p}/" for p in (depth, *places))


def is_group_prefix(rid: str) -> bool:
    """Whether ``rid`` is a prefix of sgl-tts rids rather than one request's rid: ``tts/<group>/``
    (a whole search group) or any deeper prefix ending in ``/`` (``tts/<group>/<depth>/``)."""
    return bool(rid) and rid.startswith(GROUP_PREFIX) and rid.endswith("/")


def is_tagged_rid(rid: object) -> bool:
    """Whether ``rid`` is one of sgl-tts's (``tts/...``)."""
    return isinstance(rid, str) and rid.startswith(GROUP_PREFIX)


def rid_group(rid: object) -> str | None:
    """The search group a tagged rid or rid prefix (``tts/<group>/...``) names, else ``None`` (an
    untagged rid, or ``tts/`` with no group ended by ``/`` after it)."""
    if not is_tagged_rid(rid):
        return None
    parts = rid.split("/", 2)   # type: ignore[union-attr]
    return parts[1] if len(parts) > 2 and parts[1] else None


def rid_depth(rid: object) -> int | None:
    """The depth a tagged rid (``tts/<group>/<depth>/...``) names, else ``None``."""
    if not is_tagged_rid(rid):
        return None
    parts = rid.split("/")   # type: ignore[union-attr]
    return int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else None


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
        check_group(self.group)

    def custom_params(self) -> dict[str, Any]:
        params = {"tts_group": self.group, "tts_depth": self.depth, "tts_parent": self.parent,
                  "tts_beam": self.beam, "tts_class": self.cls}
        if self.ordinal is not None:
            params["tts_ordinal"] = self.ordinal
        return params

    def rid(self, attempt: str = "") -> str:
        """This place's rid prefix, ``tts/<group>/<depth>/<beam>`` (``attempt`` appended: repeated
        requests at one place, e.g. rollouts); :meth:`request_id` makes a unique rid from it."""
        return rid_prefix(self.group, self.depth, self.beam)[:-1] + (f"/{attempt}" if attempt else "")

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
        group = rid_group(rid)
        if group is None or RID_TAG not in rid:
            return None
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


__all__ = ["CLASSES", "GROUP_PREFIX", "KEYS", "QWEN_PRM_STEP_TOKEN", "RID_TAG", "SKYWORK_PRM_STEP_TEXT",
           "STEP_POOLED_DEFAULT_IDS", "SearchTag", "check_group", "group_prefix",
           "is_group_prefix", "is_tagged_rid", "new_group", "rid_depth", "rid_group", "rid_prefix"]
