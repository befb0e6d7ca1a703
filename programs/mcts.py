"""Monte Carlo tree search over reasoning steps with parallel rollouts and early exits (seed 004).

The tree, its WU-PUCT selection and its exits are :class:`sgl_tts.mcts.MCTSTree` (ask/tell); this
program is the runtime that serves it on SGLang. Every expansion ``fork``s the prompt
``expansion_width`` times, appends the node's path and ``gen``s one step in each (the radix cache
shares the prompt and the path); the PRM scores every grown path in one call; the tree is told, and
the rollout goes on from its best child until it ends. Up to ``parallel`` rollouts are in flight at
once (WU-PUCT spreads them); with a ``control`` (:class:`sgl_tts.mcts.RolloutControl`, the job
scheduler) the number follows its ``degree``, and a search asked to shrink cancels its rollouts with
the lowest cumulative reward (their requests aborted on an sgl-tts server); a control's
``request_class`` (if it has one, e.g. ``boosted``) is the class of the requests it sends from then on.

A search stops at the first exit (``accepted``: positive early exit; ``futile``: negative early exit;
``budget``; ``exhausted``; :attr:`SearchResult.exit_reason`); rollouts still in flight then are
cancelled. The pick is the finished trajectory with the best aggregated score (the best node of the
tree if none finished); every finished node is a trajectory of the result, and ``result.tree`` is the
tree itself.

Requests are tagged ``SearchTag(group, depth, parent=node, beam=rollout)`` (rid
``tts/<group>/<depth>/<rollout>/<child>/...``), so one prefix abort ends one rollout's expansion and a
``set_class`` on the group boosts the whole search. Sampling seeds are keyed by tree position
(:attr:`sgl_tts.mcts.Node.address`): with ``parallel=1`` a search is deterministic given its seed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Sequence

import sglang as sgl

import sgl_tts
from sgl_tts.frontend import Waiter, ended as _gen_ended
from sgl_tts.mcts import MCTSConfig, MCTSTree, Node, Rollout, RolloutControl, Sample
from sgl_tts.protocol import rid_prefix
from sgl_tts.search.options import DEFAULT_STEP_TOKENS, DEFAULT_TEMPERATURE
from sgl_tts.search import (BOXED, STEP_DELIMITER, SearchResult, SearchTag, Trajectory, derive_seed,
                            new_group, read_step, step_limit, vote)

logger = logging.getLogger(__name__)



@dataclasses.dataclass
class _Expansion:
    """A rollout's expansion in flight: its forks, one per child."""

    rollout: Rollout
    node: Node
    forks: list[Any]
    name: str

    def ended(self) -> bool:
        return all(_gen_ended(f, self.name) for f in self.forks)


_O = MCTSConfig   # the home of the options' defaults (sgl_tts.mcts.tree)


@sgl.function
def mcts(s, question: str, prm, num_rollouts: int = _O.num_rollouts, expansion_width: int = _O.expansion_width,
         parallel: int = _O.parallel, c_puct: float = _O.c_puct, aggregation: str = _O.aggregation,
         threshold: float = _O.threshold, positive_exit: bool = _O.positive_exit,
         negative_exit: bool = _O.negative_exit, futility: str = _O.futility,
         first_step_cutoff: float | None = _O.first_step_cutoff, max_depth: int = _O.max_depth,
         step_tokens: int | Sequence[int] = DEFAULT_STEP_TOKENS, sampling_temperature: float = DEFAULT_TEMPERATURE,
         seed: int = 0, delimiter: str = STEP_DELIMITER, answer_pattern: str = BOXED,
         search_group: str | None = None, control: RolloutControl | None = None) -> SearchResult:
    config = MCTSConfig(num_rollouts=num_rollouts, expansion_width=expansion_width, c_puct=c_puct,
                        aggregation=aggregation, threshold=threshold, positive_exit=positive_exit,
                        negative_exit=negative_exit, futility=futility, first_step_cutoff=first_step_cutoff,
                        max_depth=max_depth, parallel=parallel)
    step_limit(step_tokens, 0)  # a bad schedule fails before any generation
    t0 = time.perf_counter()
    tree = MCTSTree(config, delimiter=delimiter, answer_pattern=answer_pattern)
    s += question + delimiter
    run = _Runtime(s, question, prm, tree, search_group or new_group(), step_tokens, sampling_temperature,
                   seed, answer_pattern, t0, control)
    watch = getattr(control, "watch", None)
    if watch is not None:   # the control wakes the search when its degree may have changed
        watch(run.waiter.wake)
    try:
        run.loop(lambda: control.degree(tree) if control is not None else parallel)
    finally:
        run.finish()
    made_at = run.made_at
    trajectories = [_trajectory(tree, n, made_at[n.id]) for n in tree.finished()]
    best = tree.best()
    answer = tree.answer(best) if best is not None else None
    if not trajectories and best is not None:
        trajectories = [_trajectory(tree, best, made_at[best.id])]
    answers = {"prm_best": answer, "majority": vote([t.answer for t in trajectories]),
               "prm_weighted": vote([t.answer for t in trajectories], [t.score for t in trajectories])}
    return SearchResult(answer, answers, trajectories, run.tokens, time.perf_counter() - t0,
                        seconds_generating=run.seconds_generating, seconds_verifying=run.seconds_verifying,
                        prm_requests=run.prm_requests, exit_reason=tree.exit.reason if tree.exit else None,
                        tree=tree, requests_aborted=run.aborted)


def _trajectory(tree: MCTSTree, node: Node, seconds: float) -> Trajectory:
    tokens, n = 0, node
    while n.parent is not None:
        tokens += n.tokens
        n = tree.nodes[n.parent]
    return Trajectory(node.path.scored, list(node.scores), node.path_score, tree.answer(node), tokens,
                      node.finished, seconds)


