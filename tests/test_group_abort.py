"""Group abort without a server: SGLang 0.5.15's real ``TokenizerManager`` with the plugin's hook sends
one ``AbortReq`` with the group's prefix, and SGLang's real ``Scheduler.abort_request`` turns that one
message into every request of the group aborted, each answered under its own rid, and nothing else.
(The live test at scale is tests/test_live_group_abort.py.)"""

from __future__ import annotations

import asyncio
import pickle

import pytest
from sglang.srt.plugins import load_plugins

load_plugins()  # as launch_server does: the plugin's hook on TokenizerManager.abort_request is applied

from sgl_tts.plugin.scheduling.abort import MODE_ENV, group_prefix, is_group_prefix  # noqa: E402


def test_group_prefixes():
    assert group_prefix("g1") == "tts/g1/"
    assert is_group_prefix("tts/g1/") and is_group_prefix("tts/g1/3/")
    assert not is_group_prefix("tts/g1/0/0") and not is_group_prefix("g1/") and not is_group_prefix("")
    with pytest.raises(ValueError, match="non-empty id without '/'"):
        group_prefix("a/b")
    with pytest.raises(ValueError):
        group_prefix("")


@pytest.fixture()
def tokenizer_manager():
    """SGLang's real TokenizerManager (CPU, the shipped generator) and a PULL socket where its
    scheduler would read."""
    import zmq
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.server_args import PortArgs, ServerArgs

    from sgl_tts.models import shipped_model

    sa = ServerArgs(model_path=str(shipped_model("generator")), device="cpu")
    pa = PortArgs.init_new(sa)
    tm = TokenizerManager(sa, pa)
    ctx = zmq.Context()
    sched = ctx.socket(zmq.PULL)
    sched.connect(pa.scheduler_input_ipc_name)
    sched.setsockopt(zmq.RCVTIMEO, 2000)
    yield tm, sched
    sched.close(0)
    ctx.term()
    # the tokenizer manager's own sockets: closed now, with no linger, or a later garbage
    # collection of its context blocks in zmq_term on them
    tm_ctx = tm.send_to_scheduler.context
    for sock in (tm.send_to_scheduler, tm.recv_from_detokenizer):
        sock.close(linger=0)
    tm_ctx.term()


def _received(sched) -> list:
    import zmq
    from sglang.srt.managers.io_struct import sock_recv

    out = []
    while True:
        try:
            out.append(sock_recv(sched))
        except zmq.Again:
            return out


def _abort(tm, *rids):
    async def in_the_server_loop():   # the tokenizer manager's sockets live in its event loop
        for rid in rids:
            tm.abort_request(rid)
        await asyncio.sleep(0.2)
    asyncio.run(in_the_server_loop())


def test_a_group_abort_is_one_abort_req_whatever_the_group_size(tokenizer_manager, monkeypatch):
    tm, sched = tokenizer_manager
    monkeypatch.delenv(MODE_ENV, raising=False)
    for rid in [f"tts/g1/0/{i}" for i in range(2000)] + ["tts/g10/0/0"]:
        tm.rid_to_state[rid] = object()   # only the keys matter to abort_request
    _abort(tm, group_prefix("g1"))
    assert [(m.rid, m.abort_all) for m in _received(sched)] == [("tts/g1/", False)]
    # a deeper prefix (one depth of a group) goes as it is too
    _abort(tm, "tts/g1/0/")
    assert [m.rid for m in _received(sched)] == ["tts/g1/0/"]
    # the abort leaves the tokenizer-side states to the scheduler's answer for each request
    assert len(tm.rid_to_state) == 2001


def test_other_aborts_behave_as_stock(tokenizer_manager, monkeypatch):
    """Around a group abort: a group with no live request sends nothing, a plain live rid is
    SGLang's own abort, an unknown rid is dropped (stock), ``g1`` does not reach ``g10``."""
    tm, sched = tokenizer_manager
    monkeypatch.delenv(MODE_ENV, raising=False)
    for rid in ["tts/g1/0/0/a", "tts/g1/1/3/b", "tts/g10/0/0/c", "plain-request"]:
        tm.rid_to_state[rid] = object()
    _abort(tm, group_prefix("g1"))
    got = _received(sched)
    assert [(m.rid, m.abort_all) for m in got] == [("tts/g1/", False)]
    _abort(tm, "tts/g2/", "plain-request", "unknown")
    assert [m.rid for m in _received(sched)] == ["plain-request"]


def test_the_per_request_path_is_kept_for_benchmarks(tokenizer_manager, monkeypatch):
    tm, sched = tokenizer_manager
    monkeypatch.setenv(MODE_ENV, "per-request")
    for rid in ["tts/g1/0/0/a", "tts/g1/1/3/b", "tts/g10/0/0/c", "plain-request"]:
        tm.rid_to_state[rid] = object()
    _abort(tm, group_prefix("g1"))
    assert sorted(m.rid for m in _received(sched)) == ["tts/g1/0/0/a", "tts/g1/1/3/b"]


@pytest.mark.parametrize("path", ["one", "per-request"])
def test_the_scheduler_aborts_exactly_the_group_and_answers_each_request(path):
    """SGLang's real ``Scheduler.abort_request`` on a scheduler's queues: one ``AbortReq("tts/g1/")``
    pops every waiting request of g1 and answers each under its own rid, marks g1's running requests
    to finish with abort at their next step, and leaves g10 and untagged requests alone; the old
    path (one AbortReq per request) ends the same."""
    from sglang.srt.managers.io_struct import AbortReq
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.scheduler import Scheduler

    from sgl_tts.bench.group_abort import _Req, _scheduler_stub

    g1 = [f"tts/g1/0/{i}" for i in range(300)]
    g10 = [f"tts/g10/0/{i}" for i in range(300)]
    reqs = {rid: _Req(rid) for rid in g1 + g10 + ["plain"]}
    # interleaved, as searches' requests arrive; the first 20 of each group running
    running = [reqs[r] for r in g1[:20] + g10[:20]]
    waiting = [reqs[r] for pair in zip(g1[20:], g10[20:]) for r in pair] + [reqs["plain"]]
    sent: list = []
    stub = _scheduler_stub(waiting, running, sent)
    msgs = [AbortReq(rid=group_prefix("g1"))] if path == "one" else [AbortReq(rid=r) for r in g1]
    for m in msgs:
        Scheduler.abort_request(stub, m)

    answers = [pickle.loads(b) for b in sent]
    assert sorted(a.rid for a in answers) == sorted(g1[20:])   # one answer per waiting request
    assert all(isinstance(a, AbortReq) and not a.abort_all for a in answers)
    assert [r.rid for r in stub.waiting_queue] == g10[20:] + ["plain"]
    assert all(isinstance(reqs[r].to_finish, FINISH_ABORT) for r in g1[:20])
    assert all(reqs[r].to_finish is None for r in g10 + ["plain"])
