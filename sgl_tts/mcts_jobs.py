"""Deprecated: moved to :mod:`sgl_tts.mcts.jobs` (this name is kept for old imports and is that module)."""

from sgl_tts.lazy import moved_module

moved_module(__name__, "sgl_tts.mcts.jobs")
