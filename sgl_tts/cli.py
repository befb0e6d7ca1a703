"""The ``sgl-tts`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
from typing import Sequence

logger = logging.getLogger("sgl_tts")


def cmd_demo(args: argparse.Namespace) -> int:
    """Compare single sample, majority vote, PRM best-of-N and PRM beam search on test problems."""
    import sgl_tts
    from sgl_tts import quality
    from sgl_tts.tiny import task
    from sgl_tts.machine import describe
    from sgl_tts.models import shipped_model
    from sgl_tts.prm import StepTagPRM

    ns = quality.check_ns(quality.int_list(args.ns, "--ns"))
    if args.problems < 1:
        raise ValueError("--problems must be at least 1")
    prm_path = args.prm or shipped_model("prm")
    if prm_path is None:
        raise FileNotFoundError("no PRM: this source tree ships no trained PRM; pass --prm PATH "
                                "(train one with `sgl-tts train-tiny --out DIR`)")
    t0 = time.perf_counter()
    generator = sgl_tts.connect(args.target or args.generator, runtime=args.runtime,
                                local_options={"engine_in": args.cpu_engine})
    prm_backend = sgl_tts.LocalBackend(prm_path, seed=args.seed, engine_in=args.cpu_engine)
    load_s = time.perf_counter() - t0
    try:
        cmp = quality.compare(generator, StepTagPRM(prm_backend), task.test_split()[:args.problems],
                              ns=ns, beam_width=args.beam_width, temperature=args.temperature,
                              seed=args.seed, progress=not args.json)
    finally:
        generator.shutdown()
        prm_backend.shutdown()
    plot = None if args.no_plot else str(quality.plot_accuracy(cmp, args.plot))
    result = {"generator": generator.get_model_name(), "generator_backend": type(generator).__name__,
              "prm": str(prm_path), **cmp.to_json(), "load_seconds": round(load_s, 3), "plot": plot,
              "machine": describe(), "date": time.strftime("%Y-%m-%d")}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"sgl-tts demo: {cmp.problems} test problems, T={cmp.temperature}, beam width "
          f"{cmp.beam_width}, PRM score = {cmp.aggregation} step")
    print(f"generator {result['generator']} ({result['generator_backend']}), PRM {prm_path}")
    print(cmp.table())
    d = cmp.details
    if d:
        n = d["samples"]
        print(f"pass@{n} (an oracle picking any right sample): {100 * d[f'pass@{n}']:.1f}%; "
              f"PRM step AUC {d['prm_step_auc']:.3f}")
    print("majority vote, PRM best-of-N and PRM-weighted vote at one N read the same samples (one "
          "run: its seconds include PRM scoring).")
    if plot:
        print(f"plot: {plot}")
    print(f"load {load_s:.1f}s, total {cmp.seconds:.1f}s on {result['machine']}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import sglang
    import torch
    import transformers

    import sgl_tts

    info = {"sgl_tts": sgl_tts.__version__, "sglang": sglang.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda": torch.cuda.is_available(),
            "python": platform.python_version()}
    print(json.dumps(info, indent=1))
    return 0


def cmd_scheduler_stats(args: argparse.Namespace) -> int:
    """Summarise the scheduler plugin's metric files (``--tts-metrics-file``)."""
    from sgl_tts.plugin.metrics import read_records, summarize

    summary = summarize(read_records(args.files))
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
    return 0


