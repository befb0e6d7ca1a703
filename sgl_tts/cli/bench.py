"""``sgl-tts bench``: stock SGLang vs SGLang with sgl-tts, each side's servers started in turn
(:mod:`sgl_tts.bench.command`: :func:`~sgl_tts.bench.command.prepare`, :class:`~sgl_tts.bench.command.SideRunner`;
:mod:`sgl_tts.bench.goodput` for what is measured)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from sgl_tts.cli.plan import add_plan_arguments


def build_parser() -> argparse.ArgumentParser:
    from sgl_tts.bench.command import (CPU_MODELS, CPU_PRESSURE_BUDGETS, CPU_PRESSURE_PROMPT_TOKENS, CPU_PRESSURE_SIDES,
                                       DEVICES)
    from sgl_tts.bench.goodput_settings import ALGORITHMS
    from sgl_tts.bench.sides import ALL_SIDES, SIDES

    ap = argparse.ArgumentParser(
        prog="sgl-tts bench",
        description="Stock SGLang vs SGLang with sgl-tts (plugin + planned memory split) on beam search "
                    "and DVTS: precise goodput, latency split, tokens, prefix-cache hits, generator-bound "
                    "limit. --generator/--prm take a model folder, a config.json or a shipped config name "
                    "(qwen2.5-math-1.5b, qwen2.5-7b, math-shepherd-mistral-7b, skywork-prm-1.5b, qwen2.5-math-prm-7b), served "
                    "with random weights.")
    from sgl_tts.launch.cpu_serving import DEFAULT_KV_MEMORY

    add_plan_arguments(ap, models_required=False)
    # the planner's workload follows the trace unless given: a request in the middle of a solution;
    # models and problem size have per-device defaults
    ap.set_defaults(beams=None, step_tokens=None, verify_tokens=None, prompt_tokens=None)
    ap.add_argument("--device", choices=DEVICES, default="cuda",
                    help="cuda (default): both sides on one GPU, the sgl-tts side with the planned split. "
                         "cpu: real SGLang servers on this CPU (SGLANG_USE_CPU_ENGINE=1), small random-weight "
                         f"models ({CPU_MODELS['generator']} + {CPU_MODELS['prm']} unless given), a shorter "
                         "trace, the stock sides --stock-split of --kv-memory and the sgl-tts side the "
                         "planner's split on measured CPU profiles (or --sgl-tts-split; the GPU flags are "
                         "ignored)")
    ap.add_argument("--kv-memory", default=None,
                    help=f"with --device cpu: RAM both KV pools of a side take together (default {DEFAULT_KV_MEMORY})")
    ap.add_argument("--pressure", action="store_true",
                    help="with --device cpu: the memory-pressure workload (issue 32): the KV budget measured for "
                         "the given --n (" + ", ".join(f"{n}: {b}" for n, b in CPU_PRESSURE_BUDGETS.items())
                         + f"), a shared {CPU_PRESSURE_PROMPT_TOKENS}-token prompt and the sides "
                         + " ".join(CPU_PRESSURE_SIDES) + " unless --sides is given")
    b = ap.add_argument_group("benchmark")
    b.add_argument("--n", type=int, nargs="+", default=None,
                   help="beam counts (default 8 .. 512; --device cpu: 8 32 64)")
    b.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    b.add_argument("--problems", type=int, default=None,
                   help="synthetic problems per (algorithm, n) (default 2; --device cpu: 1)")
    b.add_argument("--beam-width", type=int, default=4)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--temperature", type=float, default=0.8)
    b.add_argument("--trace-median", type=float, default=None,
                   help="median step tokens (trace default 150; --device cpu: 32)")
    b.add_argument("--trace-sigma", type=float, default=None, help="log-normal sigma (trace default 1.0)")
    b.add_argument("--trace-max-tokens", type=int, default=None,
                   help="longest step (trace default 4096; --device cpu: 512)")
    b.add_argument("--trace-end-probability", type=float, default=None, help="(trace default 0.15)")
    b.add_argument("--trace-max-depth", type=int, default=None, help="(trace default 40)")
    b.add_argument("--context-tokens", type=int, default=None,
                   help="generator context length (default: its config's max_position_embeddings)")
    b.add_argument("--limit-tokens", type=int, default=256, help="tokens per request of the limit measurement")
    b.add_argument("--stock-split", type=float, default=None,
                   help="the stock sides' generator share of the memory budget (default 0.5; with "
                        "--device cpu: of --kv-memory; --pressure at n = 64: 0.37)")
    b.add_argument("--sgl-tts-split", type=float, default=None,
                   help="with --device cpu: the sgl-tts side's generator share of --kv-memory, instead of the "
                        "memory planner's split on both models' measured CPU profiles (the default; the "
                        "report's header says which split each side used and whether it was planned)")
    b.add_argument("--sides", nargs="+", default=None, choices=ALL_SIDES,
                   help=f"{' and '.join(SIDES)} by default; stock-lpm/-dfs-weight: stock SGLang under its own prefix "
                        "policies; stock+overlap: the sgl-tts client's overlapped verification on stock servers; "
                        "sgl-tts+spec...: speculation, LookAhead, overlap (the ablation); sgl-tts+locality(-eviction/"
                        "-order/-families): --tts-policy locality (or its rules) on both servers; +overlap: with "
                        "overlapped verification (-by-family: siblings' PRM requests together)")
    _add_load_arguments(b)
    b.add_argument("--output", default=None,
                   help="records (JSONL; resumed if it exists): default bench-out/<generator>+<prm>.jsonl; "
                        "the report goes beside it (.md, .summary.json, .png)")
    _add_server_arguments(ap)
    _add_run_arguments(ap)
    return ap


def _add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """What a run does besides measuring: a dry run, a rebuilt report, a time limit, the output's form."""
    ap.add_argument("--dry-run", action="store_true", help="print the settings and both sides' commands, then exit")
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from --output's records")
    ap.add_argument("--with-records", nargs="+", type=Path, default=(), metavar="RECORDS",
                    help="with --report-only and --arrivals: add the cells of these load records files (each "
                         "with its own runs, budget and rates, e.g. another n's regime) to the report; a file "
                         "holding an (algorithm, n) the report holds, with the same settings, is another run of "
                         "that cell (a repeat, another --sgl-tts-split), its beams compared with the first run's")
    ap.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                    help="start no search after this many seconds: stop the servers, write the report and "
                         "exit 3 (run again to go on; for machines that limit a command's time)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--json", action="store_true",
                    help="print the summary (what .summary.json holds) on stdout instead of the Markdown "
                         "table; the servers' logs go to stderr")


