"""Scale-out on SGLang's own router (sglang-router) with two live CPU generator replicas: a search's
requests stay on one replica (read from the replicas' own scheduler metrics), round-robin routing
spreads them and caches less, group aborts and class changes reach every replica, and serve-search
runs through the router unchanged."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import time

import httpx
import pytest

from live_groups import ServerGroups
from programs.beam_search import beam_search
from sgl_tts.tiny import task
from sgl_tts.backends import SGLangEndpoint
from sgl_tts.launch.live_servers import in_flight, loads, settled_loads
from sgl_tts.launch.server_api import flush_cache
from sgl_tts.prm import StepTagPRM
from sgl_tts.serving.server import BackgroundSearchServer
from sgl_tts.serving.service import SearchService
from sgl_tts.protocol import SearchTag

pytestmark = [pytest.mark.server, pytest.mark.live_servers("own-but-prm")]

REPLICAS = ("rep0", "rep1")
LONG = {"model": "beam_search:32x4", "messages": [{"role": "user", "content": task.test_split()[3].question}],
        "seed": 1, "step_tokens": 256, "max_depth": 40, "temperature": 2.0}   # long wild steps


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, live):
    """Two generator replicas (plugin, metrics, seeded sampling) and a router in front of them, and
    two one-slot generators; the PRM is the session's, whose other servers are stopped to make room
    (about 2 GB each). The replicas and the one-slot pair start at the same time (two at once)."""
    from sgl_tts.launch.live_servers import LiveServer
    from sgl_tts.models import shipped_model

    gen = str(shipped_model("generator"))
    spec = LiveServer(gen, policy="prefix-aware", metrics=True, kv_bytes=64 << 20, seeded_sampling=True)
    # one request slot each: requests wait in the queue, where a class change always finds them
    one_slot = LiveServer(gen, policy="prefix-aware", kv_bytes=64 << 20, extra=("--max-running-requests", "1"))
    live.stop(*(set(live.running()) - {"prm"}))
    servers = ServerGroups({"replicas": {name: spec for name in REPLICAS},
                            "slots": {"slot0": one_slot, "slot1": one_slot}}, tmp_path_factory.mktemp("fleet"))
    try:
        with cf.ThreadPoolExecutor(1) as pool:   # the session's PRM too, if it is not running
            prm = pool.submit(live.url, "prm")
            servers.start()
            servers.prm_url = prm.result()
        yield servers
    finally:
        servers.stop_all()


def placement(servers) -> dict[str, collections.Counter]:
    """search group -> replica -> how many of its requests (rid ``tts/<group>/...``) it prefilled."""
    time.sleep(1.5)   # the plugin flushes its metrics at least every second
    where: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name in REPLICAS:
        for rec in servers.metrics_records(name):
            for req in rec.get("requests", []) if rec.get("event") == "prefill" else []:
                rid = req["rid"]
                if rid.startswith("tts/"):
                    where[rid.split("/")[1]][name] += 1
    return where


def home(counts: collections.Counter) -> str:
    """The replica that prefilled most of a search's requests."""
    return counts.most_common(1)[0][0]


def run_searches(router: str, prm_url: str, tag: str, problems: list[int]) -> dict[str, object]:
    """Beam search on each of ``problems`` (test-split indices), four at a time, through ``router``;
    search group ``<tag><index>``."""
    prm = StepTagPRM(SGLangEndpoint(prm_url), cache=False)
    split = task.test_split()

    def one(i):
        return f"{tag}{i}", beam_search.run(backend=SGLangEndpoint(router), question=split[i].question, prm=prm,
                                            num_beams=4, beam_width=2, max_depth=10, step_tokens=48, seed=i,
                                            search_group=f"{tag}{i}").ret_value

    with cf.ThreadPoolExecutor(4) as pool:
        return dict(pool.map(one, problems))


def test_cache_aware_routing_keeps_each_search_on_one_replica_and_uses_both(fleet):
    router = fleet.start_router("router", REPLICAS, "cache_aware")
    flush_cache(router)
    # sglang-router 0.3.2, cache_aware: a request whose text shares over --cache-threshold (0.3) of
    # itself with what a replica was sent goes there; any other goes to the replica with the fewest
    # requests in flight. So: a long request with problem 0's prompt keeps one replica busy; problem
    # 3's search (its prompt shares only "Compute ((", 0.19 of it) goes to the other one, problem 0's
    # to the busy one, where its prompt is. A search's later requests share most of their text with
    # its earlier ones and stay with them; the other four searches run at once, wherever they land.
    split = task.test_split()
    blocker = SearchTag("blocker", 0, -1, 0)
    with cf.ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.post, router + "/generate", timeout=300, json={
            "text": split[0].question + "\n\n", "rid": blocker.request_id(),
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 1.0}})
        deadline = time.monotonic() + 60
        while not any(in_flight(fleet.url(n)) for n in REPLICAS):
            assert time.monotonic() < deadline and not held.done()
            time.sleep(0.05)
        busy = {n for n in REPLICAS if in_flight(fleet.url(n))}
        aware = run_searches(router, fleet.prm_url, "aware", [3])
        aware |= run_searches(router, fleet.prm_url, "aware", [0])
        SGLangEndpoint(router).abort_group("blocker")
        held.result()
    aware |= run_searches(router, fleet.prm_url, "aware", [1, 2, 4, 5])
    where = placement(fleet)
    # each search stays home: at least 90% of its requests on one replica (round robin, below, puts
    # about half on each). Not always all: in one CI run (2026-11-26) sglang-router 0.3.2 sent part
    # of aware3 to the busy replica, which holds none of its text; not reproduced in 9 runs of this
    # sequence here, with the CPU loaded or not. A likely cause is a race in the router: cache_aware
    # matches a request against its text tree and inserts the text afterwards, outside one lock, so
    # concurrent requests can see a half-inserted tree and fall back to the smaller replica
    assert all(where[g][home(where[g])] >= 0.9 * sum(where[g].values()) for g in aware), where
    assert home(where["aware0"]) in busy and home(where["aware3"]) not in busy, (busy, where)
    # the same search through the router and on one replica directly: the same samples
    prm = StepTagPRM(SGLangEndpoint(fleet.prm_url), cache=False)
    direct = beam_search.run(backend=SGLangEndpoint(fleet.url("rep0")), question=task.test_split()[5].question,
                             prm=prm, num_beams=4, beam_width=2, max_depth=10, step_tokens=48, seed=5).ret_value
    assert [t.text for t in direct.trajectories] == [t.text for t in aware["aware5"].trajectories]

    # round robin: the same searches spread over both replicas (what that costs in prefix-cache hits is
    # measured in docs/benchmarks/LOG.md, "Scale-out"; on this short-prompt task it is small)
    router = fleet.start_router("router", REPLICAS, "round_robin")
    flush_cache(router)
    # (four: one round of run_searches's four at a time)
    rr = run_searches(router, fleet.prm_url, "rr", list(range(4)))
    where = placement(fleet)
    assert all(len(where[g]) == 2 for g in rr), where
    assert [rr[f"rr{i}"].answer for i in range(4)] == [aware[f"aware{i}"].answer for i in range(4)]   # routing changes no sample


