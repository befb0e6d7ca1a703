"""Seeded step-length traces for benchmarks on random-weight models.

A model served with ``--load-format dummy`` writes noise and never ends a step by itself, so a
benchmark fixes each step's length and whether it ends the solution from a trace: a pure function of
(seed, problem, beam path, depth). The same path gets the same lengths on every side of a comparison,
which keeps the search's work identical; different paths get independent draws.

The trace also gives each step's PRM score (:meth:`StepTrace.score`), for the same reason.

The default shape follows seed 000 Fig. 3 (Qwen2.5-Math-1.5B on AIME): step lengths are log-normal
with a median of 150 tokens and sigma 1.0 (mean ~250 tokens; ~3% of steps over 1000 tokens, the
stragglers), capped at 4096; a solution has at least 2 steps and ends after each later step with
probability 0.15 (about 8 steps on average), and always by ``max_depth``.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from typing import Sequence

from sgl_tts.search import derive_seed


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """Step lengths and solution ends as a pure function of (seed, problem, path, depth).

    Attributes:
        seed: the trace's seed.
        median_tokens, sigma: the log-normal step length (median and log-space spread).
        min_tokens, max_tokens: clamps on a step's length.
        min_depth: steps before a solution may end; end_probability: chance each later step ends it.
        max_depth: the last step always ends the solution.
    """

    seed: int = 0
    median_tokens: float = 150.0
    sigma: float = 1.0
    min_tokens: int = 8
    max_tokens: int = 4096
    min_depth: int = 2
    end_probability: float = 0.15
    max_depth: int = 40

    def __post_init__(self):
        if not (self.median_tokens > 0 and self.sigma >= 0):
            raise ValueError("median_tokens must be > 0 and sigma >= 0")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")
        if not 0 <= self.end_probability <= 1:
            raise ValueError(f"end_probability must be in [0, 1], got {self.end_probability}")
        if not 1 <= self.min_depth <= self.max_depth:
            raise ValueError(f"need 1 <= min_depth <= max_depth, got {self.min_depth}, {self.max_depth}")

    def _rng(self, kind: str, problem: str, path: Sequence[int], depth: int) -> random.Random:
        return random.Random(derive_seed("trace", self.seed, kind, problem, tuple(path), depth))

    def step_tokens(self, problem: str, path: Sequence[int], depth: int) -> int:
        """Tokens of the step at ``depth`` on ``path`` (the beam indices from the root to this step)."""
        z = self._rng("len", problem, path, depth).gauss(0.0, 1.0)
        tokens = round(self.median_tokens * math.exp(self.sigma * z))
        return max(self.min_tokens, min(self.max_tokens, tokens))

    def ends(self, problem: str, path: Sequence[int], depth: int) -> bool:
        """Whether the step at ``depth`` (0-based) on ``path`` ends the solution."""
        if depth + 1 >= self.max_depth:
            return True
        if depth + 1 < self.min_depth:
            return False
        return self._rng("end", problem, path, depth).random() < self.end_probability

    def score(self, problem: str, path: Sequence[int], depth: int) -> float:
        """The PRM score of the step at ``depth`` on ``path``, uniform in [0, 1): random weights score
        noise, so a benchmark takes its scores from the trace too, and selections are the same on
        every side of a comparison."""
        return self._rng("score", problem, path, depth).random()

    def describe(self, samples: int = 20_000) -> dict:
        """The shape of the trace over ``samples`` independent steps and solutions (for the docs)."""
        lengths = sorted(self.step_tokens("describe", (i,), 0) for i in range(samples))
        depths = []
        for i in range(min(samples, 5000)):
            d = 0
            while not self.ends("describe", (i,), d):
                d += 1
            depths.append(d + 1)
        q = lambda p: lengths[min(len(lengths) - 1, int(p * len(lengths)))]  # noqa: E731
        return {"mean_tokens": statistics.fmean(lengths), "p50_tokens": q(0.5), "p90_tokens": q(0.9),
                "p99_tokens": q(0.99), "max_tokens": lengths[-1],
                "share_over_1000": sum(x > 1000 for x in lengths) / len(lengths),
                "mean_steps": statistics.fmean(depths), "max_steps": max(depths)}


__all__ = ["StepTrace"]
