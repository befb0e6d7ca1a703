"""SGLang server backends: an HTTP endpoint that sends per-call request fields, and an in-process
SGLang runtime for a machine with CUDA."""

from __future__ import annotations

import json
import logging
from typing import Any

from sglang.global_config import global_config
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.utils import http_request

from sgl_tts.backends.request import RequestFields, take_request_fields

logger = logging.getLogger(__name__)


class SGLangEndpoint(RuntimeEndpoint):
    """SGLang's ``RuntimeEndpoint`` that also sends :class:`RequestFields` with each ``/generate``.

    Everything else (chat templates, ``select``, ``concatenate_and_append``) is SGLang's own.
    """

    def __init__(self, base_url: str, api_key: str | None = None, verify: str | None = None,
                 chat_template_name: str | None = None):
        try:
            super().__init__(base_url, api_key=api_key, verify=verify,
                             chat_template_name=chat_template_name)
        except (OSError, ConnectionError) as exc:  # urllib's URLError is an OSError
            raise ConnectionError(
                f"cannot reach an SGLang server at {base_url} ({exc}); start one with "
                f"`python -m sglang.launch_server --model-path PATH --port PORT` or fix the URL"
            ) from exc

    def _generate_body(self, s, sampling_params, fields: RequestFields) -> dict[str, Any]:
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

    def generate(self, s, sampling_params):
        data = self._generate_body(s, sampling_params, take_request_fields())
        obj = self.post("/generate", data)
        return obj["text"], obj["meta_info"]

    def generate_stream(self, s, sampling_params):
        data = self._generate_body(s, sampling_params, take_request_fields())
        data["stream"] = True
        res = http_request(self.base_url + "/generate", json=data, stream=True,
                           api_key=self.api_key, verify=self.verify)
        self._assert_success(res)
        pos = 0
        for chunk in res.iter_lines(decode_unicode=False):
            chunk = chunk.decode("utf-8")
            if chunk and chunk.startswith("data:"):
                if chunk == "data: [DONE]":
                    break
                obj = json.loads(chunk[5:].strip("\n"))
                text = obj["text"][pos:]
                pos += len(text)
                yield text, obj["meta_info"]

    def select(self, s, choices, temperature, choices_method=None):
        take_request_fields()  # fields are for generation calls only; never let them leak
        return super().select(s, choices, temperature, choices_method)

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        """POST ``payload`` to ``path`` on the server and return the decoded JSON answer."""
        res = http_request(self.base_url + path, json=payload, api_key=self.api_key, verify=self.verify)
        self._assert_success(res)
        return res.json()


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
