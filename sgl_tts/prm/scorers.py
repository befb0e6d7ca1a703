"""The PRM scorers: one protocol (:class:`PRMScorer`), the score cache they share
(:class:`CachedStepScorer`), and the two kinds of model they read (:class:`StepTagPRM`,
class:`RewardHeadPRM`); see :mod:`sgl_tts.prm`."""

from __future__ import annotations

import math
import threading
from typing import Callable, Protocol, Sequence, runtime_checkable

from sgl_tts.prm.input import STEP_TAG, default_prompt, tag_work


@runtime_checkable
class PRMScorer(Protocol):
    """Anything that scores every step of a batch of trajectories for one question."""

    def score(self, question: str, steps_batch: Sequence[Sequence[str]]) -> list[list[float]]:
        ...


class CachedStepScorer:
    """The score cache both scorers share: step k of a trajectory is stored under (question, steps
    up to k), so a prefix scored once is never sent to the model again (seed 001 §4.3.2).
    Subclasses implement :meth:`_score_new`."""

    def __init__(self, cache: bool = True):
        self._cache: dict[tuple[str, tuple[str, ...]], float] | None = {} if cache else None
        self._lock = threading.Lock()
        self.scored_steps = 0   # steps actually sent to the model (cache misses)
        self.cached_steps = 0   # steps answered from the cache

    def score(self, question: str, steps_batch: Sequence[Sequence[str]]) -> list[list[float]]:
        out: list[list[float] | None] = [None] * len(steps_batch)
        todo: list[tuple[int, list[str], list[float]]] = []
        for i, steps in enumerate(steps_batch):
            steps = list(steps)
            known = self._lookup(question, steps) if steps else []
            if len(known) == len(steps):
                out[i] = known
            else:
                todo.append((i, steps, known))
        if todo:
            # identical trajectories in one batch (beams that sampled the same step) go once
            unique: dict[tuple[tuple[str, ...], int], int] = {}
            for _, steps, known in todo:
                unique.setdefault((tuple(steps), len(known)), len(unique))
            new = self._score_new(question, [(list(k[0]), k[1]) for k in unique])
            for (steps_key, start), w in unique.items():
                self._store(question, list(steps_key), start, new[w])
            for i, steps, known in todo:
                out[i] = known + list(new[unique[(tuple(steps), len(known))]])
        return out  # type: ignore[return-value]

    def _score_new(self, question: str, work: list[tuple[list[str], int]]) -> list[list[float]]:
        """Scores of steps ``start:`` of each ``(steps, start)``, one batch for all of them."""
        raise NotImplementedError

    def _lookup(self, question: str, steps: list[str]) -> list[float]:
        if self._cache is None:
            return []
        got: list[float] = []
        with self._lock:
            for k in range(len(steps)):
                v = self._cache.get((question, tuple(steps[:k + 1])))
                if v is None:
                    break
                got.append(v)
            self.cached_steps += len(got)
        return got

    def _store(self, question: str, steps: list[str], start: int, scores: list[float]) -> None:
        with self._lock:
            self.scored_steps += len(scores)
            if self._cache is not None:
                for k, v in enumerate(scores, start):
                    self._cache[(question, tuple(steps[:k + 1]))] = v

    def clear_cache(self) -> None:
        with self._lock:
            if self._cache is not None:
                self._cache.clear()


