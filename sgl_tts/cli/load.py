"""``sgl-tts load``: many searches arriving at once, as a server sees them
(:func:`sgl_tts.bench.load.run_load`)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    from sgl_tts.bench import load
    from sgl_tts.bench.load import SIDES, VERIFIERS, LoadSettings

    p = argparse.ArgumentParser(prog="sgl-tts load", description=load.__doc__.split("\n\n")[0])
    d = LoadSettings()
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in d.rates), help="arrival rates per second, comma-separated")
    p.add_argument("--problems", type=int, default=d.problems)
    p.add_argument("--max-jobs", type=int, default=d.max_jobs, help="M: jobs (and boosted rollouts) at once")
    p.add_argument("--rollouts", type=int, default=d.rollouts)
    p.add_argument("--expansion-width", type=int, default=d.expansion_width)
    p.add_argument("--max-depth", type=int, default=d.max_depth)
    p.add_argument("--step-tokens", type=int, default=d.step_tokens)
    p.add_argument("--threshold", type=float, default=d.threshold)
    p.add_argument("--aggregation", default=d.aggregation, choices=["min", "prod"])
    p.add_argument("--first-step-cutoff", type=float, default=None)
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature")
    p.add_argument("--beams", type=int, default=d.beams)
    p.add_argument("--beam-width", type=int, default=d.beam_width)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--workload", default=d.workload,
                   help="the problems in arrival order: test (the test split), hard (sgl-tts workload --split "
                        "hard), mixed (the two alternating) or a JSONL file sgl-tts workload wrote")
    p.add_argument("--verifier", default=d.verifier, choices=VERIFIERS,
                   help="prm: the tiny step-tag PRM (default); checker: the task's checker as the PRM, a what-if "
                        "with a verifier that sees every mistake (no PRM server)")
    p.add_argument("--sides", default=",".join(SIDES), help="comma-separated, from " + ", ".join(SIDES))
    p.add_argument("--generator-url", default=None, help="a running generator (default: start the tiny "
                   "generator with the plugin on the CPU)")
    p.add_argument("--prm-url", default=None, help="a running step-tag PRM server (default: start the tiny PRM)")
    p.add_argument("--output", default="sgl-tts-load", help="output prefix: PREFIX.jsonl, PREFIX.md, PREFIX.png")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from sgl_tts.bench.load import LoadSettings, format_report, load_problems, read_records, run_load

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        s = LoadSettings(rates=tuple(float(x) for x in args.rates.split(",")), problems=args.problems,
                         max_jobs=args.max_jobs, rollouts=args.rollouts, expansion_width=args.expansion_width,
                         max_depth=args.max_depth, step_tokens=args.step_tokens, threshold=args.threshold,
                         aggregation=args.aggregation, first_step_cutoff=args.first_step_cutoff,
                         beams=args.beams, beam_width=args.beam_width, temperature=args.temperature,
                         seed=args.seed, workload=args.workload, verifier=args.verifier,
                         sides=tuple(x.strip() for x in args.sides.split(",") if x.strip()))
        load_problems(s)   # a workload file that is missing or not problems fails before any server starts
        read_records(Path(args.output).with_suffix(".jsonl"), s.key())   # so does a records file that is not one
    except (ValueError, OSError) as exc:
        print(f"sgl-tts load: error: {exc}", file=sys.stderr)
        return 2
    rows = run_load(s, args.output, generator_url=args.generator_url, prm_url=args.prm_url,
                    progress=not args.no_progress)
    print(format_report(rows))
    print(f"(records, and the table by part of the stream: {args.output}.jsonl, {args.output}.md)")
    return 0
