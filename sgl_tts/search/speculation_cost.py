"""When a speculative branch pays for itself (issue 33): a measured decode-cost curve and the rule
that starts a branch only when its expected saving exceeds its expected cost.

FlashTTS's speculative beam extension assumes that a slot a finished step frees is free capacity:
true where a decode step costs the same at any batch (memory-bound decoding on a GPU at small and
medium batches), false on a CPU or at large batches, where every extra row makes every step of the
depth slower. So the decision is made from a measured :class:`DecodeCurve`, the time of one decode
step of the generator against its running batch, read through its non-decreasing fit (a measured
batch that timed under a smaller one is noise, not free rows: :func:`~sgl_tts.server_costs.centered_isotonic`).

The rule (:meth:`SpeculationController.decide`), per decode step a branch runs:

- **cost**: every request of the batch waits for the step, so the depth's barrier (its last step's
  end) moves by ``marginal(b) = step(b + 1) - step(b)``, ``b`` the running batch;
- **saving**: the branch generated one token of child ``j``'s next step. If the child takes it over
  (chance ``p``), the next depth does not generate it: in a linear regime (every row costs its share)
  that saves the token's share of a step, ``step(n) / n`` at the next depth's batch ``n``; in a flat
  regime the depth lasts as long as its longest step, and the token shortens it only when that child
  is the straggler (about 1 in ``n``): ``step(n) / n`` again.

Both grow with the steps the branch runs, so that count cancels: **start iff
``p * step(n) / n > marginal(b)``**. A flat curve (``marginal`` ~ 0) speculates whenever a branch
may be taken; a curve through the origin (``step(b) = c * b``: every row costs ``c``) never does
(``p * c > c`` needs ``p > 1``); a fixed cost per step (``step(b) = a + c * b``) speculates while
``p * (a / n + c) > c``. A tie does not start: the rule is meant never to lose.

``p``: the chance the branch's beam is kept (its child then takes it over). SelectSpec's bins give
the branch count from the parent's score; :class:`TakeOverChance` learns the keep rate of each bin
from the search's own selections (before the first, the potential over the bins).

**At the barrier** (the depth's last step ended; the PRM now verifies what the search waits for)
a branch still running competes with the verifier where both share the device. The PRM's slowdown is
measured on the live pair (:class:`VerifierSlowdown`, :mod:`sgl_tts.launch.verifier_slowdown`): its
scoring takes ``1 + s * B`` times as long with ``B`` generator rows decoding beside it. While a branch
runs one decode step (``step(b)`` seconds, ``b`` the rows left running) the verification loses ``s *
step(b)`` seconds, every second of it on the search's critical path; the step saves ``p * step(n) /
n`` as above. So **a branch keeps running iff ``p * step(n) / n > s * step(b)``**
(:meth:`SpeculationController.keep_at_barrier`). Without a measured slowdown the rule is the
yes/no it was: every branch stops where extra rows cost anything.

The curve is measured on the generator's own server (:mod:`sgl_tts.launch.decode_curve`; ``sgl-tts
run --speculative auto`` and ``sgl-tts serve-search`` do it when the run starts or at the first
``auto`` request, and the slowdown where the PRM shares the host; a program given ``"auto"`` asks its
``SGLangEndpoint`` once per server, :meth:`SpeculationController.find_curve`; a generator that is no
server is refused). ``b`` and ``n`` are the generator's batch as this process sees it: the search's
own rows plus those of every other controlled search of the process on the same generator
(:class:`RowsInFlight`: ``sgl-tts run`` with several problems in flight, ``sgl-tts serve-search``);
another client's requests on the same server are not seen.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Hashable

from sgl_tts.server_costs import DecodeCurve, VerifierSlowdown

#: a decision's reasons (``SearchResult.stood_down`` counts those of the branches not started or stopped)
COSTS_MORE = "costs more than it saves"
NO_CURVE = "no measured decode curve"
STARTED = "saves more than it costs"
SLOWS_VERIFIER = "slows the verification more than it saves"   # a branch stopped at the barrier
VERIFIER_SHARES = "the verifier shares the device"            # stopped, no slowdown measured


class TakeOverChance:
    """The chance that a branch is taken over, by its beam's speculative potential (SelectSpec's
    bin), learned from the search's own selections: ``(kept + base) / (seen + 1)`` over the
    candidates of that potential seen so far, ``base`` the keep rate of all candidates so far (before
    any selection: the potential over the bins, SelectSpec's own reading). A branch is taken over
    exactly when its beam is kept (a kept beam has a child for each of its branches)."""

    def __init__(self, bins: int):
        self.bins = max(1, bins)
        self._seen: dict[int, int] = {}
        self._kept: dict[int, int] = {}

    def observe(self, potential: int, kept: bool) -> None:
        """One candidate of this ``potential`` was (or was not) kept at selection."""
        self._seen[potential] = self._seen.get(potential, 0) + 1
        self._kept[potential] = self._kept.get(potential, 0) + int(kept)

    def chance(self, potential: int) -> float:
        seen_all = sum(self._seen.values())
        base = sum(self._kept.values()) / seen_all if seen_all else min(1.0, potential / self.bins)
        return (self._kept.get(potential, 0) + base) / (self._seen.get(potential, 0) + 1)


@dataclasses.dataclass(frozen=True)
class BranchDecision:
    """Whether to start one speculative branch, and the two sides of the rule (seconds per decode
    step the branch runs)."""

    start: bool
    reason: str
    saving: float
    cost: float


class RowsInFlight:
    """The decode rows each controlled search of this process has running on one generator, so that
    a search judges a branch at the generator's batch rather than at its own rows alone. Each search
    publishes its count whenever it looks at its requests and leaves when it ends; what it reads back
    is the others' sum. Thread-safe (searches run on threads of their own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[Hashable, int] = {}
        self._total = 0

    def publish(self, owner: Hashable, rows: int) -> int:
        """Record that ``owner`` has ``rows`` requests decoding; returns the other owners' rows."""
        if rows < 0:
            raise ValueError(f"rows must be >= 0, got {rows}")
        with self._lock:
            self._total += rows - self._rows.get(owner, 0)
            if rows:
                self._rows[owner] = rows
            else:
                self._rows.pop(owner, None)
            return self._total - rows

    def others(self, owner: Hashable) -> int:
        with self._lock:
            return self._total - self._rows.get(owner, 0)

    def leave(self, owner: Hashable) -> None:
        self.publish(owner, 0)


_ROWS: dict[Hashable, RowsInFlight] = {}
_ROWS_LOCK = threading.Lock()


def rows_in_flight(generator: Hashable) -> RowsInFlight:
    """The process's :class:`RowsInFlight` of one generator (a server's URL, or a backend's id)."""
    with _ROWS_LOCK:
        return _ROWS.setdefault(generator, RowsInFlight())


class SpeculationController:
    """Starts a speculative branch only when its expected saving exceeds its expected cost (module
    docstring), and says whether running branches stop at the depth's barrier.

    Args:
        curve: the generator's measured decode curve; ``None``: nothing is measured, so nothing is
            started (``speculative="auto"`` never guesses), unless ``measure`` finds one.
        measure: without a ``curve``, take the generator server's when the search starts
            (:meth:`find_curve`: measured once per server, cached); a generator that is no server
            is refused there.
        verifier_shares_device: the PRM runs on the same device (always on a CPU): a branch still
            running when the depth's last step ends slows the verification the search waits for
            (:meth:`keep_at_barrier`).
        slowdown: the PRM's measured slowdown beside generation; ``None``: not measured, so a
            shared device stops every branch at the barrier where extra rows cost anything.
    """

    def __init__(self, curve: DecodeCurve | None, *, verifier_shares_device: bool = False,
                 slowdown: VerifierSlowdown | None = None, measure: bool = False):
        self.curve = curve
        self.measure = measure
        self.verifier_shares_device = verifier_shares_device
        self.slowdown = slowdown

    def find_curve(self, backend: Any) -> None:
        """With ``measure`` and no curve: the generator's, ``backend.decode_curve()`` (an
        :class:`~sgl_tts.backends.SGLangEndpoint`'s: its server's, measured once per server and process
        and cached on disk as ``sgl-tts run`` caches it). Called once, when the search starts; a
        backend that is no server to measure on raises :class:`ValueError` naming how to give a
        curve (``speculative="auto"`` never quietly runs as the plain search)."""
        if not self.measure or self.curve is not None:
            return
        measure = getattr(backend, "decode_curve", None)
        if measure is None:
            raise ValueError(
                f"speculative='auto' decides on the generator's measured decode curve, and its backend "
                f"({type(backend).__name__}) is not an SGLang server to measure one on: give the curve, "
                f"speculative=Speculation(controlled=True, curve=DecodeCurve.of([(batch, seconds), ...])) "
                f"or DecodeCurve.load(path) of a JSON file with points: [[batch, seconds], ...] "
                f"(sgl-tts run: speculation_curve: FILE), or generate on a server (sgl_tts.connect(url))")
        self.curve = measure()

    def decide(self, take_chance: float, running: int, next_batch: int) -> BranchDecision:
        """One branch whose child takes it over with chance ``take_chance``, with ``running``
        requests already in the batch and ``next_batch`` requests expected at the next depth."""
        if not 0.0 <= take_chance <= 1.0:
            raise ValueError(f"take_chance must lie in [0, 1], got {take_chance}")
        if self.curve is None:
            return BranchDecision(False, NO_CURVE, 0.0, 0.0)
        saving = take_chance * self.curve.per_row(next_batch)
        cost = self.curve.marginal(max(1, running))
        if saving > cost * (1 + 1e-9) + 1e-15:   # a tie (up to rounding) does not start
            return BranchDecision(True, STARTED, saving, cost)
        return BranchDecision(False, COSTS_MORE, saving, cost)

    def stop_at_barrier(self) -> bool:
        """Whether branches still running at the depth's barrier may have to stop (each is then
        judged by :meth:`keep_at_barrier`): when the verifier shares the device and, without a
        measured slowdown, extra rows cost it time (a flat curve costs nothing)."""
        if not self.verifier_shares_device:
            return False
        if self.slowdown is not None:
            return self.slowdown.per_row > 0
        return self.curve is None or any(self.curve.marginal(b) > 0 for b, _ in self.curve.points)

    def keep_at_barrier(self, take_chance: float, running: int, next_batch: int) -> BranchDecision:
        """Whether one branch still running at the barrier keeps running while the PRM verifies
        (module docstring): its child takes it over with chance ``take_chance``, ``running`` branches
        are left running, ``next_batch`` requests are expected at the next depth. Stops (``start`` is
        False) every branch when the verifier shares the device and no slowdown was measured."""
        if not 0.0 <= take_chance <= 1.0:
            raise ValueError(f"take_chance must lie in [0, 1], got {take_chance}")
        if not self.stop_at_barrier():
            return BranchDecision(True, "the verifier is not slowed", 0.0, 0.0)
        if self.slowdown is None or self.curve is None:
            return BranchDecision(False, VERIFIER_SHARES if self.curve is not None else NO_CURVE, 0.0, 0.0)
        saving = take_chance * self.curve.per_row(next_batch)
        cost = self.slowdown.per_row * self.curve.step(max(1, running))
        if saving > cost * (1 + 1e-9) + 1e-15:
            return BranchDecision(True, STARTED, saving, cost)
        return BranchDecision(False, SLOWS_VERIFIER, saving, cost)


__all__ = ["BranchDecision", "COSTS_MORE", "NO_CURVE", "RowsInFlight", "SLOWS_VERIFIER", "STARTED",
           "SpeculationController", "TakeOverChance", "VERIFIER_SHARES", "rows_in_flight"]
