"""Benchmark: LocalBackend decode throughput with many requests in flight (PRM data pools, evaluations).

Samples ``--samples`` solutions for each of the first ``--problems`` test problems of the task with the
shipped tiny generator at T=0.8, all submitted at once, for each ``--max-running`` and ``--threads``
setting; reports generated tokens per second and the process's user/system CPU seconds. Run it at two
git revisions to compare engine versions (the JSON names the revision).

    ./dev.sh run python benchmarks/engine_throughput.py --out docs/benchmarks/engine_throughput
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sgl_tts import LocalBackend
from sgl_tts.tiny import task
from sgl_tts.models import shipped_model
from sgl_tts.machine import describe
from sgl_tts.tiny.training import sample_solutions


def run(problems: int, samples: int, max_running: int, threads) -> dict:
    be = LocalBackend(shipped_model("generator"), max_running=max_running, seed=0, threads=threads)
    try:
        probs = task.test_split()[:problems]
        sample_solutions(be, probs[:4], 2, temperature=0.8, seed=1)  # warm-up
        before = be.engine.stats.decode_tokens
        t0, c0 = time.perf_counter(), os.times()
        texts = sample_solutions(be, probs, samples, temperature=0.8, seed=0)
        secs, c1 = time.perf_counter() - t0, os.times()
        tokens = be.engine.stats.decode_tokens - before
    finally:
        be.shutdown()
    acc = sum(task.grade(p, t).answer_ok for p, ts in zip(probs, texts) for t in ts) / (problems * samples)
    return {"problems": problems, "samples": samples, "max_running": max_running, "threads": threads,
            "seconds": round(secs, 2), "decode_tokens": tokens, "tokens_per_s": round(tokens / secs),
            "user_s": round(c1.user - c0.user, 1), "system_s": round(c1.system - c0.system, 1),
            "accuracy": round(acc, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-running", default="256,512")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args()
    rows = [run(args.problems, args.samples, int(m), int(t))
            for m in args.max_running.split(",") for t in args.threads.split(",")]
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"machine": describe(), "date": dt.date.today().isoformat(), "revision": rev,
              "command": "./dev.sh run python benchmarks/engine_throughput.py " + " ".join(sys.argv[1:]),
              "rows": rows}
    table = ["| max running | threads | tokens/s | seconds | user CPU s | system CPU s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    table += [f"| {r['max_running']} | {r['threads']} | {r['tokens_per_s']} | {r['seconds']} | "
              f"{r['user_s']} | {r['system_s']} |" for r in rows]
    print("\n".join(table))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
        out.with_suffix(".md").write_text(
            f"# Engine throughput with many requests in flight\n\n"
            f"{args.problems} test problems x {args.samples} samples of the shipped tiny generator at "
            f"T=0.8, all submitted at once.\n\nMachine: {record['machine']}. Date: {record['date']}. "
            f"Revision: {rev}. Command: `{record['command']}`.\n\n" + "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
