"""Process reward model (PRM) scorers behind one protocol.

``score(question, steps_batch) -> per-step scores``: for each candidate trajectory (a list of step
texts) one score in [0, 1] per step, batched. Scorers:

- :class:`StepTagPRM` — Math-Shepherd / RLHFlow style: the PRM reads the question and the steps, each
  followed by a step tag; the score of step k is P(good) / (P(good) + P(bad)) of the next token after
  tag k. One forward per trajectory, through any backend with ``next_token_logprobs`` (the CPU
  backend today). A score cache keyed by (question, step prefix) means no step is scored twice (seed
  001 §4.3.2): when a beam grows by one step only the new tag is scored, and the backend reuses the
  KV of the already-scored prefix.
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


class StepTagPRM:
    """A causal-LM PRM that votes ``good``/``bad`` as the next token after each step tag.

    ``backend`` needs ``tokenizer`` and ``next_token_logprobs(prompts, positions, token_ids)``
    (:class:`~sgl_tts.backends.local.LocalBackend`). A trajectory that cannot be tagged (a step
    containing the tag) scores 0.0 at every step rather than failing the whole batch.
    """

    def __init__(self, backend, *, good: str = "+", bad: str = "-", tag: str = STEP_TAG,
                 prompt: Callable[[str], str] = default_prompt, cache: bool = True):
        self.backend = backend
        tok = backend.tokenizer
        self.tag, self.prompt = tag, prompt
        ids = [tok.convert_tokens_to_ids(t) for t in (good, bad)]
        if any(i is None or i == tok.unk_token_id for i in ids):
            raise ValueError(f"label tokens {good!r}/{bad!r} are not single tokens of this tokenizer")
        self.label_ids = ids
        self._cache: dict[tuple[str, tuple[str, ...]], float] | None = {} if cache else None
        self._lock = threading.Lock()
        self.scored_steps = 0   # steps actually sent to the model (cache misses)
        self.cached_steps = 0   # steps answered from the cache

    def score(self, question: str, steps_batch: Sequence[Sequence[str]]) -> list[list[float]]:
        out: list[list[float] | None] = [None] * len(steps_batch)
        prompts, positions, todo = [], [], []
        for i, steps in enumerate(steps_batch):
            steps = list(steps)
            if not steps:
                out[i] = []
                continue
            known = self._lookup(question, steps)
            if len(known) == len(steps):
                out[i] = known
                continue
            try:
                ids, pos = tag_positions(self.backend.tokenizer, question, steps, tag=self.tag,
                                         prompt=self.prompt)
            except ValueError:
                out[i] = [0.0] * len(steps)
                continue
            prompts.append(ids)
            positions.append(pos[len(known):])
            todo.append((i, steps, known))
        if prompts:
            rows = self.backend.next_token_logprobs(prompts, positions, self.label_ids)
            for (i, steps, known), row in zip(todo, rows):
                new = [1.0 / (1.0 + math.exp(b - a)) for a, b in row]
                out[i] = known + new
                self._store(question, steps, len(known), new)
        return out  # type: ignore[return-value]

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


__all__ = ["PRMScorer", "STEP_TAG", "StepTagPRM", "default_prompt", "prm_input", "tag_positions"]
