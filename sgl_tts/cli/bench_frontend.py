"""``sgl-tts bench-frontend``: do many searches at once slow each other down?
(:func:`sgl_tts.bench.frontend.run_frontend`)."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    from sgl_tts.bench import frontend
    from sgl_tts.bench.frontend_settings import BACKENDS, PROGRAMS, FrontendSettings
    from sgl_tts.plugin.settings import CPU_ATTENTION

    p = argparse.ArgumentParser(prog="sgl-tts bench-frontend", description=frontend.__doc__.split("\n\n")[0])
    d = FrontendSettings()
    p.add_argument("--backends", default=",".join(d.backends), help="comma-separated, from " + ", ".join(BACKENDS))
    p.add_argument("--programs", default=",".join(d.programs), help="comma-separated, from " + ", ".join(PROGRAMS))
    p.add_argument("--ks", default=None, help="searches in flight, comma-separated (default 1,8,32,128; --quick 1,4)")
    p.add_argument("--quick", action="store_true",
                   help="K in {1, 4}, 4 searches per block, budgets of 4 (a CI check, not a measurement)")
    for name in ("min_searches", "beams", "beam_width", "samples", "rollouts", "expansion_width", "parallel",
                 "max_depth", "step_tokens", "max_tokens", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"default {getattr(d, name)}" + (f" (--quick {d.QUICK[name]})" if name in d.QUICK else ""))
    p.add_argument("--temperature", type=float, default=None, help=f"default {d.temperature}")
    p.add_argument("--cpu-engine", choices=("auto", "thread", "process"), default=None,
                   help=f"where the cpu backend's model engines run: a thread of this process, a child "
                        f"process each, or auto: as sgl-tts run decides per program and K (default {d.cpu_engine})")
    p.add_argument("--cpu-replicas", type=int, default=None, metavar="N",
                   help="engines of each model in processes of their own, requests routed by prompt prefix "
                        "(default: as sgl-tts run decides: one per core where auto chose processes)")
    p.add_argument("--server-attention", choices=CPU_ATTENTION, default=None,
                   help=f"the attention of the servers started here (the plugin's --tts-cpu-attention; default "
                        f"{d.server_attention}: decode rows batched by length, extends over their new tokens)")
    p.add_argument("--generator-url", default=None, help="a running generator for the server backend (default: "
                   "start the tiny generator with the plugin on the CPU)")
    p.add_argument("--generator-metrics", default=None, metavar="PREFIX",
                   help="the --tts-metrics-file of the server at --generator-url, to read the running batch it "
                        "decoded (without it that server's decode limit is taken at the nominal batch)")
    p.add_argument("--prm-url", default=None, help="a running step-tag PRM server (default: start the tiny PRM)")
    p.add_argument("--out", default="docs/benchmarks/frontend.jsonl",
                   help="records (JSONL, appended); the table (.md) and plot (.png) go next to it")
    p.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="runs of each block (default 1); the table and the goals take each block's median "
                        "run and show the spread. Runs already in --out count: a rerun with a larger R adds runs")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="log each block")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from sgl_tts.bench import frontend
    from sgl_tts.bench.load import read_records

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:
        frontend.logger.setLevel(logging.INFO)
    else:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # per-shard "Loading weights" bars
    try:
        s = frontend.settings_from_values(vars(args), quick=args.quick)
        if args.repeats < 1:
            raise ValueError(f"--repeats: must be at least 1, got {args.repeats}")
    except ValueError as exc:
        print(f"sgl-tts bench-frontend: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        records = read_records(out, s.key())
    except ValueError as exc:   # a line that is not a record (a torn last one is left out)
        print(f"sgl-tts bench-frontend: error: {exc}; pick another --out", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    todo, skipped = frontend.pending_runs(s, records, args.repeats)
    if skipped:
        print(f"sgl-tts bench-frontend: {skipped} run(s) already in {out} under settings {s.key()}: skipped")
    report, plot = frontend.run_frontend(s, out, records, todo, command="sgl-tts bench-frontend " + shlex.join(argv),
                                         quick=args.quick, generator_url=args.generator_url, prm_url=args.prm_url,
                                         generator_metrics=args.generator_metrics, progress=not args.no_progress)
    print(report)
    print(f"records: {out}; table: {out.with_suffix('.md')}; plot: {plot}")
    return 0
