"""The MCTS tree on its own (no server, no frontend): WU-PUCT arithmetic worked by hand, backpropagation,
the exits, the selective futility check and preemption order, against re-derivations from seed 004's
definitions."""

from __future__ import annotations

import math
import random

import pytest

from sgl_tts.mcts import MCTSConfig, MCTSTree, Sample
from sgl_tts.search import Step


def step(text: str) -> Step:
    """A whole step that ended on the delimiter (stop string)."""
    return Step(text, len(text), False, {"type": "stop", "matched": "\n\n"}, text)


def answer(text: str) -> Step:
    """A step that holds an answer; the model ended the text."""
    return Step(text, len(text) + 1, True, {"type": "stop", "matched": 0}, text)


def kids(tree, rollout, *children):
    """Tell ``rollout`` its children: (Step, the new step's score); earlier steps keep their scores."""
    base = list(tree.frontier(rollout).scores)
    tree.tell(rollout, [Sample(st, base + [score]) for st, score in children])


def by_text(tree, text):
    return next(n for n in tree.nodes if n.path.scored and n.path.scored[-1] == text)


def test_wu_puct_worked_by_hand():
    tree = MCTSTree(MCTSConfig(num_rollouts=10, expansion_width=3, c_puct=1.0, aggregation="min",
                               positive_exit=False, max_depth=5))
    r0 = tree.launch()
    assert r0.path == [0] and tree.root.expanding
    kids(tree, r0, (step("A"), 0.6), (step("B"), 0.8), (step("C"), 0.4))
    A, B, C = (by_text(tree, t) for t in "ABC")
    # simulation: r0 moved to B (highest step score) and expands it
    assert r0.path == [0, B.id] and B.expanding and (tree.root.in_flight, B.in_flight) == (1, 1)
    # r1: B is being expanded (not selectable); N(root)=0, O(root)=1: sqrt(1) = 1; P = 1/3
    assert tree.wu_puct(tree.root, A) == pytest.approx(0.6 + 1 / 3)
    assert tree.wu_puct(tree.root, C) == pytest.approx(0.4 + 1 / 3)
    r1 = tree.launch()
    assert r1.path == [0, A.id]
    # r0's expansion of B: its best child holds an answer: the rollout returns min(0.8, 0.5) = 0.5
    kids(tree, r0, (answer("B1 \\boxed{7}"), 0.5), (step("B2"), 0.3), (step("B3"), 0.2))
    B1 = by_text(tree, "B1 \\boxed{7}")
    assert r0.done and r0.reward == pytest.approx(0.5) and B1.finished and B1.terminal
    assert [(n.visits, n.value, n.in_flight) for n in (tree.root, B, B1)] == \
           [(1, pytest.approx(0.5), 1), (1, pytest.approx(0.5), 0), (1, pytest.approx(0.5), 0)]
    # r2: A is being expanded; Ñ(root) = 1 + 1 = 2. B: Q = W/N = 0.5, Ñ(B) = 1; C unvisited: Q = its score
    assert tree.wu_puct(tree.root, B) == pytest.approx(0.5 + (1 / 3) * math.sqrt(2) / 2)
    assert tree.wu_puct(tree.root, C) == pytest.approx(0.4 + (1 / 3) * math.sqrt(2) / 1)
    r2 = tree.launch()
    assert r2.path == [0, C.id]
    # r3: only B's subtree has a free leaf (B1 is terminal); inside B: Ñ(B) = 1, B2's Q = min(0.8, 0.3)
    B2, B3 = by_text(tree, "B2"), by_text(tree, "B3")
    assert tree.wu_puct(B, B2) == pytest.approx(0.3 + 1 / 3) and tree.wu_puct(B, B3) == pytest.approx(0.2 + 1 / 3)
    assert tree.launch().path == [0, B.id, B2.id]


