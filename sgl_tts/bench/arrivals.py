"""Open-loop load: when problems arrive (a seeded Poisson process, the same for every side of a run;
:func:`scaled_poisson_arrivals` the same pattern at every rate) and
the rule that reads a side's highest sustainable arrival rate off its measured latencies.

The rule (:func:`max_sustainable_rate`): a rate is *sustained* when

- its p99 latency, from arrival to answer (queueing included), is within ``bound`` times the side's
  unloaded latency (``sgl-tts bench`` reads it per search: each search's *stretch*, its latency over
  its own problem's latency alone on the servers, so a mix of long and short problems does not move
  the bound; without that, :func:`unloaded_latency`: its median at the lowest rate), and
- its latencies are not growing (:func:`latencies_growing`): the later half of the arrivals did not
  wait ``growth`` times longer on average than the earlier half. A server that keeps up serves both
  halves alike; one that falls behind makes every later arrival wait for the backlog of the earlier
  ones, so its queue grows without bound however long the run.

The side's maximum sustainable rate is the highest measured rate such that it and every lower measured
rate are sustained (a noisy pass above a failure does not count), ``None`` when even the lowest fails.
Its resolution is the spacing of the measured rates.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

DEFAULT_LATENCY_BOUND = 3.0   # p99 within 3x the side's unloaded latency
DEFAULT_GROWTH = 1.5          # the later half's mean latency within 1.5x the earlier half's


def poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """``count`` arrival times (seconds from 0) of a Poisson process at ``rate`` per second: exponential
    gaps of mean ``1 / rate``, drawn from a generator keyed by ``seed`` and ``rate`` (every side of a
    run gets the same times)."""
    if rate <= 0 or count < 0:
        raise ValueError(f"a Poisson process needs rate > 0 and count >= 0 (got rate {rate}, count {count})")
    rng = random.Random(f"arrivals-{seed}-{rate}")
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def scaled_poisson_arrivals(rate: float, count: int, seed: int) -> list[float]:
    """``count`` arrival times of a Poisson process at ``rate``: one unit-rate process per ``seed``, its
    times divided by ``rate``. Every rate gets the same pattern, compressed, so with a few dozen
    arrivals a higher rate is never a lighter load than a lower one by the luck of the draw (with a
    draw per rate, six arrivals at 0.05/s spanned 40 s and six at 0.1/s 108 s)."""
    if rate <= 0 or count < 0:
        raise ValueError(f"a Poisson process needs rate > 0 and count >= 0 (got rate {rate}, count {count})")
    rng = random.Random(f"scaled-arrivals-{seed}")
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(1.0)
        out.append(t / rate)
    return out


def latencies_growing(latencies: Sequence[float], growth: float = DEFAULT_GROWTH) -> bool:
    """Whether latencies listed in arrival order grow: the later half's mean over ``growth`` times the
    earlier half's (an odd count's middle arrival belongs to neither half). Fewer than two: ``False``."""
    half = len(latencies) // 2
    if half == 0:
        return False
    early, late = latencies[:half], latencies[len(latencies) - half:]
    return sum(late) / half > growth * sum(early) / half


@dataclasses.dataclass(frozen=True)
class RatePoint:
    """One side's measurement at one offered rate."""

    rate: float       # offered: problems per second
    p50: float        # latency from arrival to answer, seconds
    p99: float
    growing: bool     # :func:`latencies_growing` on its latencies in arrival order


def unloaded_latency(points: Sequence[RatePoint]) -> float | None:
    """The side's latency without load: its median at the lowest rate measured (``None``: no points)."""
    return min(points, key=lambda p: p.rate).p50 if points else None


def sustained(point: RatePoint, unloaded: float, bound: float = DEFAULT_LATENCY_BOUND) -> bool:
    """The rule's test of one rate (see the module's text)."""
    return point.p99 <= bound * unloaded and not point.growing


def max_sustainable_rate(points: Sequence[RatePoint], bound: float = DEFAULT_LATENCY_BOUND,
                         unloaded: float | None = None) -> float | None:
    """The highest measured rate that, with every lower one, is :func:`sustained` against ``unloaded``
    (default :func:`unloaded_latency`); ``None`` when the lowest is not (or nothing was measured)."""
    if unloaded is None:
        unloaded = unloaded_latency(points)
    best = None
    for point in sorted(points, key=lambda p: p.rate):
        if not sustained(point, unloaded, bound):
            break
        best = point.rate
    return best


__all__ = ["DEFAULT_GROWTH", "DEFAULT_LATENCY_BOUND", "RatePoint", "latencies_growing", "max_sustainable_rate",
           "poisson_arrivals", "scaled_poisson_arrivals", "sustained", "unloaded_latency"]
