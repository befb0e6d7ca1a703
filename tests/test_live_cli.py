"""``sgl-tts serve --device cpu`` and ``sgl-tts smoke --device cpu`` as a user runs them: real SGLang
servers on this CPU, both stopped on SIGTERM; plus the CPU flags they are built from."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from sgl_tts.launch.cpu_serving import QUICK_STOP_ENV   # the servers skip SGLang's 5 s of crash diagnostics on SIGTERM
from sgl_tts.launch.cpu_serving import CPUServerFlags, cpu_pair_flags, cpu_server_flags, needs_transformers_impl
from sgl_tts.launch.live_servers import free_port
from sgl_tts.models import shipped_model
from sgl_tts.launch.serve import _group_alive

GEN, PRM = shipped_model("generator"), shipped_model("prm")


def test_cpu_flags_for_the_tiny_pair():
    flags = cpu_pair_flags(GEN, PRM, "1GiB")
    # bf16 KV: generator 4 layers x 2 KV heads x 64 x 2 (K, V) x 2 bytes = 2 KiB a token; PRM 7 layers
    assert flags["generator"] == CPUServerFlags(262144, None)
    assert flags["prm"] == CPUServerFlags((1 << 29) // (7 * 2 * 64 * 2 * 2), "transformers")
    assert flags["prm"].args() == ["--device", "cpu", "--max-total-tokens", "149796", "--grammar-backend", "none",
                                   "--sleep-on-idle", "--model-impl", "transformers"]
    # float32 doubles the bytes a token takes
    assert cpu_server_flags(GEN, 1 << 30, dtype="float32") == CPUServerFlags(262144, None, "float32")


def test_cpu_flags_refuse_a_pool_shorter_than_the_context():
    with pytest.raises(ValueError, match=r"holds 256 tokens of generator \(4096 bytes each\), less than its "
                                         r"context length \(512\); give more memory"):
        cpu_server_flags(GEN, 1 << 20, dtype="float32")
    with pytest.raises(ValueError, match=r"share must be in \(0, 1\)"):
        cpu_pair_flags(GEN, PRM, "1GiB", generator_share=1.0)


def test_transformers_impl_only_where_sglangs_qwen2_layer_missizes_heads():
    base = {"model_type": "qwen2", "hidden_size": 288, "num_attention_heads": 4, "head_dim": 64}
    assert needs_transformers_impl(base)
    assert not needs_transformers_impl({**base, "hidden_size": 256})
    assert not needs_transformers_impl({**base, "head_dim": None})           # derived from hidden / heads
    assert not needs_transformers_impl({**base, "model_type": "llama"})      # llama.py reads head_dim
    assert needs_transformers_impl(json.loads((PRM / "config.json").read_text()))
    assert not needs_transformers_impl(json.loads((GEN / "config.json").read_text()))


def test_each_cpu_server_gets_half_the_cores_unless_the_caller_chose(monkeypatch):
    """Two CPU servers busy at once must not oversubscribe the cores with OpenMP workers."""
    from sgl_tts.launch.cpu_serving import _threads_per_server

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    assert _threads_per_server() == "1"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert _threads_per_server() == "8"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert _threads_per_server() == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _threads_per_server() == "3"


def test_serve_cpu_dry_run_prints_both_commands():
    out = subprocess.run([sys.executable, "-m", "sgl_tts.cli", "serve", "--device", "cpu", "--generator-share", "0.5",
                          "--dry-run"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "# generator: healthy at http://127.0.0.1:30000/health"
    assert out[2] == "# prm: healthy at http://127.0.0.1:30001/health"
    gen_cmd, prm_cmd = out[1], out[3]
    for cmd in (gen_cmd, prm_cmd):
        assert cmd.startswith("SGLANG_USE_CPU_ENGINE=1 OMP_NUM_THREADS=") and "-m sglang.launch_server" in cmd
        assert "--device cpu" in cmd and "--grammar-backend none" in cmd and "--sleep-on-idle" in cmd
    assert f"--model-path {GEN} " in gen_cmd and "--max-total-tokens 262144" in gen_cmd
    assert gen_cmd.endswith("--tts-policy prefix-aware --tts-seeded-sampling --tts-cpu-attention ragged")
    assert "--model-impl" not in gen_cmd
    # the PRM gets the plugin for its attention only: no policy, metrics or seeds
    assert f"--model-path {PRM} " in prm_cmd and "--model-impl transformers" in prm_cmd
    assert prm_cmd.endswith("--tts-cpu-attention ragged") and prm_cmd.count("--tts-") == 1


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as res:
        return json.loads(res.read())


@pytest.mark.server
def test_serve_cpu_serves_both_models_and_stops_on_sigterm(tmp_path, live_stopped):
    gport, pport = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sgl_tts.cli", "serve", "--device", "cpu", "--kv-memory", "128MiB",
                             "--generator-share", "0.5",
                             "--generator-port", str(gport), "--prm-port", str(pport)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **QUICK_STOP_ENV})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 600
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("sgl-tts serve: generator"):
                break
            assert time.monotonic() < deadline, "".join(lines[-30:])
        else:
            pytest.fail("serve exited before both servers were ready:\n" + "".join(lines[-30:]))
        assert line.strip() == (f"sgl-tts serve: generator http://127.0.0.1:{gport}, "
                                f"PRM http://127.0.0.1:{pport} (Ctrl-C stops both)")
        out = _post(f"http://127.0.0.1:{gport}/generate",
                    {"text": "Compute ((3+4)*5)-6.\n\n", "sampling_params": {"max_new_tokens": 40, "temperature": 0}})
        assert out["text"].startswith("Step 1: 3+4=7")
        # code a request sends (a custom logit processor) does not run unless serve was asked for it
        from sgl_tts.confidence import ConfidenceStop, stop_rule

        with pytest.raises(urllib.error.HTTPError) as refused:
            _post(f"http://127.0.0.1:{gport}/generate",
                  {"text": "Compute ((3+4)*5)-6.\n\n", "custom_logit_processor": ConfidenceStop.to_str(),
                   "sampling_params": {"max_new_tokens": 8, "custom_params": stop_rule(0.5, 4, 5, 1.0)}})
        assert refused.value.code == 400
        assert json.loads(refused.value.read())["error"]["message"] == (
            "The server is not configured to enable custom logit processor. "
            "Please set `--enable-custom-logit-processor` to enable this feature.")
        assert not any("custom logit processors are ON" in x for x in lines)
        # the PRM answers with its head size right (the transformers implementation)
        from sgl_tts.backends import SGLangEndpoint
        from sgl_tts.prm import StepTagPRM

        scores = StepTagPRM(SGLangEndpoint(f"http://127.0.0.1:{pport}")).score(
            "Compute ((3+4)*5)-6.", [["Step 1: 3+4=7", "Step 2: 7*5=35"]])
        assert len(scores[0]) == 2 and all(0 <= x <= 1 for x in scores[0])
        children = [int(p) for p in os.popen(f"pgrep -f -- '--port ({gport}|{pport})'").read().split()]
        assert children
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 130, rest
        assert "sgl-tts serve: stopped" in rest
        # no server process outlives it (each ran in its own process group)
        assert not [p for p in children if os.path.exists(f"/proc/{p}") and _group_alive(p)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for p in os.popen(f"pgrep -f -- '--port ({gport}|{pport})'").read().split():
            os.kill(int(p), signal.SIGKILL)


@pytest.mark.server
def test_smoke_cpu_runs_a_search_through_both_servers(live_stopped):
    gport, pport = free_port(), free_port()
    done = subprocess.run([sys.executable, "-m", "sgl_tts.cli", "smoke", "--device", "cpu", "--port", str(gport),
                           "--prm-port", str(pport), "--problems", "1", "--beams", "4"],
                          capture_output=True, text=True, timeout=900, env={**os.environ, **QUICK_STOP_ENV})
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert out[-1] == "OK"
    assert any(line.startswith("beam search N=4: ") and "the plugin admitted" in line for line in out)


def test_a_stopped_servers_metrics_are_moved_aside_so_a_restart_reads_only_its_own(tmp_path):
    """A server stopped and started again (tests that need the memory stop idle ones) must not show its
    predecessor's records: test_live_plugin counts a scheduler's start records and slices by index."""
    from sgl_tts.launch.live_servers import LiveServer, LiveServers

    servers = LiveServers({"gen": LiveServer(str(shipped_model("generator")), policy="prefix-aware")}, tmp_path)
    prefix = servers.metrics_prefix("gen")
    old = prefix.parent / (prefix.name + ".5163")
    old.write_text(json.dumps({"event": "start", "pid": 5163}) + "\n")
    assert [r["pid"] for r in servers.metrics_records("gen")] == [5163]
    servers._retire_metrics("gen")
    assert servers.metrics_records("gen") == []
    assert json.loads((tmp_path / "stopped-0" / old.name).read_text())["pid"] == 5163
    new = prefix.parent / (prefix.name + ".32167")   # sorts before the old pid: why slicing broke
    new.write_text(json.dumps({"event": "start", "pid": 32167}) + "\n")
    assert [r["pid"] for r in servers.metrics_records("gen")] == [32167]
