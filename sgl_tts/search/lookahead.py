"""LookAhead verification: a strategy :class:`~sgl_tts.search.pipeline.StepPipeline` is given, beside
speculation (:mod:`sgl_tts.search.speculation`).

A branch that completed a whole step before its beam was verified is scored together with it, in one
PRM request (the current step's score comes from the same request: a PRM's score of a step depends
only on the steps up to it); the branch's score is kept, so if its child is kept the child's
verification costs no PRM request. With overlapped verification a speculating candidate's request
waits for one of its branches to complete a step (or for the depth's last step).

Not to be confused with beam search's ``lookahead=k`` (rollouts that value a candidate, in
``programs/beam_search.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from sgl_tts.search import advance

if TYPE_CHECKING:
    from sgl_tts.search.beams import Branch, Candidate
    from sgl_tts.search.speculation import Speculation


class LookAhead:
    """LookAhead verification for one search: which paths a candidate's PRM request scores, and the
    scores of the longer paths kept for the children that take a branch over (by path). One per
    search: it holds its scores."""

    def __init__(self) -> None:
        self.memo: dict[tuple[str, ...], list[float]] = {}   # scores by path, for a kept child's step

    @classmethod
    def of(cls, policy: "Speculation | None") -> "LookAhead | None":
        """The strategy a speculation policy asks for (``policy.lookahead``), else ``None``."""
        return cls() if policy is not None and policy.lookahead else None

    def waits(self, c: Candidate, branches: Sequence[Branch]) -> bool:
        """Whether ``c``'s verification waits for one of its ``branches`` to complete a whole step (it
        speculates and its own path was not scored already)."""
        return bool(branches and tuple(c.path) not in self.memo)

    def ready(self, branches: Mapping[int, Sequence[Branch]], eligible: Callable[[int], bool]) -> list[int]:
        """The candidates (by index, among ``eligible`` ones) with a branch that completed a whole step."""
        return [i for i, brs in branches.items() if eligible(i) and any(br.ended() and br.whole for br in brs)]

    def paths(self, c: Candidate, branches: Sequence[Branch], delimiter: str, answer_pattern: str) -> list[list[str]]:
        """What ``c``'s PRM request scores: nothing (its path was scored with its parent's branch), or
        its path extended by each of its ``branches`` that completed a whole step, or its path alone."""
        if tuple(c.path) in self.memo:
            return []
        longer = []
        for br in branches:
            if br.ended() and br.whole:
                ext = advance(c.grown.path, br.read(), delimiter, answer_pattern).scored
                if ext[:len(c.path)] == c.path and len(ext) > len(c.path):
                    longer.append(ext)
        return longer or [c.path]

    def known(self, path: Sequence[str]) -> list[float]:
        """The scores of ``path`` (a kept child's), scored with its parent's branch."""
        return list(self.memo[tuple(path)])

    def remember(self, path: Sequence[str], scores: Sequence[float]) -> None:
        """Keep the scores of a branch's path (longer than its candidate's) for the child that takes it."""
        self.memo[tuple(path)] = list(scores)


__all__ = ["LookAhead"]
