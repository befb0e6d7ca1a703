"""``sgl-tts demo``: single sample, majority vote, PRM best-of-N, PRM beam search, PRM particle
filtering and DeepConf (online) side by side on test problems (:func:`sgl_tts.quality.compare`), on the embedded tiny models
by default."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

from sgl_tts.cli import quiet_logging


def build_parser() -> argparse.ArgumentParser:
    d = argparse.ArgumentParser(prog="sgl-tts demo")
    d.add_argument("--problems", type=int, default=50, help="test problems (default 50)")
    d.add_argument("--ns", default="1,4,16", help="N values, comma-separated, starting at 1")
    d.add_argument("--beam-width", type=int, default=4, help="beam width M of beam search")
    d.add_argument("--temperature", type=float, default=0.8)
    d.add_argument("--generator", default=None, help="generator folder (default: the shipped one)")
    d.add_argument("--prm", default=None, help="PRM folder (default: the shipped one)")
    d.add_argument("--target", default=None, help="generator on an SGLang server URL instead")
    d.add_argument("--runtime", choices=["auto", "server", "cuda", "cpu"], default="auto")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--cpu-engine", choices=["auto", "thread", "process"], default="auto",
                   help="where the CPU backend's model engines run: auto (default): as sgl-tts run decides "
                        "for best-of-N with --problems in flight (from 8: each in a process of its own, the "
                        "generator in one per core); process: one process per model; thread: threads of "
                        "this process")
    d.add_argument("--cpu-replicas", type=int, default=None, metavar="N",
                   help="generator engines, each in a process of its own, requests routed by prompt prefix")
    d.add_argument("--plot", default="sgl-tts-demo.png", help="accuracy-vs-N plot file")
    d.add_argument("--no-plot", action="store_true", help="do not save the plot")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return d


def engine_layout(args: argparse.Namespace):
    """The CPU engines' layout: every program runs with all problems in flight, so as
    :func:`~sgl_tts.backends.layout.choose_engine` lays best-of-N out with that many (its rows, one
    PRM engine)."""
    from sgl_tts.backends.layout import choose_engine

    return choose_engine(args.cpu_engine, tree_search=False, in_flight=args.problems, replicas=args.cpu_replicas)


def demo(args: argparse.Namespace) -> int:
    """Run the comparison the flags ask for and print it (a table, or one JSON object)."""
    import sgl_tts
    from sgl_tts import quality
    from sgl_tts.machine import describe
    from sgl_tts.models import shipped_model
    from sgl_tts.prm import StepTagPRM
    from sgl_tts.tiny import task

    ns = quality.check_ns(quality.int_list(args.ns, "--ns"))
    if args.problems < 1:
        raise ValueError("--problems must be at least 1")
    prm_path = args.prm or shipped_model("prm")
    if prm_path is None:
        raise FileNotFoundError("no PRM: this source tree ships no trained PRM; pass --prm PATH "
                                "(train one with `sgl-tts train-tiny --out DIR`)")
    t0 = time.perf_counter()
    layout = engine_layout(args)
    generator = sgl_tts.connect(args.target or args.generator, runtime=args.runtime,
                                local_options=layout.options())
    prm_backend = sgl_tts.LocalBackend(prm_path, seed=args.seed, **layout.prm_options())
    for backend in (generator, prm_backend):   # engines in processes load in the background: wait here,
        wait = getattr(backend, "wait_ready", None)   # so that no method's seconds include it
        if wait is not None:
            wait()
    load_s = time.perf_counter() - t0
    try:
        cmp = quality.compare(generator, StepTagPRM(prm_backend), task.test_split()[:args.problems],
                              ns=ns, beam_width=args.beam_width, temperature=args.temperature,
                              seed=args.seed, progress=not args.json,
                              # one row: its smallest N keeps the main job short (`sgl-tts quality`
                              # has every N); at N = 16 it costs as much as beam search's row
                              particle_filtering_ns=[n for n in ns if n >= 2][:1],
                              # DeepConf online at the largest N, where its early stopping has room
                              # (beside majority vote at that N: what it saves); `quality` has offline too
                              deepconf_ns=[n for n in ns if n >= 2][-1:], deepconf_modes=("online",))
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_logging()
    try:
        if args.problems >= 1 and engine_layout(args).engine_in == "process":
            from sgl_tts.backends import engine_zygote

            engine_zygote.start()   # the engines' imports, in a process that overlaps this one's
        return demo(args)
    except (ConnectionError, FileNotFoundError, ValueError) as exc:
        print(f"sgl-tts: error: {exc}", file=sys.stderr)
        return 1
