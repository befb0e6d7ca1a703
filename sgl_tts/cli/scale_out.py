"""``sgl-tts scale-out``: generator replicas behind SGLang's router, measured on this machine's CPU
(:func:`sgl_tts.bench.scaleout.run_scale_out`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    from sgl_tts.bench import scaleout

    p = argparse.ArgumentParser(prog="sgl-tts scale-out", description=scaleout.__doc__.split("\n\n")[0])
    d = scaleout.ScaleOutSettings()
    for f in dataclasses.fields(scaleout.ScaleOutSettings):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=getattr(d, f.name))
    p.add_argument("--output", default="sgl-tts-scale-out", help="output prefix: PREFIX.jsonl, .md, .png")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from sgl_tts.bench.scaleout import ScaleOutSettings, format_report, run_scale_out

    args = build_parser().parse_args(argv)
    s = ScaleOutSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ScaleOutSettings)})
    if min(dataclasses.astuple(s)[:-1]) < 1:
        print("sgl-tts scale-out: error: every count must be at least 1", file=sys.stderr)
        return 2
    rows = run_scale_out(s, args.output, on_row=lambda row: print(json.dumps(row), flush=True))
    print(format_report(rows))
    return 0
