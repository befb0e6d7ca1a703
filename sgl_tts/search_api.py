"""Deprecated: moved to :mod:`sgl_tts.serving.api` (this name is kept for old imports and is that module)."""

import sys
import warnings

import sgl_tts.serving.api as _moved

warnings.warn("sgl_tts.search_api is deprecated; import sgl_tts.serving.api", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
