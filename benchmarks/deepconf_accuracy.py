"""DeepConf's accuracy against N and the tokens online's early stopping saves (docs/TINY_MODELS.md).

Reads ``sgl-tts run`` outputs: one **offline** run at the largest N (its samples are seeded by their
index alone, so its first k samples are exactly an offline run at N = k: every smaller N and every
kept fraction is read from it, with the program's own ``kept`` and ``vote``), and any number of
**online** runs (each read as it ran). Prints a Markdown table and writes the numbers as JSON.

Usage (inside the environment)::

    sgl-tts run --program deepconf --deepconf-mode offline --n 16 --output off.jsonl
    sgl-tts run --program deepconf --n 16 --output on90.jsonl
    sgl-tts run --program deepconf --n 16 --keep-fraction 0.1 --output on10.jsonl
    python benchmarks/deepconf_accuracy.py --offline off.jsonl --online eta=0.9:on90.jsonl \\
        --online eta=0.1:on10.jsonl --out docs/results/deepconf_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Sequence

from programs.deepconf import TOLERANCE, kept
from sgl_tts.search import vote

FRACTIONS = (0.9, 0.5, 0.1)


def read(path: str) -> list[dict[str, Any]]:
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not records:
        raise SystemExit(f"{path}: no records")
    return records


def offline_rows(records: Sequence[dict]) -> list[dict[str, Any]]:
    """Accuracy at every power of two up to N (and N) from the first k samples of each problem."""
    n = len(records[0]["trajectories"])
    sizes = sorted({min(2 ** i, n) for i in range(n.bit_length())} | {n})
    rows = []
    for k in sizes:
        right: dict[str, int] = {"majority": 0, "confidence_weighted": 0, **{f"filtered_{f}": 0 for f in FRACTIONS}}
        tokens = 0
        for r in records:
            ts = r["trajectories"][:k]
            answers, conf = [t["answer"] for t in ts], [t["score"] for t in ts]
            tokens += sum(t["tokens"] for t in ts)
            picks = {"majority": vote(answers), "confidence_weighted": vote(answers, conf, TOLERANCE)}
            for f in FRACTIONS:
                keep = kept(conf, f)
                picks[f"filtered_{f}"] = vote([answers[i] for i in keep], [conf[i] for i in keep], TOLERANCE)
            for rule, a in picks.items():
                right[rule] += a == r["reference"]
        rows.append({"n": k, "tokens_per_problem": tokens / len(records),
                     **{rule: v / len(records) for rule, v in right.items()}})
    return rows


def online_row(name: str, records: Sequence[dict]) -> dict[str, Any]:
    return {"run": name, "problems": len(records),
            "accuracy": statistics.fmean(r["answer"] == r["reference"] for r in records),
            "tokens_per_problem": statistics.fmean(r["tokens_generated"] for r in records),
            "samples_stopped_per_problem": statistics.fmean(r.get("traces_stopped", 0) for r in records),
            "exits": {e: sum(r.get("exit_reason") == e for r in records) for e in ("consensus", "budget")}}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--offline", required=True, help="an offline deepconf run's output (its largest N)")
    ap.add_argument("--online", action="append", default=[], metavar="NAME:FILE", help="an online run's output")
    ap.add_argument("--out", help="write the numbers here as JSON")
    args = ap.parse_args(argv)
    off = offline_rows(read(args.offline))
    on = []
    for spec in args.online:
        name, sep, path = spec.partition(":")
        if not sep:
            raise SystemExit(f"--online takes NAME:FILE, got {spec!r}")
        on.append(online_row(name, read(path)))
    print("| N | tokens/problem | majority | confidence-weighted | filtered " +
          " | filtered ".join(f"eta={f}" for f in FRACTIONS) + " |")
    print("| ---: | ---: |" + " ---: |" * (2 + len(FRACTIONS)))
    for r in off:
        print(f"| {r['n']} | {r['tokens_per_problem']:.0f} | {100 * r['majority']:.1f}% | "
              f"{100 * r['confidence_weighted']:.1f}% | " +
              " | ".join(f"{100 * r[f'filtered_{f}']:.1f}%" for f in FRACTIONS) + " |")
    for r in on:
        print(f"online {r['run']}: {100 * r['accuracy']:.1f}% at {r['tokens_per_problem']:.0f} tokens/problem, "
              f"{r['samples_stopped_per_problem']:.1f} samples stopped per problem, exits {r['exits']}")
    if args.out:
        Path(args.out).write_text(json.dumps({"offline": off, "online": on}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
