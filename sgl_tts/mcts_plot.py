"""Deprecated: moved to :mod:`sgl_tts.mcts.plot` (this name is kept for old imports and is that module)."""

import sys
import warnings

import sgl_tts.mcts.plot as _moved

warnings.warn("sgl_tts.mcts_plot is deprecated; import sgl_tts.mcts.plot", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