class StepTagPRM(CachedStepScorer):
    """A causal-LM PRM that votes ``good``/``bad`` as the next token after each step tag.

    ``backend`` needs ``tokenizer`` and ``next_token_logprobs(prompts, positions, token_ids)``
    (:class:`~sgl_tts.backends.local.LocalBackend`, :class:`~sgl_tts.backends.SGLangEndpoint`). A
    trajectory that cannot be tagged (a step containing the tag) scores 0.0 at every step rather than
    failing the whole batch. ``layout`` (a :class:`~sgl_tts.prm.formats.StepTagLayout`, e.g.
    Math-Shepherd's) lays trajectories out and names the labels its family's way instead of
    ``good``/``bad``/``tag``/``prompt``.
    """

    def __init__(self, backend, *, good: str = "+", bad: str = "-", tag: str = STEP_TAG,
                 prompt: Callable[[str], str] = default_prompt, cache: bool = True, layout=None):
        super().__init__(cache)
        self.backend = backend
        tok = backend.tokenizer
        self.tag, self.prompt, self.layout = tag, prompt, layout
        if layout is not None:   # a family's own layout and labels (sgl_tts.prm.formats.StepTagLayout)
            self.label_ids = layout.label_ids(tok)
            return
        ids = [tok.convert_tokens_to_ids(t) for t in (good, bad)]
        if any(i is None or i == tok.unk_token_id for i in ids):
            raise ValueError(f"label tokens {good!r}/{bad!r} are not single tokens of this tokenizer")
        self.label_ids = ids

    def _tagged(self, question: str, work: list[tuple[list[str], int]]):
        if self.layout is None:
            return tag_work(self.backend.tokenizer, question, work, tag=self.tag, prompt=self.prompt)
        out: list[list[float]] = [[] for _ in work]
        tagged = []
        for w, (steps, start) in enumerate(work):
            try:
                ids, pos = self.layout.encode(self.backend.tokenizer, question, steps)
            except ValueError:
                out[w] = [0.0] * (len(steps) - start)
                continue
            tagged.append((w, ids, pos[start:]))
        return out, tagged

    def _score_new(self, question: str, work: list[tuple[list[str], int]]) -> list[list[float]]:
        out, tagged = self._tagged(question, work)
        if tagged:
            rows = self.backend.next_token_logprobs([t[1] for t in tagged], [t[2] for t in tagged],
                                                    self.label_ids)
            for (w, _, _), row in zip(tagged, rows):
                out[w] = [sigmoid(a - b) for a, b in row]
        return out


def sigmoid(x: float) -> float:
    """1 / (1 + e^-x) without overflow for large |x| (a PRM can be very sure)."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def head_score(row: Sequence[float], positive_label: int = 1) -> float:
    """A reward head's output at one position as a score in [0, 1]: one value is a logit
    (sigmoid); several are class logits (softmax, the probability of ``positive_label``)."""
    if len(row) == 1:
        return sigmoid(float(row[0]))
    if not 0 <= positive_label < len(row):
        raise ValueError(f"positive_label {positive_label} is not one of the head's {len(row)} classes")
    top = max(row)
    exps = [math.exp(float(x) - top) for x in row]
    return exps[positive_label] / sum(exps)


class RewardHeadPRM(CachedStepScorer):
    """A PRM with a value / classifier head, read at the last token of each step prefix.

    ``backend`` needs ``tokenizer`` and ``classify(inputs) -> [head outputs]`` for token-id lists
    (:class:`~sgl_tts.backends.SGLangEndpoint` via ``/classify``,
    :class:`~sgl_tts.backends.classifier.LocalClassifier` on the CPU). Step k's input is the prompt
    and steps 1..k, each followed by ``tag``; the head's output there becomes a score by
    :func:`head_score`. An untaggable trajectory scores 0.0 at every step, as with step tags.
    """

    def __init__(self, backend, *, tag: str = STEP_TAG, prompt: Callable[[str], str] = default_prompt,
                 positive_label: int = 1, cache: bool = True):
        super().__init__(cache)
        self.backend = backend
        self.tag, self.prompt, self.positive_label = tag, prompt, positive_label

    def _score_new(self, question: str, work: list[tuple[list[str], int]]) -> list[list[float]]:
        out, tagged = tag_work(self.backend.tokenizer, question, work, tag=self.tag, prompt=self.prompt)
        inputs, owner = [], []
        for w, ids, positions in tagged:
            for p in positions:  # step k's input ends with its tag: the head reads the last token
                inputs.append(ids[:p + 1])
                owner.append(w)
        if inputs:
            rows = self.backend.classify(inputs)
            if len(rows) != len(inputs):
                raise ValueError(f"the reward model answered {len(rows)} rows for {len(inputs)} inputs")
            for w, row in zip(owner, rows):
                out[w].append(head_score(row, self.positive_label))
        return out


__all__ = ["CachedStepScorer", "PRMScorer", "RewardHeadPRM", "StepTagPRM", "head_score", "sigmoid"]
