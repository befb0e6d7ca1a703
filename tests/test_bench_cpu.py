"""``sgl-tts bench --device cpu`` end to end on real SGLang servers on this CPU: the short variant of the
CPU benchmark (n = 8, one problem, a short trace, beam search and DVTS), run as a user runs it.

Four real ``sglang.launch_server`` processes start (stock generator + PRM, then sgl-tts generator + PRM,
random weights via ``--load-format dummy``), so this takes about 2 minutes on a quiet 2-core machine
(about 4 when the cores are busy), most of it server start-up. A server that cannot start fails the
test (the command exits 1 naming it); nothing is skipped.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest

pytestmark = pytest.mark.server

PORTS = range(31100, 31200)   # this test's share of the machine's ports
SIDE_FIELDS = {"problems", "goodput", "latency", "generator_seconds", "verifier_seconds", "tokens_generated",
               "tokens_kept", "generator_hit_rate", "prm_hit_rate", "tokens_speculative", "tokens_reused",
               "branches_started", "branches_declined"}


def _free_ports(count: int) -> list[int]:
    """``count`` ports of :data:`PORTS` nobody listens on (started from a per-process offset, so two
    runs at once rarely race for the same ones)."""
    start = os.getpid() % len(PORTS)
    found = []
    for k in range(len(PORTS)):
        port = PORTS[(start + k) % len(PORTS)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise RuntimeError(f"fewer than {count} free ports in {PORTS.start}-{PORTS.stop - 1}")


def _answers(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        return True
    except OSError:
        return False


@pytest.mark.timeout(900)
def test_bench_device_cpu_runs_both_sides_on_real_servers_and_keeps_the_same_beams(tmp_path):
    gen_port, prm_port = _free_ports(2)
    out = tmp_path / "run.jsonl"
    cmd = [sys.executable, "-m", "sgl_tts.cli", "bench", "--device", "cpu", "--n", "8", "--problems", "1",
           "--algorithms", "beam_search", "dvts", "--prompt-tokens", "16", "--trace-median", "8",
           "--trace-max-tokens", "32", "--trace-max-depth", "6", "--limit-tokens", "16",
           "--models-dir", str(tmp_path / "models"), "--output", str(out),
           "--generator-port", str(gen_port), "--prm-port", str(prm_port), "--health-timeout", "300",
           "--prm", "tiny-cpu-prm-pooled",   # Skywork's architecture: the plugin's step-pooled class on both sides
           "--sgl-tts-split", "0.5", "--sides", "stock", "sgl-tts", "sgl-tts+overlap", "--no-progress", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stderr[-6000:]
    assert "DIFFER" not in run.stdout + run.stderr

    # --json: stdout is exactly the summary the run wrote beside its records (the logs went to stderr)
    summary = json.loads(run.stdout)
    assert summary == json.loads(out.with_suffix(".summary.json").read_text())
    header, settings, rows = summary["header"], summary["settings"], summary["rows"]
    assert header["device"] == "cpu" and header["date"] and header["machine"]
    assert header["command"].startswith("sgl-tts bench --device cpu --n 8 ")
    assert (header["generator"], header["prm"]) == ("tiny-cpu-generator", "tiny-cpu-prm-pooled")
    # both PRM servers (stock: the plugin observe-only) served Qwen2ForPrmModel, pooling at Skywork's
    # newline id, which the generator is never let sample
    assert run.stderr.count("sgl-tts: Qwen2ForPrmModel pools at step token id 198") == 2
    assert header["workload"] is None and header["splits"] == {"stock": {"generator_share": 0.5, "planned": False},
                                                               "sgl-tts": {"generator_share": 0.5, "planned": False}}
    assert header["pools"]["stock"] == header["pools"]["sgl-tts"]   # the same split on both sides
    assert header["trace"]["median_tokens"] == 8 and header["trace"]["sigma"] == 1.0   # what ran, in full
    assert settings["n"] == [8] and settings["problems"] == 1 and settings["context_tokens"] == 2048
    assert settings["banned_token_ids"] == [4092, 4093, 4094, 4095, 198]

    assert [(r["algorithm"], r["n"]) for r in rows] == [("beam_search", 8), ("dvts", 8)]
    for row in rows:
        assert row["kept_beams_match"] is True and row["mismatched"] == []
        assert row["limit_batch"] == 8 and row["limit_goodput"] > 0
        stock, tts, overlap = (row["sides"][s] for s in ("stock", "sgl-tts", "sgl-tts+overlap"))
        for side in (stock, tts, overlap):
            assert set(side) == SIDE_FIELDS and side["problems"] == 1
            assert side["goodput"] > 0 and side["tokens_generated"] > 0 and side["tokens_kept"] > 0
            assert side["latency"] == pytest.approx(side["generator_seconds"] + side["verifier_seconds"])
            assert side["verifier_seconds"] > 0   # the PRM server read the steps
            # the random text came back as the same token ids: the radix cache reused the paths
            # (SGLang's /classify answers carry no cached tokens: the PRM's hit rate is unknown)
            assert side["generator_hit_rate"] > 0.75 and side["prm_hit_rate"] is None
        # the same work on both sides: the trace fixed every step, so the token counts agree too
        assert (stock["tokens_generated"], stock["tokens_kept"]) == (tts["tokens_generated"], tts["tokens_kept"]) \
            == (overlap["tokens_generated"], overlap["tokens_kept"])

    records = [json.loads(x) for x in out.read_text().splitlines()][1:]
    searches = sorted((r["side"], r["algorithm"]) for r in records if r["kind"] == "search")
    assert searches == sorted((s, a) for s in ("stock", "sgl-tts", "sgl-tts+overlap") for a in ("beam_search", "dvts"))
    # the plugin ran on the sgl-tts generator only: one scheduler announced it, and it wrote metrics.
    # sgl-tts+overlap ran on the same start of the sgl-tts servers (only the program's settings differ),
    # their radix caches emptied first: each server logged the flush once
    assert run.stderr.count("sgl-tts: scheduler policy prefix-aware") == 1
    assert [r for r in records if r["kind"] == "servers"] == [
        {"kind": "servers", "side": "sgl-tts+overlap", "started_for": "sgl-tts", "flushed": True}]
    assert run.stderr.count("Cache flushed successfully!") == 2
    metrics = list(tmp_path.glob("run.plugin-metrics.jsonl.*"))
    assert len(metrics) == 1 and metrics[0].stat().st_size > 0
    assert (tmp_path / "run.md").read_text().count("| match |") == 6
    # SGLang's own counters, from each generator's /metrics (--enable-metrics on both sides): 1 GiB of
    # KV holds this whole run, so nothing was evicted or retracted
    zero = {"evicted_tokens": 0, "retracted_requests": 0, "retracted_prompt_tokens": 0}
    assert {side: {k: c[k] for k in zero} for side, c in summary["server_counters"].items()} == {
        "stock": zero, "sgl-tts": zero, "sgl-tts+overlap": zero}
    # the sgl-tts observer's, on both sides (stock: the plugin observe-only): rounds were timed, and
    # every prefilled token belongs to a round
    for side, c in summary["server_counters"].items():
        assert c["prefill_rounds"] >= 1 and c["decode_rounds"] >= 1 and c["prefill_computed_tokens"] > 0, side
        assert c["prefill_round_seconds"] > 0 and c["recomputed_blocks"] >= 0, side
    assert [r["side"] for r in records if r["kind"] == "counters"] == ["stock", "sgl-tts", "sgl-tts+overlap"]
    assert "| stock | 0 | 0 | 0 |" in (tmp_path / "run.md").read_text()
    # every server was stopped
    assert not _answers(gen_port) and not _answers(prm_port)
