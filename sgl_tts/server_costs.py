"""What a server's measured costs say, as plain values: :class:`DecodeCurve` (seconds per decode step of
a generator against its running batch, read through its non-decreasing fit, :func:`centered_isotonic`)
and :class:`VerifierSlowdown` (how much a PRM's scoring slows per generator row decoding beside it).

Below both the launch layer, which measures them on live servers (:mod:`sgl_tts.launch.decode_curve`,
:mod:`sgl_tts.launch.verifier_slowdown`), and the search layer, whose speculation controller decides
from them (:mod:`sgl_tts.search.speculation_cost`): neither imports the other for them. Standard
library only."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import os
from typing import Sequence


def centered_isotonic(points: Sequence[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """The centred isotonic fit of ``(batch, seconds)`` points in batch order (CIR, Oron and Flournoy
    2017): pool adjacent violators (a point that timed over the next is pooled with it, a block's time
    the mean of its points', pooled again while a block's mean exceeds the next one's), then place each
    block's mean time at its mean batch. Non-decreasing points come back as they are (equal neighbours
    are not pooled: a measured flat stays flat); where a larger batch timed under a smaller one, the
    line through the block means rises across them, where a fit at the points' own batches would be
    flat there and read the noise as free rows."""
    blocks: list[list[float]] = []   # [sum of batches, sum of seconds, points]
    for b, s in points:
        blocks.append([float(b), float(s), 1])
        while len(blocks) > 1 and blocks[-2][1] * blocks[-1][2] > blocks[-1][1] * blocks[-2][2]:
            b2, s2, n2 = blocks.pop()
            blocks[-1][0] += b2
            blocks[-1][1] += s2
            blocks[-1][2] += n2
    return tuple((b / n, s / n) for b, s, n in blocks)


@dataclasses.dataclass(frozen=True)
class DecodeCurve:
    """Seconds per decode step of the generator against its running batch, measured at a few batch
    sizes (``points``). Every reading is of their non-decreasing fit (:attr:`fitted`,
    :func:`centered_isotonic`: a decode step never gets cheaper with more rows, so a dip is noise):
    linear between the fitted points, and beyond the last with the last two's slope (below the first,
    the first's time)."""

    points: tuple[tuple[int, float], ...]
    fitted: tuple[tuple[float, float], ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        pts = tuple((int(b), float(s)) for b, s in self.points)
        if not pts:
            raise ValueError("a decode curve needs at least one (batch, seconds) point")
        if any(b < 1 for b, _ in pts) or any(not s > 0 for _, s in pts):
            raise ValueError(f"a decode curve's batches must be >= 1 and its seconds > 0, got {pts}")
        if any(b1 >= b2 for (b1, _), (b2, _) in zip(pts, pts[1:])):
            raise ValueError(f"a decode curve's batches must increase, got {[b for b, _ in pts]}")
        object.__setattr__(self, "points", pts)
        object.__setattr__(self, "fitted", centered_isotonic(pts))
        object.__setattr__(self, "_batches", tuple(b for b, _ in self.fitted))

    @classmethod
    def of(cls, points: Sequence[tuple[int, float]]) -> "DecodeCurve":
        return cls(tuple(points))

    @classmethod
    def from_profile(cls, profile, context: float) -> "DecodeCurve":
        """The curve of a measured cost profile (a :class:`sgl_tts.launch.cpu_profile.CpuProfile`, or
        anything with ``batches`` and ``decode_step(batch, cached)``) at ``context`` cached tokens
        per request: the profile's decode steps at its batch sizes."""
        return cls(tuple((b, profile.decode_step(b, context)) for b in profile.batches))

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "DecodeCurve":
        """The curve of a JSON file with ``points: [[batch, seconds], ...]`` (what
        :mod:`sgl_tts.launch.decode_curve` caches); read once per file version."""
        st = os.stat(path)
        return _load(os.fspath(path), st.st_mtime_ns, st.st_size)

    def step(self, batch: float) -> float:
        """Seconds of one decode step at ``batch`` running requests, on the fitted curve."""
        pts = self.fitted
        if len(pts) == 1 or batch <= pts[0][0]:   # one point: a flat curve
            return pts[0][1]
        at = bisect.bisect_left(self._batches, batch)
        (b1, s1), (b2, s2) = (pts[-2], pts[-1]) if at >= len(pts) else (pts[at - 1], pts[at])
        return s1 + (s2 - s1) * (batch - b1) / (b2 - b1)   # the fit never falls: never below the first time

    def marginal(self, batch: int) -> float:
        """Seconds one more running request adds to a decode step at ``batch`` (the fitted curve's
        rise: never below 0, and 0 only where the fit is flat)."""
        return max(0.0, self.step(batch + 1) - self.step(batch))

    def per_row(self, batch: int) -> float:
        """A request's share of a decode step at ``batch``: ``step(batch) / batch``."""
        batch = max(1, batch)
        return self.step(batch) / batch


@functools.lru_cache(maxsize=32)
def _load(path: str, mtime_ns: int, size: int) -> DecodeCurve:
    with open(path, encoding="utf-8") as fh:
        return DecodeCurve.of([tuple(p) for p in json.load(fh)["points"]])


@dataclasses.dataclass(frozen=True)
class VerifierSlowdown:
    """Seconds the PRM takes to score one fixed batch, against the generator rows decoding beside it
    (``points``: ``(rows, seconds)``, rows 0 first: the PRM alone). :attr:`per_row` is ``s``: the
    fraction of its time alone each row adds (the least-squares slope of ``seconds / alone - 1``
    against the rows, through the origin; never below 0)."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self):
        pts = tuple((int(b), float(t)) for b, t in self.points)
        if len(pts) < 2 or pts[0][0] != 0:
            raise ValueError(f"a verifier slowdown needs the PRM alone (0 rows) and at least one other point, got {pts}")
        if any(b < 0 for b, _ in pts) or any(not t > 0 for _, t in pts):
            raise ValueError(f"a verifier slowdown's rows must be >= 0 and its seconds > 0, got {pts}")
        if any(b1 >= b2 for (b1, _), (b2, _) in zip(pts, pts[1:])):
            raise ValueError(f"a verifier slowdown's rows must increase, got {[b for b, _ in pts]}")
        object.__setattr__(self, "points", pts)

    @classmethod
    def of(cls, points: Sequence[tuple[int, float]]) -> "VerifierSlowdown":
        return cls(tuple(points))

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "VerifierSlowdown":
        """The slowdown of a JSON file with ``points: [[rows, seconds], ...]`` (what
        :mod:`sgl_tts.launch.verifier_slowdown` caches)."""
        with open(path, encoding="utf-8") as fh:
            return cls.of([tuple(p) for p in json.load(fh)["points"]])

    @property
    def alone(self) -> float:
        return self.points[0][1]

    @property
    def per_row(self) -> float:
        rest = self.points[1:]
        slope = sum(b * (t / self.alone - 1.0) for b, t in rest) / sum(b * b for b, _ in rest)
        return max(0.0, slope)


__all__ = ["DecodeCurve", "VerifierSlowdown", "centered_isotonic"]
