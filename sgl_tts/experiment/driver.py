"""``sgl-tts run`` itself: open the backends and the PRM, run the problems with ``in_flight`` at once,
append each result as it finishes, summarise (the command line: :mod:`sgl_tts.cli.run`)."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any, Iterator

from sgl_tts.experiment.config import RunError, RunConfig, program_function
from sgl_tts.experiment.records import read_problems, result_record, read_results, results_store
from sgl_tts.experiment.summary import Summary, summarize

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------- run
def open_prm(cfg: RunConfig):
    """The PRM scorer the config names (``None`` when the run uses none); ``prm_kind: auto`` reads
    the PRM's architecture (:func:`sgl_tts.prm.detect.detect_prm`)."""
    if not cfg.uses_prm:
        return None, None
    from sgl_tts.prm import RewardHeadPRM, StepPooledPRM, StepTagPRM
    from sgl_tts.prm.detect import detect_prm

    target = cfg.prm
    if target is None:
        from sgl_tts.models import shipped_model
        target = shipped_model("prm")
        if target is None:
            raise RunError("no PRM: this source tree ships no trained PRM; pass --prm PATH or URL "
                           "(or --prm none for self-consistency)")
    target = str(target)
    served = target.startswith(("http://", "https://"))
    kind, fmt = cfg.prm_kind, None
    if kind in ("auto", "step_pooled"):
        try:
            found = detect_prm(target)
        except ValueError as exc:
            raise RunError(str(exc), ("prm", "prm_kind")) from exc
        if kind == "step_pooled" and found.kind != "step_pooled":
            raise RunError(f"prm_kind step_pooled: {target} is a {found.architecture}, not a step-pooled PRM", ("prm_kind",))
        kind, fmt = found.kind, found.format
    if kind == "step_pooled" and not served:
        raise RunError(f"{target} is a {fmt} PRM: SGLang serves it, with the sgl-tts plugin installed "
                       f"(sgl-tts serve --prm {target}); pass the server's URL as --prm", ("prm",))
    if served:
        from sgl_tts.backends import SGLangEndpoint
        backend = SGLangEndpoint(target.rstrip("/"), tokenizer_path=cfg.prm_tokenizer)
    elif kind == "reward_head":
        from sgl_tts.backends.classifier import LocalClassifier
        backend = LocalClassifier(target)
    else:
        from sgl_tts.backends import LocalBackend
        backend = LocalBackend(target, seed=cfg.seed, **cfg.engine_layout.prm_options())
    try:
        if kind == "step_pooled":
            prm = StepPooledPRM(backend, fmt)
        elif kind == "reward_head":
            prm = RewardHeadPRM(backend, tag=cfg.prm_tag)
        else:
            prm = StepTagPRM(backend, good=cfg.prm_good, bad=cfg.prm_bad, tag=cfg.prm_tag,
                             layout=_step_tag_layout(cfg, fmt, backend.tokenizer))
    except Exception:
        backend.shutdown()
        raise
    return prm, backend


def _step_tag_layout(cfg: RunConfig, fmt: str | None, tokenizer):
    """A causal-LM PRM family's own layout (Math-Shepherd's) when the PRM is one (its format, or its
    tokenizer says so) and the run leaves the step tag and labels at their defaults; else None."""
    from sgl_tts.prm.formats import STEP_TAG_LAYOUTS, step_tag_layout_for

    defaults = RunConfig()
    if (cfg.prm_tag, cfg.prm_good, cfg.prm_bad) != (defaults.prm_tag, defaults.prm_good, defaults.prm_bad):
        return None
    return STEP_TAG_LAYOUTS[fmt] if fmt in STEP_TAG_LAYOUTS else step_tag_layout_for(tokenizer)


def check_prm(prm, question: str, where: str) -> None:
    """Score one short step before the run, so a broken PRM fails once, clearly, up front."""
    try:
        got = prm.score(question, [["1"]])
        if len(got) != 1 or len(got[0]) != 1:
            raise ValueError(f"expected one score for one step, got {got!r}")
    except Exception as exc:
        raise RunError(f"the PRM ({where}) failed to score a test step: {exc}; check --prm, "
                       f"--prm-kind and that its server is up") from exc


