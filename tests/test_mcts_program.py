"""programs/mcts.py, the runtime that serves the MCTS tree through SGLang's frontend: on the scripted
doubles it samples exactly what a plain driver of the tree samples (prompts, position seeds, scores),
runs rollouts in parallel, cancels (and aborts) what is in flight at an exit or when its control
shrinks it; on the tiny models (LocalBackend) it runs end to end and is deterministic given its seed."""

from __future__ import annotations

import random

import pytest

from programs.mcts import mcts
from sgl_tts.mcts import MCTSConfig, MCTSTree, Sample
from sgl_tts.search import Step, derive_seed, is_final
from sgl_tts.testing import ScriptedBackend, ScriptedPRM, continuation

QUESTION = "What is 6 * 7?"
STEP_TOKENS = 20


def script(prefix: str, draw: int | None) -> str:
    """Steps of heavy-tailed length (some longer than STEP_TOKENS: cut and continued), answers from
    the third step on."""
    rng = random.Random(draw)
    depth = prefix.count("\n\n") - 1
    if depth >= 2 and rng.random() < 0.35:
        return f"so \\boxed{{{rng.choice([42, 41, 42])}}}"
    return f"s{rng.randrange(100)}" + "." * rng.choice([1, 4, 30]) + "\n\n"


def step_score(text: str) -> float:
    return (derive_seed("score", text) % 1000) / 1000


def reference_tree(config: MCTSConfig, seed: int = 0) -> MCTSTree:
    """A plain serial driver of the tree: each child j of a node at address a is the script's
    continuation of the prompt + the node's text under seed derive_seed("mcts", seed, question, a, j),
    cut at the step delimiter or STEP_TOKENS as SGLang cuts; each grown path scored step by step."""
    tree = MCTSTree(config)
    while tree.exit is None:
        r = tree.launch()
        assert r is not None
        while r.id in tree.rollouts:
            node = tree.frontier(r)
            samples = []
            for j in range(config.expansion_width):
                full = script(QUESTION + "\n\n" + node.text, derive_seed("mcts", seed, QUESTION, node.address, j))
                text, reason, tokens = continuation(full, ["\n\n"], STEP_TOKENS)
                st = Step(text.strip(), tokens, is_final(text, reason), reason, text)
                samples.append(Sample(st, [step_score(x) for x in tree.grow(node, st).scored]))
            tree.tell(r, samples)
            if tree.exit is not None:
                break
    return tree


def shape(tree: MCTSTree) -> list:
    return [(n.address, n.text, n.scores, n.visits, round(n.value, 9), n.finished) for n in tree.nodes]


