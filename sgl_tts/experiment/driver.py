"""``sgl-tts run`` itself: open the backends and the PRM, run the problems with ``in_flight`` at once,
append each result as it finishes, summarise, and the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

from sgl_tts import registry
from sgl_tts.frontend import end_stream_executors
from sgl_tts.experiment.config import RunError, RunConfig, program_function, add_config_arguments, config_from_args
from sgl_tts.experiment.records import read_problems, result_record, read_results, append_line
from sgl_tts.experiment.summary import Summary, summarize, plot_summary

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------- run
def open_prm(cfg: RunConfig):
    """The PRM scorer the config names (``None`` when the run uses none)."""
    if not cfg.uses_prm:
        return None, None
    from sgl_tts.prm import RewardHeadPRM, StepTagPRM

    target = cfg.prm
    if target is None:
        from sgl_tts.models import shipped_model
        target = shipped_model("prm")
        if target is None:
            raise RunError("no PRM: this source tree ships no trained PRM; pass --prm PATH or URL "
                           "(or --prm none for self-consistency)")
    target = str(target)
    if target.startswith(("http://", "https://")):
        from sgl_tts.backends import SGLangEndpoint
        backend = SGLangEndpoint(target.rstrip("/"), tokenizer_path=cfg.prm_tokenizer)
    elif cfg.prm_kind == "reward_head":
        from sgl_tts.backends.classifier import LocalClassifier
        backend = LocalClassifier(target)
    else:
        from sgl_tts.backends import LocalBackend
        backend = LocalBackend(target, seed=cfg.seed, **cfg.engine_layout.options())
    try:
        if cfg.prm_kind == "reward_head":
            prm = RewardHeadPRM(backend, tag=cfg.prm_tag)
        else:
            prm = StepTagPRM(backend, good=cfg.prm_good, bad=cfg.prm_bad, tag=cfg.prm_tag)
    except Exception:
        backend.shutdown()
        raise
    return prm, backend


def check_prm(prm, question: str, where: str) -> None:
    """Score one short step before the run, so a broken PRM fails once, clearly, up front."""
    try:
        got = prm.score(question, [["1"]])
        if len(got) != 1 or len(got[0]) != 1:
            raise ValueError(f"expected one score for one step, got {got!r}")
    except Exception as exc:
        raise RunError(f"the PRM ({where}) failed to score a test step: {exc}; check --prm, "
                       f"--prm-kind and that its server is up") from exc


def run(cfg: RunConfig, *, generator=None, prm=None, stream=sys.stdout) -> tuple[Summary, list[dict]]:
    """Run ``cfg`` and return its summary and every record in the output (old and new).

    ``generator``/``prm`` may be given (e.g. a :class:`sgl_tts.testing.ScriptedBackend`); otherwise
    they are opened from the config and closed at the end.
    """
    from sgl_tts.search.runner import run_continuously

    problems = read_problems(cfg.problems, cfg.limit)
    out_path = Path(cfg.output)
    done = read_results(out_path, cfg.run_key(), problems)
    todo = [p for p in problems if p.index not in done]
    if done:
        print(f"resuming {out_path}: {len(done)} of {len(problems)} problems already done", file=stream)
    owned = []
    try:
        if todo and generator is None:
            import sgl_tts
            generator = sgl_tts.connect(cfg.generator, runtime=cfg.runtime,
                                        local_options=cfg.engine_layout.options())
            owned.append(generator)
        if todo and prm is None and cfg.uses_prm:
            prm, prm_backend = open_prm(cfg)
            owned.append(prm_backend)
        if todo and cfg.uses_prm:
            check_prm(prm, todo[0].question, cfg.prm or "the shipped PRM")
        program = program_function(cfg.program)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        failure = None
        with out_path.open("a", encoding="utf-8") as fh:
            stop = False

            def argument_sets() -> Iterator[dict[str, Any]]:
                for p in todo:
                    if stop:
                        return
                    yield cfg.program_arguments(p.question, prm)

            outcomes = run_continuously(program, argument_sets(), backend=generator,
                                        in_flight=cfg.in_flight, total=len(todo),
                                        progress=cfg.progress and bool(todo))
            for i, outcome in outcomes:
                problem = todo[i]
                err = outcome if isinstance(outcome, BaseException) else outcome.error()
                if err is not None:
                    logger.info("problem %s failed: %r", problem.id, err)   # the first is the run's one error line
                    if failure is None:
                        failure = (problem, err)
                    stop = True  # no new problems; the ones in flight still finish and are written
                    continue
                rec = result_record(problem, outcome.ret_value, cfg, cfg.uses_prm)
                append_line(fh, rec)
                done[problem.index] = rec
        if failure is not None:
            problem, err = failure
            raise RunError(f"problem {problem.id} (line {problem.index + 1}) failed: "
                           f"{type(err).__name__}: {err}; {len(done)} of {len(problems)} problems are "
                           f"in {out_path}; fix the cause and rerun the same command to resume")
    finally:
        for be in owned:
            if be is not None:
                be.shutdown()
    records = [done[p.index] for p in problems if p.index in done]
    return summarize(records, cfg.n, cfg.program), records


def main(argv: Sequence[str] | None = None) -> int:
    """``sgl-tts run``."""
    ap = argparse.ArgumentParser(
        prog="sgl-tts run", description="Run a TTS program over a JSONL dataset (resumable), then "
        "summarise accuracy, pass@N, accuracy vs N, goodput and latency.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_arguments(ap)
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        import transformers
        import warnings

        # a failed request is reported once, by the error line below; SGLang's interpreter would also
        # print a traceback per fork worker it stopped
        warnings.filterwarnings("ignore", message="Error in stream_executor")

        transformers.utils.logging.disable_progress_bar()  # per-shard "Loading weights" bars
    t0 = time.perf_counter()
    try:
        cfg = config_from_args(args)
        summary, records = run(cfg)
    except (RunError, OSError, ValueError) as exc:   # OSError: ConnectionError, FileNotFoundError, ...
        logger.debug("sgl-tts run failed", exc_info=True)
        # one line, always: a multi-line message (a server's reply, say) is joined
        message = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
        print(f"sgl-tts run: error: {message or type(exc).__name__}", file=sys.stderr)
        # a search that failed mid-way left fork workers waiting (non-daemon threads): without this
        # the process can outlive its error (seen once in CI after a generator was killed)
        end_stream_executors()
        return 1
    from sgl_tts.machine import describe

    plot = None
    if cfg.plot:
        title = f"{cfg.program}, N={cfg.n}" + (f", M={cfg.beam_width}" if registry.program(cfg.program).budget == "beams" else "")
        plot = str(plot_summary(summary, records, cfg.plot, title))
    info = {"config": dataclasses.asdict(cfg), "summary": summary.to_json(), "output": cfg.output,
            "plot": plot, "seconds": round(time.perf_counter() - t0, 2), "machine": describe(),
            "date": time.strftime("%Y-%m-%d")}
    summary_path = Path(cfg.output).with_suffix(".summary.json")
    summary_path.write_text(json.dumps(info, indent=1) + "\n")
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"sgl-tts run: {cfg.program} N={cfg.n} on {cfg.problems or 'the embedded test split'}"
          f" -> {cfg.output}")
    print(summary.table())
    if plot:
        print(f"plot: {plot}")
    print(f"summary: {summary_path}; {info['seconds']:.1f} s on {info['machine']}")
    return 0
