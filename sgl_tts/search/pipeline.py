"""One depth of a step-wise search at a time, with three policies that never change what it keeps.

A step-wise search (beam search, DVTS) runs depth after depth: every open beam generates a step, the
PRM verifies every candidate, the program selects and expands. :class:`StepPipeline` runs the first two
for the program and makes its children; the program keeps only its selection rule. Three policies,
all off by default, hide latency without touching which beams are kept (seed 000 §4.1, seed 001 §7):

- **Speculative beam extension** (:class:`Speculation`): as soon as a beam's step ends while others
  of its search still generate, the beam starts its next step as *speculative* requests (the
  scheduler plugin runs them only in room normal work does not need, and stops them first; a
  ``LocalBackend`` admits them last). How many (its *speculative potential*, FlashTTS's SelectSpec):
  its parent's score binned into B equal-width bins over [0, 1], B the branching factor; the top bin
  gives B branches, the bottom one 1 (:func:`speculative_potential`; at the root, with no score, 1).
  Branches start lazily, as FlashTTS keeps the batch at its size: only in slots that finished steps
  freed (a search has as many requests in flight as it has beams), highest potential first, and
  only while the depth's stragglers generate (none starts while the PRM verifies).
  Branch ``j`` is the request child ``j`` of that beam would send (same prompt, same seed, same token
  limit), so when the beam is kept child ``j`` takes it over: in the default ``exact`` mode every
  trajectory is the one the plain search samples. A branch the scheduler stopped before its step
  ended is generated again from the start (``exact``), or continued (``truncate``). In FlashTTS's
  ``truncate`` mode the children without a branch of their own also start from branch 0's text cut at
  a fraction drawn from N(R, σ) (clipped to [0, 1)), then sample on: an approximation that correlates
  siblings. After selection the branches of pruned beams are aborted at once (one group-prefix
  abort each, on an sgl-tts server).
- **LookAhead verification** (``Speculation(lookahead=True)``): a branch that completed a whole step
  before its beam was verified is scored together with it, in one PRM request (the current step's
  score comes from the same request: a PRM's score of a step depends only on the steps up to it); the
  branch's score is kept, so if its child is kept the child's verification costs no PRM request.
- **Overlapped verification** (``overlap=True``): a beam's PRM request is sent as soon as its step
  ends (with LookAhead: as soon as one of its branches completes a step, or when the last step of the
  depth ends), on a thread of its own, while the stragglers generate. Selection waits for every score.
  ``by_family=True`` sends a family's requests (the children of one parent) together, once every
  sibling's step ended: they then reach the PRM as one batch whose shared path it computes once and
  its prefix-aware order keeps together, where requests sent one by one interleave with other
  families' and, in a PRM cache under pressure, evict each other's shared path (issue 32: on the CPU
  under pressure the PRM recomputed 50-68% less than by beam, for 2-10% less goodput). The root's
  beams share only the question, so they go as their steps end; so does the depth's last family
  once only its beams generate (:class:`~sgl_tts.search.families.Families`).

Selection sees only each candidate's current step and its scores, so given the same samples and
scores every policy keeps the beams the plain search keeps (tests/test_speculation.py proves it).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import heapq
import logging
import math
import random
import time
from typing import Any, Callable, Sequence

import sgl_tts
from sgl_tts.frontend import Waiter, ended as _gen_ended
from sgl_tts.protocol import rid_prefix
from sgl_tts.search.families import Families
from sgl_tts.search import (BOXED, STEP_DELIMITER, Advance, PathSoFar, Step, SearchTag, Trajectory, advance,
                            aggregate, extract_answer, is_final, read_step)
from sgl_tts.search.speculation_cost import (DecodeCurve, RowsInFlight, SpeculationController, TakeOverChance,
                                              VerifierSlowdown, rows_in_flight)

logger = logging.getLogger(__name__)

SPECULATION_MODES = ("exact", "truncate")


@dataclasses.dataclass(frozen=True)
class Speculation:
    """How a search speculates (speculative beam extension, seed 000 §4.1).

    Attributes:
        mode: ``exact`` (a branch is only ever taken over by the child whose request it is: every
            trajectory is the plain search's) or ``truncate`` (FlashTTS: the other children also start
            from a cut of branch 0's text; an approximation that correlates siblings).
        ratio: R, the mean fraction of branch 0's text a ``truncate`` child starts from.
        spread: σ of that fraction (clipped to [0, 1)).
        lookahead: LookAhead verification: a branch's complete step is scored with its beam's step.
        bins: B, the number of score bins (and so the most branches per beam); ``None``: the search's
            branching factor.
        controlled: start a branch only when it is expected to save more than it costs
            (:class:`~sgl_tts.search.speculation_cost.SpeculationController`, issue 33), judged on
            ``curve``; without a curve nothing is started.
        curve: the generator's measured decode curve (seconds per step against the running batch).
        measure_curve: with ``controlled`` and no ``curve`` (``"auto"``): the generator server's curve,
            measured when the search starts (once per server, cached); a generator that is no server
            (the CPU backend, a scripted one) is refused with how to give a curve.
        verifier_shares_device: the PRM runs on the generator's device: a controlled search stops the
            branches still running when a depth's last step ends, so they do not slow the verification
            (each one that would cost the verifier more than it saves, judged on ``slowdown``).
        slowdown: the PRM's measured slowdown beside generation (``None``: not measured; then every
            running branch stops at the barrier).
    """

    mode: str = "exact"
    ratio: float = 0.85
    spread: float = 0.1
    lookahead: bool = True
    bins: int | None = None
    controlled: bool = False
    curve: DecodeCurve | None = None
    verifier_shares_device: bool = False
    slowdown: VerifierSlowdown | None = None
    measure_curve: bool = False

    def __post_init__(self):
        if self.measure_curve and not self.controlled:
            raise ValueError("measure_curve is a setting of the cost controller: give controlled=True with it")
        if self.mode not in SPECULATION_MODES:
            raise ValueError(f"unknown speculation mode {self.mode!r}; choose one of {list(SPECULATION_MODES)}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"the truncation ratio R must lie in [0, 1], got {self.ratio}")
        if self.spread < 0.0:
            raise ValueError(f"the truncation spread must be >= 0, got {self.spread}")
        if self.bins is not None and (not isinstance(self.bins, int) or self.bins < 1):
            raise ValueError(f"bins must be a positive integer or None, got {self.bins!r}")

    @classmethod
    def of(cls, value: "bool | str | Speculation | None") -> "Speculation | None":
        """A program's ``speculative=`` argument as a policy: ``True`` is the default (exact) policy,
        a string names a policy of :data:`SPECULATION_PRESETS`, ``False``/``None`` is no speculation."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, str):
            if value not in SPECULATION_PRESETS:
                raise ValueError(f"unknown speculation {value!r}; choose one of {list(SPECULATION_PRESETS)}")
            return SPECULATION_PRESETS[value]
        if isinstance(value, cls):
            return value
        raise TypeError(f"speculative must be a bool, a mode name or a Speculation, got {value!r}")


