"""The sgl-tts scheduler plugin inside live SGLang servers: attached in the scheduler process, its order
raises the prefix-cache share, a group abort empties the server, set_class reaches the scheduler, and
with its flags off the server answers byte for byte as stock SGLang."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import pytest

from programs.beam_search import beam_search
from sgl_tts.tiny import task
from sgl_tts.backends import SGLangEndpoint
from sgl_tts.launch.live_servers import loads, settled_loads
from sgl_tts.launch.server_api import flush_cache
from sgl_tts.protocol import SearchTag
from live_http import post_all as _post_all

pytestmark = pytest.mark.server


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def metrics_since(live, name: str, start: int) -> list[dict]:
    """The metrics records ``name``'s scheduler wrote after the first ``start`` ones (the plugin
    flushes about every second)."""
    time.sleep(1.5)
    return live.metrics_records(name)[start:]


def test_policy_attaches_in_the_scheduler_process(live):
    for name, policy in (("generator", "prefix-aware"), ("generator_off", "off")):
        live.url(name)
        starts = [r for r in live.metrics_records(name) if r["event"] == "start"]
        assert len(starts) == 1, starts
        rec = starts[0]
        assert rec["policy"] == policy and rec["seeded_sampling"] is True and rec["dedup_tokens"] == 32
        # written by SGLang's scheduler process itself (not the launcher that parsed the flags)
        comm = Path(f"/proc/{rec['pid']}/comm").read_text().strip()
        assert comm.startswith("sglang::schedul"), comm


def _workload(backend, prm, tag: str) -> list:
    problems = task.test_split()[10:16]
    states = beam_search.run_batch(
        [{"question": p.question, "prm": prm, "num_beams": 16, "beam_width": 4, "max_depth": 12,
          "search_group": f"{tag}-{i}"} for i, p in enumerate(problems)],
        backend=backend, num_threads=len(problems))
    for st in states:
        assert st.error() is None, st.error()
    return [st.ret_value for st in states]


def _share(records: list[dict], tag: str) -> tuple[int, int]:
    cached = computed = 0
    for rec in records:
        if rec["event"] != "prefill":
            continue
        for req in rec["requests"]:
            if req["rid"].startswith(f"tts/{tag}-"):
                cached += req["cached"]
                computed += req["computed"]
    return cached, computed


def test_prefix_aware_order_raises_the_cached_share_and_keeps_the_same_beams(live, local_prm):
    results, shares = {}, {}
    for name, tag in (("generator_off", "share-off"), ("generator", "share-on")):
        backend = SGLangEndpoint(live.url(name))
        flush_cache(live.url(name))   # both start empty: what earlier tests left cached is no one's gain
        start = len(live.metrics_records(name))
        results[name] = _workload(backend, local_prm, tag)
        cached, computed = _share(metrics_since(live, name, start), tag)
        assert cached + computed > 0
        shares[name] = cached / (cached + computed)
    # the same seeds on both servers (--tts-seeded-sampling): the same samples, so the order policy
    # must not change a single kept beam
    for off, on in zip(results["generator_off"], results["generator"]):
        assert [(t.steps, t.step_scores, t.answer) for t in on.trajectories] == \
               [(t.steps, t.step_scores, t.answer) for t in off.trajectories]
        assert on.answer == off.answer
    assert shares["generator"] > shares["generator_off"], shares


def _tagged_bodies(group: str, n: int, tokens: int) -> list[dict]:
    q = task.test_split()[0].question + "\n\n"
    bodies = []
    for i in range(n):
        tag = SearchTag(group=group, depth=0, parent=-1, beam=i)
        bodies.append({"text": q, "rid": tag.rid(), "sampling_params": {
            "max_new_tokens": tokens, "ignore_eos": True, "temperature": 0.0,
            "custom_params": tag.custom_params()}})
    return bodies


def test_group_abort_of_1000_live_requests_empties_the_server(live):
    url = live.url("generator")
    endpoint = SGLangEndpoint(url)
    bodies = _tagged_bodies("abort1000", 1000, 400)
    results: list = []

    async def scenario():
        task_ = asyncio.ensure_future(_post_all(url, bodies))
        # every request has reached the scheduler (running or queued) before the abort
        await asyncio.get_running_loop().run_in_executor(None, lambda: wait_for(
            lambda: (lambda ld: ld["num_running_reqs"] + ld["num_waiting_reqs"] >= 1000)(loads(url)),
            300, "1000 live requests"))
        assert loads(url)["num_running_reqs"] > 0
        await asyncio.get_running_loop().run_in_executor(None, endpoint.abort_group, "abort1000")
        results.extend(await task_)

    asyncio.run(scenario())
    assert len(results) == 1000
    reasons = [r["meta_info"]["finish_reason"]["type"] for r in results]
    assert reasons.count("abort") == 1000, {k: reasons.count(k) for k in set(reasons)}
    # read back from the server: nothing running or waiting, no KV held by a request
    final = wait_for(lambda: (lambda ld: ld if ld["num_running_reqs"] == 0 and ld["num_waiting_reqs"] == 0
                                         and ld["num_used_tokens"] == 0 else None)(loads(url)),
                     60, "an empty server")
    assert final["queues"]["waiting"] == 0 and final["queues"]["retracted"] == 0


def test_set_class_reaches_the_scheduler(live):
    """Through the control plane alone (no generation backend, no frontend interpreter) and through
    the backend that delegates to it; a server without the plugin is named as such."""
    from sgl_tts.backends.connection import ServerConnection
    from sgl_tts.backends.control import ServerControl

    url = live.url("generator")
    endpoint = ServerControl(ServerConnection(url))
    bodies = _tagged_bodies("boost", 12, 300)
    got: dict = {}

    async def scenario():
        task_ = asyncio.ensure_future(_post_all(url, bodies))
        await asyncio.get_running_loop().run_in_executor(None, lambda: wait_for(
            lambda: (lambda ld: ld["num_running_reqs"] + ld["num_waiting_reqs"] >= 12)(loads(url)),
            120, "12 live requests"))
        got["all"] = await asyncio.get_running_loop().run_in_executor(
            None, lambda: endpoint.set_class("boost", "boosted"))
        got["some"] = await asyncio.get_running_loop().run_in_executor(
            None, lambda: endpoint.set_class("boost", "speculative", beams=[0, 5, 7]))
        got["none"] = await asyncio.get_running_loop().run_in_executor(
            None, lambda: endpoint.set_class("no-such-group", "boosted"))
        endpoint.abort_group("boost")
        await task_

    asyncio.run(scenario())
    # the scheduler answers with how many of its requests it re-classed
    assert got == {"all": 12, "some": 3, "none": 0}
    with pytest.raises(ValueError, match="unknown request class 'gold'"):
        SGLangEndpoint(url).set_class("boost", "gold")
    stock = live.url("generator_stock")
    with pytest.raises(RuntimeError, match=f"^{stock} answered False to tts_set_class: is the sgl-tts plugin loaded "
                                           "there \\(SGLANG_PLUGINS\\)\\?$"):
        ServerControl(ServerConnection(stock)).set_class("boost", "boosted")


def test_plugin_loaded_with_flags_off_answers_byte_for_byte_as_stock(live):
    off, stock = live.url("generator_off"), live.url("generator_stock")
    q = [p.question + "\n\n" for p in task.test_split()[:16]]
    body = {"text": q, "sampling_params": {"max_new_tokens": 120, "temperature": 0.0},
            "return_logprob": True}
    # tagged like a search's requests, too: the plugin must ignore the tags when off
    tagged = dict(body, sampling_params=dict(body["sampling_params"],
                                             custom_params=SearchTag("g", 0, -1, 0).custom_params()))
    for payload in (body, tagged):
        # the same cache state on both (earlier tests used them differently): the same computation
        for url in (off, stock):
            flush_cache(url)
        a = asyncio.run(_post_all(off, [payload]))[0]
        b = asyncio.run(_post_all(stock, [payload]))[0]
        assert [r["text"] for r in a] == [r["text"] for r in b]
        assert [[t[1] for t in r["meta_info"]["output_token_logprobs"]] for r in a] == \
               [[t[1] for t in r["meta_info"]["output_token_logprobs"]] for r in b]
        # the same numbers too (not to the bit: SGLang's CPU prefill of the same batch may differ
        # in the last float bits between two processes)
        for ra, rb in zip(a, b):
            pairs = zip(ra["meta_info"]["output_token_logprobs"], rb["meta_info"]["output_token_logprobs"])
            assert max(abs(x[0] - y[0]) for x, y in pairs) < 1e-5


def test_speculative_requests_run_on_when_arrivals_fit(live):
    """Issue 16 item 6 on the live scheduler: untagged requests and a /health_generate probe arrive
    while speculative requests run, and there is room for all of them: no speculative request is
    stopped (each generates its whole max_new_tokens; the old rule stopped them at the first
    arrival), and the arrivals are answered."""
    url = live.url("generator")
    q = task.test_split()[1].question + "\n\n"
    spec = []
    for i in range(4):
        tag = SearchTag(group="spec-fit", depth=1, parent=0, beam=i, cls="speculative")
        spec.append({"text": q, "rid": tag.rid(), "sampling_params": {
            "max_new_tokens": 160, "ignore_eos": True, "temperature": 0.0, "custom_params": tag.custom_params()}})
    plain = [{"text": p.question + "\n\n", "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
             for p in task.test_split()[20:26]]
    out: dict = {}

    async def scenario():
        running = asyncio.ensure_future(_post_all(url, spec))
        await asyncio.get_running_loop().run_in_executor(None, lambda: wait_for(
            lambda: loads(url)["num_running_reqs"] >= 4, 120, "4 running speculative requests"))
        out["plain"] = await _post_all(url, plain)
        out["probe"] = await asyncio.get_running_loop().run_in_executor(
            None, lambda: urllib.request.urlopen(url + "/health_generate", timeout=120).status)
        out["spec"] = await running

    asyncio.run(scenario())
    assert out["probe"] == 200 and all(r["meta_info"]["completion_tokens"] == 8 for r in out["plain"])
    assert [r["meta_info"]["completion_tokens"] for r in out["spec"]] == [160] * 4
    assert [r["meta_info"]["finish_reason"] for r in out["spec"]] == [{"type": "length", "length": 160}] * 4


def test_exact_speculation_on_the_live_servers_keeps_every_beam_and_leaves_nothing_running(live, local_prm):
    """Speculative beam extension (exact mode, LookAhead, overlapped verification) on the live
    generator with the plugin: speculative requests reach its scheduler as such (tagged with their
    parent), every kept trajectory is the plain search's (seeded sampling: the same samples), and
    once the search returns nothing of it is left running or waiting (pruned branches aborted)."""
    from sgl_tts.search.speculation import Speculation

    url = live.url("generator")
    backend = SGLangEndpoint(url)
    problems = task.test_split()[30:33]
    start = len(live.metrics_records("generator"))
    got = {}
    for name, opts in (("plain", {}), ("spec", {"speculative": Speculation(), "overlap_verification": True})):
        states = beam_search.run_batch(
            [{"question": p.question, "prm": local_prm, "num_beams": 8, "beam_width": 2, "max_depth": 10,
              "search_group": f"live-{name}-{i}", **opts} for i, p in enumerate(problems)],
            backend=backend, num_threads=len(problems))
        assert all(st.error() is None for st in states), [st.error() for st in states]
        got[name] = [st.ret_value for st in states]
        if name == "spec":
            ld = settled_loads(url)
            assert (ld["num_running_reqs"], ld["num_waiting_reqs"]) == (0, 0), ld
    for plain, spec in zip(got["plain"], got["spec"]):
        assert [(t.steps, t.step_scores, t.answer) for t in spec.trajectories] == \
               [(t.steps, t.step_scores, t.answer) for t in plain.trajectories]
        assert plain.tokens_generated == spec.tokens_normal + spec.tokens_reused
    assert sum(r.tokens_reused for r in got["spec"]) > 0
    rids = [req["rid"] for rec in metrics_since(live, "generator", start) if rec["event"] == "prefill"
            for req in rec["requests"]]
    assert any(r.startswith("tts/live-spec-") and "/spec" in r for r in rids)


def test_a_request_made_before_its_groups_abort_is_answered_aborted_and_never_reaches_the_server(live):
    """A search can abort a request its interpreter thread has queued but not sent (a branch pruned at
    selection moments after it started): the server's abort finds nothing then. SGLangEndpoint answers
    such a request as aborted itself; one made after the abort (a rerun of the group) is served."""
    import sglang as sgl

    import sgl_tts

    @sgl.function
    def one_step(s, step):
        s += task.test_split()[4].question + "\n\n"
        s += step

    url = live.url("generator")
    backend = SGLangEndpoint(url)
    start = len(live.metrics_records("generator"))
    early = sgl_tts.gen("x", max_tokens=8, rid="tts/queued-abort/1/spec0/0/early")
    backend.abort_group("queued-abort")
    late = sgl_tts.gen("x", max_tokens=8, rid="tts/queued-abort/1/spec0/0/late")
    got = [one_step.run(step=step, backend=backend) for step in (early, late)]
    assert [(st["x"], st.get_meta_info("x")["finish_reason"]["type"]) for st in got][0] == ("", "abort")
    assert got[1].get_meta_info("x")["finish_reason"]["type"] == "length" and got[1]["x"]
    prefilled = {req["rid"] for rec in metrics_since(live, "generator", start) if rec["event"] == "prefill"
                 for req in rec["requests"]}
    assert "tts/queued-abort/1/spec0/0/late" in prefilled and "tts/queued-abort/1/spec0/0/early" not in prefilled


@pytest.mark.parametrize("occupant", ["speculative", "normal"])
def test_a_normal_request_arriving_at_a_full_server_preempts_speculative_work_only(live, occupant):
    """Two-phase scheduling on the live scheduler (issue 18): four long requests fill the server's
    four slots; a normal request then arrives. Speculative occupants are stopped at their next step
    (``length``, every token they generated kept) and the arrival is admitted at once; normal
    occupants are never stopped, so the arrival waits for one of them to finish."""
    url = live.url("generator_4slots")
    # (400 new tokens: the tiny generator's context is 512)
    q = task.test_split()[2].question + "\n\n"
    long_ = []
    for i in range(4):
        tag = SearchTag(group=f"full-{occupant}", depth=1, parent=0, beam=i, cls=occupant)
        long_.append({"text": q, "rid": tag.rid(), "sampling_params": {
            "max_new_tokens": 400, "ignore_eos": True, "temperature": 0.0, "custom_params": tag.custom_params()}})
    late = {"text": task.test_split()[40].question + "\n\n",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}}
    out: dict = {}

    async def scenario():
        running = asyncio.ensure_future(_post_all(url, long_))
        await asyncio.get_running_loop().run_in_executor(None, lambda: wait_for(
            lambda: loads(url)["num_running_reqs"] >= 4, 120, "4 running requests"))
        out["late"] = (await _post_all(url, [late]))[0]
        out["occupants_at_late"] = await asyncio.get_running_loop().run_in_executor(
            None, lambda: loads(url)["num_running_reqs"])
        out["long"] = await running

    asyncio.run(scenario())
    assert out["late"]["meta_info"]["completion_tokens"] == 8
    tokens = [r["meta_info"]["completion_tokens"] for r in out["long"]]
    reasons = [r["meta_info"]["finish_reason"] for r in out["long"]]
    if occupant == "speculative":
        # stopped early, as cut steps a program can continue: length, with what they generated
        assert all(0 < t < 400 for t in tokens), tokens
        assert reasons == [{"type": "length", "length": t} for t in tokens]
    else:
        # nobody stopped: the arrival waited until an occupant finished its 400 tokens
        assert tokens == [400] * 4 and reasons == [{"type": "length", "length": 400}] * 4
        assert out["occupants_at_late"] <= 3
