"""Seconds from ``sgl-tts serve --device cpu`` to its ready line (both servers answering), for one or
more checkouts, alternating them run by run so that a machine that speeds up or slows down weighs on
each alike.

    ./dev.sh run python tools/time_serve_start.py --trees /tmp/old . --runs 4

Each run starts the shipped tiny generator and PRM on free ports with the checkout's own code
(``PYTHONPATH=<tree> python -m sgl_tts.cli serve --device cpu``), waits for the line
``sgl-tts serve: generator ...``, then stops it with SIGTERM and waits until it has exited. Prints
each run and, per tree, the median. The first run of a fresh checkout also writes its bytecode: drop
it with ``--warm-up``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sgl_tts.launch.live_servers import free_port

READY = "sgl-tts serve: generator"


def time_start(tree: Path, timeout: float) -> float:
    """One start of ``tree``'s ``sgl-tts serve --device cpu``: seconds until its ready line."""
    gen, prm = free_port(), free_port()
    cmd = [sys.executable, "-m", "sgl_tts.cli", "serve", "--device", "cpu", "--generator-port", str(gen),
           "--prm-port", str(prm)]
    began = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:   # blocks on the server's output: no polling
            if line.startswith(READY):
                return time.monotonic() - began
            if time.monotonic() - began > timeout:
                break
        raise RuntimeError(f"{tree}: no ready line (exit code {proc.poll()})")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", nargs="+", type=Path, default=[Path(".")], help="checkouts to time, alternated")
    ap.add_argument("--runs", type=int, default=3, help="runs per tree")
    ap.add_argument("--warm-up", action="store_true", help="one untimed run per tree first")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    trees = [t.resolve() for t in args.trees]
    if args.warm_up:
        for tree in trees:
            time_start(tree, args.timeout)
    seconds: dict[Path, list[float]] = {t: [] for t in trees}
    for k in range(args.runs):
        for tree in trees if k % 2 == 0 else trees[::-1]:
            s = time_start(tree, args.timeout)
            seconds[tree].append(s)
            print(f"run {k + 1}: {tree} {s:.1f} s", flush=True)
    for tree, xs in seconds.items():
        print(f"{tree}: median {statistics.median(xs):.1f} s over {len(xs)} runs "
              f"({', '.join(f'{x:.1f}' for x in xs)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
