"""The MCTS job scheduler (seed 004 Algorithm 1): the allocation worked by hand (scores, gating,
proportional split, remainder, caps, the overflow rule), admission, boosting, and many searches run
through it on the scripted doubles with their degrees obeyed."""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest

from programs.mcts import mcts
from sgl_tts.mcts import MCTSConfig, MCTSTree, Sample
from sgl_tts.mcts.jobs import BoostPolicy, JobScheduler, JobView, allocate, parallelism_score
from sgl_tts.search import Step
from sgl_tts.testing import ScriptedBackend, ScriptedPRM

NOW = 10.0
# S = log(1 + Δt) + 2·I(ρ > 0.9):
A = JobView(0, arrival=0.0, observations=5, ratio=0.95, usable=99)   # log(11) + 2 = 4.3979
B = JobView(1, arrival=7.0, observations=3, ratio=0.5, usable=99)    # log(4)      = 1.3863
C = JobView(2, arrival=9.0, observations=0, ratio=0.99, usable=99)   # gated (0 observations); log(2) + 2 = 2.6931
D = JobView(3, arrival=9.5, observations=4, ratio=0.2, usable=99)    # log(1.5)    = 0.4055
TOTAL = math.log(11) + 2 + math.log(4) + math.log(2) + 2 + math.log(1.5)   # 8.8828


def test_the_parallelism_score():
    policy = BoostPolicy()
    assert parallelism_score(A, NOW, policy) == pytest.approx(math.log(11) + 2)
    assert parallelism_score(B, NOW, policy) == pytest.approx(math.log(4))
    assert parallelism_score(dataclasses.replace(A, ratio=0.9), NOW, policy) == pytest.approx(math.log(11))  # ρ > τ, strictly


def test_allocation_worked_by_hand():
    # M = 12: A ⌊4.3979/8.8828·12⌋ = ⌊5.94⌋ = 5; B ⌊1.87⌋ = 1; C gated: 1; D ⌊0.548⌋ = 0 -> 1. Sum 8;
    # the 4 left go one at a time in descending S to the ungated: A, B, D, then A again (C is gated)
    assert allocate([A, B, C, D], NOW, BoostPolicy(max_rollouts=12)) == {0: 7, 1: 2, 2: 1, 3: 2}
    # M = 8: A ⌊3.96⌋ = 3, B ⌊1.25⌋ = 1, C 1, D 1; 2 left: A, B
    assert allocate([A, B, C, D], NOW, BoostPolicy(max_rollouts=8)) == {0: 4, 1: 2, 2: 1, 3: 1}
    # caps: A can use only 4 more; the rest goes on to B and D
    capped = [dataclasses.replace(A, usable=4), B, C, D]
    assert allocate(capped, NOW, BoostPolicy(max_rollouts=12)) == {0: 4, 1: 4, 2: 1, 3: 3}
    # every job capped at 1: the rest of M stays unused
    ones = [dataclasses.replace(v, usable=1) for v in (A, B, D)]
    assert allocate(ones, NOW, BoostPolicy(max_rollouts=12)) == {0: 1, 1: 1, 3: 1}


def test_the_floors_passing_m_give_back_from_the_lowest_score():
    # M = 3, three ungated jobs: A ⌊4.3979/6.1897·3⌋ = 2, B ⌊0.67⌋ -> 1, D ⌊0.197⌋ -> 1: 4 > 3; D and B
    # hold 1 already, so A gives one back
    assert allocate([A, B, D], NOW, BoostPolicy(max_rollouts=3)) == {0: 1, 1: 1, 3: 1}
    # M = 4: 2 + 1 + 1 = 4, nothing to give back or add
    assert allocate([A, B, D], NOW, BoostPolicy(max_rollouts=4)) == {0: 2, 1: 1, 3: 1}


def test_gating_and_vanilla():
    gated = [dataclasses.replace(v, observations=1) for v in (A, B, D)]
    assert allocate(gated, NOW, BoostPolicy(max_rollouts=12, min_observations=2)) == {0: 1, 1: 1, 3: 1}
    assert allocate([A, B, C, D], NOW, BoostPolicy(max_rollouts=12, boosting=False)) == {0: 1, 1: 1, 2: 1, 3: 1}
    assert allocate([], NOW, BoostPolicy()) == {}
    with pytest.raises(ValueError, match="max_rollouts must be >= 1"):
        BoostPolicy(max_rollouts=0)
    with pytest.raises(ValueError, match=r"proximity must be in \(0, 1\]"):
        BoostPolicy(proximity=1.5)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def grown_tree(best: float) -> MCTSTree:
    """A real tree with one rollout returned, its node scored ``best``."""
    tree = MCTSTree(MCTSConfig(num_rollouts=20, expansion_width=1, positive_exit=False, max_depth=1))
    tree.tell(tree.launch(), [Sample(Step("a", 1, False, {"type": "stop", "matched": "\n\n"}, "a"), [best])])
    assert len(tree.returned) == 1
    return tree


