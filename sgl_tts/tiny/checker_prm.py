"""The task's checker as a verifier: what a search would do with a PRM that sees every mistake.

:class:`CheckerPRM` scores step ``k`` of a trajectory ``good`` when steps 1..k are all right
(:func:`sgl_tts.tiny.task.check_step`), else ``bad``: Math-Shepherd's "correct so far" label itself. It
is not a model and is never used to pick answers for real; it is the upper bound a what-if run compares
the shipped PRM with (``sgl-tts load --verifier checker``): the shipped PRM, built from the generator's
own judgement, cannot see the generator's confident mistakes (docs/TINY_MODELS.md "The hard workload").
"""

from __future__ import annotations

from typing import Iterable, Sequence

from sgl_tts.tiny import task


class CheckerPRM:
    """A :class:`~sgl_tts.prm.PRMScorer` that knows the problems' solutions.

    Args:
        problems: the problems it may be asked about (looked up by question text).
        good, bad: the score of a step that is, or is not, correct so far (``0 <= bad < good <= 1``).
    """

    def __init__(self, problems: Iterable[task.Problem], good: float = 0.95, bad: float = 0.05):
        if not 0 <= bad < good <= 1:
            raise ValueError(f"need 0 <= bad < good <= 1, got bad={bad}, good={good}")
        self._problems = {p.question: p for p in problems}
        self.good, self.bad = good, bad

    def score(self, question: str, steps_batch: Sequence[Sequence[str]]) -> list[list[float]]:
        problem = self._problems.get(question)
        if problem is None:
            raise KeyError(f"CheckerPRM knows no problem {question!r}")
        out = []
        for steps in steps_batch:
            ok, scores = True, []
            for i, step in enumerate(steps):
                ok = ok and task.check_step(problem, i, step)
                scores.append(self.good if ok else self.bad)
            out.append(scores)
        return out


__all__ = ["CheckerPRM"]
