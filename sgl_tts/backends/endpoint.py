"""SGLang server backends: an HTTP endpoint that sends per-call request fields, and an in-process
SGLang runtime for a machine with CUDA."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
from typing import Any, Sequence

from sglang.global_config import global_config
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.utils import http_request

from sgl_tts.backends.request import AbortLedger, RequestFields, aborted_answer, take_request_fields
from sgl_tts.protocol import group_prefix, is_group_prefix

logger = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """The SGLang server answered with an error status; the message names the server."""


class ServerUnavailable(ConnectionError):
    """The SGLang server stopped answering (refused, reset or closed the connection); the message
    names the server and the route."""


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

    Subclasses meter, refuse or reshape generations through three public hooks that both
    :meth:`generate` and :meth:`generate_stream` call, so a change to either reaches them:
    :meth:`prepare_request` (the body before it is sent; may change it or raise), :meth:`sending`
    (a context around the request while it is on the wire) and :meth:`finish_answer` (a whole answer
    before the program sees it).
    """

    def __init__(self, base_url: str, api_key: str | None = None, verify: str | None = None,
                 chat_template_name: str | None = None, tokenizer_path: str | None = None):
        self.tokenizer_path = tokenizer_path
        self._tokenizer = None
        self._router: bool | None = None   # unknown until workers() asks
        self._aborts = AbortLedger()
        try:
            super().__init__(base_url, api_key=api_key, verify=verify,
                             chat_template_name=chat_template_name)
        except (OSError, ConnectionError) as exc:  # urllib's URLError is an OSError
            raise ConnectionError(
                f"cannot reach an SGLang server at {base_url} ({exc}); start one with "
                f"`python -m sglang.launch_server --model-path PATH --port PORT` or fix the URL"
            ) from exc

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
            res = self._http("/generate", data, stream=True)
            self._assert_success(res)
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
        with self._answering("a select"):
            return super().select(s, choices, temperature, choices_method)

    def commit_lazy_operations(self, s):
        served = getattr(s, _SERVED, None)
        if served is not None and served[0] == id(self) and 0 <= len(s.text_) - served[1] <= COMMIT_SKIP_CHARS:
            return None   # the server caches this text already (see the class docstring)
        with self._answering("a prefix commit (fork)"):
            return super().commit_lazy_operations(s)

    def cache_prefix(self, prefix_str: str):
        with self._answering("a prefix cache request"):
            return super().cache_prefix(prefix_str)

    @property
    def tokenizer(self):
        """The served model's Hugging Face tokenizer (``tokenizer_path``, else the path the server
        reports), loaded once; token positions for PRM reads are computed with it."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            info = getattr(self, "model_info", None) or {}
            path = self.tokenizer_path or info.get("tokenizer_path") or info.get("model_path")
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError, TypeError) as exc:
                raise ValueError(
                    f"cannot load the tokenizer of the model served at {self.base_url} from {path!r} "
                    f"({exc}); pass SGLangEndpoint(..., tokenizer_path=PATH)") from exc
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as the server tokenizes a ``/generate`` prompt."""
        return self.tokenizer.encode(text)

    def next_token_logprobs(self, prompts: Sequence[str | Sequence[int]],
                            positions: Sequence[Sequence[int]],
                            token_ids: Sequence[int]) -> list[list[list[float]]]:
        """log P(next token = t | prompt[: p + 1]) for every prompt, position p and id t, like
        :meth:`LocalBackend.next_token_logprobs`, from one batched ``/generate`` with
        ``max_new_tokens: 0``, ``return_logprob``, ``logprob_start_len`` and ``token_ids_logprob``.

        SGLang 0.5.15 reports input logprobs per input token: entry k of ``input_token_ids_logprobs``
        is the distribution of the token at ``logprob_start_len + k``, read at the position before it
        (entry 0 is None), and the distribution after the last input token is dropped. So the
        distribution after position p is entry ``p + 1 - logprob_start_len``, and one padding token
        is appended to each prompt so that its last position is covered too.
        """
        if len(prompts) != len(positions):
            raise ValueError("prompts and positions must have the same length")
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        batch, starts, wanted = [], [], []
        for prompt, pos in zip(prompts, positions):
            ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
            pos = [p + len(ids) if p < 0 else p for p in pos]
            if any(not 0 <= p < len(ids) for p in pos):
                raise ValueError(f"positions {list(pos)} out of range for a prompt of {len(ids)} tokens")
            batch.append(ids + [pad])
            starts.append(min(pos) if pos else len(ids) - 1)
            wanted.append(pos)
        if not batch:
            return []
        ids_list = [int(t) for t in token_ids]
        obj = self.post("/generate", {
            "input_ids": batch, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": [True] * len(batch), "logprob_start_len": starts,
            "token_ids_logprob": [ids_list] * len(batch)})
        results = obj if isinstance(obj, list) else [obj]
        out = []
        for res, start, pos in zip(results, starts, wanted):
            entries = res["meta_info"]["input_token_ids_logprobs"]
            rows = []
            for p in pos:
                got = {int(e[1]): float(e[0]) for e in entries[p + 1 - start]}
                rows.append([got[t] for t in ids_list])
            out.append(rows)
        return out

    def classify(self, inputs: Sequence[str | Sequence[int]]) -> list[list[float]]:
        """The served reward / classifier head's output at the last token of every input, one batched
        ``/classify`` request (SGLang pools the last token and applies no softmax)."""
        if not inputs:
            return []
        if all(isinstance(x, str) for x in inputs):
            payload: dict[str, Any] = {"text": list(inputs)}
        else:
            payload = {"input_ids": [self.encode(x) if isinstance(x, str) else [int(t) for t in x]
                                     for x in inputs]}
        res = self.post("/classify", payload)
        rows = res if isinstance(res, list) else [res]
        try:
            out = [[float(v) for v in (r["embedding"] if isinstance(r["embedding"], list)
                                       else [r["embedding"]])] for r in rows]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{self.base_url}/classify answered without an embedding per input ({exc}); "
                             f"is the server running a reward / classifier-head model?") from exc
        if len(out) != len(inputs):
            raise ValueError(f"{self.base_url}/classify answered {len(out)} rows for {len(inputs)} inputs")
        return out

    def abort_group(self, group: str) -> None:
        """Abort every queued and running request of a search group (its requests' rids start with
        ``tts/<group>/``; needs the sgl-tts plugin on the server, see docs/SCHEDULER_PLUGIN.md)."""
        self.abort_prefix(group_prefix(group))

    def abort_prefix(self, prefix: str) -> None:
        """Abort every queued and running request whose rid starts with ``prefix``, a ``tts/<group>/``
        prefix or a deeper one ending in ``/`` (e.g. one speculative branch's; sgl-tts plugin)."""
        if not is_group_prefix(prefix):
            raise ValueError(f"an abort prefix must start with 'tts/<group>/' and end with '/', got {prefix!r}")
        self._aborts.record(prefix)   # its requests not sent yet are answered here (AbortLedger)
        for url in self.workers():   # a router does not pass /abort_request on: ask each server
            res = self._http("/abort_request", {"rid": prefix}, base=url)
            self._assert_success(res, url)

    def workers(self) -> list[str]:
        """The SGLang servers behind this URL: the URL itself, or, for an SGLang router
        (``sglang-router``), its workers as ``GET /workers`` lists them now (they may change)."""
        import requests

        if self._router is False:
            return [self.base_url]
        with self._answering("GET /workers"):
            res = requests.get(self.base_url + "/workers", timeout=30, verify=self.verify,
                               headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else None)
        try:
            listed = res.json().get("workers") if res.status_code == 200 else None
        except ValueError:
            listed = None
        if not isinstance(listed, list):      # a server, not a router
            self._router = False
            return [self.base_url]
        self._router = True
        urls = [w["url"].rstrip("/") for w in listed if isinstance(w, dict) and w.get("url")]
        if not urls:
            raise ServerUnavailable(f"the router at {self.base_url} has no workers")
        return urls

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
        answers = []
        for url in self.workers():   # a router does not pass /set_internal_state on: ask each server
            res = self._http("/set_internal_state", {"server_args": {"tts_set_class": command}}, base=url)
            self._assert_success(res, url)
            got = res.json()
            answers += got if isinstance(got, list) else [got]
        total = 0
        for out in answers:
            if not isinstance(out, dict):   # SGLang's bare flag: the plugin is not loaded there
                raise RuntimeError(f"{self.base_url} answered {res!r} to tts_set_class: is the sgl-tts "
                                   f"plugin loaded there (SGLANG_PLUGINS)?")
            info = (out.get("server_args") or {}).get("tts_set_class") or {}
            if "error" in info:
                raise ValueError(f"{self.base_url} refused the class change: {info['error']}")
            if not out.get("updated") or "requests" not in info:
                raise RuntimeError(f"{self.base_url} did not apply tts_set_class (is the sgl-tts plugin "
                                   f"loaded there?); it answered {out!r}")
            total += int(info["requests"])
        return total

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        """POST ``payload`` to ``path`` on the server and return the decoded JSON answer."""
        res = self._http(path, payload)
        self._assert_success(res)
        return res.json()

    def _assert_success(self, res, base: str | None = None):
        """An error status names the server and its answer (SGLang's own raises the bare answer)."""
        if res.status_code != 200:
            try:
                content = res.json()
            except ValueError:
                content = res.text
            raise ServerError(f"the SGLang server at {base or self.base_url} answered HTTP {res.status_code}: "
                              f"{content}")

    def _http(self, path: str, payload: dict[str, Any], *, stream: bool = False, base: str | None = None):
        with self._answering(f"POST {path}", base):
            return http_request((base or self.base_url) + path, json=payload, stream=stream, api_key=self.api_key,
                                verify=self.verify)

    @contextlib.contextmanager
    def _answering(self, what: str, base: str | None = None):
        """A server that is gone raises :class:`ServerUnavailable` naming it (urllib's own errors say
        neither which server nor what was asked)."""
        import requests

        try:
            yield
        except (OSError, http.client.HTTPException, requests.ConnectionError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise ServerUnavailable(f"the SGLang server at {base or self.base_url} did not answer {what} "
                                    f"({type(reason).__name__}: {reason}); is it still running?") from exc


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