def _add_load_arguments(b) -> None:
    """The load mode's flags (``--arrivals`` and what reads it) in the benchmark group ``b``."""
    from sgl_tts.bench.arrivals import DEFAULT_LATENCY_BOUND
    from sgl_tts.bench.command import LOAD_PROBLEMS
    from sgl_tts.bench.sides import LOAD_SIDES

    b.add_argument("--arrivals", type=rates, default=None, metavar="R1,R2,...",
                   help="the load mode (many searches at once): at each rate (searches / s) the --problems of "
                        "every (algorithm, n) arrive as a Poisson process and run at once; reports latency from "
                        "arrival to answer (p50/p99), throughput, both servers' waiting queues and each side's "
                        f"maximum sustainable rate. Sides by default: {' '.join(LOAD_SIDES)}; "
                        f"--problems {LOAD_PROBLEMS} by default")
    b.add_argument("--latency-bound", type=float, default=None,
                   help=f"with --arrivals: a rate is sustained when the p99 of its searches' stretch (latency over "
                        f"the same problem's alone) is within this (default {DEFAULT_LATENCY_BOUND:g}) and "
                        "stretches do not grow")
    b.add_argument("--unloaded-problems", type=int, default=None,
                   help="with --arrivals: problems of the unloaded block, run one after another, alone, before "
                        "the rates (default: every one); a search's stretch under load is its latency over its "
                        "problem's there")


def rates(text: str) -> list[float]:
    """``--arrivals``: comma-separated positive rates, each once, in increasing order."""
    try:
        got = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected rates like 0.05,0.1,0.2 (searches per second), got {text!r}") from None
    if not got or any(r <= 0 for r in got) or len(set(got)) != len(got):
        raise argparse.ArgumentTypeError(f"every rate must be > 0 and given once, got {text!r}")
    return sorted(got)


def _add_server_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``servers`` group: how each side's servers are launched and reached."""
    from sgl_tts.bench.command import MODEL_CACHE
    from sgl_tts.bench.goodput_settings import DEFAULT_SERVER_ARGS

    s = ap.add_argument_group("servers")
    s.add_argument("--load-format", default="dummy", help="SGLang --load-format (default dummy: random weights)")
    s.add_argument("--server-args", default=None,
                   help=f"extra flags for every server (default: {DEFAULT_SERVER_ARGS!r}; --device cpu: none, "
                        f"the CPU flags come from sgl_tts.launch.cpu_serving)")
    s.add_argument("--models-dir", default=str(MODEL_CACHE), help="where config names become model folders")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--generator-port", type=int, default=30000)
    s.add_argument("--prm-port", type=int, default=30001)
    s.add_argument("--health-timeout", type=float, default=900.0)


def print_dry_run(sides: Sequence[str], settings, specs: dict[str, list]) -> None:
    """``--dry-run``: the settings as JSON, then each server group's commands (a comment naming the
    side and server, then the command), and one line for each side that runs on an earlier side's
    servers."""
    from sgl_tts.bench.command import server_groups
    from sgl_tts.launch.serve import print_commands

    print(json.dumps(settings.to_json()))
    for group in server_groups(sides, specs):
        print_commands(specs[group[0]], label=group[0], health=False)
        for side in group[1:]:   # one line each: the pairs above stay (comment, command)
            print(f"# {side}: on the {group[0]} servers, started once; both radix caches flushed before it")


