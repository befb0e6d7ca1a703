"""Particle filtering over reasoning steps, guided by a PRM (Puri et al. 2025, its_hub's headline method).

A population of N particles (``num_particles``), each a partial solution. Every round each *active*
particle generates one step (``fork`` + ``gen`` with the step delimiter as stop string, all in flight
together) and the PRM scores its path; then the whole population is **resampled**: N particles drawn
with replacement, each with probability proportional to its weight. A particle drawn k times continues
as k copies (k forks of its state, each sampling its own next step); one drawn 0 times is dropped. The
rounds go on until no particle is active or ``max_depth``.

The choices, each as its_hub makes it unless said otherwise:

- **weight**: a particle's log-weight is ``logit(v) / weight_temperature``, ``v`` its path's aggregated
  step scores (``aggregation``, default ``last``: the PRM's score of the newest step, as its_hub scores
  the whole partial response), clipped to [1e-7, 1 - 1e-7]; the draw probabilities are the softmax of
  the log-weights. ``weight_temperature`` (ours; its_hub fixes 1) flattens (> 1) or sharpens (< 1) it.
- **finished particles stay in the population** (an answer, an end of sequence or an empty step finish
  one): they keep their last weight and are drawn like the others, so a strong finished particle can
  take the places of weak active ones. A copy of a finished particle generates nothing.
- **resampling**: ``multinomial`` (its_hub: N independent draws) or ``systematic`` (ours; one uniform
  ``u`` in [0, 1/N), positions ``u + k/N``: lower variance, a particle of weight w is drawn
  floor(Nw) or ceil(Nw) times). Draws come from a generator seeded by (seed, question, round), so the
  same seed resamples the same way however the search is scheduled.
- **seeds**: a step request's sampling seed is keyed by (round, parent particle, copy ordinal), as in
  beam search: the k copies of one particle sample k different continuations.
- **the answer**: both of its_hub's readings are reported (``SearchResult.answers``): ``prm_best``, the
  particle of the final population with the highest weight (its_hub's ``argmax``; ties to the earlier
  particle), and ``prm_weighted``, the answer whose particles hold the most probability (copies count
  once each), plus ``majority`` (copies counted, no weights). ``particle_pick`` chooses the search's own
  answer (``best``, its_hub's default, or ``weighted_vote``).
- ``trajectories`` are the final population's distinct particles (a particle and its copies once), in
  population order; a particle still active at ``max_depth`` is reported unfinished.

The population's order (how the draws map to particles): the finished particles as the last round
left them, then this round's candidates in the order of the particles they grew from.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import time
from typing import Sequence

import sglang as sgl

from sgl_tts.search.options import DEFAULT_TEMPERATURE, PICKS, RESAMPLING, ParticleFilteringOptions
from sgl_tts.search.beams import Beam, Candidate
from sgl_tts.search.pipeline import StepPipeline
from sgl_tts.search import (BOXED, STEP_DELIMITER, SearchResult, Trajectory, derive_seed, new_group, step_limit,
                            top_k, vote)

#: a PRM score is clipped to [EPSILON, 1 - EPSILON] before its logit (its_hub's bound)
EPSILON = 1e-7


def log_weight(value: float, temperature: float = 1.0) -> float:
    """A particle's log-weight: the logit of its aggregated score (clipped to [1e-7, 1 - 1e-7]) over
    ``temperature``."""
    v = min(1.0 - EPSILON, max(EPSILON, float(value)))
    return math.log(v / (1.0 - v)) / temperature


def probabilities(log_weights: Sequence[float]) -> list[float]:
    """The softmax of ``log_weights`` (shifted by their maximum)."""
    top = max(log_weights)
    exp = [math.exp(w - top) for w in log_weights]
    total = sum(exp)
    return [e / total for e in exp]


def resample(probs: Sequence[float], count: int, method: str, rng: random.Random) -> list[int]:
    """How many times each particle is drawn when ``count`` are drawn with replacement by ``probs``:
    ``multinomial`` (``count`` uniforms from ``rng``) or ``systematic`` (one uniform ``u`` from ``rng``,
    positions ``(u + k) / count``). A position falls to the first particle whose cumulative
    probability exceeds it."""
    if method not in RESAMPLING:
        raise ValueError(f"unknown resampling {method!r}; choose one of {list(RESAMPLING)}")
    cumulative, total = [], 0.0
    for p in probs:
        total += p
        cumulative.append(total)
    if method == "multinomial":
        positions = [rng.random() * total for _ in range(count)]
    else:
        u = rng.random()
        positions = [(u + k) / count * total for k in range(count)]
    counts = [0] * len(probs)
    for x in positions:
        counts[min(len(probs) - 1, bisect.bisect_right(cumulative, x))] += 1
    return counts


@dataclasses.dataclass
class Particle:
    """One member of the population: its trajectory so far, its log-weight, and, while it is active,
    the candidate it continues from."""

    trajectory: Trajectory               # shared by a particle's copies
    log_weight: float
    candidate: Candidate | None = None   # None once finished (or a copy of a finished one)


_O = ParticleFilteringOptions   # the home of the options' defaults (sgl_tts.search.options)


@sgl.function
def particle_filtering(s, question: str, prm, num_particles: int = _O.num_beams, max_depth: int = _O.max_depth,
                       step_tokens: int | Sequence[int] = _O.step_tokens,
                       sampling_temperature: float = DEFAULT_TEMPERATURE, aggregation: str = _O.aggregation,
                       seed: int = 0, delimiter: str = STEP_DELIMITER, answer_pattern: str = BOXED,
                       resampling: str = _O.resampling, weight_temperature: float = _O.weight_temperature,
                       particle_pick: str = _O.particle_pick, search_group: str | None = None) -> SearchResult:
    # every option checked before any generation, as `sgl-tts run` checks them
    ParticleFilteringOptions(num_particles, 1, max_depth, step_tokens, aggregation, resampling=resampling,
                             weight_temperature=weight_temperature, particle_pick=particle_pick)
    t0 = time.perf_counter()
    tag = search_group or new_group()
    s += question + delimiter
    pipe = StepPipeline(question, prm, tag, temperature=sampling_temperature, aggregation=aggregation,
                        delimiter=delimiter, answer_pattern=answer_pattern, seed=seed,
                        seed_of=lambda depth, parent, j: derive_seed("particle_filtering", seed, question, depth,
                                                                     parent, j),
                        limit_of=lambda depth: step_limit(step_tokens, depth), max_depth=max_depth, t0=t0)
    beams = [Beam(st, ordinal=i) for i, st in enumerate(s.fork(num_particles))]
    finished: list[Particle] = []
    population: list[Particle] = []
    try:
        for depth in range(max_depth):
            cands = pipe.run_depth(beams, depth)
            beams = []
            grown = [Particle(c.trajectory(delimiter, answer_pattern), log_weight(c.value, weight_temperature),
                              None if c.grown.finished else c) for c in cands]
            candidates = finished + grown
            rng = random.Random(derive_seed("particle_filtering/resample", seed, question, depth))
            counts = resample(probabilities([p.log_weight for p in candidates]), num_particles, resampling, rng)
            population = [dataclasses.replace(p) for p, k in zip(candidates, counts) for _ in range(k)]
            finished = [p for p in population if p.candidate is None]
            kept = [(p.candidate, k) for p, k in zip(candidates, counts) if k and p.candidate is not None]
            if not kept:
                break
            if depth + 1 < max_depth:
                beams = pipe.expand(kept, depth)
    finally:
        pipe.finish(beams)
    return _result(population, particle_pick, pipe, time.perf_counter() - t0)


def _result(population: list[Particle], pick: str, pipe: StepPipeline, seconds: float) -> SearchResult:
    # the population is never empty: every round draws num_particles >= 1 of it
    answers_of = [p.trajectory.answer for p in population]
    weights = [p.log_weight for p in population]
    answers = {"prm_best": answers_of[top_k(weights, 1)[0]],
               "prm_weighted": vote(answers_of, probabilities(weights)),
               "majority": vote(answers_of)}
    answer = answers["prm_best"] if pick == "best" else answers["prm_weighted"]
    distinct, seen = [], set()
    for p in population:
        if id(p.trajectory) not in seen:
            seen.add(id(p.trajectory))
            distinct.append(p.trajectory)
    return SearchResult.of(answer, answers, distinct, pipe.costs, seconds)


__all__ = ["PICKS", "ParticleFilteringOptions", "RESAMPLING", "log_weight", "particle_filtering", "probabilities",
           "resample"]
