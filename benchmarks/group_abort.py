"""Group abort on a live server: how long aborting search groups takes, the plugin's two paths
(:mod:`sgl_tts.bench.group_abort` says what is measured and how).

    ./dev.sh run python benchmarks/group_abort.py --sizes 1000,5000,10000 --groups 10 \\
        --out docs/benchmarks/group_abort.run1.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from sgl_tts.bench import group_abort
from sgl_tts.bench.group_abort import PATHS, run_case, scheduler_cost, summarize
from sgl_tts.machine import cpu_model
from sgl_tts.plugin.scheduling.abort import MODE_ENV


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/group_abort.py", description=group_abort.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,5000,10000", help="total requests per case (comma list)")
    ap.add_argument("--groups", type=int, default=10, help="search groups per case")
    ap.add_argument("--tokens", type=int, default=480, help="max_new_tokens (the model's context is 512)")
    ap.add_argument("--paths", default=",".join(PATHS), help="plugin paths to compare: per-request,one")
    ap.add_argument("--kv-mib", type=int, default=64, help="the server's KV pool (MiB, float32)")
    ap.add_argument("--policy", default="off", choices=("off", "prefix-aware"),
                    help="the plugin's --tts-policy (the abort hook is on with either; prefix-aware "
                         "re-orders the whole waiting queue every scheduler iteration)")
    ap.add_argument("--no-py-spy", action="store_true",
                    help="do not sample the live scheduler with py-spy during the aborts")
    ap.add_argument("--scheduler-only", action="store_true",
                    help="only the in-process measurement of Scheduler.abort_request (no server)")
    ap.add_argument("--out", default=None, help="write every record as JSON here")
    ap.add_argument("--workdir", default=None, help="server logs (default: a temporary folder)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    paths = [p for p in args.paths.split(",") if p]
    for p in paths:
        if p not in PATHS:
            ap.error(f"unknown path {p!r}; known: {', '.join(PATHS)}")

    from sgl_tts.launch.live_servers import LiveServer, LiveServers
    from sgl_tts.models import shipped_model

    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    scheduler: list[dict] = []
    for n in sizes:
        for rec in scheduler_cost(n, args.groups):
            if rec["path"] in paths:
                scheduler.append(rec)
                print(f"[{rec['path']}] Scheduler.abort_request, {n} requests / {args.groups} groups: first "
                      f"group {rec['first_group_s'] * 1e3:.1f} ms, all groups {rec['all_groups_s'] * 1e3:.1f} ms",
                      file=sys.stderr, flush=True)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="group-abort-"))
    records: list[dict] = []
    for path in ([] if args.scheduler_only else paths):
        # the server inherits this process's environment (ManagedServer)
        os.environ[MODE_ENV] = path
        # metrics on: the plugin's start record names the scheduler process (for py-spy)
        spec = LiveServer(str(shipped_model("generator")), policy=args.policy, metrics=True,
                          kv_bytes=args.kv_mib << 20, seeded_sampling=True)
        with LiveServers({"generator": spec}, workdir / path) as servers:
            t = time.monotonic()
            url = servers.url("generator")
            print(f"[{path}] server up in {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)
            starts = [r for r in servers.metrics_records("generator") if r["event"] == "start"]
            pid = starts[0]["pid"] if starts and not args.no_py_spy else None
            for i, n in enumerate(sizes):
                case = asyncio.run(run_case(url, n, args.groups, args.tokens, tag=f"{path}-{i}",
                                            scheduler_pid=pid, workdir=workdir / path))
                case["path"] = path
                records.append(case)
                s = summarize(case)
                print(f"[{path}] {n} requests / {args.groups} groups: per group median "
                      f"{s['median_group_s']:.3f} s, max {s['max_group_s']:.3f} s, all groups "
                      f"{s['sum_groups_s']:.2f} s; abort call median {s['median_call_s'] * 1e3:.1f} ms; "
                      f"{s['finish_reasons']}; empty after: {s['empty_after']}; scheduler in "
                      f"abort_request: {s['scheduler_in_abort_s']} s of {s['scheduler_sampled_s']} s sampled",
                      file=sys.stderr, flush=True)
    os.environ.pop(MODE_ENV, None)
    report = {"started": started, "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                              "processor": cpu_model()},
              "command": " ".join(["python benchmarks/group_abort.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "scheduler": scheduler, "records": records,
              "summary": [dict(summarize(r), path=r["path"]) for r in records]}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(scheduler_table(scheduler))
    if records:
        print()
        print(table(report["summary"]))
    return 0


def scheduler_table(rows: Sequence[dict]) -> str:
    lines = ["| path | requests | groups | first group | slowest group | all groups |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['path']} | {r['requests']} | {r['groups']} | {r['first_group_s'] * 1e3:.1f} ms | "
                     f"{r['max_group_s'] * 1e3:.1f} ms | {r['all_groups_s'] * 1e3:.1f} ms |")
    return "\n".join(lines)


def table(summary: Sequence[dict]) -> str:
    lines = ["| path | requests | groups | running / waiting at abort | scheduler in abort_request "
             "(py-spy) | per group: median | max | all groups | abort call median | finish reasons | empty after |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for s in summary:
        spy = ("n/a" if s["scheduler_in_abort_s"] is None
               else f"{s['scheduler_in_abort_s']:.2f} s of {s['scheduler_sampled_s']:.1f} s")
        lines.append(f"| {s['path']} | {s['requests']} | {s['groups']} | {s['running_at_abort']} / "
                     f"{s['waiting_at_abort']} | {spy} | {s['median_group_s']:.3f} s | {s['max_group_s']:.3f} s | "
                     f"{s['sum_groups_s']:.2f} s | {s['median_call_s'] * 1e3:.1f} ms | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(s['finish_reasons'].items()))} | "
                     f"{'yes' if s['empty_after'] else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