def _delegated(command: str):
    """Subcommands with their own argument parsers (listed in ``--help``, dispatched in ``main``)."""
    if command == "train-tiny":
        from sgl_tts.tiny.training import main as delegate
    elif command == "run":
        from sgl_tts.experiment import main as delegate
    elif command == "plan":
        from sgl_tts.launch.memory import main as delegate
    elif command == "serve":
        from sgl_tts.launch.serve import main as delegate
    elif command == "bench":
        from sgl_tts.bench.command import main as delegate
    elif command == "load":
        from sgl_tts.bench.load import main as delegate
    elif command == "serve-search":
        from sgl_tts.serving.server import main as delegate
    elif command == "scale-out":
        from sgl_tts.bench.scaleout import main as delegate
    elif command == "bench-frontend":
        from sgl_tts.bench.frontend import main as delegate
    elif command == "wheelhouse":
        from sgl_tts.wheelhouse import main as delegate
    elif command == "smoke":
        from sgl_tts.smoke import main as delegate
    else:
        from sgl_tts.quality import main as delegate
    return delegate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sgl-tts", description="Fast test-time scaling on SGLang.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="compare single sample, majority vote, PRM best-of-N and PRM "
                                    "beam search on test problems (CPU, embedded tiny models)")
    d.add_argument("--problems", type=int, default=50, help="test problems (default 50)")
    d.add_argument("--ns", default="1,4,16", help="N values, comma-separated, starting at 1")
    d.add_argument("--beam-width", type=int, default=4, help="beam width M of beam search")
    d.add_argument("--temperature", type=float, default=0.8)
    d.add_argument("--generator", default=None, help="generator folder (default: the shipped one)")
    d.add_argument("--prm", default=None, help="PRM folder (default: the shipped one)")
    d.add_argument("--target", default=None, help="generator on an SGLang server URL instead")
    d.add_argument("--runtime", choices=["auto", "server", "cuda", "cpu"], default="auto")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--cpu-engine", choices=["thread", "process"], default="thread",
                   help="where the CPU backend's model engines run: a thread of this process or a child "
                        "process each, apart from the searches' threads (default thread)")
    d.add_argument("--plot", default="sgl-tts-demo.png", help="accuracy-vs-N plot file")
    d.add_argument("--no-plot", action="store_true", help="do not save the plot")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    d.set_defaults(func=cmd_demo)
    st = sub.add_parser("scheduler-stats", help="summarise the scheduler plugin's metric files "
                                                "(python -m sglang.launch_server --tts-metrics-file PATH)")
    st.add_argument("files", nargs="+", help="metric files (PATH.<pid>, one per scheduler process)")
    st.add_argument("--json", action="store_true", help="print one JSON object")
    st.set_defaults(func=cmd_scheduler_stats)
    i = sub.add_parser("info", help="versions of sgl-tts, sglang, torch, transformers")
    i.set_defaults(func=cmd_info)
    sub.add_parser("run", add_help=False,
                   help="run a TTS program over a JSONL dataset: resumable JSONL results, accuracy / "
                        "pass@N / accuracy vs N / goodput summary (see its --help)")
    sub.add_parser("plan", add_help=False,
                   help="split one GPU's memory between a generator and a PRM (roofline-guided) and "
                        "print both servers' SGLang flags (see its --help)")
    sub.add_parser("serve", add_help=False,
                   help="start the generator and the PRM as two SGLang servers on one GPU with the "
                        "planned flags and the plugin, supervised (see its --help)")
    sub.add_parser("bench", add_help=False,
                   help="stock SGLang vs SGLang with sgl-tts on beam search and DVTS (random-weight "
                        "models, trace-driven steps): goodput, latency, cache hits (see its --help)")
    sub.add_parser("load", add_help=False,
                   help="many searches arriving with Poisson arrivals: p50/p99 latency, throughput and "
                        "accuracy of beam search and MCTS with early exits and boosting (see its --help)")
    sub.add_parser("serve-search", add_help=False,
                   help="an OpenAI-compatible /v1/chat/completions endpoint that runs a TTS program per "
                        "request on the generator and PRM servers (see its --help)")
    sub.add_parser("scale-out", add_help=False,
                   help="generator replicas behind SGLang's router: cache hits of cache-aware vs round-robin "
                        "routing, serve-search throughput with 1 vs 2 replicas (CPU; see its --help)")
    sub.add_parser("bench-frontend", add_help=False,
                   help="many searches at once (K in flight) on the CPU backend and live CPU servers: "
                        "searches/s and tokens/s against the generator's decode limit, client CPU per "
                        "1,000 tokens, threads (see its --help)")
    sub.add_parser("wheelhouse", add_help=False,
                   help="build the wheels that carry SGLang to a GPU machine without network (see its --help)")
    sub.add_parser("smoke", add_help=False,
                   help="start an SGLang server with the tiny generator and the plugin, run beam search "
                        "through it, print OK and the timings (GPU; see its --help)")
    sub.add_parser("train-tiny", add_help=False,
                   help="train the tiny generator + PRM for the arithmetic task (see its --help)")
    sub.add_parser("quality", add_help=False,
                   help="measure single/majority/best-of-N/beam search/PRM AUC (see its --help)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("train-tiny", "quality", "run", "plan", "serve", "bench", "load",
                             "serve-search", "scale-out", "bench-frontend", "wheelhouse", "smoke"):
        return _delegated(argv[0])(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # per-shard "Loading weights" bars
    try:
        return args.func(args)
    except (ConnectionError, FileNotFoundError, ValueError) as exc:
        print(f"sgl-tts: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
