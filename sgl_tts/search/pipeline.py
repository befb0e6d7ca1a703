"""One depth of a step-wise search at a time, with three policies that never change what it keeps.

A step-wise search (beam search, DVTS) runs depth after depth: every open beam generates a step, the
PRM verifies every candidate, the program selects and expands. :class:`StepPipeline` runs the first two
for the program and makes its children; the program keeps only its selection rule. Three policies,
all off by default, hide latency without touching which beams are kept (seed 000 §4.1, seed 001 §7).
Each is a strategy object of its own module that the program builds from its options and gives the
pipeline, which only orchestrates them:

- **Speculative beam extension** (:class:`~sgl_tts.search.speculation.Speculator`, carrying out a
  :class:`~sgl_tts.search.speculation.Speculation` policy: ``exact`` or ``truncate``, under a cost
  controller when ``controlled``): a beam whose step ended starts its next step as speculative
  requests while the depth's stragglers generate; a kept child takes its branch over.
- **LookAhead verification** (:class:`~sgl_tts.search.lookahead.LookAhead`, ``Speculation(lookahead=
  True)``): a branch's complete step is scored in its beam's PRM request.
- **Overlapped verification** (:class:`~sgl_tts.search.overlap.OverlappedVerification`, by beam or
  ``by_family``): a beam's PRM request leaves as soon as its step ends, on a thread of its own.

Selection sees only each candidate's current step and its scores, so given the same samples and
scores every policy keeps the beams the plain search keeps (tests/test_speculation.py proves it).
The depth's state types live in :mod:`sgl_tts.search.beams`, each strategy in its own module.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import sgl_tts
from sgl_tts.frontend import Waiter, ended as _gen_ended
from sgl_tts.search import BOXED, STEP_DELIMITER, SearchTag, Step, advance, aggregate, read_step
from sgl_tts.search.beams import Beam, Branch, Candidate, Costs, end_state, joined
from sgl_tts.search.lookahead import LookAhead
from sgl_tts.search.overlap import OverlappedVerification
from sgl_tts.search.speculation import Speculator

logger = logging.getLogger(__name__)


class StepPipeline:
    """Generation and verification of a step-wise search, one depth at a time (see module doc).

    Args:
        question, prm: the problem and the PRM scorer (``score(question, paths)``; called from
            several threads when ``overlap`` is given).
        group: the search's id (every request's tag and rid).
        seed_of: ``(depth, parent, ordinal) -> sampling seed`` of a step request.
        limit_of: ``depth -> token limit`` of a step.
        max_depth: no speculation past the last depth.
        speculator: speculative beam extension (:meth:`Speculator.of`), or ``None``.
        lookahead: LookAhead verification (:meth:`LookAhead.of`), or ``None``.
        overlap: overlapped verification (:meth:`OverlappedVerification.of`), or ``None``.

    Each strategy holds one search's state: give every pipeline new ones.
    """

    def __init__(self, question: str, prm, group: str, *, seed_of: Callable[[int, int, int], int | None],
                 limit_of: Callable[[int], int], max_depth: int, temperature: float, aggregation: str = "last",
                 delimiter: str = STEP_DELIMITER, answer_pattern: str = BOXED, seed: int = 0,
                 t0: float | None = None, speculator: Speculator | None = None, lookahead: LookAhead | None = None,
                 overlap: OverlappedVerification | None = None):
        self.question, self.prm, self.group = question, prm, group
        self.seed_of, self.limit_of, self.max_depth = seed_of, limit_of, max_depth
        self.temperature, self.aggregation = temperature, aggregation
        self.delimiter, self.answer_pattern = delimiter, answer_pattern
        self.speculator, self.lookahead, self.overlap = speculator, lookahead, overlap
        if speculator is not None:
            speculator.bind(self)
        self.seed = seed
        self.costs = Costs()
        self.t0 = time.perf_counter() if t0 is None else t0   # trajectories' times count from here
        self._retire: list[Any] = []                            # states done with after this depth
        self._current: list[Candidate] = []                     # this depth's candidates
        self.waiter = Waiter()   # every state this search generates on wakes it when its step ends

    def _branches(self) -> dict[int, list[Branch]]:
        """This depth's speculative branches, by candidate."""
        return self.speculator.branches if self.speculator is not None else {}

    # ------------------------------------------------------------------------------ one depth
    def run_depth(self, beams: Sequence[Beam], depth: int) -> list[Candidate]:
        """Generate one step on every beam and score every candidate (in beam order)."""
        start = time.perf_counter()
        limit = self.limit_of(depth)
        spec = self.speculator
        spec_limit = self.limit_of(depth + 1) if spec is not None and depth + 1 < self.max_depth else None
        name = f"step{depth}"
        cands: list[Candidate | None] = [None] * len(beams)
        if spec is not None:   # the first depth, before a request: a controller's curve
            spec.start(beams)
        waiting: dict[int, tuple[str, Any, str]] = {}   # beam -> (what it waits on, its state, variable)
        for i, b in enumerate(beams):
            if b.branch is not None:
                waiting[i] = ("branch", b.branch.state, b.branch.name)
            else:
                self._request(b, i, depth, name, limit)
                waiting[i] = ("step", b.state, name)
        verifying: list[tuple[list[Candidate], Any]] = []   # (candidates, future of their scores)
        sent: set[int] = set()
        families = self.overlap.families(beams) if self.overlap is not None else None
        while waiting:
            seen = self.waiter.seen()   # before looking: an end after this wakes the wait below
            ended = [i for i, (_, st, var) in waiting.items() if _gen_ended(st, var)]
            ready = []
            for i in ended:
                what = waiting.pop(i)[0]
                step = self._ended(beams[i], i, depth, name, limit, what)
                if step is None:        # generated again, or continued: wait for that
                    waiting[i] = ("step", beams[i].state, name)
                    continue
                c = Candidate(i, beams[i], step, advance(beams[i].path, step, self.delimiter, self.answer_pattern))
                cands[i] = c
                if spec_limit is not None and not c.grown.finished:
                    spec.queue(c, depth + 1, spec_limit)
                if self.overlap is not None and not self._lookahead_due(c):
                    ready.append(c)
            if self.overlap is not None and self.lookahead is not None:
                ready += [cands[i] for i in self.lookahead.ready(self._branches(), lambda i: (
                    i not in sent and cands[i] not in ready and (families is None or not families.holds(i))))]
            if families is not None and (ready or ended):
                ready = families.release(ready, {beams[i].parent for i in waiting})
            if spec is not None:   # the search's batch stays at its size: branches fill what steps freed
                spec.top_up(len(waiting), len(beams))
            if ready:   # what became ready in one look goes out as one PRM call
                verifying.append((ready, self._send(ready, depth)))
                sent.update(c.index for c in ready)
            if waiting and not ended:   # sleep (no CPU) until a step or a branch of this search ends
                self.waiter.wait(seen)
        barrier = time.perf_counter()
        if spec is not None:   # the branches left run on while the PRM verifies
            spec.at_barrier(len(beams))
        # no new branch while the PRM verifies (FlashTTS speculates only while stragglers generate):
        # on a shared device they would slow the verification selection waits for (CPU bench: 12x)
        rest = [c for c in cands if c.index not in sent]
        if rest:
            verifying.append((rest, self._send(rest, depth, now=self.overlap is None)))
        for group, got in verifying:
            self._apply(group, *(got.result() if hasattr(got, "result") else got))
        done = time.perf_counter()
        self.costs.seconds_generating += barrier - start
        self.costs.seconds_verifying += done - barrier
        for st in self._retire:
            end_state(st)
        self._retire = []
        self._current = cands
        return cands

    def _request(self, b: Beam, index: int, depth: int, name: str, limit: int) -> None:
        used = b.piece.tokens if b.piece is not None else 0
        tag = SearchTag(self.group, depth, b.parent, index, ordinal=b.ordinal)
        self.waiter.watch(b.state)
        b.state += sgl_tts.gen(name, max_tokens=max(1, limit - used), temperature=self.temperature,
                               stop=self.delimiter, seed=self.seed_of(depth, b.parent, b.ordinal),
                               custom_params=tag.custom_params(), rid=tag.request_id())

    def _ended(self, b: Beam, index: int, depth: int, name: str, limit: int, what: str) -> Step | None:
        """The beam's step, once what it waited on ended; ``None`` when it needs another request."""
        if what == "branch":
            got = self.speculator.take_over(b)
            if got is None:   # from the start, or continuing what the scheduler stopped
                self._request(b, index, depth, name, limit)
            return got
        step = read_step(b.state, name, self.answer_pattern)
        self.costs.tokens_normal += step.tokens
        return joined(b.piece, step, self.answer_pattern) if b.piece is not None else step

    def fork(self, state: Any, closes: bool, count: int = 1) -> list[Any] | Any:
        """``count`` children of ``state`` (one: the child itself), each given the delimiter when
        ``closes`` (the state's step was closed)."""
        kids = list(state.fork(count))
        for k in kids:
            if closes:
                k += self.delimiter
        return kids if count != 1 else kids[0]

    def _lookahead_due(self, c: Candidate) -> bool:
        """With LookAhead, a speculating candidate's verification waits for a branch's whole step."""
        return self.lookahead is not None and self.lookahead.waits(c, self._branches().get(c.index, []))

    # ---------------------------------------------------------------------------- verification
    def _requests(self, cands: Sequence[Candidate]) -> list[tuple[Candidate, list[list[str]]]]:
        """What each candidate's verification sends: nothing (LookAhead scores it already), its path,
        or, with LookAhead, the path extended by each branch that completed a whole step."""
        out = []
        for c in cands:
            paths = ([c.path] if self.lookahead is None else
                     self.lookahead.paths(c, self._branches().get(c.index, []), self.delimiter, self.answer_pattern))
            self.costs.prm_requests += len(paths)
            out.append((c, paths))
        return out

    def _send(self, cands: Sequence[Candidate], depth: int, now: bool = False):
        """:meth:`_verify`, logged (debug) in the order the search makes its PRM calls: with ``overlap``
        they run on its pool, and one made later can reach the PRM first."""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("sgl-tts: %s depth %d makes a PRM call for beams %s (parents %s)", self.group, depth,
                         [c.index for c in cands], [c.beam.parent for c in cands])
        return self._verify(cands, now)

    def _verify(self, cands: Sequence[Candidate], now: bool = False):
        """Score ``cands``: on the pool (a future) with ``overlap``, else in one call now."""
        work = self._requests(cands)

        def score() -> tuple[list[list[float]], float]:
            flat = [p for _, paths in work for p in paths]
            got = self.prm.score(self.question, flat) if flat else []
            out, k = [], 0
            for c, paths in work:
                if not paths:   # LookAhead scored it with its parent's branch
                    out.append(self.lookahead.known(c.path))
                    continue
                for p, sc in zip(paths, got[k:k + len(paths)]):
                    if len(p) > len(c.path):   # a branch's path (LookAhead)
                        self.lookahead.remember(p, sc)
                out.append(list(got[k][:len(c.path)]))
                k += len(paths)
            return out, time.perf_counter()

        if now or self.overlap is None:
            return score()
        return self.overlap.submit(score)

    def _apply(self, cands: Sequence[Candidate], scores: Sequence[list[float]], when: float) -> None:
        t = when - self.t0   # when the scores were known (a trajectory's completion time)
        for c, sc in zip(cands, scores):
            c.scores = list(sc)
            c.value = aggregate(c.scores, self.aggregation)
            c.seconds = t

    # ------------------------------------------------------------------------------ expansion
    def expand(self, kept: Sequence[tuple[Candidate, int]], depth: int) -> list[Beam]:
        """The next depth's beams: ``children`` of each kept candidate, in order. Child ``j`` takes
        over branch ``j`` when there is one; with ``truncate``, the others start from a cut of
        branch 0. Every other branch of this depth is aborted; every candidate state retires."""
        beams: list[Beam] = []
        adopted: list[int] = []
        spec = self.speculator
        if spec is not None:
            spec.learn(self._current, kept)
        for c, children in kept:
            brs = spec.take(c.index) if spec is not None else []
            closes = not c.grown.continues
            fresh = [j for j in range(children) if j >= len(brs)]
            forks = iter(self.fork(c.beam.state, closes, len(fresh)) if len(fresh) > 1
                         else [self.fork(c.beam.state, closes)] if fresh else [])
            for j in range(children):
                b = Beam(None, c.grown.path, c.tokens, c.index, j, c.value)
                if j < len(brs):
                    b.state, b.branch = brs[j].state, brs[j]
                    if not brs[j].ended():
                        adopted.append(brs[j].beam_id)
                else:
                    b.state = next(forks)
                    piece = spec.cut(brs[0], depth, c.index, j) if brs else None
                    if piece is not None:
                        b.state += piece.raw
                        b.piece = piece
                beams.append(b)
            if spec is not None:
                spec.discard(brs[children:])
        for c in self._current:   # forked from already: their threads end now, not a depth later
            end_state(c.beam.state)
        self._current = []
        if spec is not None:
            spec.end_depth(depth, adopted, beams)
        return beams

    # ------------------------------------------------------------------------------------ end
    def finish(self, beams: Sequence[Beam] = ()) -> None:
        """End the search: abort every branch still running, wait for every discarded one (their
        tokens count as speculative), and end every state."""
        if self.speculator is not None:
            self.speculator.finish(beams)
        self._retire += [c.beam.state for c in self._current] + [b.state for b in beams]
        self._current = []
        for st in self._retire:
            end_state(st)
        self._retire = []
        if self.overlap is not None:
            self.overlap.close()
        if self.speculator is not None:
            self.speculator.leave()


__all__ = ["StepPipeline"]
