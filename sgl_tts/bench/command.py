"""``sgl-tts bench``: start each side's servers (``sgl-tts serve``), run the searches, write the
records (resumable JSONL), the report (Markdown + JSON) and the plot. See :mod:`sgl_tts.bench.goodput`
for what is measured."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from sgl_tts.bench.goodput import (ALGORITHMS, DEFAULT_N, DEFAULT_SERVER_ARGS, SIDES, BenchError,
                                   BenchSettings, RecordWriter, format_report, measure_limit, plot_report,
                                   read_records, run_side, summarize)

MODEL_CACHE = Path.home() / ".cache" / "sgl-tts" / "bench-models"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
STOCK_ENV = {"SGLANG_PLUGINS": "none"}   # an allow-list naming no plugin: sgl-tts is not loaded


def build_parser() -> argparse.ArgumentParser:
    from sgl_tts.memory import add_plan_arguments

    ap = argparse.ArgumentParser(
        prog="sgl-tts bench",
        description="Stock SGLang vs SGLang with sgl-tts (plugin + planned memory split) on beam search "
                    "and DVTS: precise goodput, latency split, tokens, prefix-cache hits, generator-bound "
                    "limit. --generator/--prm take a model folder, a config.json or a shipped config name "
                    "(qwen2.5-math-1.5b, qwen2.5-7b, math-shepherd-mistral-7b, skywork-prm-1.5b), served "
                    "with random weights.")
    add_plan_arguments(ap)
    # the planner's workload follows the trace unless given: a request in the middle of a solution
    ap.set_defaults(beams=None, step_tokens=None, verify_tokens=None)
    b = ap.add_argument_group("benchmark")
    b.add_argument("--n", type=int, nargs="+", default=list(DEFAULT_N), help="beam counts (default 8 .. 512)")
    b.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    b.add_argument("--problems", type=int, default=2, help="synthetic problems per (algorithm, n)")
    b.add_argument("--beam-width", type=int, default=4)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--temperature", type=float, default=0.8)
    b.add_argument("--trace-median", type=float, default=None, help="median step tokens (trace default 150)")
    b.add_argument("--trace-sigma", type=float, default=None, help="log-normal sigma (trace default 1.0)")
    b.add_argument("--trace-max-tokens", type=int, default=None, help="longest step (trace default 4096)")
    b.add_argument("--trace-end-probability", type=float, default=None, help="(trace default 0.15)")
    b.add_argument("--trace-max-depth", type=int, default=None, help="(trace default 40)")
    b.add_argument("--context-tokens", type=int, default=None,
                   help="generator context length (default: its config's max_position_embeddings)")
    b.add_argument("--limit-tokens", type=int, default=256, help="tokens per request of the limit measurement")
    b.add_argument("--stock-split", type=float, default=0.5,
                   help="the stock side's generator share of the memory budget (default 0.5)")
    b.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    b.add_argument("--output", default=None,
                   help="records (JSONL; resumed if it exists): default bench-out/<generator>+<prm>.jsonl; "
                        "the report goes beside it (.md, .summary.json, .png)")
    s = ap.add_argument_group("servers")
    s.add_argument("--load-format", default="dummy", help="SGLang --load-format (default dummy: random weights)")
    s.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                   help=f"extra flags for every server (default: {DEFAULT_SERVER_ARGS!r})")
    s.add_argument("--models-dir", default=str(MODEL_CACHE), help="where config names become model folders")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--generator-port", type=int, default=30000)
    s.add_argument("--prm-port", type=int, default=30001)
    s.add_argument("--health-timeout", type=float, default=900.0)
    ap.add_argument("--dry-run", action="store_true", help="print the settings and both sides' commands, then exit")
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from --output's records")
    ap.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                    help="start no search after this many seconds: stop the servers, write the report and "
                         "exit 3 (run again to go on; for machines that limit a command's time)")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def model_folder(arg: str, models_dir: Path) -> Path:
    """A servable folder: ``arg`` itself if it holds a tokenizer, else a random-weight folder written
    for its config (once; rewritten if the config changed)."""
    from sgl_tts.bench.dummy_models import find_config, tokenizer_dir, write_dummy_model

    path = Path(arg)
    if path.is_dir() and any((tokenizer_dir(path) / f).exists() for f in TOKENIZER_FILES):
        return path
    src = find_config(arg)
    out = models_dir / _label(str(src))
    done = out / "config.json"
    if not (done.exists() and done.read_text() == src.read_text() and (out / "tokenizer" / "tokenizer.json").exists()):
        write_dummy_model(src, out)
    return out


def _label(arg: str) -> str:
    """A model's short name: a folder's or config's name (``config.json``: its folder's)."""
    path = Path(arg)
    if path.name == "config.json":
        path = path.parent
    return path.name[:-5] if path.name.endswith(".json") else path.name


def settings_from_args(args, context_default: int | None, planned_batch: int) -> BenchSettings:
    trace = {k: v for k, v in {"median_tokens": args.trace_median, "sigma": args.trace_sigma,
                               "max_tokens": args.trace_max_tokens,
                               "end_probability": args.trace_end_probability,
                               "max_depth": args.trace_max_depth}.items() if v is not None}
    return BenchSettings(tuple(args.algorithms), tuple(args.n), args.problems, args.beam_width, args.seed,
                         args.prompt_tokens, args.temperature, trace,
                         args.context_tokens or context_default, planned_batch, args.limit_tokens)


def report(records: list[dict], settings: BenchSettings, output: Path, header: dict) -> str:
    """Write ``.md``, ``.summary.json`` and ``.png`` beside ``output``; return the Markdown."""
    rows = summarize(records, settings)
    table = format_report(rows)
    lines = [f"# sgl-tts bench: {header['generator']} + {header['prm']}", "",
             f"- machine: {header['machine']}", f"- date: {header['date']}",
             f"- command: `{header['command']}`", f"- memory budget: {header['budget']}",
             f"- planner workload: {header.get('workload')}",
             f"- settings: `{json.dumps(settings.to_json())}`", "", table, ""]
    text = "\n".join(lines)
    output.with_suffix(".md").write_text(text)
    output.with_suffix(".summary.json").write_text(json.dumps(
        {"header": header, "settings": settings.to_json(),
         "rows": [{"algorithm": r.algorithm, "n": r.n, "limit_goodput": r.limit_goodput,
                   "limit_batch": r.limit_batch, "kept_beams_match": r.match, "mismatched": r.mismatched,
                   "sides": {k: vars(v) for k, v in r.sides.items()}} for r in rows]}, indent=1))
    if rows:
        plot_report(rows, output.with_suffix(".png"), f"{header['generator']} + {header['prm']}, "
                                                      f"{header['budget']}, {header['machine']}")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """``sgl-tts bench``."""
    from sgl_tts.machine import describe
    from sgl_tts.memory import GiB, context_tokens, plan_from_args, static_split_flags
    from sgl_tts.serve import ServerFailed, build_specs, run_servers, sigterm_stops_servers

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)

    def fail(msg: str) -> int:
        print(f"sgl-tts bench: error: {msg}", file=sys.stderr)
        return 1

    try:
        models_dir = Path(args.models_dir).expanduser()
        gen_dir, prm_dir = model_folder(args.generator, models_dir), model_folder(args.prm, models_dir)
        names = {"generator": _label(args.generator), "prm": _label(args.prm)}
        args.generator, args.prm = str(gen_dir), str(prm_dir)
        gen_cfg = json.loads((gen_dir / "config.json").read_text())
        # a path (and the PRM's input for it) must fit both models' context
        contexts = [c for c in (context_tokens(gen_dir), context_tokens(prm_dir)) if c]
        context = min(contexts) if contexts else None
        draft = settings_from_args(args, context, 1)
        shape = draft.step_trace().describe(samples=4000)
        plan_args = argparse.Namespace(**vars(args))
        plan_args.beams = args.beams or max(args.n)
        plan_args.step_tokens = args.step_tokens or round(shape["mean_tokens"])
        path = round(shape["mean_steps"] * shape["mean_tokens"] / 2)
        plan_args.prompt_tokens = args.prompt_tokens + path
        plan_args.verify_tokens = args.verify_tokens or args.prompt_tokens + path + plan_args.step_tokens
        # the longest request the benchmark sends: a path is cut before the context (see the trace)
        plan_args.longest_request = args.longest_request or draft.context_tokens
        plan = plan_from_args(plan_args)
        settings = settings_from_args(args, context, plan.flags["generator"].max_running_requests or 1)
        longest = plan_args.longest_request or 0
        stock = static_split_flags(plan.gen, plan.prm, plan.budget, plan.reserve, args.stock_split, args.first,
                                   min_pool_tokens={"generator": longest, "prm": longest})
    except (FileNotFoundError, ValueError) as exc:
        return fail(str(exc))
    vocab = int(gen_cfg["vocab_size"]) - 4
    output = Path(args.output or f"bench-out/{names['generator']}+{names['prm']}.jsonl")
    from sgl_tts.bench.dummy_models import tokenizer_dir

    toks = {"generator": tokenizer_dir(gen_dir), "prm": tokenizer_dir(prm_dir)}
    extra = shlex.split(args.server_args) + (["--load-format", args.load_format] if args.load_format else [])
    extra_by = {name: extra + (["--tokenizer-path", str(toks[name])] if toks[name] != folder else [])
                for name, folder in (("generator", gen_dir), ("prm", prm_dir))}
    ports = {"generator": args.generator_port, "prm": args.prm_port}
    side_flags = {"stock": stock, "sgl-tts": plan.flags}
    specs = {}
    for side in args.sides:
        plugin = ["--tts-policy", "prefix-aware",
                  "--tts-metrics-file", str(output.with_name(output.stem + ".plugin-metrics.jsonl"))] if side == "sgl-tts" else []
        specs[side] = build_specs(str(gen_dir), str(prm_dir), side_flags[side], host=args.host, ports=ports,
                                  first=args.first, plugin_args=plugin,
                                  extra=extra_by,
                                  env=STOCK_ENV if side == "stock" else None)
    header = {"generator": names["generator"], "prm": names["prm"], "machine": describe(),
              "date": datetime.date.today().isoformat(), "command": shlex.join(["sgl-tts", "bench", *argv]),
              "budget": f"{plan.budget / GiB:.1f} GiB",
              "workload": dataclasses.asdict(plan.work)}
    if args.dry_run:
        print(json.dumps(settings.to_json()))
        for side, side_specs in specs.items():
            for spec in side_specs:
                env = " ".join(f"{k}={v}" for k, v in (spec.env or {}).items())
                print(f"# {side} {spec.name}")
                print((env + " " if env else "") + shlex.join(spec.command))
        return 0
    try:
        records = read_records(output, settings)
    except BenchError as exc:
        return fail(str(exc))
    if args.report_only:
        if not records:
            return fail(f"{output} holds no records to report")
        print(report(records, settings, output, header))
        return 0
    writer = RecordWriter(output, settings, records)
    deadline = time.monotonic() + args.stop_after if args.stop_after is not None else None
    left = 0
    for side in args.sides:
        done = {(r["side"], r["algorithm"], r["n"], r["problem"]) for r in writer.records if r.get("kind") == "search"}
        limits = {r["batch"] for r in writer.records if r.get("kind") == "limit"}
        need = {(side, a, n, p) for a in settings.algorithms for n in settings.n for p in range(settings.problems)}
        need_limit = side == "sgl-tts" and {min(n, settings.planned_batch) for n in settings.n} - limits
        if need <= done and not need_limit:
            continue
        if deadline is not None and time.monotonic() >= deadline:
            left += len(need - done) + (1 if need_limit else 0)
            continue
        stop = threading.Event()

        def work(servers, side=side, done=done, limits=limits):
            nonlocal left
            try:
                urls = {s.spec.name: s.spec.health_url.rsplit("/", 1)[0] for s in servers}
                unfinished = run_side(side, urls["generator"], urls["prm"], settings,
                                      prm_tokenizer=str(toks["prm"]), generator_tokenizer=str(toks["generator"]),
                                      vocab=vocab, done=done, write=writer, progress=not args.no_progress,
                                      deadline=deadline)
                left += unfinished
                if side == "sgl-tts" and not unfinished:
                    measure_limit(urls["generator"], settings, vocab=vocab, write=writer, done=limits)
            except Exception as exc:
                time.sleep(0.5)   # a server that crashed has exited by now: name it, with its last lines
                dead = next((s for s in servers if not s.alive()), None)
                if dead is not None:
                    raise dead.failure(f"exited with code {dead.proc.returncode} during the searches") from exc
                raise
            finally:
                stop.set()

        try:
            with sigterm_stops_servers():
                run_servers(specs[side], health_timeout=args.health_timeout, on_ready=work, stop_event=stop)
        except (ServerFailed, BenchError, OSError) as exc:   # OSError: connection errors of urllib/requests
            print(report(writer.records, settings, output, header))
            return fail(f"{side}: {exc} (finished searches are kept in {output}; run again to resume)")
        except KeyboardInterrupt:
            print(f"sgl-tts bench: stopped; finished searches are kept in {output}", file=sys.stderr)
            return 130
    print(report(writer.records, settings, output, header))
    rows = summarize(writer.records, settings)
    if left:
        print(f"sgl-tts bench: --stop-after reached with work left ({left} searches or measurements); "
              f"run the same command again to go on from {output}", file=sys.stderr)
        return 3
    if any(r.match is False for r in rows):
        return fail("kept beams differ between the sides (see the report's last column)")
    return 0


__all__ = ["build_parser", "main", "model_folder", "report", "settings_from_args"]
