"""DeepConf on the live CPU generator server (the plugin, seeded sampling): SGLang's own top
log-probabilities reach the program, a run repeats itself given its seed, the CPU backend's
confidences agree with the server's on the same text, and a run leaves nothing running or waiting
on the server (its dropped samples' chunks aborted)."""

from __future__ import annotations

import pytest

from programs.deepconf import deepconf
from sgl_tts.backends import SGLangEndpoint
from sgl_tts.launch.live_servers import settled_loads
from sgl_tts.tiny import task

pytestmark = pytest.mark.server

SETTINGS = dict(num_samples=8, mode="online", warmup=2, keep_fraction=0.5, consensus=0.8, chunk_tokens=16,
                window=8, top_logprobs=5, seed=5)


def shape(res):
    return (res.answers, res.exit_reason, [(t.text, round(t.score, 3), t.tokens) for t in res.trajectories])


def test_online_deepconf_on_the_live_server_repeats_itself_and_leaves_nothing_running(live):
    url = live.url("generator")
    gen = SGLangEndpoint(url)
    questions = [p.question for p in task.test_split()[20:24]]
    first = [deepconf.run(question=q, backend=gen, search_group=f"live-dc-{i}", **SETTINGS).ret_value
             for i, q in enumerate(questions)]
    for res in first:
        # the server's top-5 log-probabilities: every finished sample has a positive confidence
        assert res.trajectories and all(t.score > 0 and t.tokens > 0 for t in res.trajectories)
        assert res.exit_reason in ("consensus", "budget")
        assert len(res.trajectories) + res.traces_stopped == 8
        assert res.tokens_generated >= sum(t.tokens for t in res.trajectories)
    ld = settled_loads(url)
    assert (ld["num_running_reqs"], ld["num_waiting_reqs"]) == (0, 0)
    # seeded sampling: the same samples, confidences, stops and answers again
    again = [deepconf.run(question=q, backend=gen, **SETTINGS).ret_value for q in questions]
    assert [shape(r) for r in again] == [shape(r) for r in first]
