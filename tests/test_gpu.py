"""GPU-only: connect() starts an in-process SGLang runtime when CUDA is present (skipped on CPU)."""

from __future__ import annotations

import pytest
import sglang as sgl

import sgl_tts

pytestmark = pytest.mark.gpu


def test_connect_starts_an_in_process_sglang_runtime(tiny_model_path):
    backend = sgl_tts.connect(tiny_model_path, attention_backend="triton",
                              sampling_backend="pytorch", grammar_backend="none",
                              mem_fraction_static=0.2)
    try:
        assert isinstance(backend, sgl_tts.InProcessSGLang)

        @sgl.function
        def prog(s):
            s += "Q: 1+1?\n"
            forks = s.fork(4)
            forks += lambda i: sgl_tts.gen("a", max_tokens=8, ignore_eos=True, seed=i, rid=f"gpu-{i}")
            forks.join()

        state = prog.run(backend=backend)
        state.sync()
        assert state.error() is None
        assert len(state["a"]) == 4
    finally:
        backend.shutdown()


def test_token_check_prm_scores_the_same_on_a_real_sglang_server():
    """The shipped PRM served by SGLang (bf16, GPU kernels) and read through the endpoint's logprob
    layout gives the CPU backend's step scores: checks that layout and the PRM's bf16 construction."""
    from sgl_tts import LocalBackend, task
    from sgl_tts.models import shipped_model
    from sgl_tts.prm import StepTagPRM

    server = sgl_tts.connect(shipped_model("prm"), attention_backend="triton", sampling_backend="pytorch",
                             grammar_backend="none", mem_fraction_static=0.2)
    local = LocalBackend(shipped_model("prm"))
    try:
        remote, here = StepTagPRM(server, cache=False), StepTagPRM(local, cache=False)
        for p in task.test_split()[:8]:
            steps = [p.step_texts(), [p.step_texts()[0].replace("=", "=1")] + p.step_texts()[1:]]
            got, want = remote.score(p.question, steps), here.score(p.question, steps)
            for g, w in zip(got, want):
                assert g == pytest.approx(w, abs=0.05)
            assert got[0][-1] > got[1][-1]  # the changed digit is caught on the GPU too
    finally:
        local.shutdown()
        server.shutdown()
