"""Deprecated: moved to :mod:`sgl_tts.launch.memory` (this name is kept for old imports and is that module)."""

import sys
import warnings

import sgl_tts.launch.memory as _moved

warnings.warn("sgl_tts.memory is deprecated; import sgl_tts.launch.memory", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
