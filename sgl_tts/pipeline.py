"""Deprecated: moved to :mod:`sgl_tts.search.pipeline` (this name is kept for old imports and is that module)."""

import sys
import warnings

import sgl_tts.search.pipeline as _moved

warnings.warn("sgl_tts.pipeline is deprecated; import sgl_tts.search.pipeline", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
