"""Deprecated: moved to :mod:`sgl_tts.tiny.task` (this name is kept for old imports and is that module)."""

import sys
import warnings

import sgl_tts.tiny.task as _moved

warnings.warn("sgl_tts.task is deprecated; import sgl_tts.tiny.task", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
