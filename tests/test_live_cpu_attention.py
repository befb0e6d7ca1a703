"""``--tts-cpu-attention ragged`` in live SGLang servers: it is in place in the scheduler process,
and the generator and the step-tag PRM answer as SGLang's own ``torch_native`` attention does, for
fresh prompts and for the one- and few-token extends of cached prefixes that a search sends."""

from __future__ import annotations

import asyncio

import pytest

from sgl_tts.tiny import task
from sgl_tts.backends import SGLangEndpoint
from sgl_tts.prm import StepTagPRM
from sgl_tts.launch.server_api import flush_cache
from live_http import post_all

pytestmark = [pytest.mark.server, pytest.mark.live_servers("extra")]


def _greedy(url: str, texts: list[str], tokens: int) -> list[dict]:
    body = {"text": texts, "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0},
            "return_logprob": True}
    return asyncio.run(post_all(url, [body]))[0]


def _same_answers(a: list[dict], b: list[dict]) -> None:
    assert [r["text"] for r in a] == [r["text"] for r in b]
    for ra, rb in zip(a, b):
        pairs = list(zip(ra["meta_info"]["output_token_logprobs"], rb["meta_info"]["output_token_logprobs"]))
        assert [x[1] for x, _ in pairs] == [y[1] for _, y in pairs]
        assert max(abs(x[0] - y[0]) for x, y in pairs) < 1e-4


@pytest.fixture(scope="module")
def ragged(live):
    # the four this module asks for start at once (the first live module: none is running yet)
    live.warm("generator_ragged", "prm_ragged", "generator_stock", "prm")
    yield live
    live.stop("generator_ragged", "prm_ragged")   # two more CPU servers: free their memory


def test_the_ragged_backend_is_in_place_in_both_schedulers(ragged):
    for name in ("generator_ragged", "prm_ragged"):
        ragged.url(name)
        assert "sgl-tts: ragged CPU attention in place of torch_native" in ragged.log_text(name), name
    ragged.url("generator_stock")
    assert "ragged CPU attention" not in ragged.log_text("generator_stock")


def test_the_generator_answers_as_torch_native_for_prompts_and_cached_extends(ragged):
    new, stock = ragged.url("generator_ragged"), ragged.url("generator_stock")
    questions = [p.question + "\n\n" for p in task.test_split()[:16]]
    for url in (new, stock):
        flush_cache(url)
    first_new, first_stock = _greedy(new, questions, 48), _greedy(stock, questions, 48)
    _same_answers(first_new, first_stock)
    # a search's next requests: the cached prompt + output + a delimiter (a one- or few-token extend),
    # and a longer continuation of part of it (a several-token extend after a cached prefix)
    steps = [q + r["text"] + "\n" for q, r in zip(questions, first_stock)]
    partial = [q + r["text"][: len(r["text"]) // 2] + " and" for q, r in zip(questions, first_stock)]
    for texts in (steps, partial):
        got, want = _greedy(new, texts, 24), _greedy(stock, texts, 24)
        assert sum(r["meta_info"]["cached_tokens"] for r in got) > 0   # extends of cached prefixes
        _same_answers(got, want)


def test_the_step_tag_prm_scores_as_torch_native(ragged):
    new = StepTagPRM(SGLangEndpoint(ragged.url("prm_ragged")), cache=False)
    stock = StepTagPRM(SGLangEndpoint(ragged.url("prm")), cache=False)
    for p in task.test_split()[:4]:
        steps = p.solution().split("\n\n")
        batch = [steps, steps[:2], steps[:1] + ["x = 1"]]
        for _ in range(2):   # the second time from the radix cache: extends of cached prefixes
            got, want = new.score(p.question, batch), stock.score(p.question, batch)
            for g, w in zip(got, want):
                assert len(g) == len(w) and max(abs(a - b) for a, b in zip(g, w)) < 1e-4, (g, w)
