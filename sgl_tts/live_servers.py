"""Deprecated: moved to :mod:`sgl_tts.launch.live_servers` (this name is kept for old imports and is that module)."""

import sys
import warnings

import sgl_tts.launch.live_servers as _moved

warnings.warn("sgl_tts.live_servers is deprecated; import sgl_tts.launch.live_servers", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
