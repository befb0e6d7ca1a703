"""Speculative beam extension (seed 000 §4.1): a strategy :class:`~sgl_tts.search.pipeline.StepPipeline` is given.

As soon as a beam's step ends while others of its search still generate, the beam starts its next step
as *speculative* requests (the scheduler plugin runs them only in room normal work does not need, and
stops them first; a ``LocalBackend`` admits them last). How many (its *speculative potential*,
FlashTTS's SelectSpec): its parent's score binned into B equal-width bins over [0, 1], B the branching
factor; the top bin gives B branches, the bottom one 1 (:func:`speculative_potential`; at the root,
with no score, 1). Branches start lazily, as FlashTTS keeps the batch at its size: only in slots that
finished steps freed (a search has as many requests in flight as it has beams), highest potential
first, and only while the depth's stragglers generate (none starts while the PRM verifies).

Branch ``j`` is the request child ``j`` of that beam would send (same prompt, same seed, same token
limit), so when the beam is kept child ``j`` takes it over: in the default ``exact`` mode every
trajectory is the one the plain search samples. A branch the scheduler stopped before its step ended
is generated again from the start (``exact``), or continued (``truncate``). In FlashTTS's ``truncate``
mode the children without a branch of their own also start from branch 0's text cut at a fraction
drawn from N(R, σ) (clipped to [0, 1)), then sample on: an approximation that correlates siblings.
After selection the branches of pruned beams are aborted at once (one group-prefix abort each, on an
sgl-tts server).

:class:`Speculation` is the policy (its settings, named by :data:`SPECULATION_PRESETS`);
:class:`Speculator` carries it out for one search, under the cost controller of
:mod:`sgl_tts.search.speculation_cost` when ``controlled``.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import random
from typing import TYPE_CHECKING, Any, Sequence

import sgl_tts
from sgl_tts.protocol import rid_prefix
from sgl_tts.search import SearchTag, Step
from sgl_tts.search.beams import Beam, Branch, Candidate, end_state
from sgl_tts.search.speculation_cost import RowsInFlight, SpeculationController, TakeOverChance, rows_in_flight
from sgl_tts.server_costs import DecodeCurve, VerifierSlowdown

if TYPE_CHECKING:
    from sgl_tts.search.pipeline import StepPipeline

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



def _generator_key(state: Any) -> Any:
    """Which generator a state's requests go to: its endpoint's URL, else its backend object's id."""
    backend = state.stream_executor.backend
    return getattr(backend, "base_url", None) or ("backend", id(backend))


