"""Serving many MCTS searches at once: admission, parallelism-degree control and boosting (seed 004
§4.4-4.5, Algorithm 1).

Each search is a *job*. The scheduler holds at most ``max_rollouts`` (M) jobs running and, as they
progress, decides how many rollouts each may have in flight (its degree, read by ``programs/mcts.py``
through :class:`JobControl`):

1. **Admission**: pending jobs (in arrival order) join the running set while it holds fewer than M.
2. **Scoring and allocation** (:func:`allocate`): each running job scores
   ``S = log(1 + Δt) + β · I(ρ > τ)`` (Δt: seconds since it arrived; ρ: its best node's aggregated
   score over the acceptance threshold; τ = 0.9, the proximity rule). A job with fewer than
   ``min_observations`` returned rollouts runs serially (degree 1); the others get
   ``max(1, ⌊S / ΣS · M⌋)`` (ΣS over every running job), and what is left of M goes one rollout at a
   time to the ungated jobs in descending S (ties to the earlier arrival), round after round. No job gets
   more than it can still use (its rollouts in flight plus its unlaunched budget), and if the
   ``max(1, ·)`` floors push the total past M, the lowest-S jobs above 1 give rollouts back first.
3. **Execution and preemption** (in the program): a job with more rollouts in flight than its degree
   cancels the surplus with the lowest cumulative reward (:meth:`sgl_tts.mcts.MCTSTree.to_preempt`),
   aborting exactly their requests on an sgl-tts server; one with fewer launches more.

A job whose ρ passes τ is *boosted*: its search group's requests are moved to the plugin's ``boosted``
class (``SGLangEndpoint.set_class``), which the prefix-aware order serves first. With
``boosting=False`` every job runs serially (degree 1): the vanilla and early-exit baselines.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Callable, Sequence

from sgl_tts.frontend import Waiter

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BoostPolicy:
    """Algorithm 1's knobs.

    Attributes:
        max_rollouts: M, the most jobs running and the most rollouts in flight over all of them.
        beta: β, the weight of the proximity term.
        proximity: τ, the fraction of the acceptance threshold that marks a job nearly done.
        min_observations: returned rollouts a job needs before it may run more than one at once.
        boosting: ``False``: every job runs serially (degree 1), as vanilla MCTS does.
    """

    max_rollouts: int = 8
    beta: float = 2.0
    proximity: float = 0.9
    min_observations: int = 2
    boosting: bool = True

    def __post_init__(self):
        if self.max_rollouts < 1:
            raise ValueError(f"max_rollouts must be >= 1, got {self.max_rollouts}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if not 0 < self.proximity <= 1:
            raise ValueError(f"proximity must be in (0, 1], got {self.proximity}")
        if self.min_observations < 0:
            raise ValueError(f"min_observations must be >= 0, got {self.min_observations}")


@dataclasses.dataclass(frozen=True)
class JobView:
    """What the scheduler knows of a running job when it allocates.

    Attributes:
        id: the job's id (arrival order breaks ties).
        arrival: when it arrived (seconds, the scheduler's clock).
        observations: rollouts it has returned.
        ratio: ρ, its best aggregated node score over the acceptance threshold.
        usable: the most rollouts it could have in flight (in flight + budget not yet launched).
    """

    id: int
    arrival: float
    observations: int
    ratio: float
    usable: int


def parallelism_score(job: JobView, now: float, policy: BoostPolicy) -> float:
    """``S(i, t) = log(1 + Δt) + β · I(ρ > τ)``."""
    return math.log1p(max(0.0, now - job.arrival)) + (policy.beta if job.ratio > policy.proximity else 0.0)


def allocate(jobs: Sequence[JobView], now: float, policy: BoostPolicy) -> dict[int, int]:
    """Each running job's degree (Algorithm 1, phase 2; see the module doc)."""
    if not jobs:
        return {}
    if not policy.boosting:
        return {j.id: 1 for j in jobs}
    m = policy.max_rollouts
    score = {j.id: parallelism_score(j, now, policy) for j in jobs}
    total = sum(score.values())
    gated = {j.id for j in jobs if j.observations < policy.min_observations}
    degree = {}
    for j in jobs:
        share = 1 if j.id in gated or total <= 0 else max(1, math.floor(score[j.id] / total * m))
        degree[j.id] = max(1, min(share, j.usable))
    ranked = sorted(jobs, key=lambda j: (-score[j.id], j.arrival, j.id))
    # the max(1, .) floors may pass M: the lowest S above 1 give back first
    for j in reversed(ranked):
        while sum(degree.values()) > m and degree[j.id] > 1:
            degree[j.id] -= 1
    # the rest of M, one at a time, to the ungated jobs in descending S, round after round
    left = m - sum(degree.values())
    while left > 0:
        took = False
        for j in ranked:
            if left > 0 and j.id not in gated and degree[j.id] < j.usable:
                degree[j.id] += 1
                left -= 1
                took = True
        if not took:
            break
    return degree


@dataclasses.dataclass
class Job:
    """One search the scheduler runs: its arrival, its tree once started, its outcome."""

    id: int
    arrival: float
    group: str
    tree: object | None = None        # its MCTSTree, once the search has started
    started: float | None = None
    finished: float | None = None
    boosted: bool = False
    degree: int = 1
    result: object | None = None
    error: BaseException | None = None


class JobControl:
    """The :class:`sgl_tts.mcts.RolloutControl` of one job: its degree is the scheduler's allocation."""

    def __init__(self, scheduler: "JobScheduler", job: Job):
        self.scheduler, self.job = scheduler, job

    def degree(self, tree) -> int:
        self.job.tree = tree
        return self.scheduler.degree(self.job)

    def watch(self, wake: Callable[[], None]) -> None:
        """Have ``wake`` called whenever this job's degree may have changed (a re-allocation changed
        it, a job was admitted or finished): the search sleeps between its own events otherwise."""
        self.scheduler.watch(self.job, wake)

    @property
    def request_class(self) -> str:
        """``boosted`` once the job is boosted: the requests it sends from then on are served first."""
        return "boosted" if self.job.boosted else "normal"


class JobScheduler:
    """Allocates rollouts among running MCTS jobs (phases 1 and 2; the programs do phase 3).

    Args:
        policy: Algorithm 1's knobs.
        threshold: the searches' acceptance threshold (ρ's denominator).
        boost: called with a job's search group when it becomes boosted (e.g. ``SGLangEndpoint.set_class``
            to ``boosted``); ``None``: nothing is told to the server.
        clock: the time source (seconds).
        refresh: seconds between re-allocations (a degree read within it reuses the last one).
    """

    def __init__(self, policy: BoostPolicy, threshold: float, *, boost: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, refresh: float = 0.05):
        if threshold <= 0:
            raise ValueError(f"threshold must be > 0, got {threshold}")
        self.policy, self.threshold, self.boost, self.clock, self.refresh = policy, threshold, boost, clock, refresh
        self.pending: list[Job] = []
        self.running: list[Job] = []
        self.done: list[Job] = []
        self._lock = threading.Lock()
        self._allocated_at = -math.inf
        self._next_id = 0
        self._wakers: dict[int, Callable[[], None]] = {}   # job id -> wakes its search
        self.changed = Waiter()   # woken when a job is submitted or finishes (a driver admits then)

    def submit(self, group: str, arrival: float | None = None) -> Job:
        with self._lock:
            job = Job(self._next_id, self.clock() if arrival is None else arrival, group)
            self._next_id += 1
            self.pending.append(job)
        self.changed.wake()
        return job

    def admit(self) -> list[Job]:
        """Phase 1: move pending jobs (arrival order) into the running set while it holds fewer than M."""
        with self._lock:
            admitted = []
            while self.pending and len(self.running) < self.policy.max_rollouts:
                job = self.pending.pop(0)
                job.started = self.clock()
                self.running.append(job)
                admitted.append(job)
            self._allocated_at = -math.inf
            wake = list(self._wakers.values()) if admitted else []
        for w in wake:   # the running jobs make room for the new ones at once
            w()
        return admitted

    def finish(self, job: Job) -> None:
        with self._lock:
            job.finished = self.clock()
            if job in self.running:
                self.running.remove(job)
            self.done.append(job)
            self._allocated_at = -math.inf
            self._wakers.pop(job.id, None)
            wake = list(self._wakers.values())
        for w in wake:   # the others may grow into what it freed
            w()
        self.changed.wake()

    def watch(self, job: Job, wake: Callable[[], None]) -> None:
        """Call ``wake`` whenever ``job``'s degree may have changed (until it finishes)."""
        with self._lock:
            if job not in self.done:
                self._wakers[job.id] = wake

    def view(self, job: Job) -> JobView:
        tree = job.tree
        if tree is None:
            return JobView(job.id, job.arrival, 0, 0.0, 1)
        best = max((n.path_score for n in tree.nodes[1:]), default=0.0)
        return JobView(job.id, job.arrival, len(tree.returned), best / self.threshold,
                       len(tree.rollouts) + max(0, tree.budget_left()))

    def degree(self, job: Job) -> int:
        """The job's current degree (re-allocating every ``refresh`` seconds); boosts on the way."""
        newly_boosted = []
        wake = []
        with self._lock:
            now = self.clock()
            if now - self._allocated_at >= self.refresh:
                views = [self.view(j) for j in self.running]
                degrees = allocate(views, now, self.policy)
                for j, v in zip(self.running, views):
                    if degrees[j.id] != j.degree and j is not job and j.id in self._wakers:
                        wake.append(self._wakers[j.id])   # its search re-reads it now, not at its next step
                    j.degree = degrees[j.id]
                    if self.policy.boosting and not j.boosted and v.ratio > self.policy.proximity:
                        j.boosted = True
                        newly_boosted.append(j)
                self._allocated_at = now
            degree = job.degree if job in self.running else 0
        for w in wake:
            w()
        for j in newly_boosted:
            if self.boost is not None:
                try:
                    self.boost(j.group)
                except Exception as exc:   # a stock server: no classes; the degree still applies
                    logger.info("sgl-tts: could not boost %s: %s", j.group, exc)
        return degree

    def control(self, job: Job) -> JobControl:
        return JobControl(self, job)


__all__ = ["BoostPolicy", "Job", "JobControl", "JobScheduler", "JobView", "allocate", "parallelism_score"]
