"""``python -m sgl_tts.cli``: the ``sgl-tts`` command."""

from sgl_tts.cli import entry

entry()
