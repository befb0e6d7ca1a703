"""SGLang server backends: an HTTP endpoint that sends per-call request fields, and an in-process
SGLang runtime for a machine with CUDA."""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any, Sequence

from sglang.global_config import global_config
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

from sgl_tts.backends.connection import ServerConnection, ServerError, ServerUnavailable  # noqa: F401 (their old home)
from sgl_tts.backends.control import ServerControl
from sgl_tts.backends.request import AbortLedger, RequestFields, aborted_answer, take_request_fields
from sgl_tts.backends.scoring import ServerScoring

logger = logging.getLogger(__name__)


# the text a fork adds past what the server last generated on its state, at most, for its prefix
# commit to be skipped (a step delimiter the program appended; a few tokens each child computes)
COMMIT_SKIP_CHARS = 32
_SERVED = "_sgl_tts_served"   # on a StreamExecutor: (endpoint id, its text's length once its last gen is in)


class SGLangEndpoint(RuntimeEndpoint):
    """SGLang's ``RuntimeEndpoint`` that also sends :class:`RequestFields` with each ``/generate``.

    One difference in what it sends: ``fork`` of a state whose text this server has just generated
    (plus at most :data:`COMMIT_SKIP_CHARS` characters the program appended) sends no prefix commit
    (SGLang's ``max_new_tokens: 0`` request). The server's radix cache holds a finished request's
    prompt and output already, so that commit would compute one token and cost every child a round
    trip; a fork of any other text (a fresh prompt) commits as SGLang does. The samples are the same
    either way. Everything else (chat templates, ``select``, ``concatenate_and_append``) is SGLang's own.

    Its parts are objects of their own, each usable alone: :attr:`connection`
    (:class:`~sgl_tts.backends.connection.ServerConnection`: HTTP, errors that name the server, a
    router's workers), :attr:`control` (:class:`~sgl_tts.backends.control.ServerControl`: the
    plugin's aborts and class changes) and :attr:`scoring`
    (:class:`~sgl_tts.backends.scoring.ServerScoring`: PRM reads). Its methods of the same names
    delegate to them, so a program sees one backend.

    Subclasses meter, refuse or reshape generations through three public hooks that both
    :meth:`generate` and :meth:`generate_stream` call, so a change to either reaches them:
    :meth:`prepare_request` (the body before it is sent; may change it or raise), :meth:`sending`
    (a context around the request while it is on the wire) and :meth:`finish_answer` (a whole answer
    before the program sees it).
    """

    def __init__(self, base_url: str, api_key: str | None = None, verify: str | None = None,
                 chat_template_name: str | None = None, tokenizer_path: str | None = None):
        self.connection = ServerConnection(base_url, api_key=api_key, verify=verify)
        self._aborts = AbortLedger()
        self.control = ServerControl(self.connection, self._aborts)
        try:
            super().__init__(base_url, api_key=api_key, verify=verify,
                             chat_template_name=chat_template_name)
        except (OSError, ConnectionError) as exc:  # urllib's URLError is an OSError
            raise ConnectionError(
                f"cannot reach an SGLang server at {base_url} ({exc}); start one with "
                f"`python -m sglang.launch_server --model-path PATH --port PORT` or fix the URL"
            ) from exc
        # self.post: a subclass's override (metering) sees the PRM reads too
        self.scoring = ServerScoring(self.post, base_url, tokenizer_path=tokenizer_path,
                                     model_info=getattr(self, "model_info", None))

    @property
    def tokenizer_path(self) -> str | None:
        return self.scoring.tokenizer_path

    def request_body(self, s, sampling_params, fields: RequestFields) -> dict[str, Any]:
        """The ``/generate`` body SGLang's client sends for ``s`` and these sampling params, with the
        request fields (rid, priority, custom params, token ids' logprobs, seed)."""
        self._handle_dtype_to_regex(sampling_params)
        data: dict[str, Any] = {
            "text": s.text_,
            "sampling_params": {
                "skip_special_tokens": global_config.skip_special_tokens_in_output,
                "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
                **sampling_params.to_srt_kwargs(),
            },
        }
        for item in ("return_logprob", "logprob_start_len", "top_logprobs_num",
                     "return_text_in_logprobs"):
            value = getattr(sampling_params, item, None)
            if value is not None:
                data[item] = value
        apply_request_fields(data, fields)
        self._add_images(s, data)
        return data

    # ------------------------------------------------------------------------ hooks (subclasses)
    def prepare_request(self, s, data: dict[str, Any], fields: RequestFields) -> Any:
        """Called with every generation's body before it is sent (streamed or not): may change it, or
        raise to refuse the request. What it returns reaches :meth:`finish_answer`. Default: nothing."""
        return None

    @contextlib.contextmanager
    def sending(self, data: dict[str, Any]):
        """A context around each generation while it is on the wire (a stream: until it ends)."""
        yield

    def finish_answer(self, s, data: dict[str, Any], prepared: Any, text: str,
                      meta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Called with every whole answer (not streamed) before the program sees it; may rewrite it.
        ``prepared`` is what :meth:`prepare_request` returned. Default: the answer as it came."""
        return text, meta

    # ---------------------------------------------------------------------------- generation
    def generate(self, s, sampling_params):
        fields = take_request_fields()
        if self._aborts.covers(fields):
            return aborted_answer(fields)
        data = self.request_body(s, sampling_params, fields)
        prepared = self.prepare_request(s, data, fields)
        with self.sending(data):
            obj = self.post("/generate", data)
        text, meta = self.finish_answer(s, data, prepared, obj["text"], obj["meta_info"])
        self._served(s, len(s.text_) + len(text))   # the interpreter appends the text next
        return text, meta

    def _served(self, s, length: int) -> None:
        """Note that the server caches the first ``length`` characters of ``s``'s text: a request on
        them just finished."""
        try:
            setattr(s, _SERVED, (id(self), length))
        except AttributeError:   # a state that takes no attributes: its forks just commit
            pass

    def generate_stream(self, s, sampling_params):
        fields = take_request_fields()
        if self._aborts.covers(fields):
            yield aborted_answer(fields)
            return
        data = self.request_body(s, sampling_params, fields)
        self.prepare_request(s, data, fields)
        data["stream"] = True
        start = len(s.text_)   # the interpreter appends each piece to the text as it comes
        pos = 0
        with self.sending(data):
            res = self.connection.request("/generate", data, stream=True)
            self.connection.check(res)
            for chunk in res.iter_lines(decode_unicode=False):
                chunk = chunk.decode("utf-8")
                if chunk and chunk.startswith("data:"):
                    if chunk == "data: [DONE]":
                        break
                    obj = json.loads(chunk[5:].strip("\n"))
                    text = obj["text"][pos:]
                    pos += len(text)
                    yield text, obj["meta_info"]
        self._served(s, start + pos)

    def select(self, s, choices, temperature, choices_method=None):
        take_request_fields()  # fields are for generation calls only; never let them leak
        with self.connection.answering("a select"):
            return super().select(s, choices, temperature, choices_method)

    def commit_lazy_operations(self, s):
        served = getattr(s, _SERVED, None)
        if served is not None and served[0] == id(self) and 0 <= len(s.text_) - served[1] <= COMMIT_SKIP_CHARS:
            return None   # the server caches this text already (see the class docstring)
        with self.connection.answering("a prefix commit (fork)"):
            return super().commit_lazy_operations(s)

    def cache_prefix(self, prefix_str: str):
        with self.connection.answering("a prefix cache request"):
            return super().cache_prefix(prefix_str)

    # ------------------------------------------------ PRM reads and control plane (delegated)
    @property
    def tokenizer(self):
        """The served model's tokenizer (:attr:`ServerScoring.tokenizer`)."""
        return self.scoring.tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as the server tokenizes a ``/generate`` prompt."""
        return self.scoring.encode(text)

    def next_token_logprobs(self, prompts: Sequence[str | Sequence[int]], positions: Sequence[Sequence[int]],
                            token_ids: Sequence[int]) -> list[list[list[float]]]:
        """:meth:`ServerScoring.next_token_logprobs` (a step-tag PRM's read)."""
        return self.scoring.next_token_logprobs(prompts, positions, token_ids)

    def classify(self, inputs: Sequence[str | Sequence[int]]) -> list[list[float]]:
        """:meth:`ServerScoring.classify` (a reward-head PRM's read)."""
        return self.scoring.classify(inputs)

    def step_rows(self, inputs: Sequence[Sequence[int]]) -> list[list[list[float]]]:
        """:meth:`ServerScoring.step_rows` (a step-pooled PRM's read)."""
        return self.scoring.step_rows(inputs)

    def abort_group(self, group: str) -> None:
        """:meth:`ServerControl.abort_group`: abort a search group's requests (sgl-tts plugin)."""
        self.control.abort_group(group)

    def abort_prefix(self, prefix: str) -> None:
        """:meth:`ServerControl.abort_prefix`; a request of ``prefix`` not sent yet is answered here
        as aborted, never sent."""
        self.control.abort_prefix(prefix)

    def set_class(self, group: str, cls: str, beams: Sequence[int] | None = None,
                  depth: int | None = None, priority: int | None = None) -> int:
        """:meth:`ServerControl.set_class`: re-class a search group's requests (sgl-tts plugin)."""
        return self.control.set_class(group, cls, beams=beams, depth=depth, priority=priority)

    def decode_curve(self):
        """This server's decode curve (a :class:`~sgl_tts.server_costs.DecodeCurve`: seconds
        per decode step against the running batch), what ``speculative="auto"`` decides on: measured
        the first time this process asks and cached on disk per server, as ``sgl-tts run`` caches it
        (:func:`sgl_tts.launch.decode_curve.server_curve`)."""
        from sgl_tts.launch.decode_curve import server_curve

        return server_curve(self.base_url).curve

    def workers(self) -> list[str]:
        """The SGLang servers behind this URL (:meth:`ServerConnection.workers`)."""
        return self.connection.workers()

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        """POST ``payload`` to ``path`` on the server and return the decoded JSON answer (every
        non-streamed request of this backend, PRM reads included, goes through here)."""
        return self.connection.post(path, payload)


def apply_request_fields(data: dict[str, Any], fields: RequestFields) -> dict[str, Any]:
    """Put ``fields`` where SGLang 0.5.15's ``GenerateReqInput`` expects them."""
    sp = data.setdefault("sampling_params", {})
    if fields.rid is not None:
        data["rid"] = fields.rid
    if fields.priority is not None:
        data["priority"] = int(fields.priority)
    if fields.custom_params is not None:
        sp["custom_params"] = dict(fields.custom_params)
    if fields.seed is not None:
        sp["sampling_seed"] = int(fields.seed)
    if fields.custom_logit_processor is not None:
        data["custom_logit_processor"] = fields.custom_logit_processor
    if fields.token_ids_logprob is not None:
        data["token_ids_logprob"] = [int(t) for t in fields.token_ids_logprob]
        data["return_logprob"] = True
    return data


class InProcessSGLang(SGLangEndpoint):
    """Start an SGLang server for ``model_path`` in a child process (needs CUDA) and talk to it.

    Keyword arguments are SGLang ``ServerArgs`` (e.g. ``mem_fraction_static=0.5``).
    """

    def __init__(self, model_path: str, **server_args: Any):
        from sglang.lang.backend.runtime_endpoint import Runtime

        self.runtime = Runtime(model_path=str(model_path), **server_args)
        super().__init__(self.runtime.url)

    def shutdown(self) -> None:
        self.runtime.shutdown()
