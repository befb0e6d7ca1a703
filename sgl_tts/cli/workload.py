"""``sgl-tts workload``: write a problem set as JSONL, and with ``--measure`` say how hard it is for the
shipped models (:mod:`sgl_tts.tiny.hardness`).

    sgl-tts workload --split hard --count 200 --out hard.jsonl
    sgl-tts workload --split mixed --count 200 --out mixed.jsonl --measure --report hard.json --plot fig6a.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    from sgl_tts.tiny import task

    ap = argparse.ArgumentParser(prog="sgl-tts workload", description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", default="hard", choices=task.SPLITS,
                    help="test: the 500-problem test split; hard: multipliers up to 30 (never trained on); "
                         "mixed: the two alternating, test first")
    ap.add_argument("--count", type=int, default=None, help="first COUNT problems (default: test 500, others 200)")
    ap.add_argument("--out", default=None, help="write the problems here as JSONL (sgl-tts run's dataset format)")
    ap.add_argument("--measure", action="store_true",
                    help="sample and score them: greedy and T accuracy, PRM step AUC, first-step cut-off")
    ap.add_argument("--samples", type=int, default=4, help="T-sampled solutions per problem (--measure)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--threshold", type=float, default=0.8, help="acceptance threshold the cut-off is chosen for")
    ap.add_argument("--aggregation", default="min", choices=["min", "prod"], help="trajectory score")
    ap.add_argument("--max-reach", type=float, default=0.02,
                    help="the cut-off is the largest first-step score below which at most this share of "
                         "trajectories reached the threshold")
    ap.add_argument("--generator", default=None, help="generator folder (default: the shipped one)")
    ap.add_argument("--prm", default=None, help="PRM folder (default: the shipped one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report", default=None, help="write the measurement as JSON here")
    ap.add_argument("--plot", default=None, help="save the first-step plot (seed 004 Fig. 6a) here")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from sgl_tts.tiny import task

    args = build_parser().parse_args(argv)
    try:
        problems = task.split(args.split, args.count)
        if args.samples < 1:
            raise ValueError(f"--samples must be >= 1, got {args.samples}")
        if not 0 <= args.max_reach < 1:
            raise ValueError(f"--max-reach must be in [0, 1), got {args.max_reach}")
    except ValueError as exc:
        print(f"sgl-tts workload: error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        task.write_jsonl(problems, args.out, prefix=args.split)
        print(f"wrote {len(problems)} {args.split} problems to {args.out}")
    if not args.measure:
        if not args.out:
            print(f"{len(problems)} {args.split} problems (nothing written: give --out or --measure)")
        return 0
    record = measure(problems, args, " ".join(sys.argv[1:] if argv is None else argv))
    h, c = record["hardness"], record["first_step"]
    print(f"{h['problems']} problems: greedy accuracy {h['greedy_accuracy']:.3f}, T={args.temperature:g} sample "
          f"accuracy {h['sample_accuracy']:.3f}; PRM step AUC {h['step_auc']:.3f} on {h['graded_steps']} sampled "
          f"steps ({h['wrong_steps']} wrong so far), {h['greedy_step_auc']:.3f} on the greedy solutions")
    for lv, d in h["by_level"].items():
        print(f"  level {lv}: greedy {d.get('greedy', float('nan')):.3f}, sample {d.get('sample', float('nan')):.3f}")
    cut = "none" if c["cutoff"] is None else f"{c['cutoff']:.4f}"
    print(f"first step vs trajectory ({args.aggregation}): Spearman {c['spearman']:.2f}, Pearson {c['pearson']:.2f}; "
          f"cut-off {cut} ({c['reached_below']}/{c['below']} below it reached {args.threshold:g}, "
          f"{c['reached_above']}/{c['above']} at or above)")
    return 0


def measure(problems, args, command: str) -> dict:
    """Sample, grade and score ``problems``; write the report and the plot the arguments ask for."""
    from sgl_tts import LocalBackend
    from sgl_tts.cli import quiet_logging
    from sgl_tts.machine import describe
    from sgl_tts.models import shipped_model
    from sgl_tts.prm import StepTagPRM
    from sgl_tts.tiny.hardness import choose_cutoff, first_step_points, measure_hardness, solve_and_score

    quiet_logging()
    t0 = time.perf_counter()
    gen = LocalBackend(args.generator or shipped_model("generator"), max_running=512, seed=args.seed)
    prm_backend = LocalBackend(args.prm or shipped_model("prm"), max_running=256, seed=args.seed)
    try:
        sols = solve_and_score(gen, StepTagPRM(prm_backend, cache=False), problems, samples=args.samples,
                               temperature=args.temperature, seed=args.seed, progress=not args.no_progress)
    finally:
        gen.shutdown()
        prm_backend.shutdown()
    hard = measure_hardness(sols, args.temperature)
    points = first_step_points(sols, args.aggregation)
    cut = choose_cutoff(points, args.threshold, args.max_reach)
    record = {"split": args.split, "problems": len(problems), "hardness": hard.as_dict(),
              "first_step": cut.as_dict(), "aggregation": args.aggregation,
              "seconds": round(time.perf_counter() - t0, 1), "machine": describe(),
              "date": time.strftime("%Y-%m-%d"), "command": "sgl-tts workload " + command}
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(record, indent=1) + "\n")
    if args.plot:
        from sgl_tts.tiny.hardness_plot import plot_first_step

        plot_first_step(points, cut, args.plot, f"{args.split}: {len(problems)} problems x {args.samples} "
                                                f"samples, T={args.temperature:g}, {args.aggregation}")
    return record
