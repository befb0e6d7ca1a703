"""Deprecated: moved to :mod:`sgl_tts.serving.service` (this name is kept for old imports and is that module)."""

import sys
import warnings

import sgl_tts.serving.service as _moved

warnings.warn("sgl_tts.search_service is deprecated; import sgl_tts.serving.service", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
