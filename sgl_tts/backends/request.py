"""Per-call request fields that SGLang's ``sgl.gen`` does not pass, carried to the backend.

``sgl_tts.gen(...)`` is ``sgl.gen(...)`` plus ``rid``, ``priority``, ``custom_params``,
``custom_logit_processor``, ``token_ids_logprob`` and ``seed``. The interpreter hands a backend only the text and the sampling
parameters, so the fields travel beside them: when the interpreter's worker thread reads the
expression's sampling parameters (immediately before it calls ``backend.generate`` on that same
thread), the expression leaves its fields in a thread-local slot, and sgl-tts backends take them out.
Each ``StreamExecutor`` runs its expressions in order on its own thread, so a field can never reach
another call. Stock SGLang backends never take the fields (they are not sent); the next
``sgl_tts.gen`` on that thread then warns.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import warnings
from typing import Any, Mapping, Sequence

from sglang.lang.api import gen as _sgl_gen
from sglang.lang.ir import SglExpr, SglGen

from sgl_tts.protocol import rid_group

_slot = threading.local()
_clock = itertools.count(1)   # orders request creation and aborts (next() is atomic under the GIL)


@dataclasses.dataclass(frozen=True)
class RequestFields:
    """Fields of one ``/generate`` request beyond the sampling parameters.

    Attributes:
        rid: request id (SGLang's ``rid``); lets a scheduler plugin or an abort address the request.
        priority: scheduling priority (SGLang: higher value first by default).
        custom_params: free-form per-request parameters (SGLang ``sampling_params.custom_params``),
            e.g. search group, parent beam, depth and request class for the sgl-tts scheduler plugin.
        token_ids_logprob: token ids whose log-probabilities to return at every returned position
            (turns ``return_logprob`` on).
        seed: per-request sampling seed (SGLang ``sampling_params.sampling_seed``).
        custom_logit_processor: an SGLang custom logit processor, serialized
            (``CustomLogitProcessor.to_str()``), applied to this request's logits with its
            ``custom_params`` (a server needs ``--enable-custom-logit-processor``).
        issued: when ``sgl_tts.gen`` made the request, on the clock :class:`AbortLedger` reads (0:
            unknown); not sent.
    """

    rid: str | None = None
    priority: int | None = None
    custom_params: Mapping[str, Any] | None = None
    token_ids_logprob: Sequence[int] | None = None
    seed: int | None = None
    custom_logit_processor: str | None = None
    issued: int = dataclasses.field(default=0, compare=False)

    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in dataclasses.fields(self) if f.name != "issued")


class RequestGen(SglGen):
    """An ``SglGen`` that carries :class:`RequestFields` to sgl-tts backends."""

    def __init__(self, base: SglGen, fields: RequestFields):
        super().__init__(base.name)
        self._params = base.sampling_params
        self.request_fields = fields

    @property
    def sampling_params(self):  # read by StreamExecutor._execute_gen right before backend.generate
        if getattr(_slot, "fields", None) is not None:
            warnings.warn("request fields of an earlier sgl_tts.gen were never sent: its backend is "
                          "not an sgl-tts backend (stock SGLang backends ignore rid, priority, "
                          "custom_params, token_ids_logprob and seed)", RuntimeWarning, stacklevel=2)
        _slot.fields = self.request_fields
        return self._params

    @sampling_params.setter
    def sampling_params(self, value):
        self._params = value

    def __repr__(self) -> str:
        return f"Gen('{self.name}', {self.request_fields})"


def take_request_fields() -> RequestFields:
    """Remove and return the fields left for the current call (empty fields if there are none)."""
    fields = getattr(_slot, "fields", None)
    _slot.fields = None
    return fields if fields is not None else RequestFields()


class AbortLedger:
    """The ``tts/<group>/...`` rid prefixes a backend aborted, and when.

    A search can abort a request its interpreter thread has queued but not sent yet (a speculative
    branch pruned at selection moments after it was started): the server's abort finds nothing then,
    and the request, sent a moment later, runs to its end. So a backend answers a request made
    (``sgl_tts.gen``) before an abort of a prefix of its rid as aborted, without sending it; one made
    after it (a rerun of the same search group) is sent as usual. The last ``groups`` groups are kept.
    """

    def __init__(self, groups: int = 1024):
        self._groups = groups
        self._by_group: collections.OrderedDict[str, list[tuple[str, int]]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def record(self, prefix: str) -> None:
        """Note an abort of ``prefix`` (call it before the abort is sent)."""
        group = rid_group(prefix)
        if group is None:
            return
        with self._lock:
            entries = self._by_group.pop(group, [])
            entries.append((prefix, next(_clock)))
            self._by_group[group] = entries
            while len(self._by_group) > self._groups:
                self._by_group.popitem(last=False)

    def covers(self, fields: RequestFields) -> bool:
        """Whether an abort recorded after ``fields``' request was made covers its rid."""
        group = rid_group(fields.rid)
        if group is None or not fields.issued:
            return False
        with self._lock:
            entries = list(self._by_group.get(group, ()))
        return any(fields.rid.startswith(prefix) and when > fields.issued for prefix, when in entries)


def aborted_answer(fields: RequestFields) -> tuple[str, dict[str, Any]]:
    """What a backend answers for a request an :class:`AbortLedger` covers: no text, ``abort``."""
    return "", {"id": fields.rid, "finish_reason": {"type": "abort", "message": "aborted before it was sent"},
                "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}


def gen(
    name: str | None = None,
    *,
    rid: str | None = None,
    priority: int | None = None,
    custom_params: Mapping[str, Any] | None = None,
    token_ids_logprob: Sequence[int] | None = None,
    seed: int | None = None,
    custom_logit_processor: str | None = None,
    **kwargs: Any,
) -> SglExpr:
    """``sgl.gen`` with per-request fields (see :class:`RequestFields`); other arguments as ``sgl.gen``.

    Example::

        forks += lambda i: sgl_tts.gen("step", max_tokens=64, stop="\\n\\n", seed=1000 + i,
                                       custom_params={"group": "q17", "depth": 2})
    """
    fields = RequestFields(rid, priority, dict(custom_params) if custom_params is not None else None,
                           list(token_ids_logprob) if token_ids_logprob is not None else None, seed,
                           custom_logit_processor, issued=next(_clock))
    base = _sgl_gen(name, **kwargs)
    if fields.is_empty():
        return base
    if not isinstance(base, SglGen):
        raise ValueError("request fields (rid, priority, custom_params, token_ids_logprob, seed) "
                         "apply to generation calls, not to choices/select")
    return RequestGen(base, fields)
