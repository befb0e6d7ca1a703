"""LocalBackend through SGLang's real interpreter (``@sgl.function``, fork/gen/join/select/run_batch)."""

from __future__ import annotations

import time

import pytest
import sglang as sgl
import torch

import sgl_tts
from sgl_tts.backends.engine import LogprobSpec, SamplingSpec, UnsupportedFeatureError

PROMPT = "Question: compute ((3+4)*5)-6.\n\n"


def run(program, backend, **kwargs):
    state = program.run(backend=backend, **kwargs)
    state.sync()
    assert state.error() is None, state.error()
    return state


def ref_logprobs(model, ids):
    """log-softmax of a plain transformers forward over ``ids``: [len(ids), vocab]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)


@sgl.function
def fork_steps(s, width, max_tokens, seed0):
    s += PROMPT
    forks = s.fork(width)
    forks += lambda i: sgl_tts.gen("step", max_tokens=max_tokens, temperature=1.0, ignore_eos=True,
                                   seed=seed0 + i)
    forks.join()


# ------------------------------------------------------------------------------------ batching
def test_64_concurrent_forks_complete_in_shared_batches(tiny_model_path):
    @sgl.function
    def prog(s):
        s += PROMPT
        forks = s.fork(64)
        forks += lambda i: sgl_tts.gen("step", max_tokens=32, temperature=1.0, ignore_eos=True, seed=i)
        forks.join()
        s["metas"] = [f.get_meta_info("step") for f in forks]

    be = sgl_tts.LocalBackend(tiny_model_path, seed=0)  # fresh counters
    try:
        state = run(prog, be)
        assert len(state["step"]) == 64
        assert [m["completion_tokens"] for m in state["metas"]] == [32] * 64
        stats = be.engine.stats
        assert stats.requests == 64
        assert stats.max_running == 64
        # 64 sequential requests would need 64 * 31 decode forwards; batched they share ~31.
        assert stats.decode_forwards <= 31 + 8, stats.decode_forwards
    finally:
        be.shutdown()


def test_fork_outputs_have_exact_token_counts(backend):
    @sgl.function
    def prog(s):
        s += PROMPT
        forks = s.fork(16)
        forks += lambda i: sgl.gen("x", max_tokens=7, ignore_eos=True)
        forks.join()
        s["metas"] = [f.get_meta_info("x") for f in forks]

    state = run(prog, backend)
    metas = state["metas"]
    assert [m["completion_tokens"] for m in metas] == [7] * 16
    assert all(m["finish_reason"] == {"type": "length", "length": 7} for m in metas)
    assert all(m["prompt_tokens"] == len(backend.encode(PROMPT)) for m in metas)


# ------------------------------------------------------------------------------------- seeding
def test_seeded_sampling_is_reproducible_and_seed_dependent(backend):
    a = run(fork_steps, backend, width=8, max_tokens=12, seed0=100)["step"]
    b = run(fork_steps, backend, width=8, max_tokens=12, seed0=100)["step"]
    c = run(fork_steps, backend, width=8, max_tokens=12, seed0=200)["step"]
    assert a == b
    assert a != c
    assert len(set(a)) == 8  # different seeds within a fork give different samples


def test_seed_result_does_not_depend_on_batch_company(backend):
    alone = run(fork_steps, backend, width=1, max_tokens=12, seed0=105)["step"][0]
    crowd = run(fork_steps, backend, width=8, max_tokens=12, seed0=100)["step"][5]
    assert alone == crowd


# ------------------------------------------------------------------------------ stops and eos
def greedy_ids(backend, text, n):
    comp = backend.engine.generate(backend.encode(text), SamplingSpec(max_new_tokens=n, temperature=0,
                                                                      ignore_eos=True))
    return comp.output_ids


def test_gen_with_stop_string_cuts_text_and_continues_the_program(backend):
    ids = greedy_ids(backend, PROMPT, 12)
    full = backend.tokenizer.decode(ids)
    stop = full[4:6]
    cut = full[:full.find(stop)]

    @sgl.function
    def prog(s):
        s += PROMPT
        s += sgl.gen("a", max_tokens=12, temperature=0, stop=stop, ignore_eos=True)
        s += "|"

    state = run(prog, backend)
    assert state["a"] == cut
    assert state.get_meta_info("a")["finish_reason"] == {"type": "stop", "matched": stop}
    assert state.text() == PROMPT + cut + "|"


def test_stop_token_ids_min_new_tokens_and_ignore_eos(backend):
    ids = greedy_ids(backend, PROMPT, 6)
    first = ids[0]
    text_first = backend.tokenizer.decode([first])

    @sgl.function
    def prog(s, stop_id, min_tokens, no_eos):
        s += PROMPT
        s += sgl.gen("a", max_tokens=6, temperature=0, stop_token_ids=[stop_id],
                     min_tokens=min_tokens, ignore_eos=no_eos)

    stopped = run(prog, backend, stop_id=first, min_tokens=0, no_eos=False)
    assert stopped["a"] == ""  # the matched stop token is dropped from the text
    assert stopped.get_meta_info("a")["finish_reason"] == {"type": "stop", "matched": first}
    assert stopped.get_meta_info("a")["completion_tokens"] == 1

    ignored = run(prog, backend, stop_id=first, min_tokens=0, no_eos=True)
    assert ignored["a"].startswith(text_first)  # SGLang: ignore_eos also ignores stop_token_ids
    assert ignored.get_meta_info("a")["completion_tokens"] == 6

    delayed = run(prog, backend, stop_id=first, min_tokens=3, no_eos=False)
    out = backend.encode(PROMPT + delayed["a"])[len(backend.encode(PROMPT)):]
    assert first not in out[:3]  # blocked until min_new_tokens


def test_top_k_1_and_tiny_top_p_equal_greedy(backend):
    greedy = backend.tokenizer.decode(greedy_ids(backend, PROMPT, 10))

    @sgl.function
    def prog(s, k, p):  # (argument names must not clash with SglFunction.run's own, e.g. top_k)
        s += PROMPT
        s += sgl_tts.gen("a", max_tokens=10, temperature=1.0, top_k=k, top_p=p,
                         ignore_eos=True, seed=3)

    assert run(prog, backend, k=1, p=1.0)["a"] == greedy
    assert run(prog, backend, k=-1, p=1e-9)["a"] == greedy
    assert run(prog, backend, k=-1, p=1.0)["a"] != greedy


# ------------------------------------------------------------------------------------ logprobs
def test_next_token_logprobs_match_a_direct_forward(backend, hf_model):
    texts = [PROMPT + "Step 1: 3+4=7\n\n", "Short one\n\n", PROMPT + "Step 1: 3+4=8\n\nStep 2:"]
    token_ids = [43, 45, 10]  # "+", "-", "\n"
    positions = [[3, 10, -1], [0, -1], [5, -2, -1]]
    got = backend.next_token_logprobs(texts, positions, token_ids)
    for text, pos, rows in zip(texts, positions, got):
        ids = backend.encode(text)
        ref = ref_logprobs(hf_model, ids)
        for p, row in zip(pos, rows):
            expected = ref[p][token_ids].tolist()
            assert row == pytest.approx(expected, abs=1e-4)
    # Same prompts again: now served from the prefix cache, still equal.
    again = backend.next_token_logprobs(texts, positions, token_ids)
    for a, b in zip(got, again):
        for ra, rb in zip(a, b):
            assert ra == pytest.approx(rb, abs=1e-4)


def test_gen_logprobs_follow_sglang_alignment(backend, hf_model):
    @sgl.function
    def prog(s):
        s += PROMPT
        s += sgl_tts.gen("a", max_tokens=5, temperature=0, ignore_eos=True, return_logprob=True,
                         logprob_start_len=4, top_logprobs_num=2, token_ids_logprob=[43, 45])

    state = run(prog, backend)
    meta = state.get_meta_info("a")
    prompt_ids = backend.encode(PROMPT)
    out_ids = [e[1] for e in meta["output_token_logprobs"]]
    ref = ref_logprobs(hf_model, prompt_ids + out_ids)
    inp = meta["input_token_logprobs"]
    assert [e[1] for e in inp] == prompt_ids[4:]
    assert inp[0][0] is None  # SGLang: the first returned input entry has no logprob
    for j in range(1, len(inp)):
        assert inp[j][0] == pytest.approx(float(ref[4 + j - 1, prompt_ids[4 + j]]), abs=1e-4)
    ids_lp = meta["input_token_ids_logprobs"]
    assert ids_lp[0] is None and len(ids_lp) == len(inp)
    for j in range(1, len(ids_lp)):
        assert [e[0] for e in ids_lp[j]] == pytest.approx(ref[4 + j - 1, [43, 45]].tolist(), abs=1e-4)
        assert [e[1] for e in ids_lp[j]] == [43, 45]
    n = len(prompt_ids)
    for k, (lp, tid, _) in enumerate(meta["output_token_logprobs"]):
        assert tid == int(ref[n - 1 + k].argmax())  # greedy
        assert lp == pytest.approx(float(ref[n - 1 + k, tid]), abs=1e-4)
        top = meta["output_top_logprobs"][k]
        assert [e[1] for e in top] == ref[n - 1 + k].topk(2).indices.tolist()
    assert len(meta["output_token_ids_logprobs"]) == 5


def test_default_logprob_start_returns_no_input_logprobs(backend):
    comp = backend.engine.generate(backend.encode(PROMPT), SamplingSpec(max_new_tokens=2, temperature=0),
                                   LogprobSpec(return_logprob=True))
    assert comp.meta_info["input_token_logprobs"] == []
    assert len(comp.meta_info["output_token_logprobs"]) == len(comp.output_ids)


def test_prefix_reuse_keeps_outputs_identical(tiny_model_path):
    texts = [PROMPT + f"Step {i}:" for i in range(6)]
    results = {}
    for cache_mb in (0, 64):
        be = sgl_tts.LocalBackend(tiny_model_path, prefix_cache_mb=cache_mb)
        try:
            futs = [be.engine.submit(be.encode(t), SamplingSpec(max_new_tokens=8, temperature=0,
                                                                ignore_eos=True),
                                     LogprobSpec(return_logprob=True)) for t in texts]
            first = [f.result() for f in futs]
            # Continue each text with its output: the second round extends cached sequences.
            futs = [be.engine.submit(be.encode(t + c.text), SamplingSpec(max_new_tokens=8, temperature=0,
                                                                         ignore_eos=True),
                                     LogprobSpec(return_logprob=True)) for t, c in zip(texts, first)]
            second = [f.result() for f in futs]
            results[cache_mb] = (first, second, be.engine.stats.cached_tokens)
        finally:
            be.shutdown()
    (f0, s0, hits0), (f1, s1, hits1) = results[0], results[64]
    assert hits0 == 0 and hits1 > 6 * len(PROMPT) // 2
    for a, b in zip(f0 + s0, f1 + s1):
        assert a.output_ids == b.output_ids
        assert [e[0] for e in a.meta_info["output_token_logprobs"]] == pytest.approx(
            [e[0] for e in b.meta_info["output_token_logprobs"]], abs=1e-4)


# ------------------------------------------------------------------------- select / run_batch
def test_run_batch_matches_single_runs(backend):
    @sgl.function
    def prog(s, q, seed):
        s += "Q: " + q + "\nA:"
        s += sgl_tts.gen("a", max_tokens=8, temperature=0.9, ignore_eos=True, seed=seed)

    args = [{"q": f"what is {i}+{i}?", "seed": i} for i in range(12)]
    batch = prog.run_batch(args, backend=backend, num_threads=12)
    single = [run(prog, backend, **a)["a"] for a in args]
    assert [st["a"] for st in batch] == single


# -------------------------------------------------------------------------- priorities
def test_higher_priority_waiting_request_is_admitted_first(tiny_model_path):
    be = sgl_tts.LocalBackend(tiny_model_path, max_running=1)
    try:
        ids = be.encode(PROMPT)
        long = SamplingSpec(max_new_tokens=40, ignore_eos=True)
        done = []
        first = be.engine.submit(ids, long)
        low = be.engine.submit(ids, SamplingSpec(max_new_tokens=2, ignore_eos=True), priority=0)
        high = be.engine.submit(ids, SamplingSpec(max_new_tokens=2, ignore_eos=True), priority=5)
        for name, f in (("low", low), ("high", high), ("first", first)):
            f.add_done_callback(lambda _f, n=name: done.append(n))
        for f in (first, low, high):
            f.result(timeout=60)
        assert done.index("high") < done.index("low")
    finally:
        be.shutdown()


# ------------------------------------------------------------------------- clear errors
@pytest.mark.parametrize("kwargs, message", [
    ({"regex": "[0-9]+"}, "LocalBackend does not support regex/dtype constrained decoding"),
    ({"dtype": int}, "LocalBackend does not support regex/dtype constrained decoding"),
    ({"json_schema": "{}"}, "LocalBackend does not support json_schema constrained decoding"),
    ({"n": 2}, "LocalBackend does not support n=2 (fork the program instead)"),
    ({"frequency_penalty": 0.5}, "LocalBackend does not support frequency/presence penalties"),
])
def test_unsupported_features_raise_clear_errors(backend, kwargs, message):
    @sgl.function
    def prog(s):
        s += PROMPT
        s += sgl.gen("a", max_tokens=4, **kwargs)

    state = prog.run(backend=backend)
    state.sync()
    err = state.error()
    assert isinstance(err, UnsupportedFeatureError)
    assert str(err).startswith(message)


@pytest.mark.parametrize("spec, message", [
    (SamplingSpec(temperature=-1.0), "temperature must be a non-negative finite number, got -1.0."),
    (SamplingSpec(top_p=0.0), "top_p must be in (0, 1], got 0.0."),
    (SamplingSpec(top_k=0), "top_k must be -1 (disable) or at least 1, got 0."),
    (SamplingSpec(max_new_tokens=4, min_new_tokens=5), "min_new_tokens must be in [0, max_new_tokens(4)], got 5."),
    (SamplingSpec(max_new_tokens=5000), "exceeds the model's max_position_embeddings (2048)"),
])
def test_bad_sampling_parameters_are_refused(backend, spec, message):
    with pytest.raises(ValueError) as info:
        backend.engine.submit(backend.encode(PROMPT), spec)
    assert message in str(info.value)


def test_missing_model_folder_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model at .*nowhere: expected a Hugging Face model folder"):
        sgl_tts.LocalBackend(tmp_path / "nowhere")


def test_close_while_threads_submit_never_leaves_a_waiter_hanging(tiny_model_path):
    import threading

    for trial in range(5):
        be = sgl_tts.LocalBackend(tiny_model_path)
        futures, lock = [], threading.Lock()

        def submitter():
            for _ in range(50):
                try:
                    f = be.engine.submit(be.encode(PROMPT), SamplingSpec(max_new_tokens=4, ignore_eos=True))
                except RuntimeError:
                    return
                with lock:
                    futures.append(f)

        threads = [threading.Thread(target=submitter) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.01 * trial)
        be.shutdown()
        for t in threads:
            t.join()
        for f in futures:
            try:
                f.result(timeout=30)
            except RuntimeError as exc:
                assert "closed" in str(exc)


def test_non_cpu_device_and_sliding_window_models_are_refused(tiny_model_path):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from sgl_tts.backends.local import check_supported_architecture

    with pytest.raises(ValueError, match="LocalBackend runs on the CPU"):
        sgl_tts.LocalBackend(tiny_model_path, device="cuda")
    check_supported_architecture(Qwen2Config())
    check_supported_architecture(LlamaConfig())
    check_supported_architecture(MistralConfig(sliding_window=None))
    for cfg in (Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0),
                MistralConfig(sliding_window=4096)):
        with pytest.raises(UnsupportedFeatureError, match="full-attention decoder models only"):
            check_supported_architecture(cfg)


def test_closed_engine_refuses_work_and_fails_waiters(tiny_model_path):
    be = sgl_tts.LocalBackend(tiny_model_path)
    fut = be.engine.submit(be.encode(PROMPT), SamplingSpec(max_new_tokens=200, ignore_eos=True))
    time.sleep(0.05)
    be.shutdown()
    with pytest.raises(RuntimeError, match="the engine is closed"):
        be.engine.submit(be.encode(PROMPT), SamplingSpec())
    try:
        fut.result(timeout=30)  # either it finished before the close or it was failed, never hangs
    except RuntimeError as exc:
        assert "closed" in str(exc)


def test_sampled_first_tokens_respect_top_k_and_top_p(backend, hf_model):
    ids = backend.encode(PROMPT)
    probs = ref_logprobs(hf_model, ids)[-1].exp()
    order = probs.argsort(descending=True).tolist()
    # top-p keeps the smallest prefix of the sorted distribution whose mass reaches p.
    mass, nucleus = 0.0, []
    for t in order:
        nucleus.append(t)
        mass += float(probs[t])
        if mass >= 0.05:
            break
    for spec, allowed in [(dict(top_k=3), set(order[:3])), (dict(top_p=0.05), set(nucleus))]:
        futs = [backend.engine.submit(ids, SamplingSpec(max_new_tokens=1, ignore_eos=True, seed=i, **spec))
                for i in range(96)]
        seen = {f.result().output_ids[0] for f in futs}
        assert seen == allowed, spec
