"""``sgl-tts quality``: the test-split measurement behind docs/TINY_MODELS.md
(:func:`sgl_tts.quality.measure`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    from sgl_tts import quality
    from sgl_tts.search import AGGREGATIONS
    from sgl_tts.tiny import task

    ap = argparse.ArgumentParser(prog="sgl-tts quality", description=quality.__doc__.splitlines()[0])
    ap.add_argument("--generator", default=None, help="generator folder (default: the shipped one)")
    ap.add_argument("--prm", default=None, help="PRM folder (default: the shipped one)")
    ap.add_argument("--count", type=int, default=task.TEST_SIZE, help="test problems (default: all)")
    ap.add_argument("--ns", default="1,4,16", help="comma-separated N values (must include 1)")
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--aggregation", default="last", choices=sorted(AGGREGATIONS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--plot", default=None, help="save the accuracy-vs-N plot here")
    ap.add_argument("--json", action="store_true")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``sgl-tts quality``."""
    from sgl_tts.machine import describe
    from sgl_tts.quality import int_list, measure, plot_accuracy

    args = build_parser().parse_args(argv)
    cmp = measure(args.generator, args.prm, count=args.count, ns=int_list(args.ns, "--ns"),
                  beam_width=args.beam_width, temperature=args.temperature, aggregation=args.aggregation,
                  seed=args.seed)
    record = {**cmp.to_json(), "machine": describe(), "date": time.strftime("%Y-%m-%d"),
              "command": "sgl-tts quality " + " ".join(sys.argv[1:] if argv is None else argv)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    if args.plot:
        plot_accuracy(cmp, args.plot)
    if args.json:
        print(json.dumps(record))
    else:
        print(cmp.table())
        for k, v in cmp.details.items():
            print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
        print(f"({cmp.problems} problems, T={cmp.temperature}, {cmp.seconds:.0f}s)")
    return 0
