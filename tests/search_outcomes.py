"""What a search run on real CPU engines kept, in a form two runs can be compared by (tests that
check a change of engine layout keeps the algorithm's output)."""

from __future__ import annotations

import pytest

from sgl_tts.experiment import program_function
from sgl_tts.prm import StepTagPRM
from sgl_tts.search.runner import run_continuously

# The PRM's scores of the same steps move in their last digits with the PRM's batches (which
# requests share a forward pass, what its prefix cache held: float sums in another order), which
# differ from run to run with in-flight timing: seen 2e-6 on a score of 0.029 (2026-11-29). What an
# engine layout must keep exactly is what the search chose: steps, answers, tokens.
SCORE_REL, SCORE_ABS = 1e-3, 1e-6


def search_outcomes(cfg, problems, generator, prm_backend, in_flight: int) -> dict:
    """Per problem index: the answer, the tokens generated, every trajectory's steps and their scores
    of ``cfg.program`` run on ``problems`` with ``in_flight`` at once."""
    prm = StepTagPRM(prm_backend)
    args = [cfg.program_arguments(p.question, prm) for p in problems]
    got = {}
    for i, state in run_continuously(program_function(cfg.program), args, backend=generator, in_flight=in_flight):
        assert not isinstance(state, BaseException) and state.error() is None
        r = state.ret_value
        got[i] = (r.answer, r.tokens_generated, [t.steps for t in r.trajectories],
                  [s for t in r.trajectories for s in t.step_scores])
    return got


def assert_same_outcomes(got: dict, want: dict, label: str) -> None:
    """The same problems, answers, token counts and trajectories' steps exactly; the same scores to
    :data:`SCORE_REL` (relative) or :data:`SCORE_ABS`."""
    assert sorted(got) == sorted(want), label
    for i in want:
        assert got[i][:3] == want[i][:3], (label, i)
        assert got[i][3] == pytest.approx(want[i][3], rel=SCORE_REL, abs=SCORE_ABS), (label, i)