def test_group_abort_and_class_change_through_the_router_reach_every_replica(fleet):
    slots = ("slot0", "slot1")
    router = fleet.start_router("router_slots", slots, "round_robin")
    try:
        endpoint = SGLangEndpoint(router)
        assert sorted(endpoint.workers()) == sorted(fleet.url(n) for n in slots)
        assert SGLangEndpoint(fleet.url("slot0")).workers() == [fleet.url("slot0")]

        def long(base: str, group: str, i: int):
            tag = SearchTag(group, 0, -1, i)
            body = {"text": "Compute ((1+2)*3)-4.\n\n", "rid": tag.request_id(),
                    "sampling_params": {"max_new_tokens": 400, "temperature": 2.0, "ignore_eos": True,
                                        "custom_params": tag.custom_params()}}
            return httpx.post(base + "/generate", json=body, timeout=300).json()["meta_info"]

        def three_each(pool, group: str, via_router: bool):
            """Three requests on each replica: one running, two waiting (one request slot each)."""
            futs = [pool.submit(long, router if via_router else fleet.url(slots[i % 2]), group, i) for i in range(6)]
            deadline = time.monotonic() + 60
            while min(loads(fleet.url(n))["num_waiting_reqs"] for n in slots) < 2:
                assert time.monotonic() < deadline, [loads(fleet.url(n)) for n in slots]
                time.sleep(0.02)
            return futs

        with cf.ThreadPoolExecutor(6) as pool:
            # sent to the replicas directly and sent through the router (which forwards the rid but
            # drops sampling_params.custom_params: the plugin reads the tag from the rid): either way
            # a class change through the router re-classes the two waiting on each replica (four or
            # more: both replicas got it), and the group abort reaches every request on both
            for group, via_router in (("spread", False), ("routed", True)):
                futs = three_each(pool, group, via_router)
                assert endpoint.set_class(group, "boosted") >= 4, group
                endpoint.abort_group(group)
                assert all(f.result()["finish_reason"]["type"] == "abort" for f in futs)
                # none of the group is left on either replica: counted by each scheduler itself (a
                # class change finds every waiting and running request of the group), then in the
                # published load snapshot, which may trail the last answer by a scheduler round
                assert [SGLangEndpoint(fleet.url(n)).set_class(group, "normal") for n in slots] == [0, 0]
                settled = [settled_loads(fleet.url(n)) for n in slots]
                assert [(ld["num_running_reqs"], ld["num_waiting_reqs"]) for ld in settled] == [(0, 0)] * 2, settled
    finally:
        fleet.kill("router_slots")
        for n in slots:
            fleet.kill(n)


def test_serve_search_through_the_router_answers_as_one_server_does_and_aborts_on_disconnect(fleet):
    router = fleet.start_router("router", REPLICAS, "cache_aware")
    served = BackgroundSearchServer(SearchService(router, fleet.prm_url))
    try:
        body = {"budget": 8, "beam_width": 2, "max_depth": 12, "step_tokens": 48}
        via_router = served.client().chat.completions.create(model="beam_search", messages=[
            {"role": "user", "content": task.test_split()[9].question}], seed=3, extra_body=body)
        alone = BackgroundSearchServer(SearchService(fleet.url("rep1"), fleet.prm_url))
        try:
            one = alone.client().chat.completions.create(model="beam_search", messages=[
                {"role": "user", "content": task.test_split()[9].question}], seed=3, extra_body=body)
        finally:
            alone.stop()
        assert via_router.choices[0].message.content == one.choices[0].message.content
        assert via_router.usage.completion_tokens == one.usage.completion_tokens
        # a disconnect mid-search: nothing of it is left on either replica
        with httpx.Client(timeout=600) as h:
            with h.stream("POST", served.url + "/v1/chat/completions", json=dict(LONG, stream=True)) as r:
                for line in r.iter_lines():
                    if '"progress"' in line:
                        break
        deadline = time.monotonic() + 15
        while (served.service.running or any(in_flight(fleet.url(n)) for n in REPLICAS)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not served.service.running and [in_flight(fleet.url(n)) for n in REPLICAS] == [0, 0]
    finally:
        served.stop()
