"""MCTS over reasoning steps (seed 004): the tree, many searches at once, and drawing a tree.

- :mod:`sgl_tts.mcts.tree`: the tree you ask and tell (WU-PUCT, node reuse, early exits); its names
  are this package's (``from sgl_tts.mcts import MCTSTree`` as before);
- :mod:`sgl_tts.mcts.jobs`: many MCTS searches at once (Algorithm 1: parallelism degrees, boosting);
- :mod:`sgl_tts.mcts.plot`: ``draw_tree`` (matplotlib, loaded when called).

The runtime that drives a tree on SGLang is the program, ``programs/mcts.py``.
"""

from sgl_tts.mcts.tree import *  # noqa: F401,F403
from sgl_tts.mcts.tree import __all__  # noqa: F401
