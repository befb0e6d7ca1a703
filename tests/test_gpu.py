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
