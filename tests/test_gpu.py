"""GPU-only: connect() starts an in-process SGLang runtime when CUDA is present (skipped on CPU).

Every runtime here runs without CUDA graphs: these tests check results, not speed, and a capture
costs 25 s or more of a 15-minute GPU lease (docs/gpu-bringup-log.md)."""

from __future__ import annotations

import pytest
import sglang as sgl

import sgl_tts

pytestmark = pytest.mark.gpu


def test_connect_starts_an_in_process_sglang_runtime(tiny_model_path):
    backend = sgl_tts.connect(tiny_model_path, attention_backend="triton",
                              sampling_backend="pytorch", grammar_backend="none",
                              mem_fraction_static=0.2, disable_cuda_graph=True)
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
    from sgl_tts import LocalBackend
    from sgl_tts.tiny import task
    from sgl_tts.models import shipped_model
    from sgl_tts.prm import StepTagPRM

    server = sgl_tts.connect(shipped_model("prm"), attention_backend="triton", sampling_backend="pytorch",
                             grammar_backend="none", mem_fraction_static=0.2,
                             disable_cuda_graph=True)
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


def test_scheduler_plugin_runs_in_a_real_server(tmp_path, monkeypatch):
    """SGLang started in-process with the plugin configured through its environment variables (an
    Engine takes no plugin keywords): a tagged beam search runs under the prefix-aware policy and
    the scheduler writes metrics; a group abort stops a long request of that group."""
    import glob
    import threading

    from programs.beam_search import beam_search
    from sgl_tts import LocalBackend
    from sgl_tts.models import shipped_model
    from sgl_tts.plugin.scheduling.metrics import read_records, summarize
    from sgl_tts.prm import StepTagPRM
    from sgl_tts.protocol import SearchTag

    monkeypatch.setenv("SGLANG_TTS_POLICY", "prefix-aware")
    monkeypatch.setenv("SGLANG_TTS_METRICS_FILE", str(tmp_path / "metrics"))
    server = sgl_tts.connect(shipped_model("generator"), attention_backend="triton",
                             sampling_backend="pytorch", grammar_backend="none", mem_fraction_static=0.2,
                             disable_cuda_graph=True)
    prm_backend = LocalBackend(shipped_model("prm"))
    try:
        r = beam_search.run(question="Compute ((3+4)*5)-6.", prm=StepTagPRM(prm_backend), num_beams=8,
                            beam_width=2, backend=server, search_group="gpu1").ret_value
        assert r.trajectories

        @sgl.function
        def long(s):
            tag = SearchTag("gpu2", 0, -1, 0)
            s += "Compute 1+1.\n\n"
            # the tiny generator's context is 512 tokens: a longer request is refused with a 400
            # (context length), never aborted (the likely failure on the H200, 2026-11-27). 480
            # decode steps without CUDA graphs (milliseconds each) outlast the abort at 0.3 s
            s += sgl_tts.gen("x", max_tokens=480, ignore_eos=True, custom_params=tag.custom_params(),
                             rid=tag.rid("long"))

        done = {}
        t = threading.Thread(target=lambda: done.setdefault("state", long.run(backend=server)))
        t.start()
        import time
        time.sleep(0.3)
        server.abort_group("gpu2")
        t.join(timeout=60)
        assert not t.is_alive()
        meta = done["state"].get_meta_info("x") or {}
        assert (meta.get("finish_reason") or {}).get("type") == "abort", \
            f"not aborted: {meta.get('finish_reason')} after {meta.get('completion_tokens')} tokens"
    finally:
        prm_backend.shutdown()
        server.shutdown()
    files = glob.glob(str(tmp_path / "metrics.*"))
    assert files, "no scheduler metrics written"
    s = summarize(read_records(files))
    assert s["prefill_batches"] > 0 and s["batches"] > 0 and s["cached_tokens"] > 0


def test_serve_starts_the_tiny_pair_and_both_answer(tmp_path):
    """`sgl-tts serve` on the GPU with the shipped tiny generator and PRM: both servers come up with
    the planned flags, both answer /generate, and Ctrl-C (SIGINT) stops both."""
    import json
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from sgl_tts.bench.goodput_settings import DEFAULT_SERVER_ARGS
    from sgl_tts.models import shipped_model

    # the lent machines' SGLang comes from the wheelhouse, without FA3's kernels, flashinfer's cubins
    # or xgrammar: SGLang's defaults would not start there (what the benchmark and smoke test pass)
    cmd = [sys.executable, "-m", "sgl_tts.cli", "serve", "--generator", str(shipped_model("generator")),
           "--prm", str(shipped_model("prm")), "--gpu", "H200", "--gpu-memory", "16GiB",
           "--generator-port", "31000", "--prm-port", "31001", "--health-timeout", "300",
           "--server-args", DEFAULT_SERVER_ARGS]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 400
        for line in proc.stdout:
            if "sgl-tts serve: generator http://" in line or time.time() > deadline:
                break
        for port in (31000, 31001):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", method="POST",
                                         data=json.dumps({"text": "Compute 1+2.\n\n",
                                                          "sampling_params": {"max_new_tokens": 4}}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as res:
                assert "text" in json.loads(res.read())
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
