"""What a search run on real CPU engines kept, in a form two runs can be compared by (tests that
check a change of engine layout keeps the algorithm's output)."""

from __future__ import annotations

from sgl_tts.experiment import program_function
from sgl_tts.prm import StepTagPRM
from sgl_tts.search.runner import run_continuously


def search_outcomes(cfg, problems, generator, prm_backend, in_flight: int) -> dict:
    """Per problem index: the answer, the tokens generated, every trajectory's steps and their scores
    (rounded to 6 places) of ``cfg.program`` run on ``problems`` with ``in_flight`` at once."""
    prm = StepTagPRM(prm_backend)
    args = [cfg.program_arguments(p.question, prm) for p in problems]
    got = {}
    for i, state in run_continuously(program_function(cfg.program), args, backend=generator, in_flight=in_flight):
        assert not isinstance(state, BaseException) and state.error() is None
        r = state.ret_value
        got[i] = (r.answer, r.tokens_generated, [t.steps for t in r.trajectories],
                  [round(s, 6) for t in r.trajectories for s in t.step_scores])
    return got
