"""Benchmark: the memory planner's CPU split against fixed splits of the same KV budget (issue 32).

Runs ``sgl-tts bench --device cpu --sides sgl-tts`` on one pressured workload (default: beam search,
n = 64, a 512-token prompt, 24 MiB of KV for both pools) once with the planner's split (the
generator's share of the budget, from both models' measured CPU profiles, see
``sgl_tts.launch.cpu_profile``) and once per fixed share (``--sgl-tts-split``, default 0.3 / 0.5 /
0.7), each into its own records file under ``--work-dir`` (so a run stopped part way resumes, and the
bench's own resume check keeps splits apart). Then writes a table (split, planned?, generator and PRM
pools, goodput, latency) and "plan vs best measured" to ``--out`` (Markdown, and JSON beside it).

    ./dev.sh run python benchmarks/planner_split_check.py --out docs/benchmarks/planner_split_check.md

A quick end-to-end try: ``--n 8 --out /tmp/split_check.md``. Every run is one search per split on
two shared cores: rerun on a quiet machine before reading much into a few percent.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import subprocess
import sys
from pathlib import Path

from sgl_tts.machine import describe


def bench_command(args, split: float | None, output: Path) -> list[str]:
    """``sgl-tts bench`` for one split (``None``: the planner's)."""
    cmd = [sys.executable, "-m", "sgl_tts.cli", "bench", "--device", "cpu", "--n", str(args.n),
           "--algorithms", args.algorithm, "--kv-memory", args.kv_memory, "--prompt-tokens", str(args.prompt_tokens),
           "--sides", args.side, "--output", str(output), "--no-progress", "--json"]
    if split is not None:
        cmd += ["--sgl-tts-split", str(split)]
    return cmd + shlex.split(args.bench_args)


def run_split(args, split: float | None) -> dict:
    """One split's row: its share, whether planned, pools, goodput and latency (from the bench's summary)."""
    name = "planned" if split is None else f"split-{split}"
    output = Path(args.work_dir) / f"{name}.jsonl"
    output.parent.mkdir(parents=True, exist_ok=True)
    cmd = bench_command(args, split, output)
    print(f"$ {shlex.join(cmd)}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name}: sgl-tts bench exited with {done.returncode}")
    summary = json.loads(done.stdout)
    header = summary["header"]
    side = summary["rows"][0]["sides"][args.side]
    chosen = header["splits"]["sgl-tts"]
    return {"split": chosen["generator_share"], "planned": chosen["planned"],
            "pools": header["pools"]["sgl-tts"], "goodput": side["goodput"], "latency": side["latency"],
            "predicted_seconds": chosen.get("predicted_seconds"), "command": shlex.join(["sgl-tts", *cmd[3:]])}


def table(rows: list[dict]) -> tuple[str, str]:
    """The Markdown table and the plan-vs-best line."""
    best = max(rows, key=lambda r: r["goodput"])
    plan = next(r for r in rows if r["planned"])
    lines = ["| generator share | planned | KV pools (tokens, generator / PRM) | goodput (tok/s) | latency (s) |",
             "|---:|---|---|---:|---:|"]
    for r in sorted(rows, key=lambda r: r["split"]):
        lines.append(f"| {r['split']:.3f} | {'yes' if r['planned'] else ''} | {r['pools']['generator']} / "
                     f"{r['pools']['prm']} | {r['goodput']:.1f} | {r['latency']:.2f} |")
    verdict = (f"plan vs best measured: the plan ({plan['split']:.3f}) reached {plan['goodput']:.1f} tok/s, "
               f"{plan['goodput'] / best['goodput']:.2f}x the best measured split ({best['split']:.3f}, "
               f"{best['goodput']:.1f} tok/s); latency {plan['latency']:.2f} s vs {best['latency']:.2f} s")
    return "\n".join(lines), verdict


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--algorithm", default="beam_search")
    ap.add_argument("--kv-memory", default="24MiB")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--side", default="sgl-tts", help="the sgl-tts side to run (e.g. sgl-tts+locality)")
    ap.add_argument("--splits", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    ap.add_argument("--bench-args", default="", help="more sgl-tts bench flags, one quoted string")
    ap.add_argument("--work-dir", default="bench-out/planner_split_check")
    ap.add_argument("--out", default="docs/benchmarks/planner_split_check.md")
    args = ap.parse_args(argv)
    rows = [run_split(args, None)] + [run_split(args, s) for s in args.splits]
    text, verdict = table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = "\n".join([f"# The memory planner's CPU split against fixed splits", "",
                     f"- machine: {describe()}", f"- date: {dt.date.today().isoformat()}",
                     f"- command: `python benchmarks/planner_split_check.py {shlex.join(argv or sys.argv[1:])}`",
                     f"- workload: {args.algorithm}, n = {args.n}, prompt {args.prompt_tokens} tokens, "
                     f"{args.kv_memory} of KV for both pools, sgl-tts side only", "",
                     "Each row: `" + rows[0]["command"].replace("--output", "... --output").split(" ... ")[0]
                     + " [--sgl-tts-split S]`", "", text, "", verdict, ""])
    out.write_text(doc)
    out.with_suffix(".json").write_text(json.dumps({"machine": describe(), "date": dt.date.today().isoformat(),
                                                   "rows": rows, "verdict": verdict}, indent=1))
    print(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
