"""Generation semantics on a live SGLang server vs LocalBackend: the same programs, the same answers.

The live generator runs in float32 (the ``live`` fixture), so greedy text must be identical and
logprobs equal to 1e-3; stop strings, ``max_new_tokens`` and EOS end a completion the same way; a
``sampling_seed`` reproduces a sample.
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import sglang as sgl

import sgl_tts
from sgl_tts.tiny import task
from sgl_tts.backends import LocalBackend, SGLangEndpoint
from sgl_tts.models import shipped_model

pytestmark = pytest.mark.server

EOS_ID = 281   # the tiny models' <|endoftext|> (config.json eos_token_id)


@pytest.fixture(scope="module")
def local():
    be = LocalBackend(str(shipped_model("generator")))
    yield be
    be.shutdown()


@pytest.fixture(scope="module")
def remote(live):
    return SGLangEndpoint(live.url("generator_stock"))


@sgl.function
def complete(s, question, limit, stop_at, past_eos):
    # (argument names must not be SglFunction.run's own keywords: max_tokens, stop, ignore_eos, ...)
    s += question + "\n\n"
    s += sgl.gen("out", max_tokens=limit, stop=stop_at, temperature=0, return_logprob=True,
                 ignore_eos=past_eos)


def _run(backend, question, max_tokens=200, stop=(), ignore_eos=False):
    state = complete.run(question=question, limit=max_tokens, stop_at=list(stop), past_eos=ignore_eos,
                         backend=backend)
    assert state.error() is None, state.error()
    meta = state.get_meta_info("out")
    return state["out"], meta


def _run_all(backend, questions, max_tokens=200):
    """:func:`_run` of every question at once (the backend batches them), in order."""
    states = complete.run_batch([{"question": q, "limit": max_tokens, "stop_at": [], "past_eos": False}
                                 for q in questions], backend=backend, num_threads=len(questions))
    for st in states:
        assert st.error() is None, st.error()
    return [(st["out"], st.get_meta_info("out")) for st in states]


def _logprobs(meta):
    return [(float(lp), int(tok)) for lp, tok, *_ in meta["output_token_logprobs"]]


def test_greedy_text_logprobs_and_eos_match_local(local, remote):
    problems = task.test_split()[:12]
    # all twelve at once on each side: a batch computes each row as it would alone (to 1e-3)
    questions = [p.question for p in problems]
    right = 0
    answers = zip(problems, _run_all(local, questions), _run_all(remote, questions))
    for p, (text_l, meta_l), (text_r, meta_r) in answers:
        assert text_r == text_l, p.question
        # a whole solution ends at the end-of-sequence token, on both
        assert meta_r["finish_reason"] == meta_l["finish_reason"] == {"type": "stop", "matched": EOS_ID}
        lp_l, lp_r = _logprobs(meta_l), _logprobs(meta_r)
        assert [t for _, t in lp_r] == [t for _, t in lp_l]
        assert max(abs(a - b) for (a, _), (b, _) in zip(lp_l, lp_r)) < 1e-3
        assert meta_r["completion_tokens"] == meta_l["completion_tokens"] == len(lp_l)
        right += task.grade(p, text_r).answer_ok
    assert right >= 8


def test_stop_string_and_max_new_tokens_match_local(local, remote):
    q = task.test_split()[3].question
    text_l, meta_l = _run(local, q, max_tokens=64, stop=["\n\n"])
    text_r, meta_r = _run(remote, q, max_tokens=64, stop=["\n\n"])
    assert text_r == text_l and text_r.startswith("Step 1:") and "\n\n" not in text_r
    assert meta_r["finish_reason"] == meta_l["finish_reason"] == {"type": "stop", "matched": "\n\n"}
    text_l, meta_l = _run(local, q, max_tokens=5, ignore_eos=True)
    text_r, meta_r = _run(remote, q, max_tokens=5, ignore_eos=True)
    assert text_r == text_l
    assert meta_r["finish_reason"]["type"] == meta_l["finish_reason"]["type"] == "length"
    assert meta_r["completion_tokens"] == meta_l["completion_tokens"] == 5


@sgl.function
def seeded(s, question, seeds):
    s += question + "\n\n"
    forks = s.fork(len(seeds))
    for f, seed in zip(forks, seeds):
        f += sgl_tts.gen("out", max_tokens=60, stop="\n\n", temperature=1.0, seed=seed)
    s["outs"] = [f["out"] for f in forks]


def _samples(backend, seeds, question=task.test_split()[7].question):
    state = seeded.run(question=question, seeds=seeds, backend=backend)
    assert state.error() is None, state.error()
    return state["outs"]


def test_sampling_seed_reproduces_a_sample_with_seeded_sampling(live):
    remote = SGLangEndpoint(live.url("generator"))      # --tts-seeded-sampling
    seeds = list(range(100, 112))
    first = _samples(remote, seeds)
    with cf.ThreadPoolExecutor(1) as pool:
        # the same seeds on another server with the flag (started meanwhile if it is not running)
        other = pool.submit(lambda: _samples(SGLangEndpoint(live.url("generator_off")), seeds))
        assert _samples(remote, seeds) == first             # same seeds, same samples (in a batch of 12)
        assert len(set(first)) >= 3                         # ... and the seeds do draw different samples
        assert _samples(remote, [seeds[5]]) == [first[5]]   # a seed's sample does not depend on its batch
        assert other.result() == first                      # ... nor on its server


def test_stock_sglang_ignores_sampling_seed_on_the_cpu(remote):
    # why --tts-seeded-sampling exists: SGLang 0.5.15 builds the seed tensor only with
    # --enable-deterministic-inference, which its CPU attention backends refuse
    seeds = list(range(100, 112))
    assert _samples(remote, seeds) != _samples(remote, seeds)


def test_the_scripted_double_finishes_as_the_live_server_does(live):
    """ScriptedBackend's finishing rule (``sgl_tts.testing.continuation``) against the live server:
    the greedy completion's tokens are the script; every (stop strings, token limit) then gives the
    server's text, finish reason and completion tokens, including a stop string or the end of
    sequence on the last allowed token (the limit wins) and a stop string across two tokens."""
    import requests
    from transformers import AutoTokenizer

    from sgl_tts.testing import continuation

    url = live.url("generator_stock") + "/generate"
    tok = AutoTokenizer.from_pretrained(str(shipped_model("generator")))
    prompt = task.test_split()[0].question + "\n\n"

    def generate(limit, stop=()):
        body = {"text": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": limit, "temperature": 0, "stop": list(stop) or None}}
        res = requests.post(url, json=body, timeout=300)
        assert res.status_code == 200, res.text
        out = res.json()
        meta = out["meta_info"]
        return out["text"], meta["finish_reason"], meta["completion_tokens"], [x[1] for x in meta["output_token_logprobs"]]

    _, reason, n, ids = generate(200)
    assert reason == {"type": "stop", "matched": EOS_ID} and ids[-1] == EOS_ID, reason
    pieces = [tok.decode([i]) for i in ids[:-1]]
    k = next(i for i, p in enumerate(pieces) if i > 2 and p.strip() and pieces[i + 1].strip())
    cases = [((), n - 1), ((), n), ((), n + 5), (("\n\n",), n), ((pieces[k],), k + 1), ((pieces[k],), k + 2),
             ((pieces[k] + pieces[k + 1][:1],), n), ((pieces[k] + pieces[k + 1][:1],), k + 2), ((), 1)]
    if "\n\n" in pieces:
        at = pieces.index("\n\n")
        cases += [(("\n\n",), at + 1), (("\n\n",), at + 2)]
    for stop, limit in cases:
        assert generate(limit, stop)[:3] == continuation(pieces, stop, limit, EOS_ID), (stop, limit)