def test_admission_boosting_and_finishing():
    clock = Clock()
    boosted = []
    sched = JobScheduler(BoostPolicy(max_rollouts=2, min_observations=1), threshold=0.8, boost=boosted.append,
                         clock=clock, refresh=0.0)
    jobs = [sched.submit(f"g{i}") for i in range(3)]
    assert [j.id for j in sched.admit()] == [0, 1] and [j.id for j in sched.pending] == [2]
    assert sched.degree(jobs[2]) == 0                     # not admitted: holds back
    clock.t = 1.0
    jobs[0].tree = grown_tree(0.75)                    # ρ = 0.75 / 0.8 = 0.9375 > 0.9: boosted
    jobs[1].tree = grown_tree(0.5)
    # S: log 2 + 2 = 2.693 and log 2 = 0.693: ⌊1.59⌋ = 1 and ⌊0.41⌋ -> 1; M = 2 is used up
    assert sched.degree(jobs[0]) == 1 and sched.degree(jobs[1]) == 1
    assert boosted == ["g0"] and jobs[0].boosted and not jobs[1].boosted
    sched.degree(jobs[0])
    assert boosted == ["g0"]                              # told once
    sched.finish(jobs[0])
    assert [j.id for j in sched.admit()] == [2] and jobs[0] in sched.done and jobs[0].finished == 1.0


def test_a_watched_job_is_woken_whenever_its_degree_may_change():
    """A search sleeps between its own steps: the scheduler wakes it when a re-allocation changes its
    degree (not the job whose read caused it), when a job is admitted (room to make) and when one
    finishes (room to take); `changed` wakes a driver on every submit and finish."""
    clock = Clock()
    sched = JobScheduler(BoostPolicy(max_rollouts=6, min_observations=1), threshold=0.8, clock=clock, refresh=0.0)
    jobs = [sched.submit(f"g{i}") for i in range(3)]
    assert len(sched.admit()) == 3
    woken = [0, 0, 0]
    for j in jobs:
        sched.control(j).watch(lambda i=j.id: woken.__setitem__(i, woken[i] + 1))
    assert [sched.degree(j) for j in jobs] == [1, 1, 1]   # no observations yet: every job gated at 1
    assert woken == [0, 0, 0]                              # nothing changed
    clock.t = 1.0
    jobs[0].tree = grown_tree(0.75)   # observed and near the threshold: its share grows
    assert sched.degree(jobs[1]) == 1 and jobs[0].degree > 1
    assert woken == [1, 0, 0]         # job 0's degree changed; job 1 read its own
    seen = sched.changed.seen()
    sched.finish(jobs[2])
    assert woken == [2, 1, 0] and sched.changed.wait(seen, timeout=0)
    sched.submit("g3")
    assert sched.admit() and woken == [3, 2, 0]
    sched.control(jobs[2]).watch(lambda: woken.__setitem__(2, 99))   # a finished job is not watched
    sched.finish(jobs[1])
    assert woken == [4, 2, 0]


def test_many_searches_through_the_scheduler_obey_their_degrees():
    """Six MCTS searches on the scripted doubles, M = 4: admission holds the running set to 4 jobs,
    some job runs rollouts in parallel once it has an observation, and every search completes with
    nothing left running."""
    from test_mcts_program import QUESTION, STEP_TOKENS, script, step_score

    backend = ScriptedBackend(script, seconds_per_token=0.001)
    sched = JobScheduler(BoostPolicy(max_rollouts=4, min_observations=1), threshold=0.6, refresh=0.0)
    seen = []
    lock = threading.Lock()

    class Watch:
        def __init__(self, job):
            self.inner = sched.control(job)

        def degree(self, tree):
            d = self.inner.degree(tree)
            with lock:
                seen.append((len(sched.running), len(tree.rollouts), d))
            return d

        @property
        def request_class(self):
            return self.inner.request_class

        def watch(self, wake):
            self.inner.watch(wake)

    results = {}

    def run(job, seed):
        try:
            results[job.id] = mcts.run(question=QUESTION, prm=ScriptedPRM(step_score), backend=backend,
                                       step_tokens=STEP_TOKENS, num_rollouts=6, expansion_width=2,
                                       positive_exit=False, threshold=0.6, max_depth=5, seed=seed,
                                       control=Watch(job), search_group=job.group).ret_value
        finally:
            sched.finish(job)

    for i in range(6):
        sched.submit(f"job{i}")
    threads = []
    while sched.pending or sched.running:
        changed = sched.changed.seen()
        for job in sched.admit():
            t = threading.Thread(target=run, args=(job, job.id))
            t.start()
            threads.append(t)
        if sched.pending or sched.running:
            assert sched.changed.wait(changed, timeout=60)   # a finished job frees a place
    for t in threads:
        t.join()
    assert sorted(results) == list(range(6))
    assert all(r.exit_reason in ("budget", "exhausted") for r in results.values())
    assert max(s[0] for s in seen) <= 4
    assert any(s[2] > 1 for s in seen)                    # some job ran rollouts in parallel
    assert backend.running() == 0
    # a job near the threshold (best node > 0.9 * 0.6) was boosted: its later requests say so
    boosted = {j.group for j in sched.done if j.boosted}
    classes = {(d.custom_params["tts_group"], d.custom_params["tts_class"]) for d in backend.draws}
    # (a job boosted at its last read sends nothing more)
    assert boosted and set() < {g for g, c in classes if c == "boosted"} <= boosted
