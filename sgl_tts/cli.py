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


def _printable(text: str, limit: int = 48) -> str:
    shown = "".join(c if c.isprintable() else "·" for c in text.replace("\n", "⏎"))
    return shown if len(shown) <= limit else shown[: limit - 1] + "…"


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the parallel-steps program on the embedded default model (or ``--target``)."""
    import sgl_tts
    from programs.parallel_steps import parallel_steps

    t0 = time.perf_counter()
    backend = sgl_tts.connect(args.target, runtime=args.runtime)
    load_s = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        state = parallel_steps.run(question=args.question, width=args.width,
                                   step_tokens=args.step_tokens, seed=args.seed, backend=backend)
        state.sync()
        if state.error() is not None:
            raise state.error()
        run_s = time.perf_counter() - t1
        metas = state["step_meta"]
        result = {
            "backend": type(backend).__name__,
            "model": backend.get_model_name(),
            "question": args.question,
            "steps": [{"text": t, "completion_tokens": m["completion_tokens"],
                       "finish_reason": m["finish_reason"]} for t, m in zip(state["step"], metas)],
            "answer": state["answer"],
            "tokens": sum(m["completion_tokens"] for m in metas),
            "load_seconds": round(load_s, 3),
            "run_seconds": round(run_s, 3),
        }
        engine = getattr(backend, "engine", None)
        if engine is not None:
            st = engine.stats
            result["engine"] = {"decode_forwards": st.decode_forwards, "max_running": st.max_running,
                                "prefill_tokens": st.prefill_tokens, "cached_tokens": st.cached_tokens}
    finally:
        backend.shutdown()
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"sgl-tts demo: {result['backend']} on {result['model']}")
    if "tiny-untrained" in str(result["model"]):
        print("  (embedded default = an untrained tiny Qwen2: the runtime is real, the text is noise)")
    print(f"question: {args.question}")
    print(f"{'branch':>6}  {'tokens':>6}  {'finish':<14} step")
    for i, s in enumerate(result["steps"]):
        fr = s["finish_reason"] or {}
        finish = fr.get("type", "?") + (f":{fr['matched']!r}" if "matched" in fr else "")
        print(f"{i:>6}  {s['completion_tokens']:>6}  {finish:<14.14} {_printable(s['text'])}")
    print(f"selected answer: {result['answer']!r}")
    eng = result.get("engine")
    batched = (f"; {result['tokens']} tokens in {eng['decode_forwards']} decode passes, up to "
               f"{eng['max_running']} branches per pass") if eng else ""
    print(f"model load {result['load_seconds']:.2f}s, program {result['run_seconds']:.2f}s{batched}")
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


def _delegated(command: str):
    """Subcommands with their own argument parsers (listed in ``--help``, dispatched in ``main``)."""
    if command == "train-tiny":
        from sgl_tts.training import main as delegate
    else:
        from sgl_tts.quality import main as delegate
    return delegate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sgl-tts", description="Fast test-time scaling on SGLang.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="run an SGLang program (fork/gen/join/select) on the embedded default")
    d.add_argument("--target", default=None,
                   help="SGLang server URL or model folder (default: the embedded default model)")
    d.add_argument("--runtime", choices=["auto", "server", "cuda", "cpu"], default="auto")
    d.add_argument("--question", default="Compute ((3+4)*5)-6.",
                   help="a problem in the task format (default: a 3-operation chain)")
    d.add_argument("--width", type=int, default=8, help="number of forked branches")
    d.add_argument("--step-tokens", type=int, default=32, help="max tokens per step")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    d.set_defaults(func=cmd_demo)
    i = sub.add_parser("info", help="versions of sgl-tts, sglang, torch, transformers")
    i.set_defaults(func=cmd_info)
    sub.add_parser("train-tiny", add_help=False,
                   help="train the tiny generator + PRM for the arithmetic task (see its --help)")
    sub.add_parser("quality", add_help=False,
                   help="measure single/majority/best-of-N/beam search/PRM AUC (see its --help)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("train-tiny", "quality"):
        return _delegated(argv[0])(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # per-shard "Loading weights" bars
    if getattr(args, "width", 1) < 1:
        print("sgl-tts: error: --width must be at least 1", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ConnectionError, FileNotFoundError, ValueError) as exc:
        print(f"sgl-tts: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
