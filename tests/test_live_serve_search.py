"""``sgl-tts serve-search`` on the live CPU servers, driven by the official ``openai`` client: answers
equal the program run directly, every supported field does what it says, streaming, bad requests,
disconnects that leave nothing on the generator, and 100 concurrent clients."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
import urllib.request

import httpx
import openai
import pytest

from programs.beam_search import beam_search
from sgl_tts.tiny import task
from sgl_tts.backends import SGLangEndpoint
from sgl_tts.launch.live_servers import loads
from sgl_tts.serving.api import parse_request
from sgl_tts.serving.server import BackgroundSearchServer
from sgl_tts.serving.service import SearchService

pytestmark = pytest.mark.server

QUESTION = task.test_split()[3].question


def ask(content: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": content}]


class Served(BackgroundSearchServer):
    """serve-search over the given generator and PRM, in a thread, with an openai client."""

    def __init__(self, generator_url: str, prm_url: str, max_concurrent: int = 8):
        super().__init__(SearchService(generator_url, prm_url, max_concurrent=max_concurrent))
        self.client = super().client()


@pytest.fixture(scope="module")
def served(live):
    s = Served(live.url("generator"), live.url("prm"))
    yield s
    s.stop()


def test_models_and_health(served):
    assert [m.id for m in served.client.models.list()] == ["beam_search", "dvts", "best_of_n",
                                                           "self_consistency", "mcts", "particle_filtering", "deepconf"]
    with urllib.request.urlopen(served.url + "/health", timeout=30) as res:
        assert json.loads(res.read())["status"] == "ok"


def test_the_answer_is_the_programs_own_run_with_the_same_seed(served, live):
    body = {"budget": 8, "beam_width": 2, "max_depth": 12, "step_tokens": 48}
    got = served.client.chat.completions.create(model="beam_search", messages=ask(), seed=11, temperature=0.8,
                                                extra_body=body)
    # the same program run directly, its settings from the same request
    cfg = parse_request({"model": "beam_search", "messages": ask(), "seed": 11, "temperature": 0.8, **body}).config
    direct = beam_search.run(backend=SGLangEndpoint(live.url("generator")),
                             **cfg.program_arguments(QUESTION, served.service.prm)).ret_value
    best = max((t for t in direct.trajectories if t.answer == direct.answer), key=lambda t: t.score)
    report = got.model_extra["sgl_tts"]
    assert got.choices[0].message.content == best.text
    assert got.choices[0].finish_reason == "stop" and got.choices[0].message.role == "assistant"
    assert report["answer"] == direct.answer and report["answers"] == direct.answers
    assert got.usage.completion_tokens == report["tokens_generated"] == direct.tokens_generated
    assert got.usage.prompt_tokens == len(SGLangEndpoint(live.url("generator")).encode(QUESTION + "\n\n"))
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    assert report["tokens_kept"] == direct.tokens_kept and report["trajectories"] == len(direct.trajectories)
    assert (report["program"], report["budget"], report["beam_width"], report["seed"]) == ("beam_search", 8, 2, 11)
    assert report["scores"] == [round(best.score, 6)] and report["latency_s"] > 0
    assert got.model == "beam_search" and got.object == "chat.completion" and got.id.startswith("chatcmpl-")


def test_every_supported_field_does_what_it_says(served):
    c = served.client
    # n: choices, distinct trajectories, the pick first; max_tokens limits each best-of-N sample
    r = c.chat.completions.create(model="best_of_n:8", messages=ask(), n=2, seed=2, max_tokens=12)
    assert len(r.choices) == 2 and len({ch.message.content for ch in r.choices}) == 2
    assert [ch.index for ch in r.choices] == [0, 1]
    assert all(ch.finish_reason == "length" for ch in r.choices)        # 12 tokens end no solution
    assert r.usage.completion_tokens == 8 * 12
    # max_completion_tokens is the same limit
    r2 = c.chat.completions.create(model="best_of_n:8", messages=ask(), seed=2, max_completion_tokens=12)
    assert r2.choices[0].message.content == r.choices[0].message.content
    # temperature 0: every sample is the greedy one, so one distinct choice whatever n asks
    r = c.chat.completions.create(model="best_of_n:4", messages=ask(), n=4, temperature=0)
    assert len(r.choices) == 1 and r.usage.completion_tokens % 4 == 0
    # seed: the same seed repeats the search, another one samples differently
    a = c.chat.completions.create(model="best_of_n:4", messages=ask(), n=4, seed=5)
    b = c.chat.completions.create(model="best_of_n:4", messages=ask(), n=4, seed=5)
    d = c.chat.completions.create(model="best_of_n:4", messages=ask(), n=4, seed=6)
    assert [x.message.content for x in a.choices] == [x.message.content for x in b.choices]
    assert {x.message.content for x in a.choices} != {x.message.content for x in d.choices}
    # self_consistency (no PRM), dvts and mcts with their settings; the report says what ran
    r = c.chat.completions.create(model="self_consistency:4", messages=ask(), seed=1)
    assert r.model_extra["sgl_tts"]["program"] == "self_consistency" and r.choices[0].message.content
    r = c.chat.completions.create(model="dvts:4x2", messages=ask(), seed=1, extra_body={"max_depth": 12})
    assert (r.model_extra["sgl_tts"]["program"], r.model_extra["sgl_tts"]["budget"]) == ("dvts", 4)
    r = c.chat.completions.create(model="mcts:6x2", messages=ask(), seed=1, extra_body={
        "aggregation": "min", "threshold": 0.5, "max_depth": 12})
    assert r.model_extra["sgl_tts"]["exit_reason"] == "accepted"   # every clean step scores ~0.96 > 0.5
    # user and metadata are accepted and ignored
    c.chat.completions.create(model="best_of_n:2", messages=ask(), user="someone", metadata={"k": "v"}, max_tokens=4)


def test_streaming_sends_progress_then_the_answer_of_the_same_search(served):
    kwargs = dict(model="beam_search:8x2", messages=ask(), seed=4, extra_body={"max_depth": 12})
    whole = served.client.chat.completions.create(**kwargs)
    events = list(served.client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                        **kwargs))
    assert events[0].choices[0].delta.role == "assistant"
    progress = [e.model_extra["sgl_tts"] for e in events if not e.choices and e.usage is None]
    assert progress and all(p["event"] == "progress" for p in progress)
    assert [p["tokens"] for p in progress] == sorted(p["tokens"] for p in progress)
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == whole.choices[0].message.content
    done = [e for e in events if e.choices and e.choices[0].finish_reason]
    assert len(done) == 1 and done[0].choices[0].finish_reason == "stop"
    assert done[0].model_extra["sgl_tts"]["answer"] == whole.model_extra["sgl_tts"]["answer"]
    assert events[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert progress[-1]["tokens"] <= whole.usage.completion_tokens
    assert len({e.id for e in events}) == 1


def test_bad_requests_get_error_objects_and_the_server_keeps_serving(served):
    c = served.client
    cases = [
        (openai.NotFoundError, dict(model="not_a_program", messages=ask()), "unknown model 'not_a_program'"),
        (openai.BadRequestError, dict(model="beam_search", messages=ask(), extra_body={"budget": 0}),
         "'budget' must be at least 1, got 0"),
        (openai.BadRequestError, dict(model="beam_search", messages=ask(), n=0), "'n' must be at least 1, got 0"),
        (openai.BadRequestError, dict(model="beam_search", messages=[]), "'messages' must be a non-empty list"),
        (openai.BadRequestError, dict(model="beam_search", messages=ask(), extra_body={"budget": 10_000}),
         "'budget' = 10000 is over this server's limit of 64"),
    ]
    for cls, kwargs, words in cases:
        with pytest.raises(cls) as info:
            c.chat.completions.create(**kwargs)
        err = info.value.body
        assert words in err["message"] and err["type"] == "invalid_request_error", err
    # a body missing 'messages' altogether, and one that is not JSON
    r = httpx.post(served.url + "/v1/chat/completions", json={"model": "beam_search"}, timeout=30)
    assert r.status_code == 400 and "non-empty list" in r.json()["error"]["message"]
    r = httpx.post(served.url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body is not valid JSON"
    ok = c.chat.completions.create(model="best_of_n:2", messages=ask(), max_tokens=8)
    assert ok.usage.completion_tokens == 16


def wait_empty(url: str, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        ld = loads(url)
        if ld["num_running_reqs"] == 0 and ld["num_waiting_reqs"] == 0:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError(f"the generator still has requests after {timeout} s: {loads(url)}")


LONG = {"model": "beam_search:32x4", "messages": ask(), "seed": 1, "step_tokens": 256, "max_depth": 40,
        "temperature": 2.0}   # wild samples at T=2: long steps, many of them


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_mid_search_leaves_nothing_of_it_on_the_generator(served, live, stream):
    gen_url = live.url("generator")
    wait_empty(gen_url, 60)
    served_before = served.service.served
    body = dict(LONG, stream=stream)
    with httpx.Client(timeout=httpx.Timeout(600, read=600)) as h:
        if stream:
            with h.stream("POST", served.url + "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if '"progress"' in line:
                        break                   # mid-search: the first step is back; now hang up
        else:
            try:   # give up waiting once the search is under way
                h.post(served.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(600, read=1.5))
                pytest.fail("the long search answered within 1.5 s; the test needs a longer one")
            except httpx.ReadTimeout:
                pass
            assert served.service.running, "the search was not running when the client hung up"
    emptied = wait_empty(gen_url, 30)
    deadline = time.monotonic() + 30
    while served.service.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not served.service.running and served.service.served == served_before   # cancelled, not finished
    assert emptied < 10
    time.sleep(0.5)    # nothing of it comes back later either
    ld = loads(gen_url)
    assert ld["num_running_reqs"] == 0 and ld["num_waiting_reqs"] == 0


def test_a_hundred_concurrent_clients_each_get_their_own_answer_once(served):
    problems = task.test_split()[:100]

    def one(i: int):
        r = served.client.chat.completions.create(model="best_of_n:2", messages=ask(problems[i].question),
                                                  seed=1000 + i, n=2, max_tokens=64)
        return i, r

    with cf.ThreadPoolExecutor(100) as pool:
        results = list(pool.map(one, range(100)))
    assert len(results) == 100
    assert len({r.id for _, r in results}) == 100
    assert len({r.model_extra["sgl_tts"]["search_group"] for _, r in results}) == 100
    for i, r in results:
        assert r.model_extra["sgl_tts"]["seed"] == 1000 + i     # its own search, not another client's
        assert r.choices and r.choices[0].message.content
    # the same request again, alone, gives the same answer (no cross-talk under load)
    for i in (0, 57, 99):
        _, again = one(i)
        assert [c.message.content for c in again.choices] == [c.message.content for c in results[i][1].choices]
    assert served.service.served >= 100 and not served.service.running and served.service.waiting == 0
