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

__version__ = "0.1.0"

__all__ = [
    "InProcessSGLang", "LocalBackend", "RequestFields", "SGLangEndpoint", "UnsupportedFeatureError",
    "__version__", "connect", "gen",
]
