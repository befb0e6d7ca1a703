"""The scorer for a step-pooled PRM: every new step's score of a trajectory in one request.

A PRM served by the plugin's model classes (``Qwen2ForProcessRewardModel``, ``Qwen2ForPrmModel``)
answers, per input, the head's output at every step token the server computed
(:mod:`sgl_tts.plugin.models.step_pooling`). So scoring a depth of N trajectories is one batched
request of N inputs, and SGLang's radix cache serves the prompt and the steps siblings and earlier
depths already sent: only the new step's tokens are computed.
"""

from __future__ import annotations

from typing import Sequence

from sgl_tts.prm.formats import FORMATS, StepPooledFormat, step_marks
from sgl_tts.prm.scorers import CachedStepScorer


class StepPooledPRM(CachedStepScorer):
    """Scores from a step-pooled PRM.

    ``backend`` needs ``tokenizer`` and ``step_rows(inputs) -> per input, the rows of its last step
    tokens`` (:meth:`sgl_tts.backends.SGLangEndpoint.step_rows`, ``/classify``). ``fmt``: the
    family's :class:`~sgl_tts.prm.formats.StepPooledFormat` or its name. A row answers the last of
    the input's step tokens; a step whose token the radix cache already held (computed for another
    request) is asked again with the input cut at its token, whose last token is always computed. An
    input the format cannot hold scores 0.0 at every step, as with the other scorers.
    """

    def __init__(self, backend, fmt: StepPooledFormat | str, *, cache: bool = True):
        super().__init__(cache)
        if isinstance(fmt, str):
            if fmt not in FORMATS:
                raise ValueError(f"unknown step-pooled PRM format {fmt!r}; known: {', '.join(FORMATS)}")
            fmt = FORMATS[fmt]
        self.backend, self.format = backend, fmt
        self.step_id = fmt.step_token_id(backend.tokenizer)
        self.requests = 0      # inputs sent
        self.re_asked = 0      # steps asked again because the server had them cached

    def _score_new(self, question: str, work: list[tuple[list[str], int]]) -> list[list[float]]:
        out: list[list[float]] = [[] for _ in work]
        todo: list[tuple[int, list[int], list[int]]] = []
        for w, (steps, start) in enumerate(work):
            try:
                ids, ends = self.format.encode(self.backend.tokenizer, question, steps)
            except ValueError:
                out[w] = [0.0] * (len(steps) - start)
                continue
            todo.append((w, ids, ends[start:]))
        if not todo:
            return out
        got = self._rows([ids for _, ids, _ in todo])
        again: list[tuple[int, int]] = []   # (todo index, position) not answered
        for t, (_, ids, wanted) in enumerate(todo):
            again += [(t, p) for p in wanted if p not in got[t]]
        if again:
            self.re_asked += len(again)
            rows = self._rows([todo[t][1][:p + 1] for t, p in again])
            for (t, p), answered in zip(again, rows):
                got[t][p] = answered[p]
        for t, (w, _, wanted) in enumerate(todo):
            out[w] = [self.format.score(got[t][p]) for p in wanted]
        return out

    def _rows(self, inputs: list[list[int]]) -> list[dict[int, Sequence[float]]]:
        """Per input, {position: row} for the step tokens the server answered (its last ones)."""
        self.requests += len(inputs)
        answers = self.backend.step_rows(inputs)
        if len(answers) != len(inputs):
            raise ValueError(f"the PRM answered {len(answers)} inputs for {len(inputs)}")
        out = []
        for ids, rows in zip(inputs, answers):
            marks = step_marks(ids, self.step_id)
            if len(rows) > len(marks) or (ids and ids[-1] == self.step_id and not rows):
                raise ValueError(
                    f"the PRM answered {len(rows)} rows for an input with {len(marks)} step tokens "
                    f"(id {self.step_id}): is it served by sgl-tts's {self.format.architecture} with this tokenizer?")
            out.append(dict(zip(marks[len(marks) - len(rows):], rows)))
        return out


__all__ = ["StepPooledPRM"]
