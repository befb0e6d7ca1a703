"""Deprecated: moved to :mod:`sgl_tts.tiny.training` (this name is kept for old imports and is that module)."""

import sys
import warnings

import sgl_tts.tiny.training as _moved

warnings.warn("sgl_tts.training is deprecated; import sgl_tts.tiny.training", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
