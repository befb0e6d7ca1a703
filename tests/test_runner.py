"""Continuous problem batching: every problem runs once, ``in_flight`` of them at a time, results
stream back in completion order and equal one-at-a-time runs; a failing problem stops nothing."""

from __future__ import annotations

import gc
import threading

import pytest

from sgl_tts import LocalBackend
from sgl_tts.tiny import task
from sgl_tts.models import shipped_model
from sgl_tts.frontend import YOUNG_GC_ALLOCATIONS
from sgl_tts.search.runner import run_continuously

from programs.best_of_n import best_of_n

PROBLEMS = task.test_split()[:7]


class GatePRM:
    """Scores 1.0 everywhere; the first ``k`` score calls wait until ``k`` problems are inside
    ``score`` at once (so fewer than ``k`` in flight times out), and the peak is recorded."""

    def __init__(self, k: int):
        self.barrier = threading.Barrier(k, timeout=10)
        self.lock = threading.Lock()
        self.calls = self.inside = self.peak = 0

    def score(self, question, steps_batch):
        with self.lock:
            self.calls += 1
            first = self.calls <= self.barrier.parties
            self.inside += 1
            self.peak = max(self.peak, self.inside)
        try:
            if first:
                self.barrier.wait()
            return [[1.0] * len(st) for st in steps_batch]
        finally:
            with self.lock:
                self.inside -= 1


@pytest.fixture(scope="module")
def generator():
    be = LocalBackend(shipped_model("generator"), seed=0)
    yield be
    be.shutdown()


def test_keeps_k_problems_in_flight_and_streams_every_result_once(generator):
    prm = GatePRM(3)
    args = [dict(question=p.question, num_samples=4, prm=prm) for p in PROBLEMS]
    got = list(run_continuously(best_of_n, iter(args), backend=generator, in_flight=3))
    assert sorted(i for i, _ in got) == list(range(len(PROBLEMS)))
    assert prm.peak == 3 and prm.calls == len(PROBLEMS)  # three at once, never four
    for i, state in got:
        assert state.error() is None
        alone = best_of_n.run(**args[i], backend=generator).ret_value
        assert [t.steps for t in state.ret_value.trajectories] == [t.steps for t in alone.trajectories]


def test_a_failing_problem_is_reported_and_the_rest_run(generator):
    args = [dict(question=p.question, num_samples=2) for p in PROBLEMS[:3]]
    args[1]["no_such_argument"] = 1
    got = dict(run_continuously(best_of_n, args, backend=generator, in_flight=2))
    assert set(got) == {0, 1, 2} and isinstance(got[1], TypeError)
    assert got[0].error() is None and got[2].error() is None
    with pytest.raises(ValueError, match="in_flight must be at least 1, got 0"):
        next(run_continuously(best_of_n, args, backend=generator, in_flight=0))


class ThresholdPRM:
    """Scores 1.0 everywhere and notes the collector's young-generation threshold at each call."""

    def __init__(self):
        self.seen: list[int] = []

    def score(self, question, steps_batch):
        self.seen.append(gc.get_threshold()[0])
        return [[1.0] * len(st) for st in steps_batch]


def test_young_collections_are_rarer_only_while_problems_run(generator):
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        prm = ThresholdPRM()
        args = [dict(question=p.question, num_samples=2, prm=prm) for p in PROBLEMS[:3]]
        got = list(run_continuously(best_of_n, args, backend=generator, in_flight=2))
        assert len(got) == 3 and all(not isinstance(state, Exception) for _, state in got)
        assert len(prm.seen) == 3 and set(prm.seen) == {YOUNG_GC_ALLOCATIONS}
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)
