"""Deprecated: moved to :mod:`sgl_tts.launch.cpu_serving` (this name is kept for old imports and is that module)."""

import sys
import warnings

import sgl_tts.launch.cpu_serving as _moved

warnings.warn("sgl_tts.cpu_serving is deprecated; import sgl_tts.launch.cpu_serving", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
