"""The search layer: what programs are written with, under ``programs/`` and over the backends.

- :mod:`sgl_tts.search.steps`: the primitives programs share (``gen_step``, ``aggregate``, ``top_k``,
  ``expand``, ``vote``, ``advance``, seeds, ``Trajectory`` / ``SearchResult``); its names are this
  package's (``from sgl_tts.search import gen_step`` as before);
- :mod:`sgl_tts.search.pipeline`: one depth of a step-wise search at a time (``StepPipeline``), given
  strategies that never change a kept beam (:mod:`~sgl_tts.search.speculation`,
  :mod:`~sgl_tts.search.lookahead`, :mod:`~sgl_tts.search.overlap`; its state in :mod:`~sgl_tts.search.beams`);
- :mod:`sgl_tts.search.runner`: ``run_continuously``, K problems in flight.

(``sgl_tts.frontend``, what sgl-tts adds to SGLang's interpreter, stays at the top: the
package's ``__init__`` needs it, and the plugin must not load this layer.)
"""

from sgl_tts.search.steps import *  # noqa: F401,F403
from sgl_tts.search.steps import __all__  # noqa: F401
