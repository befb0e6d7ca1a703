"""How hard a problem set is for the shipped models, and how early a search can tell (``sgl-tts workload``).

Two measurements on a problem set (:func:`sgl_tts.tiny.task.split`), both from the generator's own
samples scored by the step-tag PRM:

- :func:`measure_hardness`: greedy accuracy, T-sample accuracy, and the PRM's step AUC against the
  checker's "correct so far" labels, on the T samples (what a search sees) and on the greedy solutions
  (where a PRM built from the generator's own judgement cannot see the generator's confident mistakes);
- :func:`first_step_points` and :func:`choose_cutoff`: seed 004's Fig. 6a, the first step's score
  against the whole trajectory's aggregated score, and the selective futility check's cut-off chosen
  from it: the largest first-step score below which (almost) no trajectory reaches the acceptance
  threshold.

Plots are :mod:`sgl_tts.tiny.hardness_plot`; the command is :mod:`sgl_tts.cli.workload`.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Sequence

from tqdm.auto import tqdm

from sgl_tts.search import aggregate
from sgl_tts.tiny import task


@dataclasses.dataclass(frozen=True)
class Solution:
    """One generated solution, graded and scored: what both measurements read."""

    problem: int                  # index in the problem set
    level: int
    greedy: bool
    steps: tuple[str, ...]
    labels: tuple[int, ...]       # the checker's "correct so far", per step
    scores: tuple[float, ...]     # the PRM's step scores (as many as steps, or none if it broke the tags)
    correct: bool                 # the boxed answer is right


@dataclasses.dataclass(frozen=True)
class Hardness:
    """A problem set's difficulty for the generator and the PRM's discrimination on it.

    ``step_auc`` is over the T-sampled solutions' steps; ``greedy_step_auc`` over the greedy ones
    (``nan`` when all their steps carry one label). ``by_level`` maps a level to its greedy and
    sample accuracy."""

    problems: int
    samples: int
    temperature: float
    greedy_accuracy: float
    sample_accuracy: float
    step_auc: float
    graded_steps: int
    wrong_steps: int
    greedy_step_auc: float
    by_level: dict[int, dict[str, float]]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def solve_and_score(generator, prm, problems: Sequence[task.Problem], *, samples: int = 4,
                    temperature: float = 0.8, seed: int = 0, max_new_tokens: int = 256,
                    progress: bool = True) -> list[Solution]:
    """Greedy and ``samples`` T-sampled solutions per problem from ``generator`` (a LocalBackend),
    graded by the checker and scored by ``prm`` (a :class:`~sgl_tts.prm.StepTagPRM`)."""
    from sgl_tts.tiny.training import sample_solutions

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if not problems:
        raise ValueError("no problems")
    greedy = sample_solutions(generator, problems, 1, temperature=0.0, seed=seed, max_new_tokens=max_new_tokens)
    sampled = sample_solutions(generator, problems, samples, temperature=temperature, seed=seed,
                               max_new_tokens=max_new_tokens)
    out: list[Solution] = []
    for i, p in enumerate(tqdm(problems, desc="scoring", disable=not progress)):
        texts = [(t, False) for t in sampled[i]] + [(greedy[i][0], True)]
        grades = [task.grade(p, t) for t, _ in texts]
        batch = [list(g.steps) for g in grades if g.steps]
        scored = iter(prm.score(p.question, batch) if batch else [])
        for (t, is_greedy), g in zip(texts, grades):
            scores = next(scored) if g.steps else []
            if len(scores) != len(g.steps):
                scores = []
            out.append(Solution(i, p.level, is_greedy, tuple(g.steps), tuple(int(v) for v in g.prefix_ok),
                                tuple(float(x) for x in scores), g.answer_ok))
    return out


def measure_hardness(solutions: Sequence[Solution], temperature: float) -> Hardness:
    """Accuracies and step AUCs of :func:`solve_and_score`'s output (solutions without scores count for
    accuracy, not for the AUC)."""
    from sgl_tts.prm import auc

    def step_pairs(sols):
        scores, labels = [], []
        for s in sols:
            if s.scores:
                scores += s.scores
                labels += s.labels
        return scores, labels

    sampled = [s for s in solutions if not s.greedy]
    greedy = [s for s in solutions if s.greedy]
    problems = len(greedy)
    scores, labels = step_pairs(sampled)
    g_scores, g_labels = step_pairs(greedy)
    levels: dict[int, dict[str, list[bool]]] = collections.defaultdict(lambda: {"greedy": [], "sample": []})
    for s in solutions:
        levels[s.level]["greedy" if s.greedy else "sample"].append(s.correct)
    by_level = {lv: {k: sum(v) / len(v) for k, v in d.items() if v} for lv, d in sorted(levels.items())}
    return Hardness(problems, len(sampled) // max(problems, 1), temperature,
                    sum(s.correct for s in greedy) / problems, sum(s.correct for s in sampled) / len(sampled),
                    auc(scores, labels), len(labels), labels.count(0), auc(g_scores, g_labels), by_level)


@dataclasses.dataclass(frozen=True)
class FirstStep:
    """One trajectory's first step score and its final aggregated score (a point of seed 004 Fig. 6a)."""

    first: float
    final: float
    correct: bool
    level: int