def check_backends(cfg: RunConfig, generator, prm, question: str) -> None:
    """Before the first search: the PRM scores a step (:func:`check_prm`), and ``speculative: auto``
    with its curve left to measure has a generator that can measure one (a server: an in-process
    CUDA runtime's is measured by its first search). A generator that is no server (the CPU backend, a
    scripted one) is refused, naming how to give a curve: ``auto`` never quietly runs as the plain
    search."""
    if cfg.speculative == "auto" and cfg.speculation_curve == "measure" and not hasattr(generator, "decode_curve"):
        from sgl_tts.launch.decode_curve import curve_dir

        raise RunError(f"speculative: auto decides on the generator's decode curve, and the generator "
                       f"({cfg.generator or type(generator).__name__}) is not a server to measure one on: give "
                       f"speculation_curve: FILE (a JSON file with points: [[batch, seconds], ...]; sgl-tts run "
                       f"caches a server's under {curve_dir()}), none (no curve: no branch starts), "
                       f"or a generator server's URL", ("speculation_curve",))
    if cfg.uses_prm:
        check_prm(prm, question, cfg.prm or "the shipped PRM")


def with_decode_curve(cfg: RunConfig, stream=sys.stdout) -> RunConfig:
    """``cfg`` with ``speculation_curve: measure`` resolved for a generator server: its decode curve
    (:func:`sgl_tts.launch.decode_curve.curve_for_server`, cached per server), by its file. Any other
    generator is left to :func:`check_backends` (refused unless it is a server of its own)."""
    if cfg.speculative != "auto" or cfg.speculation_curve != "measure" or not (cfg.generator and "://" in cfg.generator):
        return cfg
    from sgl_tts.launch.cpu_profile import ProfileError
    from sgl_tts.launch.decode_curve import curve_for_server

    try:
        measured = curve_for_server(cfg.generator)
    except ProfileError as exc:
        raise RunError(f"speculative: auto: {exc}", ("speculation_curve",)) from None
    print(f"decode curve of {cfg.generator} ({measured.date}, {measured.path}): "
          + ", ".join(f"batch {b}: {1e3 * t:.1f} ms" for b, t in measured.curve.points), file=stream)
    return dataclasses.replace(cfg, speculation_curve=str(measured.path))


def with_verifier_slowdown(cfg: RunConfig, stream=sys.stdout) -> RunConfig:
    """``cfg`` with ``verifier_slowdown: measure`` resolved where it matters: the PRM shares the
    generator's device and both are servers (:func:`sgl_tts.launch.verifier_slowdown.slowdown_for_servers`,
    cached per pair). Elsewhere nothing is measured: a PRM on another device is never slowed, and a
    shared device without a measurement stops every running branch at the barrier."""
    if cfg.speculative != "auto" or cfg.verifier_slowdown != "measure" or not cfg.shares_device:
        return cfg
    if not (cfg.generator and "://" in cfg.generator and cfg.prm and "://" in cfg.prm):
        return cfg
    from sgl_tts.launch.cpu_profile import ProfileError
    from sgl_tts.launch.verifier_slowdown import slowdown_for_servers

    try:
        measured = slowdown_for_servers(cfg.generator, cfg.prm)
    except ProfileError as exc:
        raise RunError(f"speculative: auto: {exc}", ("verifier_slowdown",)) from None
    print(f"verifier slowdown of {cfg.prm} beside {cfg.generator} ({measured.date}, {measured.path}): "
          + ", ".join(f"{b} rows: {t:.3f} s" for b, t in measured.slowdown.points)
          + f"; {measured.slowdown.per_row:.3f} of its time per generator row", file=stream)
    return dataclasses.replace(cfg, verifier_slowdown=str(measured.path))


def run(cfg: RunConfig, *, generator=None, prm=None, stream=sys.stdout) -> tuple[Summary, list[dict]]:
    """Run ``cfg`` and return its summary and every record in the output (old and new).

    ``generator``/``prm`` may be given (e.g. a :class:`sgl_tts.testing.ScriptedBackend`); otherwise
    they are opened from the config and closed at the end.
    """
    from sgl_tts.search.runner import run_continuously

    cfg = with_verifier_slowdown(with_decode_curve(cfg, stream), stream)
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
        if todo:
            check_backends(cfg, generator, prm, todo[0].question)
        program = program_function(cfg.program)
        store = results_store(out_path, cfg.run_key())
        store.open()   # a torn last line is cut off before the first new record follows it
        failure = None
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
            store.append(rec)
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
