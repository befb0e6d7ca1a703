"""``python -m sgl_tts.cli``: the ``sgl-tts`` command."""

import sys

from sgl_tts.cli import main

sys.exit(main())