class Speculator:
    """Speculative beam extension for one search: the branches of the depth's candidates, started in
    the slots finished steps free, taken over by the kept children, aborted for the pruned ones.

    The pipeline calls it at fixed points of a depth (every one a no-op where there is nothing to do):
    :meth:`start` (before the depth's first request), :meth:`queue` (a candidate's step ended),
    :meth:`top_up` (after each look at the depth's requests), :meth:`at_barrier` (the depth's last step
    ended), :meth:`take_over` (a beam's step was a branch), then at selection :meth:`learn`,
    :meth:`take`, :meth:`cut`, :meth:`discard` and :meth:`end_depth`, and :meth:`finish` /
    :meth:`leave` at the search's end. It requests through the pipeline it is bound to
    (:meth:`bind`: its group, seeds, sampling, waiter and costs). One per search: it holds its state.
    """

    def __init__(self, policy: Speculation, bins: int):
        self.policy = policy
        self.bins = policy.bins if policy.bins else bins
        self.controller = (SpeculationController(policy.curve, verifier_shares_device=policy.verifier_shares_device,
                                                 slowdown=policy.slowdown, measure=policy.measure_curve)
                           if policy.controlled else None)
        self._take_over = TakeOverChance(self.bins)             # learned from this search's selections
        self.branches: dict[int, list[Branch]] = {}             # this depth's, by candidate
        self._queue: list = []                                  # branches waiting for a free slot (a heap)
        self._queued = 0
        self._discarded: list[Branch] = []
        self._class_change = True
        self._rows: RowsInFlight | None = None   # a controller's view of the generator's other rows
        self._pipe: StepPipeline | None = None

    @classmethod
    def of(cls, policy: "Speculation | None", bins: int) -> "Speculator | None":
        """The strategy for ``policy`` (``None``: no speculation) with ``bins`` the search's branching
        factor (the default number of score bins)."""
        return None if policy is None else cls(policy, bins)

    def bind(self, pipe: StepPipeline) -> None:
        """The search this speculator works for (called by the pipeline it is given to)."""
        if self._pipe is not None and self._pipe is not pipe:
            raise ValueError("a Speculator holds one search's branches: give each StepPipeline its own")
        self._pipe = pipe

    # ------------------------------------------------------------------------------ one depth
    def start(self, beams: Sequence[Beam]) -> None:
        """Before a depth's first request: at the first depth, a controller finds its curve and its
        view of the generator's rows."""
        if self.controller is not None and self._rows is None and beams:
            self.controller.find_curve(beams[0].state.stream_executor.backend)
            self._rows = rows_in_flight(_generator_key(beams[0].state))

    def queue(self, c: Candidate, depth: int, limit: int) -> None:
        """Queue ``c``'s branches, up to its speculative potential; :meth:`top_up` starts them."""
        count = speculative_potential(c.beam.prior, self.bins)
        for j in range(count):   # (potential, child, arrival): the order slots are given in
            heapq.heappush(self._queue, (-count, j, self._queued, c, depth, limit))
            self._queued += 1

    def top_up(self, waiting: int, batch: int) -> None:
        """After a look at the depth's requests (``waiting`` steps still generating, ``batch`` beams): the
        search's batch stays at its size, branches fill what finished steps freed; a controller's view
        of the generator's rows is kept current."""
        if self._rows is None and not self._queue:
            return
        running = waiting + self.running()
        others = 0   # the rows the process's other controlled searches have on the generator
        if self._rows is not None:
            others = self._rows.publish(self, running)
        if self._queue:
            self._fill(batch - running, running, batch, others)
            if self._rows is not None:
                self._rows.publish(self, waiting + self.running())

    def _fill(self, free: int, running: int, next_batch: int, others: int = 0) -> None:
        """Start queued branches in the ``free`` slots (FlashTTS keeps the batch at its size: a slot a
        finished step frees goes to the branches of the beams with the highest potential, a beam's
        branches in child order). Under a controller, a branch starts only if it pays at ``running``
        requests in flight and ``next_batch`` at the next depth, each plus the ``others`` rows of the
        process's other controlled searches on the generator; one that does not is dropped (a lower
        potential would not pay either)."""
        pipe = self._pipe
        costs = pipe.costs
        while free > 0 and self._queue:
            potential, j, _, c, depth, limit = heapq.heappop(self._queue)
            if self.controller is not None:
                decision = self.controller.decide(self._take_over.chance(-potential), running + others,
                                                  next_batch + others)
                if not decision.start:
                    costs.branches_declined += 1
                    costs.stood_down[decision.reason] = costs.stood_down.get(decision.reason, 0) + 1
                    continue
            running += 1
            costs.branches_started += 1
            closes = not c.grown.continues
            kid = pipe.fork(c.beam.state, closes)
            beam_id = (c.index + 1) * 1_000_000 + j     # unique at its depth, apart from normal beams
            tag = SearchTag(pipe.group, depth, c.index, beam_id, "speculative", ordinal=j)
            prefix = f"{self._candidate_prefix(c.index, depth)}{j}/"
            name = f"speculative{depth}"
            pipe.waiter.watch(kid)
            kid += sgl_tts.gen(name, max_tokens=limit, temperature=pipe.temperature, stop=pipe.delimiter,
                               seed=pipe.seed_of(depth, c.index, j), custom_params=tag.custom_params(),
                               rid=tag.request_id(prefix=prefix))
            self.branches.setdefault(c.index, []).append(
                Branch(c.index, j, kid, c.beam.state, closes, prefix, beam_id, limit, name, pipe.answer_pattern,
                       potential=-potential))
            free -= 1

    def running(self) -> int:
        """The branches of this depth still generating."""
        return sum(1 for brs in self.branches.values() for br in brs if not br.ended())

    def at_barrier(self, batch: int) -> None:
        """The depth's last step ended (``batch`` beams): a controller whose verifier shares the device
        stops the branches that would slow it; the rest run on while the PRM verifies."""
        if self.controller is not None and self.controller.stop_at_barrier():
            self._stop_running(batch, self._rows.others(self) if self._rows is not None else 0)
        if self._rows is not None:
            self._rows.publish(self, self.running())

    def _stop_running(self, next_batch: int, others: int = 0) -> None:
        """Abort each branch still generating that would slow the verification (about to share the
        device) more than it saves (:meth:`SpeculationController.keep_at_barrier`; without a measured
        slowdown, every one), the lowest take-over chance first; a kept child whose branch was stopped
        sends its own request at the next depth (exact mode). ``others``: as in :meth:`_fill`."""
        costs = self._pipe.costs
        running = sorted((br for brs in self.branches.values() for br in brs if not br.ended()),
                         key=lambda br: (self._take_over.chance(br.potential), -br.candidate, -br.ordinal))
        left = len(running)
        for br in running:
            decision = self.controller.keep_at_barrier(self._take_over.chance(br.potential), left + others,
                                                       next_batch + others)
            if decision.start:
                continue
            self._abort(br.state, br.rid_prefix)
            costs.branches_stopped += 1
            costs.stood_down[decision.reason] = costs.stood_down.get(decision.reason, 0) + 1
            left -= 1

    def take_over(self, b: Beam) -> Step | None:
        """``b``'s step from the branch it took over, once that branch ended; ``None`` when ``b`` must
        send a request of its own: from the start (``exact``, or a failed branch, on a fresh fork of
        its parent) or continuing what the scheduler stopped (``truncate``: ``b.piece``)."""
        costs = self._pipe.costs
        br, b.branch = b.branch, None
        got = br.read()
        costs.tokens_speculative += br.tokens
        if br.whole:
            costs.tokens_reused += got.tokens
            return got
        if got is not None and self.policy.mode == "truncate":   # continue what was stopped
            costs.tokens_reused += got.tokens
            b.piece = got
        else:                  # exact (or a failed branch): the child's own request, from the start
            end_state(br.state)
            b.state = self._pipe.fork(br.origin, br.closes)
        return None

    # ------------------------------------------------------------------------------ selection
    def learn(self, current: Sequence[Candidate], kept: Sequence[tuple[Candidate, int]]) -> None:
        """What the controller's take-over chances learn from: which of the depth's candidates were kept."""
        if self.controller is not None:
            chosen = {c.index for c, _ in kept}
            for c in current:
                self._take_over.observe(speculative_potential(c.beam.prior, self.bins), c.index in chosen)

    def take(self, candidate: int) -> list[Branch]:
        """A kept candidate's branches, for its children to take over (child ``j`` branch ``j``)."""
        return self.branches.pop(candidate, [])

    def cut(self, br: Branch, depth: int, parent: int, ordinal: int) -> Step | None:
        """FlashTTS's truncation: branch 0's text cut at a fraction ~ N(R, σ) in [0, 1), for a child
        with no branch of its own (``truncate`` mode, and only once branch 0 has ended)."""
        if self.policy.mode != "truncate" or not br.ended():
            return None
        got = br.read()
        if got is None or not got.raw:
            return None
        pipe = self._pipe
        rng = random.Random(sgl_tts.search.derive_seed("truncate", pipe.seed, pipe.question, depth, parent, ordinal))
        x = min(max(rng.gauss(self.policy.ratio, self.policy.spread), 0.0), 1.0 - 1e-9)
        keep = int(len(got.raw) * x)
        if keep == 0:
            return None
        return Step(got.raw[:keep].strip(), round(got.tokens * keep / len(got.raw)), False,
                    {"type": "length", "length": round(got.tokens * keep / len(got.raw))}, got.raw[:keep])

    def discard(self, brs: Sequence[Branch], prefix: str | None = None) -> None:
        """Abort ``brs`` (all of one candidate's with its ``prefix``: one abort; else one each) and let
        their threads end; their tokens are counted when they answer (:meth:`finish`)."""
        live = [br for br in brs if not br.ended()]
        if live:
            for p in ([prefix] if prefix is not None else [br.rid_prefix for br in live]):
                self._abort(live[0].state, p)
        for br in brs:
            end_state(br.state)
            self._discarded.append(br)

    def end_depth(self, depth: int, adopted: list[int], beams: Sequence[Beam]) -> None:
        """After the children of ``depth`` are made: every branch no child took over is aborted (one
        abort per pruned candidate), and the running branches children took over (``adopted``, by
        beam id) become normal work."""
        for index, brs in self.branches.items():
            self.discard(brs, self._candidate_prefix(index, depth + 1))
        self.branches, self._queue = {}, []
        if adopted:
            self._make_normal(adopted, depth + 1, beams)

    def _candidate_prefix(self, candidate: int, depth: int) -> str:
        """The rid prefix of every speculative request of ``candidate`` (its branches at ``depth``)."""
        return rid_prefix(self._pipe.group, depth, f"spec{candidate}")

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
            change(self._pipe.group, "normal", beams=beam_ids, depth=depth)
        except RuntimeError as exc:   # a stock server: classes mean nothing there
            logger.info("sgl-tts: speculative branches stay speculative (%s)", exc)
            self._class_change = False

    # ------------------------------------------------------------------------------------ end
    def finish(self, beams: Sequence[Beam] = ()) -> None:
        """The search ends: abort every branch still running, wait for every discarded one (their
        tokens count as speculative)."""
        for brs in self.branches.values():
            self.discard(brs)
        self.branches, self._queue = {}, []
        self.discard([b.branch for b in beams if b.branch is not None])
        for br in self._discarded:
            br.read()   # aborted ones answer at once; a failure counts no tokens
            self._pipe.costs.tokens_speculative += br.tokens
        self._discarded = []

    def leave(self) -> None:
        """The search's rows leave the controller's view of the generator."""
        if self._rows is not None:
            self._rows.leave(self)


__all__ = ["SPECULATION_MODES", "SPECULATION_PRESETS", "Speculation", "Speculator", "speculative_potential"]
