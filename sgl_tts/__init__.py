"""sgl-tts: fast test-time scaling (best-of-N, PRM beam search, DVTS, MCTS) on SGLang.

A TTS program is an SGLang program: ``fork`` to expand, ``gen`` a step, score it, select, repeat.
``sgl_tts.connect()`` gives the backend it runs on; ``sgl_tts.gen`` is ``sgl.gen`` with per-request
fields (rid, priority, custom_params, token_ids_logprob, seed).

The names below load on first use (PEP 562): ``import sgl_tts.plugin``, which every SGLang
scheduler process does, must not load the client's backends, the CPU engine or SGLang's frontend
interpreter (tests/test_layering.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl_tts.frontend import guard_thread_bootstrap
from sgl_tts.lazy import lazy_attributes

# SGLang's frontend starts and drops a worker thread per fork: guard CPython's thread bookkeeping
# against the finalizer deadlock those can hit (sgl_tts.frontend)
guard_thread_bootstrap()

__version__ = "0.1.0"

_LAZY = {
    "InProcessSGLang": "sgl_tts.backends",
    "LocalBackend": "sgl_tts.backends",
    "RequestFields": "sgl_tts.backends",
    "SGLangEndpoint": "sgl_tts.backends",
    "UnsupportedFeatureError": "sgl_tts.backends",
    "connect": "sgl_tts.backends",
    "gen": "sgl_tts.backends",
    "Waiter": "sgl_tts.frontend",
}

__all__ = sorted([*_LAZY, "__version__"])

if TYPE_CHECKING:
    from sgl_tts.backends import (InProcessSGLang, LocalBackend, RequestFields, SGLangEndpoint,
                                  UnsupportedFeatureError, connect, gen)
    from sgl_tts.frontend import Waiter


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
