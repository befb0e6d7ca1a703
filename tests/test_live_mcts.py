"""MCTS on the live CPU servers (generator with the plugin and seeded sampling, the step-tag PRM
server): seed-deterministic when serial, and rollouts it cancels leave no request on the generator."""

from __future__ import annotations

import time

import pytest

from programs.mcts import mcts
from sgl_tts.tiny import task
from sgl_tts.backends import SGLangEndpoint
from sgl_tts.launch.live_servers import loads, settled_loads
from sgl_tts.prm import StepTagPRM

pytestmark = pytest.mark.server


def shape(tree):
    return [(n.address, n.text, [round(x, 4) for x in n.scores], n.visits) for n in tree.nodes]


def test_serial_mcts_on_the_live_servers_repeats_itself_given_its_seed(live):
    gen = SGLangEndpoint(live.url("generator"))
    prm = StepTagPRM(SGLangEndpoint(live.url("prm")), cache=False)
    q = task.test_split()[7].question
    opts = dict(num_rollouts=4, expansion_width=3, max_depth=6, aggregation="min", threshold=0.95,
                negative_exit=True, seed=3)
    first = mcts.run(question=q, prm=prm, backend=gen, **opts).ret_value
    second = mcts.run(question=q, prm=prm, backend=gen, **opts).ret_value
    assert len(first.tree.nodes) > 3 and first.exit_reason in ("accepted", "futile", "budget", "exhausted")
    assert shape(first.tree) == shape(second.tree)
    assert (first.answer, first.exit_reason, first.tokens_generated) == \
           (second.answer, second.exit_reason, second.tokens_generated)


class HoldBack:
    """Four rollouts until four are in flight, then none (every rollout cancelled) until the generator
    has nothing of the search left, then four again until the budget is spent."""

    def __init__(self, url: str):
        self.url, self.phase, self.emptied_in = url, "fill", None

    def degree(self, tree) -> int:
        if self.phase == "fill":
            if len(tree.rollouts) >= 4:
                self.phase, self.t0 = "hold", time.monotonic()
                return 0
            return 4
        if self.phase == "hold":
            ld = loads(self.url)
            if ld["num_running_reqs"] == 0 and ld["num_waiting_reqs"] == 0:
                self.phase, self.emptied_in = "finish", time.monotonic() - self.t0
                return 4
            if time.monotonic() - self.t0 > 60:
                raise AssertionError(f"cancelled rollouts still on the generator after 60 s: {ld}")
            return 0
        return 4


def test_cancelled_rollouts_leave_no_request_on_the_generator(live):
    url = live.url("generator")
    gen = SGLangEndpoint(url)
    prm = StepTagPRM(SGLangEndpoint(live.url("prm")))
    control = HoldBack(url)
    res = mcts.run(question=task.test_split()[9].question, prm=prm, backend=gen, num_rollouts=8,
                   expansion_width=3, max_depth=6, positive_exit=False, step_tokens=64, control=control,
                   search_group="live-mcts-hold").ret_value
    assert control.emptied_in is not None and len(res.tree.cancelled) >= 4
    assert res.requests_aborted > 0              # some were still generating when cancelled: aborted
    assert res.exit_reason in ("budget", "exhausted")
    ld = settled_loads(url)
    assert (ld["num_running_reqs"], ld["num_waiting_reqs"]) == (0, 0)
