"""Deprecated: moved to :mod:`sgl_tts.search.runner` (this name is kept for old imports and is that module)."""

import sys
import warnings

import sgl_tts.search.runner as _moved

warnings.warn("sgl_tts.runner is deprecated; import sgl_tts.search.runner", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
