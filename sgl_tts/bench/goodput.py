"""``sgl-tts bench``: stock SGLang against SGLang with sgl-tts, the same TTS programs side by side.

Each *side* is a generator + PRM server pair started by :mod:`sgl_tts.launch.serve` on one GPU:

- ``stock``: SGLang's own scheduling (scheduling plugin-free, observed by the same observer as the
  sgl-tts side: the plugin loaded observe-only, :mod:`sgl_tts.plugin.scheduling.observer`), a static split of the memory
  budget (``--stock-split``, the generator's share; 0.5 by default), SGLang's own batch limits;
- ``stock-lpm``, ``stock-dfs-weight``: the same stock servers under SGLang's own prefix-aware
  scheduling policies (``--schedule-policy lpm`` / ``dfs-weight``), what a user would try first;
- ``sgl-tts``: the plugin on (``--tts-policy prefix-aware``) and the memory planner's split and batch.

The report's ``vs best stock`` compares each side with the best stock side that ran. Each side's
servers also report SGLang's own counters (``--enable-metrics``): tokens evicted from the radix
cache and requests retracted (and their prompt tokens), and the sgl-tts observer's, the same code on
every side: prompt tokens recomputed that had been computed before (thrashing, block-granular), prompt
tokens prefilled, and the scheduler's time per round; from the generator's ``/metrics`` before and
after the side's searches (:mod:`sgl_tts.bench.server_counters`).

On the CPU (``sgl-tts bench --device cpu``) both sides get the same split and SGLang's own batch
limits (no planning there), so they differ only in the plugin's scheduling.

On each side beam search and DVTS run for every n on the same synthetic problems, one problem at a
time. Models are real architectures with random weights, so the *trace* (:mod:`sgl_tts.bench.trace`)
fixes what a real model would decide: every step's length (the request asks for exactly that many
tokens with ``ignore_eos``), whether it ends the solution, and its PRM score. The PRM server still
reads every step as its architecture does in a real run (a step-tag PRM's request per new step; a
step-pooled PRM's, ``Qwen2ForProcessRewardModel`` or ``Qwen2ForPrmModel`` served by the plugin's
classes, one ``/classify`` input per trajectory: that is the verifier's work and time), but its random
output is replaced by the trace's score. Selections are therefore the same
on both sides by construction, and the benchmark checks it: the kept beams of every search (each
named by its path of beam indices) must match, or the report says where they differ.

Reported per (algorithm, n) and side: precise goodput (seed 000 §6.1: mean tokens of a kept
trajectory over its mean completion time), completion latency split into generator and verifier
time, tokens generated and kept, the prefix-cache hit rate of each server (SGLang's ``cached_tokens``
over ``prompt_tokens``), and the generator-bound limit: the same generated tokens decoded at the
planned batch with no stragglers and no PRM waits (a measured decode throughput at that batch),
depth by depth, so a trajectory that ends at depth d is done once every step up to d is decoded.

The benchmark's parts, one module each: its settings (:mod:`sgl_tts.bench.goodput_settings`), the
trace on the servers (:mod:`sgl_tts.bench.goodput_trace`), the sides (:mod:`sgl_tts.bench.sides`),
the report (:mod:`sgl_tts.bench.goodput_report`) and the records file
(:mod:`sgl_tts.bench.goodput_store`); this module runs a side's searches (:func:`run_side`) and
measures the generator-bound limit (:func:`measure_limit`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Callable, Iterable

from sgl_tts.bench.errors import BenchError
from sgl_tts.bench.goodput_settings import BenchSettings, search_group
from sgl_tts.bench.goodput_trace import MeteredEndpoint, StepRegistry, TraceEndpoint, TraceScores
from sgl_tts.bench.sides import SIDE_OPTIONS, run_config, side_curve, side_slowdown
from sgl_tts.frontend import end_stream_executors

logger = logging.getLogger(__name__)


def run_side(side: str, generator_url: str, prm_url: str, settings: BenchSettings, *,
             prm_tokenizer: str | None = None, generator_tokenizer: str | None = None,
             vocab: int = 32000, done: Iterable[tuple] = (), write: Callable[[dict], None],
             progress: bool = True, deadline: float | None = None) -> int:
    """Run every (algorithm, n, problem) not in ``done`` on one side's servers; ``write`` gets one
    record per finished search (so nothing finished is lost if a later one fails). No search starts
    after ``deadline`` (``time.monotonic()``); returns how many were left for a later run."""
    from tqdm.auto import tqdm

    trace = settings.step_trace()
    configs = side_configs(side, generator_url, prm_url, settings, trace, write)
    registry = StepRegistry()
    gen = TraceEndpoint(generator_url, trace, registry, context_tokens=settings.context_tokens,
                        tokenizer_path=generator_tokenizer, banned_token_ids=settings.banned_token_ids)
    prm_backend = MeteredEndpoint(prm_url, tokenizer_path=prm_tokenizer)
    gen.tokenizer, prm_backend.tokenizer   # loaded now, not inside the first timed search
    done = set(done)
    todo = [(a, n, p) for a in settings.algorithms for n in settings.n for p in range(settings.problems)
            if (side, a, n, p) not in done]
    for k, (algorithm, n, problem) in enumerate(tqdm(todo, desc=f"{side} searches", disable=not progress)):
        if deadline is not None and time.monotonic() >= deadline:
            logger.warning("%s: time is up; %d searches left for the next run", side, len(todo) - k)
            return len(todo) - k
        group = search_group(algorithm, n, problem)
        registry.clear()
        gen.take_meter(), prm_backend.take_meter()
        verifier = trace_verifier(prm_backend, registry, trace)
        t0 = time.perf_counter()
        state, error = run_search(algorithm, configs[algorithm, n], settings.question(problem, vocab), verifier,
                                  group, gen)
        seconds = time.perf_counter() - t0
        if error is not None:
            # a fork's own error (an HTTP error, a BenchError) only reaches the program as a missing
            # variable: report the fork's
            cause = next(iter(end_stream_executors()), None) or error
            raise BenchError(f"search {group} failed: {cause!r}") from (cause if isinstance(cause, BaseException) else None)
        result = state.ret_value
        kept = kept_beams(registry, result)
        g, v = gen.take_meter(), prm_backend.take_meter()
        write({"kind": "search", "side": side, "algorithm": algorithm, "n": n, "problem": problem,
               "seconds": seconds, "verifier_seconds": verifier.seconds,
               "generator_seconds": max(0.0, seconds - verifier.seconds),
               # the program's own split (what it waited for: overlapped PRM time is not counted twice)
               "waited_generating": result.seconds_generating, "waited_verifying": result.seconds_verifying,
               "tokens_generated": int(result.tokens_generated), "tokens_kept": int(result.tokens_kept),
               "tokens_speculative": int(result.tokens_speculative), "tokens_reused": int(result.tokens_reused),
               "branches": {"started": result.branches_started, "declined": result.branches_declined,
                            "stopped": result.branches_stopped, "stood_down": dict(result.stood_down)},
               "prm_requests": int(result.prm_requests),
               "trajectories": len(result.trajectories),
               "trajectory_tokens": sum(t.tokens for t in result.trajectories),
               "trajectory_seconds": sum(t.seconds for t in result.trajectories),
               "depth_tokens": [registry.depth_tokens.get(d, 0) for d in range(max(registry.depth_tokens) + 1)],
               "generator": dataclasses.asdict(g), "prm": dataclasses.asdict(v), "kept": kept})
    return 0


@functools.lru_cache(maxsize=None)
def served_prm_architecture(prm_url: str) -> str | None:
    """The PRM server's architecture when it is a step-pooled one (``/model_info``), else None; read
    once per server."""
    from sgl_tts.prm.detect import architectures_of
    from sgl_tts.protocol import STEP_POOLED_DEFAULT_IDS

    return next((a for a in architectures_of(prm_url) if a in STEP_POOLED_DEFAULT_IDS), None)


def trace_verifier(prm_backend, registry: StepRegistry, trace) -> TraceScores:
    """A search's verifier, answering with the trace's scores after doing the real PRM's work: a
    step-pooled PRM (``Qwen2ForProcessRewardModel``, ``Qwen2ForPrmModel``, served by the plugin's
    classes) scores every step of a trajectory in one ``/classify`` input
    (:class:`~sgl_tts.bench.goodput_trace.WordStepPooledFormat`); any other is read as a step-tag PRM."""
    from sgl_tts.bench.dummy_models import WORD_TAG
    from sgl_tts.bench.goodput_trace import WordStepPooledFormat
    from sgl_tts.prm import StepPooledPRM, StepTagPRM

    pooled = served_prm_architecture(prm_backend.base_url)
    if pooled is not None:
        return TraceScores(StepPooledPRM(prm_backend, WordStepPooledFormat(pooled)), registry, trace)
    return TraceScores(StepTagPRM(prm_backend, good="+", bad="-", tag=WORD_TAG), registry, trace)


def run_search(algorithm: str, config, question: str, verifier, group: str, backend) -> tuple:
    """One search of ``algorithm`` with its run settings: ``(state, error)``, the error the program's
    state reports or the exception it raised (``None`` when it finished)."""
    from sgl_tts.experiment import program_function

    try:
        state = program_function(algorithm).run(**config.program_arguments(question, verifier),
                                                search_group=group, backend=backend)
        return state, state.error()
    except Exception as exc:  # noqa: BLE001 - reported with the search that failed
        return None, exc


def side_configs(side: str, generator_url: str, prm_url: str, settings: BenchSettings, trace,
                 write: Callable[[dict], None]) -> dict:
    """Each (algorithm, n)'s run settings on ``side`` (every one checked before the first search); an
    ``auto`` side's decode curve and the PRM's slowdown measured (cached per server) and recorded first."""
    from sgl_tts.experiment import RunError

    try:
        configs = {(a, n): run_config(side, a, n, settings, trace) for a in settings.algorithms for n in settings.n}
    except RunError as exc:
        raise BenchError(f"side {side}: {exc}") from None
    if SIDE_OPTIONS[side].get("speculative") == "auto":   # its decode curve, before the first search
        measured = side_curve(side, generator_url, settings, trace)
        write({"kind": "curve", "side": side, "points": [list(p) for p in measured.curve.points],
               "context": measured.context, "date": measured.date, "path": measured.path})
        slowdown = side_slowdown(side, generator_url, prm_url)
        write({"kind": "slowdown", "side": side, "points": [list(p) for p in slowdown.slowdown.points],
               "per_row": round(slowdown.slowdown.per_row, 6), "date": slowdown.date, "path": slowdown.path})
        configs = {k: dataclasses.replace(c, speculation_curve=measured.path, verifier_slowdown=slowdown.path)
                   for k, c in configs.items()}
    return configs


def kept_beams(registry: StepRegistry, result) -> list:
    """A search's kept trajectories, comparable across sides: each one's path of beam indices (not its
    random text), whether it finished, its tokens and score, sorted."""
    return sorted([list(registry.node(t.steps[-1])[1]) if t.steps else [], bool(t.finished), int(t.tokens),
                   round(float(t.score), 9)] for t in result.trajectories)


def measure_limit(generator_url: str, settings: BenchSettings, *, vocab: int = 32000,
                  write: Callable[[dict], None], done: Iterable[int] = ()) -> None:
    """Decode throughput at every batch the limit needs (``min(n, planned_batch)``): that many
    requests of ``limit_tokens`` tokens each (``ignore_eos``) sent at once, no PRM, no stragglers."""
    import requests

    done = set(done)
    for batch in sorted({min(n, settings.planned_batch) for n in settings.n} - done):
        texts = [settings.question(10_000 + i, vocab) for i in range(batch)]
        body = {"text": texts, "sampling_params": {"max_new_tokens": settings.limit_tokens,
                                                   "ignore_eos": True, "temperature": settings.temperature}}
        t0 = time.perf_counter()
        res = requests.post(generator_url.rstrip("/") + "/generate", json=body, timeout=3600)
        seconds = time.perf_counter() - t0
        if res.status_code != 200:
            raise BenchError(f"the limit measurement at batch {batch} failed: HTTP {res.status_code} {res.text[:200]}")
        out = res.json()
        tokens = sum(int(o["meta_info"]["completion_tokens"]) for o in (out if isinstance(out, list) else [out]))
        write({"kind": "limit", "batch": batch, "tokens": tokens, "seconds": seconds,
               "tokens_per_s": tokens / seconds if seconds > 0 else 0.0})


__all__ = ["kept_beams", "measure_limit", "run_search", "run_side", "side_configs", "trace_verifier"]