def test_in_flight_rollouts_turn_the_choice_where_plain_puct_would_pile_on():
    """c_puct = 2: one rollout is inside A's subtree. WU-PUCT counts it (Ñ = N + O) and sends the next
    rollout to B; PUCT on N alone would have sent it to A again."""
    tree = MCTSTree(MCTSConfig(num_rollouts=10, expansion_width=2, c_puct=2.0, positive_exit=False))
    r0 = tree.launch()
    kids(tree, r0, (step("A"), 0.9), (step("B"), 0.1))
    kids(tree, r0, (answer("\\boxed{1}"), 0.95), (step("A2"), 0.2), )
    A, B = by_text(tree, "A"), by_text(tree, "B")
    assert r0.done and (A.visits, A.value) == (1, pytest.approx(0.9))   # min(0.9, 0.95)
    r1 = tree.launch()
    assert r1.path == [0, A.id, by_text(tree, "A2").id]
    # PUCT on N alone: A 0.9 + 2 * 1/2 * sqrt(1) / (1 + 1) = 1.4 > B 0.1 + 2 * 1/2 * sqrt(1) / 1 = 1.1
    assert tree.wu_puct(tree.root, A) == pytest.approx(0.9 + 2.0 * 0.5 * math.sqrt(2) / 3)
    assert tree.wu_puct(tree.root, B) == pytest.approx(0.1 + 2.0 * 0.5 * math.sqrt(2) / 1)
    assert tree.launch().path == [0, B.id]            # 1.514 > 1.371


def test_ties_go_to_the_earlier_child_and_no_free_leaf_means_wait():
    tree = MCTSTree(MCTSConfig(num_rollouts=10, expansion_width=2, positive_exit=False))
    r0 = tree.launch()
    assert tree.launch() is None                      # the root is being expanded: nothing free
    kids(tree, r0, (step("X"), 0.5), (step("Y"), 0.5))
    assert r0.path[-1] == by_text(tree, "X").id       # equal step scores: the first sample
    assert tree.launch().path == [0, by_text(tree, "Y").id]
    assert tree.launch() is None and tree.exit is None


def test_exits_accepted_budget_and_exhausted():
    # accepted: a finished child at the threshold, even one the rollout does not move to
    tree = MCTSTree(MCTSConfig(expansion_width=2, threshold=0.9))
    r = tree.launch()
    kids(tree, r, (step("open"), 0.99), (answer("\\boxed{3}"), 0.9))
    assert tree.exit.reason == "accepted" and tree.exit.node == by_text(tree, "\\boxed{3}").id
    assert tree.launch() is None
    # not with positive_exit off; a finished child below the threshold accepts nothing
    tree = MCTSTree(MCTSConfig(expansion_width=2, threshold=0.9, positive_exit=False, num_rollouts=2))
    r = tree.launch()
    kids(tree, r, (answer("\\boxed{1}"), 0.95), (step("open"), 0.3))
    assert r.done and r.reward == pytest.approx(0.95) and tree.exit is None
    assert tree.launch().path == [0, by_text(tree, "open").id]
    # budget: num_rollouts returned
    tree = MCTSTree(MCTSConfig(expansion_width=2, positive_exit=False, num_rollouts=2, max_depth=2))
    r = tree.launch()
    kids(tree, r, (step("a"), 0.4), (step("b"), 0.3))
    kids(tree, r, (step("a1"), 0.4), (step("a2"), 0.3))   # depth 2 = max_depth: terminal, r returns
    assert r.done and tree.exit is None
    r = tree.launch()
    kids(tree, r, (step("b1"), 0.4), (step("b2"), 0.3))
    assert tree.exit.reason == "budget" and tree.exit.rollouts == 2
    # exhausted: nothing left to expand and nothing in flight
    tree = MCTSTree(MCTSConfig(expansion_width=2, positive_exit=False, num_rollouts=5))
    kids(tree, tree.launch(), (answer("\\boxed{1}"), 0.5), (answer("\\boxed{2}"), 0.4))
    assert tree.exit.reason == "exhausted" and tree.exit.rollouts == 1


def test_budget_counts_rollouts_in_flight_and_a_cancel_frees_its_share():
    tree = MCTSTree(MCTSConfig(num_rollouts=2, expansion_width=2, positive_exit=False))
    r0 = tree.launch()
    kids(tree, r0, (step("a"), 0.5), (step("b"), 0.4))
    r1 = tree.launch()
    assert tree.budget_left() == 0 and tree.launch() is None
    tree.cancel(r1)
    assert r1.cancelled and tree.budget_left() == 1 and tree.cancelled == [r1]
    assert all(n.in_flight == (1 if n.id in r0.path else 0) for n in tree.nodes)
    assert not by_text(tree, "b").expanding
    with pytest.raises(ValueError, match="rollout 1 is not in flight"):
        kids(tree, r1, (step("c"), 0.5))


