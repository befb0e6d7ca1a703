"""``sgl-tts train-tiny``: train the tiny generator and PRM (:func:`sgl_tts.tiny.training.train_tiny`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    from sgl_tts.tiny.training import TinyRecipe, train_tiny

    ap = argparse.ArgumentParser(prog="sgl-tts train-tiny", description=train_tiny.__doc__)
    ap.add_argument("--out", required=True, help="folder for generator/, prm/ and the PRM data pool")
    d = TinyRecipe()
    for f in dataclasses.fields(TinyRecipe):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(d, f.name)),
                        default=getattr(d, f.name))
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from sgl_tts.tiny.training import TinyRecipe, train_tiny

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    recipe = TinyRecipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TinyRecipe)})
    timings = train_tiny(args.out, recipe)
    print(json.dumps({"out": str(args.out), "recipe": dataclasses.asdict(recipe), **timings}))
    return 0
