"""Backends: where an SGLang program's ``gen``/``select`` calls run.

``connect()`` picks one: an SGLang server URL, an in-process SGLang runtime when CUDA is present, or
the CPU :class:`LocalBackend`. All of them accept :func:`sgl_tts.gen`'s per-request fields.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from sglang.lang.backend.base_backend import BaseBackend

    from sgl_tts.backends.endpoint import InProcessSGLang, SGLangEndpoint, apply_request_fields
    from sgl_tts.backends.engine import BatchEngine, Completion, UnsupportedFeatureError
    from sgl_tts.backends.local import LocalBackend
    from sgl_tts.backends.request import RequestFields, gen, take_request_fields

from sgl_tts.lazy import lazy_attributes

logger = logging.getLogger(__name__)

# Imported on first use (PEP 562): an engine process (sgl_tts.backends.engine_process) needs torch
# and transformers only, not SGLang's frontend, which takes seconds to import.
_LAZY = {
    "InProcessSGLang": "sgl_tts.backends.endpoint",
    "SGLangEndpoint": "sgl_tts.backends.endpoint",
    "apply_request_fields": "sgl_tts.backends.endpoint",
    "BatchEngine": "sgl_tts.backends.engine",
    "Completion": "sgl_tts.backends.semantics",
    "UnsupportedFeatureError": "sgl_tts.backends.semantics",
    "LocalBackend": "sgl_tts.backends.local",
    "RequestFields": "sgl_tts.backends.request",
    "gen": "sgl_tts.backends.request",
    "take_request_fields": "sgl_tts.backends.request",
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

Runtime = Literal["auto", "server", "cuda", "cpu"]


def _is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def connect(target: str | os.PathLike | None = None, *, runtime: Runtime = "auto",
            local_options: dict[str, Any] | None = None, **kwargs: Any) -> "BaseBackend":
    """Return an SGLang frontend backend for ``target``.

    * ``target`` is an ``http(s)://`` URL of a running SGLang server -> :class:`SGLangEndpoint`
      (kwargs: ``api_key``, ``chat_template_name``).
    * ``target`` is a model folder (or ``None`` for the embedded default model) and CUDA is
      available -> :class:`InProcessSGLang`, an SGLang server started for it (kwargs: SGLang
      ``ServerArgs``).
    * otherwise -> :class:`LocalBackend` on the CPU (kwargs: its options).

    ``runtime`` forces a choice: ``"server"`` (URL only), ``"cuda"`` or ``"cpu"``.
    ``local_options`` are :class:`LocalBackend` options applied only when the choice is that backend
    (e.g. ``{"engine_in": "process"}`` from a command line that also takes URLs).
    """
    if target is not None and _is_url(str(target)):
        if runtime not in ("auto", "server"):
            raise ValueError(f"runtime={runtime!r} does not apply to a server URL")
        from sgl_tts.backends.endpoint import SGLangEndpoint

        return SGLangEndpoint(str(target).rstrip("/"), **kwargs)
    if runtime == "server":
        raise ValueError(f"runtime='server' needs an http(s):// URL, got {target!r}")
    if target is None:
        from sgl_tts.models import default_model_path

        target = default_model_path()
    if runtime == "cuda" or (runtime == "auto" and _cuda_available()):
        from sgl_tts.backends.endpoint import InProcessSGLang

        logger.info("starting an in-process SGLang runtime for %s", target)
        return InProcessSGLang(str(target), **kwargs)
    from sgl_tts.backends.local import LocalBackend

    return LocalBackend(target, **{**(local_options or {}), **kwargs})


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


__all__ = [
    "BatchEngine", "Completion", "InProcessSGLang", "LocalBackend", "RequestFields",
    "SGLangEndpoint", "UnsupportedFeatureError", "apply_request_fields", "connect", "gen",
    "take_request_fields",
]
