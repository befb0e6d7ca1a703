"""Process reward model (PRM) scorers behind one protocol.

``score(question, steps_batch) -> per-step scores``: for each candidate trajectory (a list of step
texts) one score in [0, 1] per step, batched. Scorers:

- :class:`StepTagPRM` — Math-Shepherd / RLHFlow style: the PRM reads the question and the steps, each
  followed by a step tag; the score of step k is P(good) / (P(good) + P(bad)) of the next token after
  tag k. One forward per trajectory, through any backend with ``next_token_logprobs`` (the CPU
  backend today). A score cache keyed by (question, step prefix) means no step is scored twice (seed
  001 §4.3.2): when a beam grows by one step only the new tag is scored, and the backend reuses the
  KV of the already-scored prefix.
- :class:`RewardHeadPRM` — a PRM with a value / classifier head (SGLang's ``*ForSequenceClassification``
  and ``*ForRewardModel`` classes, served at ``/classify``): the head reads the last token, so step k
  is scored on the input that ends with step k's tag, one input per step (the same cache means one
  new input per beam per depth, and SGLang's radix cache reuses the shared prefix).

Both read the same input text (:func:`prm_input`) and work through an SGLang server
(:class:`~sgl_tts.backends.SGLangEndpoint`) or a local CPU model (:class:`~sgl_tts.backends.LocalBackend`
for step tags, :class:`~sgl_tts.backends.classifier.LocalClassifier` for heads).
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Protocol, Sequence, runtime_checkable

STEP_TAG = "\n\n"


@runtime_checkable
class PRMScorer(Protocol):
    """Anything that scores every step of a batch of trajectories for one question."""

    def score(self, question: str, steps_batch: Sequence[Sequence[str]]) -> list[list[float]]:
        ...


def default_prompt(question: str) -> str:
    """The project's prompt format: the question, then a blank line."""
    return question + "\n\n"


def prm_input(question: str, steps: Sequence[str], *, tag: str = STEP_TAG,
              prompt: Callable[[str], str] = default_prompt) -> str:
    """The text a step-tag PRM reads: the prompt, then every step followed by ``tag``."""
    return prompt(question) + "".join(s + tag for s in steps)


def tag_positions(tokenizer, question: str, steps: Sequence[str], *, tag: str = STEP_TAG,
                  prompt: Callable[[str], str] = default_prompt) -> tuple[list[int], list[int]]:
    """Token ids of the PRM input (prompt, then every step followed by ``tag``) and the positions of
    the tag tokens, one per step. The tag must be a single token and must not occur inside a step."""
    for st in steps:
        if tag in st or st != st.strip("\n"):
            raise ValueError(f"a step must not contain the step tag or start/end with a newline: {st!r}")
    head = prompt(question)
    ids = tokenizer.encode(prm_input(question, steps, tag=tag, prompt=prompt))
    tag_ids = tokenizer.encode(tag)
    if len(tag_ids) != 1:
        raise ValueError(f"the step tag {tag!r} must be a single token for this tokenizer, got {tag_ids}")
    start = len(tokenizer.encode(head))
    pos = [i for i in range(start, len(ids)) if ids[i] == tag_ids[0]]
    if len(pos) != len(steps):
        raise ValueError(f"expected {len(steps)} step tags, found {len(pos)}")
    return ids, pos


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


def tag_work(tokenizer, question: str, work: list[tuple[list[str], int]], *, tag: str,
             prompt: Callable[[str], str]) -> tuple[list[list[float]], list[tuple[int, list[int], list[int]]]]:
    """Token ids and the tag positions still to score for each ``(steps, start)`` of a scorer's
    work: ``(out, [(work index, ids, positions from start)])``. A trajectory that cannot be tagged
    (a step holding the tag) gets 0.0 for every step in ``out`` rather than failing the batch."""
    out: list[list[float]] = [[] for _ in work]
    tagged = []
    for w, (steps, start) in enumerate(work):
        try:
            ids, pos = tag_positions(tokenizer, question, steps, tag=tag, prompt=prompt)
        except ValueError:
            out[w] = [0.0] * (len(steps) - start)
            continue
        tagged.append((w, ids, pos[start:]))
    return out, tagged


class StepTagPRM(CachedStepScorer):
    """A causal-LM PRM that votes ``good``/``bad`` as the next token after each step tag.

    ``backend`` needs ``tokenizer`` and ``next_token_logprobs(prompts, positions, token_ids)``
    (:class:`~sgl_tts.backends.local.LocalBackend`, :class:`~sgl_tts.backends.SGLangEndpoint`). A
    trajectory that cannot be tagged (a step containing the tag) scores 0.0 at every step rather than
    failing the whole batch.
    """

    def __init__(self, backend, *, good: str = "+", bad: str = "-", tag: str = STEP_TAG,
                 prompt: Callable[[str], str] = default_prompt, cache: bool = True):
        super().__init__(cache)
        self.backend = backend
        tok = backend.tokenizer
        self.tag, self.prompt = tag, prompt
        ids = [tok.convert_tokens_to_ids(t) for t in (good, bad)]
        if any(i is None or i == tok.unk_token_id for i in ids):
            raise ValueError(f"label tokens {good!r}/{bad!r} are not single tokens of this tokenizer")
        self.label_ids = ids

    def _score_new(self, question: str, work: list[tuple[list[str], int]]) -> list[list[float]]:
        out, tagged = tag_work(self.backend.tokenizer, question, work, tag=self.tag, prompt=self.prompt)
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


__all__ = ["CachedStepScorer", "PRMScorer", "RewardHeadPRM", "STEP_TAG", "StepTagPRM", "default_prompt",
           "head_score", "prm_input", "sigmoid", "tag_positions", "tag_work"]
