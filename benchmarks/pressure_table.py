"""The pressure table (issue 32): every recorded ``sgl-tts bench --device cpu`` run at the measured
pressure budgets (``docs/benchmarks/cpu_pressure*.jsonl``), one row per side, against the issue's goals;
writes ``docs/benchmarks/cpu_pressure.md`` with ``.summary.json`` and ``.png`` beside it.

    ./dev.sh run python benchmarks/pressure_table.py
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from sgl_tts.bench.pressure_table import write

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=Path, nargs="+",
                    default=sorted((ROOT / "docs" / "benchmarks").glob("cpu_pressure*.jsonl")),
                    help="bench records files (default: docs/benchmarks/cpu_pressure*.jsonl)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "cpu_pressure.md")
    args = ap.parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    print(write(args.records, args.out, shlex.join(["python", "benchmarks/pressure_table.py", *given])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
