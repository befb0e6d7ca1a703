"""Deprecated: moved to :mod:`sgl_tts.mcts.jobs` (this name is kept for old imports and is that module)."""

import sys
import warnings

import sgl_tts.mcts.jobs as _moved

warnings.warn("sgl_tts.mcts_jobs is deprecated; import sgl_tts.mcts.jobs", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