def _check_args(ap: argparse.ArgumentParser, args) -> None:
    """Flags that only work together, then the device's defaults (``ap.error`` exits 2 naming the cause)."""
    from sgl_tts.bench.command import apply_device_defaults

    if args.with_records and not (args.report_only and args.arrivals):
        ap.error("--with-records needs --report-only and --arrivals: it adds load cells to a rebuilt load report")
    if args.device != "cpu" and not (args.generator and args.prm):
        ap.error("--generator and --prm are required with --device cuda")
    try:
        apply_device_defaults(args)
    except ValueError as exc:
        ap.error(str(exc))


def _other_records(paths: Sequence[Path], header: dict) -> list:
    """``--with-records``: each file's records as a :class:`~sgl_tts.bench.load_report.LoadSource`."""
    from sgl_tts.bench.command import measured_header
    from sgl_tts.bench.errors import BenchError
    from sgl_tts.bench.goodput_store import read_with_settings
    from sgl_tts.bench.load_report import LoadSource

    out = []
    for path in paths:
        settings, records = read_with_settings(path)
        if not settings.load:
            raise BenchError(f"{path} holds searches run one at a time, not the load mode (--arrivals)")
        out.append(LoadSource(path.name, settings, measured_header(header, records), records))
    return out


def _kept_beams_differ(records, settings) -> bool:
    """Whether some search kept other beams on one side than on another."""
    if settings.load:
        from sgl_tts.bench.load_report import summarize_load

        return any(c.kept_beams_match is False for c in summarize_load(records, settings.latency_bound))
    from sgl_tts.bench.goodput_report import summarize

    return any(r.match is False for r in summarize(records, settings))


def main(argv: Sequence[str] | None = None) -> int:
    """``sgl-tts bench``."""
    from sgl_tts.bench.command import (SideRunner, bench_header, measured_header, prepare, report, run_record,
                                       server_groups, side_specs, summary_json)
    from sgl_tts.bench.errors import BenchError
    from sgl_tts.bench.goodput_store import RecordWriter, read_records
    from sgl_tts.frontend import end_stream_executors
    from sgl_tts.launch.serve import ServerFailed, sigterm_stops_servers

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    _check_args(ap, args)

    def fail(msg: str) -> int:
        print(f"sgl-tts bench: error: {msg}", file=sys.stderr)
        return 1

    try:
        setup = prepare(args)
    except (FileNotFoundError, ValueError) as exc:
        return fail(str(exc))
    settings = setup.settings
    output = Path(args.output or f"bench-out/{setup.names['generator']}+{setup.names['prm']}.jsonl")
    specs = side_specs(args, setup, output)
    header = bench_header(args, argv, setup)
    if args.dry_run:
        print_dry_run(args.sides, settings, specs)
        return 0

    def show(records, extra=()) -> None:
        """The report on stdout: the Markdown table, or with --json the summary."""
        shown = measured_header(header, records)
        text = report(records, settings, output, shown, extra)
        print(json.dumps(summary_json(records, settings, shown, output, extra), indent=1) if args.json else text,
              flush=True)

    try:
        records = read_records(output, settings)
    except BenchError as exc:
        return fail(str(exc))
    if args.report_only:
        if not records:
            return fail(f"{output} holds no records to report")
        try:
            show(records, _other_records(args.with_records, header))
        except (BenchError, ValueError) as exc:
            return fail(str(exc))
        return 0
    writer = RecordWriter(output, settings, records)
    writer(run_record(header))
    runner = SideRunner(args, setup, specs, writer)
    # one SIGTERM handler for every side: a signal between two sides stops the command the same way
    try:
        with sigterm_stops_servers():
            for group in server_groups(args.sides, specs):
                try:
                    runner.run_group(group)
                except (ServerFailed, BenchError, OSError) as exc:   # OSError: connection errors of urllib/requests
                    end_stream_executors()
                    show(writer.records)
                    return fail(f"{runner.side}: {exc} (finished searches are kept in {output}; run again to resume)")
    except KeyboardInterrupt:
        # A search cut short leaves its forks' workers (non-daemon threads) waiting for work; their
        # states would end them when collected, but not when the signal landed inside that clean-up
        # (swallowed in __del__) or a state is held in a cycle: the process would never exit
        end_stream_executors()
        print(f"sgl-tts bench: stopped; finished searches are kept in {output}", file=sys.stderr)
        return 130
    show(writer.records)
    differ = _kept_beams_differ(writer.records, settings)
    if runner.left:
        print(f"sgl-tts bench: --stop-after reached with work left ({runner.left} searches or measurements); "
              f"run the same command again to go on from {output}", file=sys.stderr)
        return 3
    if differ:
        return fail("kept beams differ between the sides (see the report's last column)")
    return 0
