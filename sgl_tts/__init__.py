"""sgl-tts: fast test-time scaling (best-of-N, PRM beam search, DVTS, MCTS) on SGLang.

A TTS program is an SGLang program: ``fork`` to expand, ``gen`` a step, score it, select, repeat.
``sgl_tts.connect()`` gives the backend it runs on; ``sgl_tts.gen`` is ``sgl.gen`` with per-request
fields (rid, priority, custom_params, token_ids_logprob, seed).
"""

from sgl_tts.backends import (
    InProcessSGLang,
    LocalBackend,
    RequestFields,
    SGLangEndpoint,
    UnsupportedFeatureError,
    connect,
    gen,
)
from sgl_tts.frontend import Waiter, guard_thread_bootstrap

# SGLang's frontend starts and drops a worker thread per fork: guard CPython's thread bookkeeping
# against the finalizer deadlock those can hit (sgl_tts.frontend)
guard_thread_bootstrap()

__version__ = "0.1.0"

__all__ = [
    "InProcessSGLang", "LocalBackend", "RequestFields", "SGLangEndpoint", "UnsupportedFeatureError", "Waiter",
    "__version__", "connect", "gen",
]