CASES = {
    "budget": dict(num_rollouts=6, expansion_width=3, positive_exit=False, threshold=0.99),
    "accepted": dict(num_rollouts=30, expansion_width=3, threshold=0.6, aggregation="last"),
    "futile": dict(num_rollouts=30, expansion_width=2, threshold=0.7, negative_exit=True, aggregation="min"),
    "prod, step futility": dict(num_rollouts=30, expansion_width=2, threshold=0.35, negative_exit=True,
                                aggregation="prod", futility="step", positive_exit=False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_serial_program_samples_and_selects_what_a_plain_driver_does(case):
    opts = dict(CASES[case], max_depth=6)
    want = reference_tree(MCTSConfig(**opts))
    backend, prm = ScriptedBackend(script), ScriptedPRM(step_score)
    state = mcts.run(question=QUESTION, prm=prm, backend=backend, step_tokens=STEP_TOKENS, **opts)
    assert state.error() is None, state.error()
    res = state.ret_value
    assert shape(res.tree) == shape(want)
    assert res.exit_reason == want.exit.reason
    best = want.best()
    assert res.answer == want.answer(best)
    assert res.tokens_generated == sum(n.tokens for n in want.nodes)
    assert [t.steps for t in res.trajectories] == [n.path.scored for n in want.finished()] or \
        (not want.finished() and [t.steps for t in res.trajectories] == [best.path.scored])
    assert res.prm_requests == len(want.nodes) - 1
    # every request tagged with its place: tts/<group>/<depth>/<rollout>/<child>/...
    parts = [d.rid.split("/") for d in backend.draws]
    assert {(int(p[2]), p[4]) for p in parts} <= {(d, str(j)) for d in range(6) for j in range(3)}
    assert len(backend.draws) == len(want.nodes) - 1


def test_the_four_cases_cover_every_exit():
    reasons = {reference_tree(MCTSConfig(**CASES[c], max_depth=6)).exit.reason for c in CASES}
    assert reasons == {"budget", "accepted", "futile", "exhausted"}


def test_parallel_rollouts_spread_and_keep_the_samples_of_their_positions():
    opts = dict(num_rollouts=12, expansion_width=3, positive_exit=False, threshold=0.99, max_depth=6)
    backend = ScriptedBackend(script, seconds_per_token=0.002)
    res = mcts.run(question=QUESTION, prm=ScriptedPRM(step_score), backend=backend, step_tokens=STEP_TOKENS,
                   parallel=3, **opts).ret_value
    assert res.exit_reason == "budget" and len(res.tree.returned) == 12
    assert 3 < backend.peak <= 9                     # several rollouts' expansions at once, never more than 3
    serial = {n.address: (n.text, n.scores) for n in reference_tree(MCTSConfig(**opts)).nodes}
    common = [n for n in res.tree.nodes if n.address in serial]
    assert len(common) > 3 and all((n.text, n.scores) == serial[n.address] for n in common)
    assert all(n.in_flight == 0 and not n.expanding for n in res.tree.nodes)


def test_an_exit_cancels_and_aborts_the_rollouts_in_flight_and_counts_their_tokens():
    backend = ScriptedBackend(script, seconds_per_token=0.004)
    res = mcts.run(question=QUESTION, prm=ScriptedPRM(step_score), backend=backend, step_tokens=STEP_TOKENS,
                   parallel=4, num_rollouts=40, expansion_width=3, threshold=0.5, aggregation="last",
                   max_depth=6).ret_value
    assert res.exit_reason == "accepted"
    assert backend.running() == 0
    aborted = [d for d in backend.draws if d.finish_reason["type"] == "abort"]
    assert aborted and res.tree.cancelled and res.requests_aborted == len(aborted)
    # an aborted request answers with the tokens it had (one per character of its text here)
    told = sum(n.tokens for n in res.tree.nodes)
    assert res.tokens_generated >= told + sum(len(d.text) for d in aborted) > told


class ShrinkingControl:
    """Three rollouts at a time until two have returned, then one; records what the tree held."""

    def __init__(self):
        self.expected: set[int] | None = None
        self.after: list[int] = []

    def degree(self, tree: MCTSTree) -> int:
        if len(tree.returned) < 2:
            return 3
        if self.expected is None:
            self.expected = {r.id for r in tree.to_preempt(len(tree.rollouts) - 1)}
        else:
            self.after.append(len(tree.rollouts))
        return 1


def test_a_shrinking_control_cancels_the_lowest_reward_rollouts():
    backend = ScriptedBackend(script, seconds_per_token=0.003)
    control = ShrinkingControl()
    res = mcts.run(question=QUESTION, prm=ScriptedPRM(step_score), backend=backend, step_tokens=STEP_TOKENS,
                   num_rollouts=8, expansion_width=2, positive_exit=False, threshold=0.99, max_depth=6,
                   control=control).ret_value
    assert control.expected and control.after and max(control.after) <= 1
    assert control.expected <= {r.id for r in res.tree.cancelled}
    assert res.exit_reason == "budget" and len(res.tree.returned) == 8
    assert backend.running() == 0


def test_bad_arguments_fail_before_any_generation():
    backend = ScriptedBackend(script)
    for kwargs, message in (({"parallel": 0}, "parallel must be a positive integer"),
                            ({"negative_exit": True, "aggregation": "last"}, "negative early exit needs"),
                            ({"step_tokens": [0]}, "step_tokens must be positive")):
        with pytest.raises(ValueError, match=message):
            mcts.run(question=QUESTION, prm=ScriptedPRM(step_score), backend=backend, **kwargs)
    assert backend.draws == []