def test_preemption_cancels_the_lowest_cumulative_reward_first():
    tree = MCTSTree(MCTSConfig(num_rollouts=10, expansion_width=4, positive_exit=False))
    r0 = tree.launch()
    kids(tree, r0, (step("a"), 0.9), (step("b"), 0.2), (step("c"), 0.6), (step("d"), 0.2))
    r1, r2, r3 = tree.launch(), tree.launch(), tree.launch()
    at = {r.id: tree.nodes[r.path[-1]].path.scored[-1] for r in (r0, r1, r2, r3)}
    assert at == {0: "a", 1: "c", 2: "b", 3: "d"}     # WU-PUCT order: c (0.6) then b, d (ties: earlier)
    # lowest reward first (b and d at 0.2: the later launched, r3 at d, first), then c
    assert [r.id for r in tree.to_preempt(3)] == [3, 2, 1]
    assert tree.to_preempt(0) == []


def test_config_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="negative early exit needs aggregation 'min' or 'prod'"):
        MCTSConfig(aggregation="last", negative_exit=True)
    with pytest.raises(ValueError, match="under 'mean' a later step can raise"):
        MCTSConfig(aggregation="mean", negative_exit=True)
    with pytest.raises(ValueError, match="first_step_cutoff belongs to the negative early exit"):
        MCTSConfig(first_step_cutoff=0.3)
    with pytest.raises(ValueError, match="unknown futility 'leaf'"):
        MCTSConfig(futility="leaf")
    with pytest.raises(ValueError, match="num_rollouts must be >= 1"):
        MCTSConfig(num_rollouts=0)
    tree = MCTSTree(MCTSConfig(expansion_width=1))
    r = tree.launch()
    with pytest.raises(ValueError, match="sample 0: 2 scores for a path of 1 steps"):
        tree.tell(r, [Sample(step("x"), [0.5, 0.5])])


# ------------------------------------------------------------------------------ negative exit
def _bound(tree, leaf, how: str, futility: str) -> float:
    """Re-derived from seed 004 §3.4: the step scores along the leaf's path (one per node, root
    excluded), aggregated by min or by product; or the leaf's own step score."""
    own, n = [], leaf
    while n.parent is not None:
        own.append(n.scores[-1])
        n = tree.nodes[n.parent]
    own.reverse()
    if futility == "step":
        return own[-1]
    if how == "min":
        return min(own)
    product = 1.0
    for x in own:
        product *= x
    return product


def _first_step_score(tree, leaf) -> float:
    n = leaf
    while tree.nodes[n.parent].parent is not None:
        n = tree.nodes[n.parent]
    return n.scores[-1]


@pytest.mark.parametrize("how", ["min", "prod"])
@pytest.mark.parametrize("futility", ["path", "step"])
@pytest.mark.parametrize("cutoff", [None, 0.35, 0.8])
def test_negative_exit_fires_exactly_when_every_checked_leaf_is_futile(how, futility, cutoff):
    """Random trees grown by random rollouts (several in flight): after every tell, the tree has exited
    as futile if and only if every leaf outside the cut-off is below the threshold (a tree whose root
    is unexpanded never is). Positive exit is off, so nothing else can come first."""
    fired = kept_going = 0
    for trial in range(60):
        rng = random.Random(f"{how}-{futility}-{cutoff}-{trial}")
        thr = rng.choice([0.3, 0.5, 0.7])
        tree = MCTSTree(MCTSConfig(num_rollouts=500, expansion_width=rng.randint(1, 3), aggregation=how,
                                   threshold=thr, positive_exit=False, negative_exit=True, futility=futility,
                                   first_step_cutoff=cutoff, max_depth=rng.randint(2, 5)))
        flying = []
        for _ in range(40):
            while len(flying) < 3 and rng.random() < 0.6:
                r = tree.launch()
                if r is None:
                    break
                flying.append(r)
            if not flying:
                break
            r = flying.pop(rng.randrange(len(flying)))
            children = []
            for j in range(tree.config.expansion_width):
                score = rng.choice([rng.random(), rng.uniform(thr, 1.0), rng.uniform(0.0, thr)])
                children.append((answer(f"\\boxed{{{j}}}") if rng.random() < 0.2 else step(f"s{rng.random()}"), score))
            kids(tree, r, *children)
            if not r.done:
                flying.append(r)
            leaves = [n for n in tree.nodes if not n.children]
            checked = [n for n in leaves if n.parent is not None
                       and (cutoff is None or _first_step_score(tree, n) >= cutoff)]
            expected = not tree.root.leaf and all(_bound(tree, n, how, futility) < thr for n in checked)
            if expected:
                assert tree.exit is not None and tree.exit.reason == "futile", (trial, tree.exit)
                fired += 1
                break
            assert tree.exit is None or tree.exit.reason in ("budget", "exhausted"), (trial, tree.exit)
            if tree.exit is not None:
                break
            kept_going += 1
    assert fired > 5 and kept_going > 50   # both sides of the rule were exercised