def first_step_points(solutions: Sequence[Solution], aggregation: str = "min") -> list[FirstStep]:
    """The T-sampled, scored solutions as (first step score, trajectory score) points."""
    return [FirstStep(s.scores[0], aggregate(s.scores, aggregation), s.correct, s.level)
            for s in solutions if not s.greedy and s.scores]


@dataclasses.dataclass(frozen=True)
class Cutoff:
    """The selective futility check's cut-off and the evidence for it.

    ``cutoff``: take the largest observed first-step score ``c`` such that for every observed score
    ``s < c`` at most ``max_reach`` of the trajectories whose first step scored in ``[s, c)`` reached
    the threshold; the cut-off is the middle between ``c`` and the observed score below it (every
    value in that gap leaves out the same trajectories); ``None`` if no observed score above the lowest
    qualifies. ``below``/``reached_below``: trajectories under the
    cut-off and how many of them reached the threshold; ``above``/``reached_above`` likewise at or
    above it. ``pearson``/``spearman``: correlation of first and final scores."""

    threshold: float
    max_reach: float
    cutoff: float | None
    below: int
    reached_below: int
    above: int
    reached_above: int
    pearson: float
    spearman: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's r (the standard library's), ``nan`` where it is undefined (fewer than 2 points, or a
    constant side)."""
    try:
        return statistics.correlation(x, y)
    except statistics.StatisticsError:
        return float("nan")


def _ranks(x: Sequence[float]) -> list[float]:
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and x[order[j]] == x[order[i]]:
            j += 1
        for k in range(i, j):
            ranks[order[k]] = (i + j - 1) / 2.0
        i = j
    return ranks


def _bands_rarely_reach(below: Sequence[FirstStep], threshold: float, max_reach: float) -> bool:
    """Whether in every band of ``below`` (sorted by first-step score) from an observed score up to
    the top, at most ``max_reach`` of the trajectories reached ``threshold``."""
    reached = n = 0
    for i in range(len(below) - 1, -1, -1):
        n += 1
        reached += below[i].final >= threshold
        if (i == 0 or below[i - 1].first < below[i].first) and reached / n > max_reach:
            return False
    return True


def choose_cutoff(points: Sequence[FirstStep], threshold: float, max_reach: float = 0.02) -> Cutoff:
    """The cut-off (see :class:`Cutoff`): the largest observed first-step score below which the
    trajectories reached ``threshold`` at most ``max_reach`` of the time in every band from an observed
    score up to it, not only over all of them. With a PRM whose first steps score near 0 or near
    clean, the share over all is held down by the mass near 0 even where the band just under the
    cut-off reaches the threshold often (issue 34's load run: chosen over all, the cut-off fell just
    under the clean score, among first steps that often lead to acceptance, and the negative exit
    gave up a search that positive exit alone answered right)."""
    if not points:
        raise ValueError("no scored trajectories")
    if not 0 <= max_reach < 1:
        raise ValueError(f"max_reach must be in [0, 1), got {max_reach}")
    pts = sorted(points, key=lambda p: p.first)
    cutoff = None
    values = sorted({p.first for p in pts})
    for k, c in enumerate(values):
        below = [p for p in pts if p.first < c]
        if not below:
            continue   # a cut-off that leaves nothing out says nothing
        if not _bands_rarely_reach(below, threshold, max_reach):
            continue   # a higher score may still qualify: its bands are counted afresh
        # any value in (previous score, c] leaves out the same trajectories: the middle of that gap,
        # so that a score a little off the observed one (numerics, another batch) is judged the same
        cutoff = (values[k - 1] + c) / 2
    if cutoff is None:
        n_below = r_below = 0
    else:
        n_below = sum(p.first < cutoff for p in pts)
        r_below = sum(p.first < cutoff and p.final >= threshold for p in pts)
    r_all = sum(p.final >= threshold for p in pts)
    firsts, finals = [p.first for p in pts], [p.final for p in pts]
    return Cutoff(threshold, max_reach, cutoff, n_below, r_below, len(pts) - n_below, r_all - r_below,
                  _pearson(firsts, finals), _pearson(_ranks(firsts), _ranks(finals)))


__all__ = ["Cutoff", "FirstStep", "Hardness", "Solution", "choose_cutoff", "first_step_points",
           "measure_hardness", "solve_and_score"]