#: the policies a name selects (``speculative="..."``, ``sgl-tts run --speculative``): each mode at its
#: defaults, ``exact-no-lookahead`` (exact without LookAhead verification: the ablation step
#: between plain exact speculation and the full policy, seed 000 Fig. 15) and ``auto`` (exact, each
#: branch started only where it pays: :mod:`sgl_tts.search.speculation_cost`)
SPECULATION_PRESETS: dict[str, Speculation] = {
    "exact": Speculation(), "exact-no-lookahead": Speculation(lookahead=False), "truncate": Speculation(mode="truncate"),
    # exact speculation under the cost controller, on the generator server's measured curve
    "auto": Speculation(controlled=True, measure_curve=True)}


def speculative_potential(score: float | None, bins: int) -> int:
    """SelectSpec's speculative potential M: ``score`` (clipped to [0, 1]) in the j-th highest of ``bins``
    equal-width bins gives ``bins - j + 1`` branches: ``ceil(score * bins)``, at least 1. With no
    score (a root beam) it is 1."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    if score is None:
        return 1
    s = min(1.0, max(0.0, float(score)))
    return max(1, min(bins, math.ceil(s * bins)))


# ------------------------------------------------------------------------------------- state
@dataclasses.dataclass
class Branch:
    """A speculative next step of a candidate, requested before selection."""

    candidate: int        # the candidate's index at its depth
    ordinal: int          # the child it would be
    state: Any            # the fork it generates on (the candidate's text, the delimiter if due)
    origin: Any           # the candidate's state (a child that cannot use the branch forks it again)
    closes: bool          # the candidate's step was closed (the fork got the delimiter)
    rid_prefix: str       # its requests' rid prefix (a group abort of this one branch)
    beam_id: int          # its tag's beam (unique at its depth, for a class change)
    max_tokens: int
    name: str             # its variable (one per depth: a fork copies its parent's variables)
    answer_pattern: str = BOXED
    step: Step | None = None
    failed: BaseException | None = None
    potential: int = 0    # its candidate's speculative potential (the take-over chance's bin)

    def ended(self) -> bool:
        return self.step is not None or self.failed is not None or _gen_ended(self.state, self.name)

    def read(self) -> Step | None:
        """Its step once ended (waits for it), or ``None`` when its request failed: a request the
        plain search may never send (a pruned beam's, say) must not fail the search; a child that
        takes the branch over sends its own request instead."""
        if self.step is None and self.failed is None:
            try:
                self.step = read_step(self.state, self.name, self.answer_pattern)
            except Exception as exc:   # noqa: BLE001 - kept, logged, and the child asks again
                logger.warning("sgl-tts: a speculative request (%s) failed: %s", self.rid_prefix, exc)
                self.failed = exc
        return self.step

    @property
    def tokens(self) -> int:
        return self.step.tokens if self.step is not None else 0

    @property
    def whole(self) -> bool:
        """It ended as the child's own request would have: not stopped by the scheduler, aborted or
        failed."""
        step = self.read()
        return step is not None and _whole(step, self.max_tokens)


@dataclasses.dataclass
class Beam:
    """An open path and how its next step starts.

    ``branch``: the speculative branch it took over (its step, or the start of it); ``piece``: text its
    step starts from that it did not generate itself (a ``truncate`` cut of a sibling's branch).
    """

    state: Any
    path: PathSoFar = PathSoFar()
    tokens: int = 0          # generated along this path
    parent: int = -1         # its candidate index at the previous depth
    ordinal: int = 0         # its place among its parent's children (keys its sampling seed)
    prior: float | None = None   # its parent's score (its speculative potential)
    branch: Branch | None = None
    piece: Step | None = None


@dataclasses.dataclass
class Candidate:
    """A beam after one more step, scored."""

    index: int
    beam: Beam
    step: Step
    grown: Advance
    scores: list[float] = dataclasses.field(default_factory=list)
    value: float = 0.0
    seconds: float = 0.0     # when its scores were known, from the search's start

    @property
    def tokens(self) -> int:
        return self.beam.tokens + self.step.tokens

    @property
    def path(self) -> list[str]:
        return self.grown.scored

    def trajectory(self, delimiter: str, answer_pattern: str) -> Trajectory:
        """This candidate as a trajectory: its scored path, scores, value, answer, tokens and time."""
        path = self.grown.scored
        return Trajectory(path, self.scores, self.value, extract_answer(delimiter.join(path), answer_pattern),
                          self.tokens, self.grown.finished, self.seconds)


@dataclasses.dataclass
class Costs:
    """Where a search's tokens and time went."""

    tokens_normal: int = 0        # generated by normal requests
    tokens_speculative: int = 0   # generated by speculative requests
    tokens_reused: int = 0        # speculative tokens that became a kept child's step
    prm_requests: int = 0         # PRM requests sent (one per verified candidate or speculated pair)
    branches_started: int = 0     # speculative branches started
    branches_declined: int = 0    # not started: the controller judged they would not pay
    branches_stopped: int = 0     # stopped at a depth's barrier (the verifier shares the device)
    stood_down: dict[str, int] = dataclasses.field(default_factory=dict)   # declined, by reason
    seconds_generating: float = 0.0   # per depth: from its start until its last step ended
    seconds_verifying: float = 0.0    # per depth: from then until every score was known

    @property
    def tokens_wasted(self) -> int:
        return self.tokens_speculative - self.tokens_reused


def _whole(step: Step, max_tokens: int) -> bool:
    reason = step.finish_reason or {}
    if reason.get("type") == "length":
        return int(reason.get("length", step.tokens)) >= max_tokens
    return reason.get("type") == "stop"


def _joined(piece: Step, rest: Step, answer_pattern: str) -> Step:
    raw = piece.raw + rest.raw
    return Step(raw.strip(), piece.tokens + rest.tokens, is_final(raw, rest.finish_reason, answer_pattern),
                rest.finish_reason, raw)


def _generator_key(state: Any) -> Any:
    """Which generator a state's requests go to: its endpoint's URL, else its backend object's id."""
    backend = state.stream_executor.backend
    return getattr(backend, "base_url", None) or ("backend", id(backend))


def _end(state: Any) -> None:
    """Let a state's worker thread exit once its queued work is done (does not wait)."""
    state.stream_executor.end()


# ---------------------------------------------------------------------------------- pipeline
class StepPipeline:
    """Generation and verification of a step-wise search, one depth at a time (see module doc).

    Args:
        question, prm: the problem and the PRM scorer (``score(question, paths)``; called from
            several threads when ``overlap`` is on).
        group: the search's id (every request's tag and rid).
        seed_of: ``(depth, parent, ordinal) -> sampling seed`` of a step request.
        limit_of: ``depth -> token limit`` of a step.
        max_depth: no speculation past the last depth.
        bins: the branching factor (the default number of speculative bins).
        speculation: the speculation policy, or ``None``.
        overlap: overlapped verification.
        by_family: with ``overlap``, a family's PRM requests go together once all its steps ended.
    """

    def __init__(self, question: str, prm, group: str, *, seed_of: Callable[[int, int, int], int | None],
                 limit_of: Callable[[int], int], max_depth: int, temperature: float, aggregation: str = "last",
                 delimiter: str = STEP_DELIMITER, answer_pattern: str = BOXED, bins: int = 1,
                 speculation: Speculation | None = None, overlap: bool = False, by_family: bool = False,
                 seed: int = 0, t0: float | None = None):
        self.question, self.prm, self.group = question, prm, group
        self.seed_of, self.limit_of, self.max_depth = seed_of, limit_of, max_depth
        self.temperature, self.aggregation = temperature, aggregation
        self.delimiter, self.answer_pattern = delimiter, answer_pattern
        if by_family and not overlap:
            raise ValueError("by_family is a way of overlapped verification: give overlap=True with it")
        self.speculation, self.overlap, self.by_family = speculation, overlap, by_family
        self.bins = (speculation.bins if speculation and speculation.bins else bins)
        self.controller = (SpeculationController(speculation.curve, verifier_shares_device=speculation.verifier_shares_device,
                                                 slowdown=speculation.slowdown, measure=speculation.measure_curve)
                           if speculation and speculation.controlled else None)
        self._take_over = TakeOverChance(self.bins)             # learned from this search's selections
        self.seed = seed
        self.costs = Costs()
        self.t0 = time.perf_counter() if t0 is None else t0   # trajectories' times count from here
        self._memo: dict[tuple[str, ...], list[float]] = {}     # LookAhead scores by path
        self._branches: dict[int, list[Branch]] = {}            # this depth's, by candidate
        self._queue: list = []                                  # branches waiting for a free slot (a heap)
        self._queued = 0
        self._discarded: list[Branch] = []
        self._retire: list[Any] = []                            # states done with after this depth
        self._current: list[Candidate] = []                     # this depth's candidates
        self._pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="sgl-tts-verify") if overlap else None
        self._class_change = True
        self._waiter = Waiter()   # every state this search generates on wakes it when its step ends
        self._rows: RowsInFlight | None = None   # a controller's view of the generator's other rows

    # ------------------------------------------------------------------------------ one depth
    def run_depth(self, beams: Sequence[Beam], depth: int) -> list[Candidate]:
        """Generate one step on every beam and score every candidate (in beam order)."""
        start = time.perf_counter()
        limit = self.limit_of(depth)
        spec_limit = self.limit_of(depth + 1) if self.speculation and depth + 1 < self.max_depth else None
        name = f"step{depth}"
        cands: list[Candidate | None] = [None] * len(beams)
        if self.controller is not None and self._rows is None and beams:   # the first depth, before a request
            self.controller.find_curve(beams[0].state.stream_executor.backend)
            self._rows = rows_in_flight(_generator_key(beams[0].state))
        waiting: dict[int, tuple[str, Any, str]] = {}   # beam -> (what it waits on, its state, variable)
        for i, b in enumerate(beams):
            if b.branch is not None:
                waiting[i] = ("branch", b.branch.state, b.branch.name)
            else:
                self._request(b, i, depth, name, limit)
                waiting[i] = ("step", b.state, name)
        verifying: list[tuple[list[Candidate], Any]] = []   # (candidates, future of their scores)
        sent: set[int] = set()
        families = Families(beams) if self.by_family else None
        others = 0   # the rows the process's other controlled searches have on the generator
        while waiting:
            seen = self._waiter.seen()   # before looking: an end after this wakes the wait below
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
                    self._speculate(c, depth + 1, spec_limit)
                if self.overlap and not self._lookahead_due(c):
                    ready.append(c)
            if self.overlap and self.speculation and self.speculation.lookahead:
                ready += [cands[i] for i, brs in self._branches.items()
                          if i not in sent and cands[i] not in ready and (families is None or not families.holds(i))
                          and any(br.ended() and br.whole for br in brs)]
            if families is not None and (ready or ended):
                ready = families.release(ready, {beams[i].parent for i in waiting})
            if self._rows is not None or self._queue:
                running = len(waiting) + self._running_branches()
                if self._rows is not None:
                    others = self._rows.publish(self, running)
                if self._queue:   # the search's batch stays at its size: branches fill what steps freed
                    self._fill(len(beams) - running, running, len(beams), others)
                    if self._rows is not None:
                        self._rows.publish(self, len(waiting) + self._running_branches())
            if ready:   # what became ready in one look goes out as one PRM call
                verifying.append((ready, self._send(ready, depth)))
                sent.update(c.index for c in ready)
            if waiting and not ended:   # sleep (no CPU) until a step or a branch of this search ends
                self._waiter.wait(seen)
        barrier = time.perf_counter()
        if self.controller is not None and self.controller.stop_at_barrier():
            self._stop_running_branches(len(beams), self._rows.others(self) if self._rows is not None else 0)
        if self._rows is not None:   # the branches left run on while the PRM verifies
            self._rows.publish(self, self._running_branches())
        # no new branch while the PRM verifies (FlashTTS speculates only while stragglers generate):
        # on a shared device they would slow the verification selection waits for (CPU bench: 12x)
        rest = [c for c in cands if c.index not in sent]
        if rest:
            verifying.append((rest, self._send(rest, depth, now=not self.overlap)))
        for group, got in verifying:
            self._apply(group, *(got.result() if hasattr(got, "result") else got))
        done = time.perf_counter()
        self.costs.seconds_generating += barrier - start
        self.costs.seconds_verifying += done - barrier
        for st in self._retire:
            _end(st)
        self._retire = []
        self._current = cands
        return cands

    def _request(self, b: Beam, index: int, depth: int, name: str, limit: int) -> None:
        used = b.piece.tokens if b.piece is not None else 0
        tag = SearchTag(self.group, depth, b.parent, index, ordinal=b.ordinal)
        self._waiter.watch(b.state)
        b.state += sgl_tts.gen(name, max_tokens=max(1, limit - used), temperature=self.temperature,
                               stop=self.delimiter, seed=self.seed_of(depth, b.parent, b.ordinal),
                               custom_params=tag.custom_params(), rid=tag.request_id())

    def _ended(self, b: Beam, index: int, depth: int, name: str, limit: int, what: str) -> Step | None:
        """The beam's step, once what it waited on ended; ``None`` when it needs another request."""
        if what == "branch":
            br, b.branch = b.branch, None
            got = br.read()
            self.costs.tokens_speculative += br.tokens
            if br.whole:
                self.costs.tokens_reused += got.tokens
                return got
            if got is not None and self.speculation.mode == "truncate":   # continue what was stopped
                self.costs.tokens_reused += got.tokens
                b.piece = got
            else:                  # exact (or a failed branch): the child's own request, from the start
                _end(br.state)
                b.state = self._fork(br.origin, br.closes)
            self._request(b, index, depth, name, limit)
            return None
        step = read_step(b.state, name, self.answer_pattern)
        self.costs.tokens_normal += step.tokens
        return _joined(b.piece, step, self.answer_pattern) if b.piece is not None else step

    def _fork(self, state: Any, closes: bool, count: int = 1) -> list[Any] | Any:
        kids = list(state.fork(count))
        for k in kids:
            if closes:
                k += self.delimiter
        return kids if count != 1 else kids[0]

    # ---------------------------------------------------------------------------- speculation
    def _speculate(self, c: Candidate, depth: int, limit: int) -> None:
        """Queue ``c``'s branches, up to its speculative potential; :meth:`_fill` starts them."""
        count = speculative_potential(c.beam.prior, self.bins)
        for j in range(count):   # (potential, child, arrival): the order slots are given in
            heapq.heappush(self._queue, (-count, j, self._queued, c, depth, limit))
            self._queued += 1

    def _fill(self, free: int, running: int, next_batch: int, others: int = 0) -> None:
        """Start queued branches in the ``free`` slots (FlashTTS keeps the batch at its size: a slot a
        finished step frees goes to the branches of the beams with the highest potential, a beam's
        branches in child order). Under a controller, a branch starts only if it pays at ``running``
        requests in flight and ``next_batch`` at the next depth, each plus the ``others`` rows of the
        process's other controlled searches on the generator; one that does not is dropped (a lower
        potential would not pay either)."""
        while free > 0 and self._queue:
            potential, j, _, c, depth, limit = heapq.heappop(self._queue)
            if self.controller is not None:
                decision = self.controller.decide(self._take_over.chance(-potential), running + others,
                                                  next_batch + others)
                if not decision.start:
                    self.costs.branches_declined += 1
                    self.costs.stood_down[decision.reason] = self.costs.stood_down.get(decision.reason, 0) + 1
                    continue
            running += 1
            self.costs.branches_started += 1
            closes = not c.grown.continues
            kid = self._fork(c.beam.state, closes)
            beam_id = (c.index + 1) * 1_000_000 + j     # unique at its depth, apart from normal beams
            tag = SearchTag(self.group, depth, c.index, beam_id, "speculative", ordinal=j)
            prefix = f"{self._candidate_prefix(c.index, depth)}{j}/"
            name = f"speculative{depth}"
            self._waiter.watch(kid)
            kid += sgl_tts.gen(name, max_tokens=limit, temperature=self.temperature, stop=self.delimiter,
                               seed=self.seed_of(depth, c.index, j), custom_params=tag.custom_params(),
                               rid=tag.request_id(prefix=prefix))
            self._branches.setdefault(c.index, []).append(
                Branch(c.index, j, kid, c.beam.state, closes, prefix, beam_id, limit, name, self.answer_pattern,
                       potential=-potential))
            free -= 1

    def _running_branches(self) -> int:
        return sum(1 for brs in self._branches.values() for br in brs if not br.ended())

    def _stop_running_branches(self, next_batch: int, others: int = 0) -> None:
        """Abort each branch still generating that would slow the verification (about to share the
        device) more than it saves (:meth:`SpeculationController.keep_at_barrier`; without a measured
        slowdown, every one), the lowest take-over chance first; a kept child whose branch was stopped
        sends its own request at the next depth (exact mode). ``others``: as in :meth:`_fill`."""
        running = sorted((br for brs in self._branches.values() for br in brs if not br.ended()),
                         key=lambda br: (self._take_over.chance(br.potential), -br.candidate, -br.ordinal))
        left = len(running)
        for br in running:
            decision = self.controller.keep_at_barrier(self._take_over.chance(br.potential), left + others,
                                                       next_batch + others)
            if decision.start:
                continue
            self._abort(br.state, br.rid_prefix)
            self.costs.branches_stopped += 1
            self.costs.stood_down[decision.reason] = self.costs.stood_down.get(decision.reason, 0) + 1
            left -= 1

    def _lookahead_due(self, c: Candidate) -> bool:
        """With LookAhead, a speculating candidate's verification waits for a branch's whole step."""
        return bool(self.speculation and self.speculation.lookahead and self._branches.get(c.index)
                    and tuple(c.path) not in self._memo)

    # ---------------------------------------------------------------------------- verification
    def _requests(self, cands: Sequence[Candidate]) -> list[tuple[Candidate, list[list[str]]]]:
        """What each candidate's verification sends: nothing (LookAhead scores it already), its path,
        or, with LookAhead, the path extended by each branch that completed a whole step."""
        out = []
        for c in cands:
            if tuple(c.path) in self._memo:
                out.append((c, []))
                continue
            paths = [c.path]
            if self.speculation and self.speculation.lookahead:
                longer = []
                for br in self._branches.get(c.index, []):
                    if br.ended() and br.whole:
                        ext = advance(c.grown.path, br.read(), self.delimiter, self.answer_pattern).scored
                        if ext[:len(c.path)] == c.path and len(ext) > len(c.path):
                            longer.append(ext)
                paths = longer or paths
            self.costs.prm_requests += len(paths)
            out.append((c, paths))
        return out

    def _send(self, cands: Sequence[Candidate], depth: int, now: bool = False):
        """:meth:`_verify`, logged (debug) in the order the search makes its PRM calls: with ``overlap``
        they run on the pool, and one made later can reach the PRM first."""
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
                if not paths:
                    out.append(list(self._memo[tuple(c.path)]))
                    continue
                for p, sc in zip(paths, got[k:k + len(paths)]):
                    if len(p) > len(c.path):
                        self._memo[tuple(p)] = list(sc)
                out.append(list(got[k][:len(c.path)]))
                k += len(paths)
            return out, time.perf_counter()

        if now or self._pool is None:
            return score()
        return self._pool.submit(score)

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
        if self.controller is not None:   # what the controller's take-over chances learn from
            chosen = {c.index for c, _ in kept}
            for c in self._current:
                self._take_over.observe(speculative_potential(c.beam.prior, self.bins), c.index in chosen)
        for c, children in kept:
            brs = self._branches.pop(c.index, [])
            closes = not c.grown.continues
            fresh = [j for j in range(children) if j >= len(brs)]
            forks = iter(self._fork(c.beam.state, closes, len(fresh)) if len(fresh) > 1
                         else [self._fork(c.beam.state, closes)] if fresh else [])
            for j in range(children):
                b = Beam(None, c.grown.path, c.tokens, c.index, j, c.value)
                if j < len(brs):
                    b.state, b.branch = brs[j].state, brs[j]
                    if not brs[j].ended():
                        adopted.append(brs[j].beam_id)
                else:
                    b.state = next(forks)
                    piece = self._cut(brs[0], depth, c.index, j) if brs else None
                    if piece is not None:
                        b.state += piece.raw
                        b.piece = piece
                beams.append(b)
            self._discard(brs[children:])
        for c in self._current:   # forked from already: their threads end now, not a depth later
            _end(c.beam.state)
        self._current = []
        for index, brs in self._branches.items():
            self._discard(brs, self._candidate_prefix(index, depth + 1))
        self._branches, self._queue = {}, []
        if adopted:
            self._make_normal(adopted, depth + 1, beams)
        return beams

    def _cut(self, br: Branch, depth: int, parent: int, ordinal: int) -> Step | None:
        """FlashTTS's truncation: branch 0's text cut at a fraction ~ N(R, σ) in [0, 1), for a child
        with no branch of its own (``truncate`` mode, and only once branch 0 has ended)."""
        if self.speculation is None or self.speculation.mode != "truncate" or not br.ended():
            return None
        got = br.read()
        if got is None or not got.raw:
            return None
        rng = random.Random(sgl_tts.search.derive_seed("truncate", self.seed, self.question, depth, parent, ordinal))
        x = min(max(rng.gauss(self.speculation.ratio, self.speculation.spread), 0.0), 1.0 - 1e-9)
        keep = int(len(got.raw) * x)
        if keep == 0:
            return None
        return Step(got.raw[:keep].strip(), round(got.tokens * keep / len(got.raw)), False,
                    {"type": "length", "length": round(got.tokens * keep / len(got.raw))}, got.raw[:keep])

    def _discard(self, brs: Sequence[Branch], prefix: str | None = None) -> None:
        """Abort ``brs`` (all of one candidate's with its ``prefix``: one abort; else one each) and let
        their threads end; their tokens are counted when they answer (:meth:`finish`)."""
        live = [br for br in brs if not br.ended()]
        if live:
            for p in ([prefix] if prefix is not None else [br.rid_prefix for br in live]):
                self._abort(live[0].state, p)
        for br in brs:
            _end(br.state)
            self._discarded.append(br)

    def _candidate_prefix(self, candidate: int, depth: int) -> str:
        """The rid prefix of every speculative request of ``candidate`` (its branches at ``depth``)."""
        return rid_prefix(self.group, depth, f"spec{candidate}")

    def _abort(self, state: Any, prefix: str) -> None:
        backend = state.stream_executor.backend
        abort = getattr(backend, "abort_prefix", None)
        if abort is not None:
            try:
                abort(prefix)
            except Exception as exc:   # the branch then runs to its end; nothing is lost but time
                logger.warning("sgl-tts: could not abort speculative requests %s: %s", prefix, exc)

    def _make_normal(self, beam_ids: list[int], depth: int, beams: Sequence[Beam]) -> None:
        """A running branch a kept child took over is normal work now (sgl-tts plugin servers)."""
        backend = beams[0].state.stream_executor.backend
        change = getattr(backend, "set_class", None)
        if change is None or not self._class_change:
            return
        try:
            change(self.group, "normal", beams=beam_ids, depth=depth)
        except RuntimeError as exc:   # a stock server: classes mean nothing there
            logger.info("sgl-tts: speculative branches stay speculative (%s)", exc)
            self._class_change = False

    # ------------------------------------------------------------------------------------ end
    def finish(self, beams: Sequence[Beam] = ()) -> None:
        """End the search: abort every branch still running, wait for every discarded one (their
        tokens count as speculative), and end every state."""
        for brs in self._branches.values():
            self._discard(brs)
        self._branches, self._queue = {}, []
        self._discard([b.branch for b in beams if b.branch is not None])
        for br in self._discarded:
            br.read()   # aborted ones answer at once; a failure counts no tokens
            self.costs.tokens_speculative += br.tokens
        self._discarded = []
        self._retire += [c.beam.state for c in self._current] + [b.state for b in beams]
        self._current = []
        for st in self._retire:
            _end(st)
        self._retire = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._rows is not None:
            self._rows.leave(self)


__all__ = ["Beam", "Branch", "Candidate", "Costs", "SPECULATION_MODES", "SPECULATION_PRESETS", "Speculation", "StepPipeline",
           "speculative_potential"]