def test_selective_check_leaves_out_low_first_steps_but_still_explores_them():
    """futility='step' (seed 004's rule): a leaf whose own step is above the threshold keeps the search
    going, unless its first step scored under the cut-off; such leaves are still selected."""
    cfg = dict(num_rollouts=20, expansion_width=2, aggregation="min", threshold=0.7, positive_exit=False,
               negative_exit=True, futility="step")
    for cutoff, exits in ((None, False), (0.3, True)):
        tree = MCTSTree(MCTSConfig(**cfg, first_step_cutoff=cutoff))
        r = tree.launch()
        kids(tree, r, (step("low start"), 0.2), (step("good"), 0.8))
        assert tree.frontier(r).path.scored[-1] == "good"
        r2 = tree.launch()
        assert tree.frontier(r2).path.scored[-1] == "low start"    # still explored
        kids(tree, r2, (step("recovers"), 0.95), (step("no"), 0.1))
        assert tree.exit is None                                    # "good" (0.8) is a viable leaf
        kids(tree, r, (step("g1"), 0.1), (step("g2"), 0.2))
        # leaves: recovers (its step 0.95, first step 0.2), no (0.1), g1 (0.1), g2 (0.2)
        assert (tree.exit is not None and tree.exit.reason == "futile") == exits


def test_a_leaf_at_the_threshold_is_viable_and_an_unexpanded_root_is_never_futile():
    for futility in ("path", "step"):
        tree = MCTSTree(MCTSConfig(expansion_width=2, threshold=0.5, positive_exit=False, negative_exit=True,
                                   futility=futility))
        r = tree.launch()
        tree.cancel(r)                       # the root is still a leaf: nothing is known yet
        assert tree.exit is None
        r = tree.launch()
        kids(tree, r, (step("at"), 0.5), (step("under"), 0.49))
        assert tree.exit is None             # "at" scored exactly the threshold: viable (futile is below)
        kids(tree, r, (step("x"), 0.1), (step("y"), 0.2))
        assert tree.exit.reason == "futile"  # "at" was expanded; every leaf is below now


def test_the_drawing_places_every_node_under_its_parent_and_names_the_exit():
    import matplotlib
    matplotlib.use("Agg")
    from sgl_tts.mcts.plot import draw_tree, layout

    tree = MCTSTree(MCTSConfig(expansion_width=2, threshold=0.9, aggregation="last"))
    r = tree.launch()
    kids(tree, r, (step("a"), 0.5), (step("b"), 0.4))
    kids(tree, r, (step("a1"), 0.2), (answer("\\boxed{1}"), 0.95))
    pos = layout(tree)
    a, b, a1, fin = (by_text(tree, t) for t in ("a", "b", "a1", "\\boxed{1}"))
    # leaves left to right in depth-first order; a parent over the middle of its children
    assert [pos[n.id] for n in (a1, fin, b)] == [(0.0, -2.0), (1.0, -2.0), (2.0, -1.0)]
    assert pos[a.id] == (0.5, -1.0) and pos[0] == (1.25, 0.0)
    ax = draw_tree(tree)
    assert "exit: accepted" in ax.get_title() and len(ax.collections[0].get_offsets()) == len(tree.nodes)
