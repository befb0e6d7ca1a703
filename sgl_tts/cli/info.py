"""``sgl-tts info``: the versions of sgl-tts, sglang, torch and transformers (and Python, CUDA)."""

from __future__ import annotations

import argparse
import json
import platform
from typing import Sequence

from sgl_tts.cli import quiet_logging


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog="sgl-tts info")


def main(argv: Sequence[str] | None = None) -> int:
    build_parser().parse_args(argv)
    quiet_logging()
    import sglang
    import torch
    import transformers

    import sgl_tts

    info = {"sgl_tts": sgl_tts.__version__, "sglang": sglang.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda": torch.cuda.is_available(),
            "python": platform.python_version()}
    print(json.dumps(info, indent=1))
    return 0
