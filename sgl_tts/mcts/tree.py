"""Node-reusing MCTS over reasoning steps, as a tree you ask and tell (seed 004, App. A and §3.4-4.3).

The tree holds the search's state and its selection policy and nothing else: it never generates or
scores. A runtime (``programs/mcts.py`` on SGLang; a test's loop on scripted samples) drives it:

    rollout = tree.launch()              # WU-PUCT selection down to a free leaf (None: none free now)
    node = tree.frontier(rollout)        # the node whose children the rollout samples next
    ... sample tree.config.expansion_width steps after node.text, score each grown path ...
    tree.tell(rollout, samples)          # the rollout moves to its best new child, or ends there
    tree.cancel(rollout)                 # give a rollout up (the nodes it made stay in the tree)
    tree.exit                            # None while the search goes on; else why it stopped

A **rollout** selects a leaf (WU-PUCT at every node from the root), expands it (samples
``expansion_width`` children), then simulates: moves to the child with the highest step score (ties to
the earlier child) and expands that, until the child it moved to is terminal (it holds an answer, the
model ended the text, or ``max_depth``). Its return, the terminal node's aggregated path score, is
backpropagated along its path (N += 1, W += return). Every node a rollout made stays in the tree, so a
later rollout can select any of them (node reuse).

**WU-PUCT** (parallel rollouts): a child's value is ``Q + c_puct * P * sqrt(Ñ(parent)) / (1 + Ñ(child))``
with ``Ñ = N + O``, O the rollouts in flight through the node, so concurrent rollouts spread out
instead of piling onto one path. ``Q`` is W/N, or for a node no rollout has returned through, its own
aggregated path score (its PRM evaluation); ``P`` is uniform over siblings. Ties go to the earlier
child. A leaf another rollout is expanding, a terminal node, and a subtree with no such free leaf are
not selectable.

**Exits** (checked after every tell and cancel, reason recorded in :attr:`MCTSTree.exit`):

- ``accepted`` (positive early exit): a finished node's aggregated path score reached ``threshold``;
- ``futile`` (negative early exit): every leaf is below ``threshold``. Under ``min`` and under
  ``prod`` (scores in [0, 1]) a leaf's aggregated path score bounds the score of every trajectory
  through it, and so does its own step score (a looser bound): ``futility="path"`` (default) checks the
  first, ``futility="step"`` the second, as seed 004 §3.4 states its rule. Under ``last`` and ``mean``
  neither bounds anything, and the tree refuses ``negative_exit`` with them. With
  ``first_step_cutoff`` (selective futility check, §4.3), leaves whose first step scored below it are
  left out of the check (they are still explored); if every leaf is left out the check holds. (Under
  ``futility="path"`` such a leaf's score is at most its first step's, so the cut-off changes the
  check only when it is above the threshold; under ``"step"`` it is what makes the rule fire.)
- ``budget``: ``num_rollouts`` rollouts returned;
- ``exhausted``: no leaf can be expanded and no rollout is in flight.

Sampling seeds belong to tree positions (:attr:`Node.address`, the child indices from the root), not to
the order things happened in, so a node at a given position holds the same sample however rollouts
were scheduled.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Protocol, Sequence

from sgl_tts.search import (BOXED, STEP_DELIMITER, AGGREGATIONS, PathSoFar, Step, advance, aggregate,
                            extract_answer)
from sgl_tts.search.options import DEFAULT_BUDGET, DEFAULT_MAX_DEPTH, DEFAULT_WIDTH, run_setting

EXIT_REASONS = ("accepted", "futile", "budget", "exhausted")
SOUND_FOR_NEGATIVE_EXIT = ("min", "prod")
FUTILITY = ("path", "step")


@dataclasses.dataclass(frozen=True)
class MCTSConfig:
    """One MCTS search's settings (shared by the program, the CLI and the job scheduler).

    Attributes:
        num_rollouts: rollouts to return at most (the budget).
        expansion_width: children sampled per expansion.
        parallel: MCTS rollouts in flight at once (WU-PUCT; 1: serial and deterministic); the
            program's (the tree reads one rollout at a time).
        c_puct: MCTS's weight of the exploration term.
        aggregation: trajectory score from its step scores (``min``, ``prod``, ``last``, ``mean``).
        threshold: MCTS's acceptance threshold of both early exits.
        positive_exit: MCTS stops once a finished trajectory reaches ``threshold``.
        negative_exit: MCTS stops once every leaf is futile (``min``/``prod`` only).
        futility: what MCTS's negative-exit check compares with ``threshold``: a leaf's aggregated path
            score (``path``) or its own step score (``step``, seed 004's rule); both bound every
            trajectory through the leaf under ``min``/``prod``.
        first_step_cutoff: MCTS's selective futility check: leaves whose first step scored below this are
            left out of the negative-exit check (``None``: none is).
        max_depth: steps at most in a trajectory (a node at this depth is terminal).

    The fields made with :func:`~sgl_tts.search.options.run_setting` are ``sgl-tts run`` settings of
    program ``mcts`` (its ``n`` is ``num_rollouts``, its ``beam_width`` ``expansion_width``).
    """

    num_rollouts: int = DEFAULT_BUDGET
    expansion_width: int = DEFAULT_WIDTH
    parallel: int = run_setting(1)
    c_puct: float = run_setting(1.0)
    aggregation: str = "min"
    threshold: float = run_setting(0.9)
    positive_exit: bool = run_setting(True)
    negative_exit: bool = run_setting(False)
    futility: str = run_setting("path")
    first_step_cutoff: float | None = run_setting(None)
    max_depth: int = DEFAULT_MAX_DEPTH

    def __post_init__(self):
        if isinstance(self.parallel, bool) or not isinstance(self.parallel, int) or self.parallel < 1:
            raise ValueError(f"parallel must be a positive integer, got {self.parallel}")
        if self.num_rollouts < 1:
            raise ValueError(f"num_rollouts must be >= 1, got {self.num_rollouts}")
        if self.expansion_width < 1:
            raise ValueError(f"expansion_width must be >= 1, got {self.expansion_width}")
        if self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")
        if self.c_puct < 0:
            raise ValueError(f"c_puct must be >= 0, got {self.c_puct}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {self.aggregation!r}; choose one of {sorted(AGGREGATIONS)}")
        if self.negative_exit and self.aggregation not in SOUND_FOR_NEGATIVE_EXIT:
            raise ValueError(
                f"negative early exit needs aggregation 'min' or 'prod' (a path's score then bounds every "
                f"extension of it); under {self.aggregation!r} a later step can raise a futile path's score")
        if self.futility not in FUTILITY:
            raise ValueError(f"unknown futility {self.futility!r}; choose one of {', '.join(FUTILITY)}")
        if self.first_step_cutoff is not None and not self.negative_exit:
            raise ValueError("first_step_cutoff belongs to the negative early exit: set negative_exit=True")


@dataclasses.dataclass
class Node:
    """One step of the tree (the root holds the question: no step, no score).

    ``visits`` (N), ``value`` (W, the sum of returns backpropagated through it) and ``in_flight`` (O,
    rollouts passing through it now) are the WU-PUCT statistics.
    """

    id: int
    parent: int | None
    address: tuple[int, ...]          # child indices from the root (the root: ())
    path: PathSoFar                   # the steps up to here (a cut step left open: ``path.pending``)
    text: str                         # what follows the prompt to reach this node (the next request's suffix)
    scores: tuple[float, ...] = ()    # the PRM's scores of ``path.scored``
    path_score: float = 0.0           # the scores aggregated
    finished: bool = False            # an answer, an end of sequence or an empty step
    terminal: bool = False            # finished, or at max_depth: never expanded
    tokens: int = 0                   # tokens of this node's generation
    children: list[int] = dataclasses.field(default_factory=list)
    visits: int = 0
    value: float = 0.0
    in_flight: int = 0
    expanding: bool = False           # a rollout is sampling its children

    @property
    def depth(self) -> int:
        return len(self.address)

    @property
    def step_score(self) -> float | None:
        """The score of this node's own step (``None`` at the root or for an empty path)."""
        return self.scores[-1] if self.scores else None

    @property
    def first_score(self) -> float | None:
        """The score of the path's first step (the selective futility check reads it)."""
        return self.scores[0] if self.scores else None

    @property
    def leaf(self) -> bool:
        return not self.children


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sampled child step and the PRM's scores of the path it grows (``MCTSTree.grow(...).scored``)."""

    step: Step
    scores: Sequence[float]


@dataclasses.dataclass
class Rollout:
    """One rollout in flight: the node ids from the root to where it is."""

    id: int
    path: list[int]
    done: bool = False
    cancelled: bool = False
    reward: float | None = None       # the return it backpropagated


@dataclasses.dataclass(frozen=True)
class Exit:
    """Why a search stopped, and when (rollouts returned and nodes made by then)."""

    reason: str
    rollouts: int
    nodes: int
    node: int | None = None           # the node that decided it (``accepted``)


class RolloutControl(Protocol):
    """Who decides how many rollouts a search runs at once (the job scheduler's parallelism degree).

    A runtime asks before it launches: with more in flight than :meth:`degree` says, it cancels the
    surplus (:meth:`MCTSTree.to_preempt`); with fewer, it launches up to it. A control whose degree
    can change while the search waits also has ``watch(wake)``: it calls ``wake()`` then, and the
    runtime (asleep until a step ends otherwise) reads the degree again."""

    def degree(self, tree: "MCTSTree") -> int: ...


class MCTSTree:
    """The search tree, its WU-PUCT selection and its exits (see the module doc).

    Args:
        config: the search's settings.
        delimiter, answer_pattern: how generated text closes steps and holds an answer.
    """

    def __init__(self, config: MCTSConfig = MCTSConfig(), *, delimiter: str = STEP_DELIMITER,
                 answer_pattern: str = BOXED):
        self.config = config
        self.delimiter = delimiter
        self.answer_pattern = answer_pattern
        self.nodes: list[Node] = [Node(0, None, (), PathSoFar(), "")]
        self.rollouts: dict[int, Rollout] = {}   # in flight
        self.returned: list[Rollout] = []
        self.cancelled: list[Rollout] = []
        self.exit: Exit | None = None
        self._next_rollout = 0

    # ------------------------------------------------------------------------------ reading
    @property
    def root(self) -> Node:
        return self.nodes[0]

    def children(self, node: Node) -> list[Node]:
        return [self.nodes[c] for c in node.children]

    def leaves(self) -> Iterator[Node]:
        return (n for n in self.nodes if n.leaf)

    def finished(self) -> list[Node]:
        """Every finished node (a complete trajectory), in the order they were made."""
        return [n for n in self.nodes if n.finished]

    def best(self) -> Node | None:
        """The pick: the finished node with the best aggregated score (ties to the earlier made);
        without one, the best-scored node of the tree; ``None`` for a tree never expanded."""
        pool = self.finished() or self.nodes[1:]
        if not pool:
            return None
        return max(pool, key=lambda n: (n.path_score, -n.id))

    def q(self, node: Node) -> float:
        """Q: the mean return through ``node``, or its own aggregated score before any return."""
        return node.value / node.visits if node.visits else node.path_score

    def wu_puct(self, parent: Node, child: Node) -> float:
        """``Q(child) + c_puct * P * sqrt(N(parent) + O(parent)) / (1 + N(child) + O(child))``, P = 1/siblings."""
        prior = 1.0 / len(parent.children)
        explore = math.sqrt(parent.visits + parent.in_flight) / (1 + child.visits + child.in_flight)
        return self.q(child) + self.config.c_puct * prior * explore

    def selectable(self, node: Node) -> bool:
        """Whether a rollout could be sent into ``node``'s subtree now (a free, unexpanded, non-terminal leaf)."""
        if node.terminal:
            return False
        if node.leaf:
            return not node.expanding
        return any(self.selectable(c) for c in self.children(node))

    def grow(self, node: Node, step: Step) -> PathSoFar:
        """The path a child of ``node`` with ``step`` would have: what a runtime scores
        (``.scored``) before it tells."""
        return advance(node.path, step, self.delimiter, self.answer_pattern).path

    def frontier(self, rollout: Rollout) -> Node:
        """The node whose children ``rollout`` samples next."""
        return self.nodes[rollout.path[-1]]

    def budget_left(self) -> int:
        """Rollouts that may still be launched."""
        return self.config.num_rollouts - len(self.returned) - len(self.rollouts)

    # ---------------------------------------------------------------------------- asking
    def select(self) -> list[Node] | None:
        """The WU-PUCT path from the root to a free leaf, or ``None`` when none is free."""
        node = self.root
        if not self.selectable(node):
            return None
        path = [node]
        while not node.leaf:
            options = [c for c in self.children(node) if self.selectable(c)]
            node = max(options, key=lambda c: (self.wu_puct(path[-1], c), -c.id))
            path.append(node)
        return path

    def launch(self) -> Rollout | None:
        """Start a rollout at the leaf WU-PUCT selects; ``None`` when the search has stopped, its budget
        is taken, or no leaf is free now (every free one is being expanded: wait for a tell)."""
        if self.exit is not None or self.budget_left() <= 0:
            return None
        path = self.select()
        if path is None:
            return None
        for n in path:
            n.in_flight += 1
        path[-1].expanding = True
        rollout = Rollout(self._next_rollout, [n.id for n in path])
        self._next_rollout += 1
        self.rollouts[rollout.id] = rollout
        return rollout

    # ---------------------------------------------------------------------------- telling
    def tell(self, rollout: Rollout, samples: Sequence[Sample]) -> None:
        """The children ``rollout`` sampled at its frontier, each with the PRM's scores of its grown path.

        Adds them to the tree; the rollout moves to the child with the highest step score (ties to
        the earlier sample), or, if that child is terminal, returns its aggregated score along its
        path and ends. Then the exits are checked.
        """
        if rollout.id not in self.rollouts:
            raise ValueError(f"rollout {rollout.id} is not in flight (done or cancelled)")
        if not samples:
            raise ValueError("tell needs at least one sample")
        parent = self.frontier(rollout)
        parent.expanding = False
        made = []
        for j, sample in enumerate(samples):
            grown = advance(parent.path, sample.step, self.delimiter, self.answer_pattern)
            if len(sample.scores) != len(grown.path.scored):
                raise ValueError(f"sample {j}: {len(sample.scores)} scores for a path of "
                                 f"{len(grown.path.scored)} steps")
            scores = tuple(float(x) for x in sample.scores)
            node = Node(len(self.nodes), parent.id, parent.address + (j,), grown.path,
                        parent.text + sample.step.raw + ("" if grown.continues else self.delimiter),
                        scores, aggregate(scores, self.config.aggregation), grown.finished,
                        grown.finished or parent.depth + 1 >= self.config.max_depth, sample.step.tokens)
            self.nodes.append(node)
            parent.children.append(node.id)
            made.append(node)
        best = max(made, key=lambda n: (n.step_score if n.step_score is not None else -math.inf, -n.id))
        best.in_flight += 1
        rollout.path.append(best.id)
        if best.terminal:
            self._return(rollout, best.path_score)
        else:
            best.expanding = True
        self._check_exits(made)

    def cancel(self, rollout: Rollout) -> None:
        """Give ``rollout`` up (a preemption, or the search stopped): its in-flight counts are removed
        and its budget is free again; the nodes it made stay. A finished rollout is left as it is."""
        if rollout.id not in self.rollouts:
            return
        del self.rollouts[rollout.id]
        for nid in rollout.path:
            self.nodes[nid].in_flight -= 1
        self.frontier(rollout).expanding = False
        rollout.cancelled = True
        self.cancelled.append(rollout)
        self._check_exits([])

    def reward_so_far(self, rollout: Rollout) -> float:
        """A rollout's cumulative reward now: its frontier's aggregated path score (the job scheduler
        preempts the lowest first)."""
        return self.frontier(rollout).path_score

    def to_preempt(self, count: int) -> list[Rollout]:
        """The ``count`` rollouts in flight a shrinking allocation cancels: lowest cumulative reward
        first (:meth:`reward_so_far`), ties to the latest launched (the least work lost)."""
        ranked = sorted(self.rollouts.values(), key=lambda r: (self.reward_so_far(r), -r.id))
        return ranked[:max(0, count)]

    def _return(self, rollout: Rollout, reward: float) -> None:
        for nid in rollout.path:
            n = self.nodes[nid]
            n.visits += 1
            n.value += reward
            n.in_flight -= 1
        rollout.done, rollout.reward = True, reward
        del self.rollouts[rollout.id]
        self.returned.append(rollout)

    def _check_exits(self, made: Sequence[Node]) -> None:
        if self.exit is not None:
            return
        cfg = self.config

        def stop(reason: str, node: int | None = None) -> None:
            self.exit = Exit(reason, len(self.returned), len(self.nodes), node)

        if cfg.positive_exit:
            for n in made:
                if n.finished and n.path_score >= cfg.threshold:
                    return stop("accepted", n.id)
        if cfg.negative_exit and self.futile():
            return stop("futile")
        if len(self.returned) >= cfg.num_rollouts:
            return stop("budget")
        if not self.rollouts and not self.selectable(self.root):
            return stop("exhausted")

    def futile(self) -> bool:
        """Whether every leaf checked is below the threshold (negative early exit; see the module doc).
        A tree whose root is still a leaf is not futile."""
        if self.root.leaf:
            return False
        cut = self.config.first_step_cutoff
        checked = [n for n in self.leaves()
                   if cut is None or n.first_score is None or n.first_score >= cut]
        def bound(n: Node) -> float:
            if self.config.futility == "step":
                return n.step_score if n.step_score is not None else 0.0
            return n.path_score

        return all(bound(n) < self.config.threshold for n in checked)

    def answer(self, node: Node) -> str | None:
        return extract_answer(self.delimiter.join(node.path.scored), self.answer_pattern)


__all__ = ["EXIT_REASONS", "FUTILITY", "Exit", "MCTSConfig", "MCTSTree", "Node", "Rollout", "RolloutControl", "Sample"]
