"""``sgl-tts scheduler-stats``: summarise the scheduler plugin's metric files (``--tts-metrics-file``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from sgl_tts.cli import quiet_logging


def build_parser() -> argparse.ArgumentParser:
    st = argparse.ArgumentParser(prog="sgl-tts scheduler-stats")
    st.add_argument("files", nargs="+", help="metric files (PATH.<pid>, one per scheduler process)")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    return st


def main(argv: Sequence[str] | None = None) -> int:
    from sgl_tts.plugin.scheduling.metrics import read_records, summarize

    args = build_parser().parse_args(argv)
    quiet_logging()
    try:
        summary = summarize(read_records(args.files))
    except (ConnectionError, FileNotFoundError, ValueError) as exc:
        print(f"sgl-tts: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary))
        return 0
    hit = summary["prefix_hit_rate"]
    occ = summary["kv_occupancy"]
    bs = summary["batch_size"]
    print(f"batches {summary['batches']}: size mean {bs['mean']:.1f}, p50 {bs['p50']}, max {bs['max']}")
    if occ["mean"] is not None:
        print(f"KV occupancy: mean {100 * occ['mean']:.0f}%, max {100 * occ['max']:.0f}%")
    print(f"prefill batches {summary['prefill_batches']}, requests admitted {summary['admitted']}, "
          f"deferred {summary['deferred']}")
    print("prefix-cache hit rate: " + ("n/a" if hit is None else f"{100 * hit:.1f}%")
          + f" ({summary['cached_tokens']} cached / {summary['computed_tokens']} computed prompt tokens)")
    print(f"evicted tokens {summary['evicted_tokens']}; recomputed blocks (evicted, then needed "
          f"again) {summary['recomputed_blocks']}")
    rounds, seconds = summary["rounds"], summary["round_seconds"]
    if any(rounds.values()):   # records written before the round timer have none
        print("scheduler time per round: " + ", ".join(
            f"{mode} {1000 * seconds[mode] / rounds[mode]:.2f} ms x {rounds[mode]}" if rounds[mode] else f"{mode} -"
            for mode in rounds))
    return 0
