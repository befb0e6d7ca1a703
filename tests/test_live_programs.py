"""Every program through SGLangEndpoint on the live generator, scored by the live PRM server, against
the same program on LocalBackend: accuracy on 50 test problems agrees within a binomial tolerance, and
every step score the live PRM gave equals the local PRM's to 1e-3. The reward-head PRM through a live
``/classify`` server scores as the step-tag PRM does."""

from __future__ import annotations

import dataclasses
import math

import pytest

from sgl_tts import task
from sgl_tts.backends import LocalBackend, SGLangEndpoint
from sgl_tts.experiment import RunConfig, run
from sgl_tts.models import shipped_model
from sgl_tts.prm import RewardHeadPRM, StepTagPRM

pytestmark = pytest.mark.server

PROBLEMS = 50
# (program, settings): beam search and its variants, DVTS, best-of-N, all at N = 4
CASES = {
    "beam_search": dict(program="beam_search", n=4, beam_width=2),
    "beam_search_proportional": dict(program="beam_search", n=4, beam_width=2, branching="proportional"),
    "beam_search_schedule": dict(program="beam_search", n=4, beam_width=2, step_tokens=[8, 64]),
    "beam_search_lookahead": dict(program="beam_search", n=4, beam_width=2, lookahead=1),
    "dvts": dict(program="dvts", n=4, beam_width=2),
    "best_of_n": dict(program="best_of_n", n=4),
}
# the variants cost more per problem (lookahead rolls out every candidate): fewer problems
PROBLEMS_OF = {"beam_search_lookahead": 20, "beam_search_schedule": 20, "beam_search_proportional": 20}


def binomial_tolerance(p: float, n: int) -> float:
    """Three standard errors of the difference of two independent accuracies over n problems each
    (0.30 at p = 0.5, n = 50): two runs sample independently, so only this much agreement is owed."""
    p = min(max(p, 1 / n), 1 - 1 / n)
    return 3 * math.sqrt(2 * p * (1 - p) / n)


@pytest.fixture(scope="module")
def local_prm():
    backend = LocalBackend(str(shipped_model("prm")))
    yield StepTagPRM(backend)
    backend.shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_program_on_live_servers_matches_local(case, live, local_prm, tmp_path):
    limit = PROBLEMS_OF.get(case, PROBLEMS)
    base = RunConfig(**CASES[case], limit=limit, in_flight=8, progress=False, seed=3)
    local = dataclasses.replace(base, output=str(tmp_path / "local.jsonl"))
    remote = dataclasses.replace(base, output=str(tmp_path / "live.jsonl"), generator=live.url("generator"),
                                 prm=live.url("prm"))
    s_local, _ = run(local)
    s_live, records = run(remote)
    assert s_live.problems == s_local.problems == limit
    for rule in ("majority", "prm_weighted"):
        a, b = s_live.accuracy[rule], s_local.accuracy[rule]
        assert abs(a - b) <= binomial_tolerance((a + b) / 2, limit), (rule, a, b)
    # the live PRM's step scores are the local PRM's, step prefix by step prefix
    checked = 0
    for rec in records:
        trajectories = [t for t in rec["trajectories"] if t["steps"]]
        want = local_prm.score(rec["question"], [t["steps"] for t in trajectories])
        for t, w in zip(trajectories, want):
            assert len(t["step_scores"]) == len(w)
            assert max(abs(a - b) for a, b in zip(t["step_scores"], w)) < 1e-3, (rec["question"], t["steps"])
            checked += len(w)
    assert checked >= limit * 2


def test_reward_head_prm_on_live_classify_scores_as_the_step_tag_prm(live, local_prm):
    head = RewardHeadPRM(SGLangEndpoint(live.url("reward_head")))
    remote_tag = StepTagPRM(SGLangEndpoint(live.url("prm")))
    problems = task.test_split()[:6]
    for p in problems:
        good = p.solution().split("\n\n")
        bad = list(good)
        bad[1] = bad[1][:-1] + str((int(bad[1][-1]) + 1) % 10)   # a slipped digit in step 2
        batch = [good, bad, good[:2]]
        want = local_prm.score(p.question, batch)
        for scorer in (head, remote_tag):
            got = scorer.score(p.question, batch)
            for g, w in zip(got, want):
                assert len(g) == len(w)
                assert max(abs(a - b) for a, b in zip(g, w)) < 1e-3, (p.question, g, w)
        # and the scores mean something: the slipped step is scored lower than the right one
        assert want[1][1] < want[0][1]
