"""Deprecated: the wire protocol moved to :mod:`sgl_tts.protocol` (this name is kept for old imports)."""

import warnings

from sgl_tts.protocol import *  # noqa: F401,F403
from sgl_tts.protocol import __all__  # noqa: F401

warnings.warn("sgl_tts.tts_request is deprecated; import sgl_tts.protocol", DeprecationWarning, stacklevel=2)
