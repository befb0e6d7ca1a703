"""Deprecated: moved to :mod:`sgl_tts.launch.serve` (this name is kept for old imports and is that module)."""

import sys
import warnings

import sgl_tts.launch.serve as _moved

warnings.warn("sgl_tts.serve is deprecated; import sgl_tts.launch.serve", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
