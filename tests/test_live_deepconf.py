"""DeepConf on the live CPU generator server (the plugin, seeded sampling): SGLang's own top
log-probabilities reach the program, a run repeats itself given its seed, the CPU backend's token
confidences agree with the server's on the same tokens (within 1e-4), and a run leaves nothing running
or waiting on the server (its dropped samples' chunks aborted). The stop inside generation (``ConfidenceStop``,
SGLang's custom logit processor, ``--enable-custom-logit-processor``) ends a sample on the server
exactly where the definition says, and an online run with it repeats itself too."""

from __future__ import annotations

import pytest
import sglang as sgl
import torch

import sgl_tts
from programs.deepconf import deepconf
from sgl_tts.backends import LocalBackend, SGLangEndpoint
from sgl_tts.backends.semantics import LogprobSpec, SamplingSpec
from sgl_tts.confidence import TOLERANCE, ConfidenceStop, stop_rule, stop_token
from sgl_tts.launch.live_servers import settled_loads
from sgl_tts.models import shipped_model
from sgl_tts.tiny import task

pytestmark = pytest.mark.server

SETTINGS = dict(num_samples=8, deepconf_mode="online", warmup_samples=2, keep_fraction=0.5, consensus=0.8,
                chunk_tokens=16, confidence_window=8, confidence_top_k=5, seed=5)


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


@sgl.function
def _one(s, question, rule):
    s += question + "\n\n"
    s += sgl_tts.gen("x", max_tokens=80, temperature=0.8, seed=3, return_logprob=True, top_logprobs_num=5,
                     custom_params=rule, custom_logit_processor=ConfidenceStop.to_str() if rule else None)


def _confidences(state):
    return [-sum(e[0] for e in top) / len(top) for top in state.get_meta_info("x")["output_top_logprobs"]]


def test_the_stop_inside_generation_ends_a_sample_on_the_server_where_the_definition_says(live):
    url = live.url("generator")
    gen = SGLangEndpoint(url)
    question = task.test_split()[30].question
    plain = _one.run(question=question, rule=None, backend=gen)
    conf = _confidences(plain)
    window = 6
    # the threshold between the plain sample's lowest and highest window: it stops somewhere inside
    groups = [sum(conf[t - window:t]) / window for t in range(window, len(conf) + 1)]
    threshold = (min(groups) + max(groups)) / 2
    t = stop_token(conf, window, threshold)
    assert t is not None and t < len(conf) - 1
    stopped = _one.run(question=question, rule=stop_rule(threshold, window, 5, 0.8), backend=gen)
    meta = stopped.get_meta_info("x")
    # seeded sampling: the same tokens up to t, then the forced end of sequence as token t + 1
    assert meta["completion_tokens"] == t + 1 and meta["finish_reason"]["type"] == "stop"
    assert plain["x"].startswith(stopped["x"]) and len(stopped["x"]) < len(plain["x"])
    assert _confidences(stopped)[:t] == pytest.approx(conf[:t], abs=1e-4)
    last = meta["output_top_logprobs"][-1]
    assert last[0][:2] == [0.0, meta["finish_reason"]["matched"]]
    assert {v for v, _, _ in last[1:]} == {torch.finfo(torch.float32).min}
    ld = settled_loads(url)
    assert (ld["num_running_reqs"], ld["num_waiting_reqs"]) == (0, 0)


def test_the_cpu_backend_gives_the_servers_confidences_on_the_same_tokens(live):
    """A sample drawn on the server as DeepConf asks for it (temperature 0.8, top-5), then its exact
    tokens fed to the CPU backend on the shipped generator: before each token, one token is generated
    from the prompt and the tokens so far at the same temperature and k, and that position's top-5 is
    what DeepConf reads there. Both run the model in float32 (different kernels): the token
    confidences agree within DeepConf's own TOLERANCE (1e-4, below which it counts confidences as
    tied), so the two backends stop and vote alike (measured: 8e-6 at most over 80 tokens
    of confidences 3 to 15)."""
    gen = SGLangEndpoint(live.url("generator"))
    question = task.test_split()[31].question
    state = _one.run(question=question, rule=None, backend=gen)
    meta, served = state.get_meta_info("x"), _confidences(state)
    tokens = [t for _, t, _ in meta["output_token_logprobs"]]
    local = LocalBackend(str(shipped_model("generator")))
    try:
        prompt = local.encode(question + "\n\n")
        assert len(prompt) == meta["prompt_tokens"] and len(tokens) == len(served) >= 20
        asks = [local.engine.submit(prompt + tokens[:t], SamplingSpec(max_new_tokens=1, temperature=0.8),
                                    LogprobSpec(return_logprob=True, top_logprobs_num=5)) for t in range(len(tokens))]
        tops = [a.result(timeout=120).meta_info["output_top_logprobs"][0] for a in asks]
    finally:
        local.shutdown()
    cpu = [-sum(e[0] for e in top) / len(top) for top in tops]
    assert all(len(top) == 5 for top in tops)
    assert cpu == pytest.approx(served, abs=TOLERANCE)


def test_online_deepconf_with_the_stop_inside_generation_repeats_itself_on_the_live_server(live):
    url = live.url("generator")
    gen = SGLangEndpoint(url)
    settings = dict(SETTINGS, chunk_tokens=0, keep_fraction=0.9)
    questions = [p.question for p in task.test_split()[24:27]]
    runs = [[deepconf.run(question=q, backend=gen, **settings).ret_value for q in questions] for _ in range(2)]
    for res in runs[0]:
        assert res.trajectories and len(res.trajectories) + res.traces_stopped == 8
    assert [shape(r) for r in runs[1]] == [shape(r) for r in runs[0]]
    assert [r.tokens_generated for r in runs[1]] == [r.tokens_generated for r in runs[0]] or \
        any(r.exit_reason == "consensus" for r in runs[0])   # dropped samples' tokens depend on timing
    ld = settled_loads(url)
    assert (ld["num_running_reqs"], ld["num_waiting_reqs"]) == (0, 0)


def test_a_server_without_custom_logit_processors_is_named_with_the_way_out(live):
    gen = SGLangEndpoint(live.url("generator_stock"))
    with pytest.raises(RuntimeError, match=r"start it with --enable-custom-logit-processor \(sgl-tts serve: --enable-deepconf-stop; .*"
                       r"loopback host\), or set chunk_tokens"):
        # 8 tokens: no warm-up sample has an answer, so the vote is not settled and the rest are sampled
        deepconf.run(question=task.test_split()[0].question, backend=gen,
                     **dict(SETTINGS, chunk_tokens=0, max_tokens=8)).ret_value
    assert deepconf.run(question=task.test_split()[0].question, backend=gen, **SETTINGS).ret_value.trajectories
