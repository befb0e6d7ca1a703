"""Overlapped verification by family (issue 32): a family's PRM requests (the children of one parent
at one depth) leave together, once every sibling's step has ended.

Sent one by one as their steps end, siblings reach the PRM spread over the depth, between other
families' requests; in a PRM whose KV cache is under pressure those evict the family's shared path
before the next sibling arrives, and each sibling computes it again. Sent together, they arrive as one
batch: the PRM computes the shared path once and its prefix-aware order keeps them together. The
price is some overlap: a family waits for its slowest sibling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from sgl_tts.search.beams import Beam, Candidate


class Families:
    """Overlapped verification by family: holds each ready candidate until every sibling (the beams of
    one parent at this depth) is ready, then releases the family in beam order. A root beam (no
    parent) is released at once. Once the beams still generating all belong to one family, that
    family's ready members go at once, and so does each later one: no other family of the search is
    left to come between them in the PRM's queue, and the depth's tail is not spent waiting. What is
    still held when the depth's last step ends goes out with the rest at the barrier."""

    def __init__(self, beams: Sequence[Beam]):
        self.size: dict[int, int] = {}
        for b in beams:
            self.size[b.parent] = self.size.get(b.parent, 0) + 1
        self.held: dict[int, list[Candidate]] = {}   # parent -> its ready children, until released
        self._open: set[int] = set()   # families whose members go as they are ready

    def holds(self, index: int) -> bool:
        """Whether candidate ``index`` is held (ready, waiting for its siblings)."""
        return any(c.index == index for family in self.held.values() for c in family)

    def release(self, ready: Sequence[Candidate], generating: set[int]) -> list[Candidate]:
        """What of ``ready`` (and of what was held) goes to the PRM now, in beam order per family;
        ``generating``: the parents of the beams still generating at this depth."""
        out: list[Candidate] = []
        for c in ready:
            parent = c.beam.parent
            if parent < 0 or parent in self._open:
                out.append(c)
                continue
            family = self.held.setdefault(parent, [])
            family.append(c)
            if len(family) == self.size[parent]:
                out += sorted(self.held.pop(parent), key=lambda x: x.index)
        if len(generating) == 1:
            last = next(iter(generating))
            if last >= 0:
                self._open.add(last)
                out += sorted(self.held.pop(last, []), key=lambda x: x.index)
        return out


__all__ = ["Families"]