class _Runtime:
    """Launches, waits for and tells a tree's rollouts on SGLang forks."""

    def __init__(self, s, question: str, prm, tree: MCTSTree, group: str, step_tokens, temperature: float,
                 seed: int, answer_pattern: str, t0: float, control: RolloutControl | None = None):
        self.s, self.question, self.prm, self.tree, self.group = s, question, prm, tree, group
        self.step_tokens, self.temperature, self.seed = step_tokens, temperature, seed
        self.answer_pattern, self.t0, self.control = answer_pattern, t0, control
        self.inflight: dict[int, _Expansion] = {}
        self.waiter = Waiter()   # every fork's step end wakes the search
        self.discarded: list[_Expansion] = []
        self.made_at: dict[int, float] = {0: 0.0}
        self.tokens = 0
        self.aborted = 0
        self.prm_requests = 0
        self.seconds_generating = 0.0
        self.seconds_verifying = 0.0

    def loop(self, degree) -> None:
        """Launch up to ``degree()`` rollouts, tell the tree each expansion as it ends, until an exit.
        Between ends the search sleeps (no CPU): a fork's step ending, or the control
        (``RolloutControl.watch``), wakes it."""
        tree, waiter = self.tree, self.waiter
        while tree.exit is None:
            seen = waiter.seen()   # before looking: an end or a wake after this ends the wait below
            want = max(0, int(degree()))
            if len(self.inflight) > want:
                for r in tree.to_preempt(len(self.inflight) - want):
                    self.cancel(r)
            while len(self.inflight) < want:
                r = tree.launch()
                if r is None:
                    break
                self.expand(r)
            if not self.inflight and want > 0:   # nothing launchable and nothing running
                raise RuntimeError("MCTS runtime: no rollout in flight and none launchable, yet no exit")
            ended = [e for e in self.inflight.values() if e.ended()]
            if not ended:
                waited = time.perf_counter()
                waiter.wait(seen)   # degree 0: the job scheduler holds this search back until it wakes it
                if self.inflight:
                    self.seconds_generating += time.perf_counter() - waited
                ended = [e for e in self.inflight.values() if e.ended()]
                if not ended:       # woken by the control: read the degree again
                    continue
            for e in sorted(ended, key=lambda e: e.rollout.id):
                if tree.exit is not None:
                    break
                self.told(e)

    def expand(self, r: Rollout) -> None:
        """Sample the children of ``r``'s frontier: one fork per child, all in flight at once."""
        node = self.tree.frontier(r)
        name = f"step_r{r.id}_n{node.id}"
        forks = list(self.s.fork(self.tree.config.expansion_width))
        limit = step_limit(self.step_tokens, node.depth)
        # a boosted job's requests go in as such (the plugin serves that class first)
        cls = getattr(self.control, "request_class", None) or "normal"
        for j, f in enumerate(forks):
            self.waiter.watch(f)
            tag = SearchTag(self.group, node.depth, node.id, r.id, cls)
            if node.text:
                f += node.text
            f += sgl_tts.gen(name, max_tokens=limit, temperature=self.temperature, stop=self.tree.delimiter,
                             seed=derive_seed("mcts", self.seed, self.question, node.address, j),
                             custom_params=tag.custom_params(), rid=tag.request_id(str(j)))
        self.inflight[r.id] = _Expansion(r, node, forks, name)

    def told(self, e: _Expansion) -> None:
        del self.inflight[e.rollout.id]
        steps = [read_step(f, e.name, self.answer_pattern) for f in e.forks]
        for f in e.forks:
            f.stream_executor.end()
        self.tokens += sum(st.tokens for st in steps)
        grown = [self.tree.grow(e.node, st).scored for st in steps]
        verifying = time.perf_counter()
        todo = [i for i, g in enumerate(grown) if g]
        got = self.prm.score(self.question, [grown[i] for i in todo]) if todo else []
        self.prm_requests += len(todo)
        self.seconds_verifying += time.perf_counter() - verifying
        scores: list[Sequence[float]] = [[] for _ in grown]
        for i, sc in zip(todo, got):
            scores[i] = sc
        before = len(self.tree.nodes)
        self.tree.tell(e.rollout, [Sample(st, sc) for st, sc in zip(steps, scores)])
        now = time.perf_counter() - self.t0
        for nid in range(before, len(self.tree.nodes)):
            self.made_at[nid] = now
        if e.rollout.id in self.tree.rollouts and self.tree.exit is None:   # on to its best child
            self.expand(e.rollout)

    def cancel(self, r: Rollout) -> None:
        """Give a rollout up: the tree forgets it, its requests are aborted (sgl-tts servers)."""
        self.tree.cancel(r)
        e = self.inflight.pop(r.id, None)
        if e is None:
            return
        abort = getattr(self.s.stream_executor.backend, "abort_prefix", None)
        if abort is not None and not e.ended():
            try:
                abort(rid_prefix(self.group, e.node.depth, r.id))
            except Exception as exc:   # the requests then run to their end; nothing is lost but time
                logger.warning("sgl-tts: could not abort rollout %d of %s: %s", r.id, self.group, exc)
        for f in e.forks:
            f.stream_executor.end()
        self.discarded.append(e)

    def finish(self) -> None:
        """Cancel what is still in flight and count the tokens of every cancelled expansion."""
        for e in list(self.inflight.values()):
            self.cancel(e.rollout)
        for e in self.discarded:
            for f in e.forks:
                try:
                    st = read_step(f, e.name, self.answer_pattern)
                except Exception:   # a failed request: no tokens to count
                    continue
                self.tokens += st.tokens
                self.aborted += (st.finish_reason or {}).get("type") == "abort"
        self.discarded = []
