"""The ``sgl-tts`` command line: one module per command under :mod:`sgl_tts.cli`, each holding that
command's argument parser (``build_parser``) and ``main(argv) -> int``; the library modules it calls
hold no argument parsing.

This package itself only dispatches: :data:`COMMANDS` names each command's module, imported when the
command runs, so ``sgl-tts --help`` and ``sgl-tts info`` stay fast and importing :mod:`sgl_tts.cli`
loads neither torch nor SGLang (``tests/test_layering.py``)."""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import sys
from typing import NamedTuple, NoReturn, Sequence

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


class Command(NamedTuple):
    """One ``sgl-tts`` subcommand: the module holding its ``build_parser`` and ``main``, and its line
    in ``sgl-tts --help``."""

    module: str
    help: str


# command name -> module and help line, in --help's order
COMMANDS: dict[str, Command] = {
    "demo": Command("sgl_tts.cli.demo", "compare single sample, majority vote, PRM best-of-N and PRM beam search "
                                        "on test problems (CPU, embedded tiny models)"),
    "scheduler-stats": Command("sgl_tts.cli.scheduler_stats",
                               "summarise the scheduler plugin's metric files "
                               "(python -m sglang.launch_server --tts-metrics-file PATH)"),
    "info": Command("sgl_tts.cli.info", "versions of sgl-tts, sglang, torch, transformers"),
    "run": Command("sgl_tts.cli.run",
                   "run a TTS program over a JSONL dataset: resumable JSONL results, accuracy / pass@N / accuracy "
                   "vs N / goodput summary (see its --help)"),
    "plan": Command("sgl_tts.cli.plan",
                    "split one GPU's memory between a generator and a PRM (roofline-guided) and print both "
                    "servers' SGLang flags (see its --help)"),
    "serve": Command("sgl_tts.cli.serve",
                     "start the generator and the PRM as two SGLang servers on one GPU with the planned flags "
                     "and the plugin, supervised (see its --help)"),
    "bench": Command("sgl_tts.cli.bench",
                     "stock SGLang vs SGLang with sgl-tts on beam search and DVTS (random-weight models, "
                     "trace-driven steps): goodput, latency, cache hits (see its --help)"),
    "load": Command("sgl_tts.cli.load",
                    "many searches arriving with Poisson arrivals: p50/p99 latency, throughput and accuracy of "
                    "beam search and MCTS with early exits and boosting (see its --help)"),
    "serve-search": Command("sgl_tts.cli.serve_search",
                            "an OpenAI-compatible /v1/chat/completions endpoint that runs a TTS program per "
                            "request on the generator and PRM servers (see its --help)"),
    "scale-out": Command("sgl_tts.cli.scale_out",
                         "generator replicas behind SGLang's router: cache hits of cache-aware vs round-robin "
                         "routing, serve-search throughput with 1 vs 2 replicas (CPU; see its --help)"),
    "bench-frontend": Command("sgl_tts.cli.bench_frontend",
                              "many searches at once (K in flight) on the CPU backend and live CPU servers: "
                              "searches/s and tokens/s against the generator's decode limit, client CPU per "
                              "1,000 tokens, threads (see its --help)"),
    "wheelhouse": Command("sgl_tts.cli.wheelhouse",
                          "build the wheels that carry SGLang to a GPU machine without network (see its --help)"),
    "smoke": Command("sgl_tts.cli.smoke",
                     "start an SGLang server with the tiny generator and the plugin, run beam search through it, "
                     "print OK and the timings (GPU; see its --help)"),
    "train-tiny": Command("sgl_tts.cli.train_tiny",
                          "train the tiny generator + PRM for the arithmetic task (see its --help)"),
    "quality": Command("sgl_tts.cli.quality",
                       "measure single/majority/best-of-N/beam search/PRM AUC (see its --help)"),
    "workload": Command("sgl_tts.cli.workload",
                        "write a problem set (test, hard, mixed) as JSONL; --measure: greedy/sample accuracy, "
                        "PRM step AUC, first-step cut-off for MCTS's selective futility check (see its --help)"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: ``-v`` and the commands, each a stub that takes the rest of the line
    (the command's own parser reads it)."""
    p = argparse.ArgumentParser(prog="sgl-tts", description="Fast test-time scaling on SGLang.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        sub.add_parser(name, add_help=False, help=command.help)
    return p


def quiet_logging() -> bool:
    """Logging for a command that logs through ``sgl_tts``: warnings and up, unless ``sgl-tts -v``
    configured debug logging already. Returns whether it did (verbose): when not, transformers'
    per-shard "Loading weights" progress bars are turned off too."""
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)   # no-op after -v's set-up
    verbose = logging.getLogger().getEffectiveLevel() <= logging.DEBUG
    if not verbose:
        import transformers

        transformers.utils.logging.disable_progress_bar()
    return verbose


def main(argv: Sequence[str] | None = None) -> int:
    """``sgl-tts [-v] COMMAND ...``: the command's module runs the rest of the line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        name, rest = argv[0], argv[1:]
    else:   # -v before the command, --help, or a mistake the parser reports
        args, rest = build_parser().parse_known_args(argv)
        name = args.command
        if args.verbose:
            logging.basicConfig(level=logging.DEBUG, format=LOG_FORMAT)
    return importlib.import_module(COMMANDS[name].module).main(rest)


def entry() -> NoReturn:
    """The ``sgl-tts`` process (its console script and ``python -m sgl_tts.cli``): :func:`main` on
    the command line, then exit with its status.

    Before exiting, the heap is frozen (``gc.freeze``): the command has written and closed what it
    writes, and the interpreter's last cyclic collection over the ~430k objects torch, transformers
    and SGLang leave only delays the exit (measured on an idle 2-core machine: 1.7 s, frozen 0.3 s; a
    killed ``sgl-tts run`` was seen in that collection). Exit handlers still run. Only here, never in :func:`main`:
    a process that goes on (a test, a notebook) keeps its collector."""
    try:
        code = main()
    finally:
        gc.freeze()
    sys.exit(code)


__all__ = ["COMMANDS", "Command", "build_parser", "entry", "main", "quiet_logging"]
