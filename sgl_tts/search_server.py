"""Deprecated: moved to :mod:`sgl_tts.serving.server` (this name is kept for old imports and is that module)."""

import sys
import warnings

import sgl_tts.serving.server as _moved

warnings.warn("sgl_tts.search_server is deprecated; import sgl_tts.serving.server", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
