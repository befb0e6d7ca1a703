"""Online DeepConf's stop inside generation (``sgl_tts.confidence.ConfidenceStop``, an SGLang custom
logit processor) against its definition, and in the CPU engine, where it runs as SGLang's sampler
runs it: the stopped sample's confidences are the plain sample's, and it ends with a forced end of
sequence one token after the first window below the threshold."""

from __future__ import annotations

import types

import numpy as np
import pytest
import sglang as sgl
import torch

import sgl_tts
from sgl_tts.confidence import STOP_RULE, ConfidenceStop, stop_rule, stop_token

EOS = 7


def confidence_by_definition(logits_row, temperature, k):
    """-mean of the k highest log-probabilities of softmax(logits / T), in float64 numpy."""
    z = np.asarray(logits_row, dtype=np.float64) / temperature
    logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    return -np.sort(logp)[::-1][:k].mean()


def test_the_processor_records_each_positions_confidence_and_forces_the_end_after_the_first_low_window():
    rng = np.random.default_rng(3)
    window, k, temp = 3, 4, 0.7
    # row 0: sharp distributions, then flat ones (low confidence); row 1: no rule; row 2: sharp always
    sharp = lambda: np.eye(12)[rng.integers(12)] * 9.0 + rng.normal(0, 0.1, 12)   # noqa: E731
    flat = lambda: rng.normal(0, 0.1, 12)                                         # noqa: E731
    req = types.SimpleNamespace(eos_token_ids={EOS, 9})
    threshold = confidence_by_definition(sharp(), temp, k) - 1.0
    params = [stop_rule(threshold, window, k, temp) | {"__req__": req}, {"other": 1},
              stop_rule(threshold, window, k, temp) | {"__req__": req}]
    proc = ConfidenceStop()
    seen0, forced_at = [], None
    for step in range(8):
        rows = [sharp() if step < 2 else flat(), flat(), sharp()]
        logits = torch.tensor(np.stack(rows), dtype=torch.float32)
        before = logits.clone()
        out = proc(logits, params)
        # a row without a rule and a row above the threshold are untouched
        assert torch.equal(out[1], before[1]) and torch.equal(out[2], before[2])
        if len(seen0) >= window and np.mean(seen0[-window:]) < threshold - 1e-4:
            forced_at = step
            assert out[0, 7].item() == 0.0 and torch.isinf(out[0]).sum().item() == 11   # the smaller EOS id
            break   # the request ends at its end of sequence
        assert torch.equal(out[0], before[0])
        seen0.append(confidence_by_definition(rows[0], temp, k))
    # two sharp positions, then flat ones: a window of three holding one flat position is already below
    assert forced_at == window
    assert params[0]["_tts_confidences"] == pytest.approx(seen0, rel=1e-5)
    assert stop_token(params[0]["_tts_confidences"], window, threshold) == forced_at
    assert "_tts_confidences" not in params[1] and len(params[2]["_tts_confidences"]) == forced_at + 1


def test_a_bad_rule_or_a_request_without_an_end_of_sequence_is_left_alone():
    proc = ConfidenceStop()
    logits = torch.zeros(2, 5)
    params = [{STOP_RULE: {"window": "x"}}, stop_rule(1e9, 1, 2, 1.0) | {"__req__": types.SimpleNamespace()}]
    for _ in range(3):
        out = proc(logits.clone(), params)
        assert torch.equal(out, logits)   # never raises in the server's scheduler, never forces without an EOS
    with pytest.raises(ValueError, match="window and top_k must be at least 1"):
        stop_rule(1.0, 0, 5, 1.0)


@sgl.function
def _one(s, rule):
    s += "Compute ((3+4)*5)-6.\n\n"
    s += sgl_tts.gen("x", max_tokens=60, temperature=0.8, seed=11, return_logprob=True, top_logprobs_num=5,
                     custom_params=rule, custom_logit_processor=ConfidenceStop.to_str() if rule else None)


def _confidences(state):
    return [-sum(e[0] for e in top) / len(top) for top in state.get_meta_info("x")["output_top_logprobs"]]


@pytest.mark.parametrize("engine_in", ["thread", "process"])
def test_the_cpu_engine_stops_a_sample_as_the_server_would(tiny_model_path, engine_in):
    backend = sgl_tts.LocalBackend(tiny_model_path, seed=0, engine_in=engine_in)
    try:
        window = 4
        plain = _one.run(rule=None, backend=backend)
        conf = _confidences(plain)
        never = _one.run(rule=stop_rule(-1e9, window, 5, 0.8), backend=backend)
        always = _one.run(rule=stop_rule(1e9, window, 5, 0.8), backend=backend)
        never.sync()
        always.sync()
    finally:
        backend.shutdown()
    # a threshold nothing falls below changes nothing
    assert never["x"] == plain["x"] and _confidences(never) == pytest.approx(conf, abs=1e-5)
    # one every window falls below: the first full window (4 tokens) stops it, then the end of sequence
    meta = always.get_meta_info("x")
    eos = meta["finish_reason"]["matched"]
    assert meta["completion_tokens"] == window + 1 and meta["finish_reason"]["type"] == "stop"
    assert plain["x"].startswith(always["x"]) and len(always["x"]) < len(plain["x"])
    assert _confidences(always)[:window] == pytest.approx(conf[:window], abs=1e-5)
    # the forced token: all mass on the end of sequence, the rest clamped as SGLang clamps -inf
    last = meta["output_top_logprobs"][-1]
    assert list(last[0][:2]) == [0.0, eos] and {v for v, _, _ in last[1:]} == {torch.finfo(torch.float32).min}


def test_a_processor_that_does_not_load_is_refused_in_the_callers_thread(tiny_model_path):
    from sgl_tts.backends.semantics import SamplingSpec

    backend = sgl_tts.LocalBackend(tiny_model_path, seed=0)
    try:
        with pytest.raises(ValueError, match="the custom logit processor could not be loaded"):
            backend.engine.submit([1, 2], SamplingSpec(max_new_tokens=2), logit_processor=('{"callable": "00"}', None))
        assert backend.engine.stats.requests == 0
    finally:
        backend.shutdown()
