"""`sgl-tts bench-frontend`: a --quick run on the CPU backend in this process (its records, that its
tokens and searches are what the programs return, skipping on a rerun, bad flags), and one on the live
CPU servers."""

from __future__ import annotations

import json

import pytest

from sgl_tts.bench import frontend
from sgl_tts.bench.frontend import FrontendSettings, main

FIELDS = {
    "backend", "program", "k", "searches", "wall_s", "searches_per_s", "tokens", "tokens_per_s",
    "cpu_user_s", "cpu_system_s", "engine_threads", "engine_user_s", "engine_system_s", "client_user_s",
    "client_system_s", "cpu_user_per_1k_tokens", "cpu_system_per_1k_tokens", "client_user_per_1k_tokens",
    "client_system_per_1k_tokens", "system_share", "client_system_share", "peak_threads", "correct", "accuracy",
    "key", "limit_batch", "limit_new_tokens", "limit_tokens_per_s", "limit_fraction", "max_running", "options",
    "settings", "machine", "command", "date", "decode_iterations", "decode_rows", "decode_batch_mean",
    "limit_batch_source", "nominal_batch", "nominal_limit_tokens_per_s", "nominal_limit_fraction",
    "server_processes", "server_user_s", "server_system_s", "client_own_system_share", "started_at", "ended_at"}


def check_record(r: dict, s: FrontendSettings, engine_threads: int) -> None:
    assert set(r) == FIELDS
    assert r["key"] == s.key() and r["searches"] == s.searches(r["k"]) == 4
    assert r["wall_s"] > 0 and r["tokens"] > 0
    assert r["ended_at"] - r["started_at"] == pytest.approx(r["wall_s"], abs=0.05)
    assert r["searches_per_s"] == pytest.approx(r["searches"] / r["wall_s"], rel=0.01)
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"], rel=0.01)
    per_search = {"beam_search": s.beams, "best_of_n": s.samples, "mcts": s.parallel * s.expansion_width}
    assert r["nominal_batch"] == min(r["k"] * per_search[r["program"]], r["max_running"])
    # the limit is taken at the running batch the generator reported: its rows per decode iteration
    assert r["limit_batch_source"] == "observed"
    # (rows may exceed the searches' tokens: a pruned speculative step is decoded, yet no search's)
    assert 0 < r["decode_iterations"] <= r["decode_rows"]
    assert r["decode_batch_mean"] == pytest.approx(r["decode_rows"] / r["decode_iterations"], abs=0.01)
    assert r["decode_batch_mean"] <= r["nominal_batch"]
    assert r["limit_batch"] == max(1, round(r["decode_batch_mean"]))
    assert r["limit_new_tokens"] == 64 and r["limit_tokens_per_s"] > 0 and r["nominal_limit_tokens_per_s"] > 0
    assert r["limit_fraction"] == pytest.approx(r["tokens_per_s"] / r["limit_tokens_per_s"], rel=0.01)
    assert r["nominal_limit_fraction"] == pytest.approx(r["tokens_per_s"] / r["nominal_limit_tokens_per_s"], rel=0.01)
    assert r["engine_threads"] == engine_threads
    assert 0 <= r["client_user_s"] <= r["cpu_user_s"] and 0 <= r["client_system_s"] <= r["cpu_system_s"]
    assert r["cpu_user_s"] > 0 and 0 <= r["system_share"] <= 1 and 0 <= r["client_system_share"] <= r["system_share"]
    # servers given by URL (and the cpu backend) have no processes of the run's to measure
    assert (r["server_processes"], r["server_user_s"], r["server_system_s"]) == (0, 0, 0)
    own = r["client_user_s"] + r["client_system_s"]
    assert r["client_own_system_share"] == pytest.approx(r["client_system_s"] / own, abs=0.02)   # seconds are rounded
    assert r["cpu_user_per_1k_tokens"] == pytest.approx(1000 * r["cpu_user_s"] / r["tokens"], abs=1e-3)
    assert r["peak_threads"] >= r["k"] + 1
    assert r["accuracy"] == pytest.approx(r["correct"] / r["searches"], abs=1e-4)
    assert r["command"].startswith("sgl-tts bench-frontend ") and "--quick" in r["command"]
    assert r["machine"] and r["date"].endswith("UTC")


def test_quick_cpu_run_records_what_the_programs_returned_and_skips_it_on_rerun(tmp_path, capsys, monkeypatch):
    from sgl_tts import LocalBackend, task
    from sgl_tts.experiment import program_function
    from sgl_tts.machine import describe
    from sgl_tts.models import shipped_model
    from sgl_tts.prm import StepTagPRM

    out = tmp_path / "frontend.jsonl"
    # MCTS with more than one rollout in flight tells the tree in the order expansions end, which
    # timing decides; with one it is deterministic given its seed, so the rerun below can match it
    argv = ["--backends", "cpu", "--quick", "--parallel", "1", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["backend"], r["program"], r["k"]) for r in records] == [
        ("cpu", p, k) for p in ("beam_search", "best_of_n", "mcts") for k in (1, 4)]
    s = FrontendSettings(backends=("cpu",), **{**FrontendSettings.QUICK, "parallel": 1})
    for r in records:
        check_record(r, s, engine_threads=2)
        assert r["machine"] == describe()
    assert "| cpu | beam_search | 4 | 4 |" in printed
    assert "throughput never falls as K grows, cpu mcts" in printed
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.with_suffix(".md").read_text().startswith("| backend | program | K |")

    # the same problems and seeds run directly, one after another: the same tokens and answers
    problems = task.test_split()[:4]
    gen = LocalBackend(shipped_model("generator"), seed=s.seed)
    prm_backend = LocalBackend(shipped_model("prm"), seed=s.seed)
    try:
        for program in s.programs:
            cfg, prm = s.run_config(program), StepTagPRM(prm_backend)
            results = [program_function(program).run(**cfg.program_arguments(p.question, prm), backend=gen).ret_value
                       for p in problems]
            correct = sum(res.answer == str(p.answer) for res, p in zip(results, problems))
            for r in (x for x in records if x["program"] == program):
                assert (r["searches"], r["tokens"], r["correct"]) == (
                    len(results), sum(res.tokens_generated for res in results), correct), (program, r["k"])
    finally:
        gen.shutdown()
        prm_backend.shutdown()

    # a rerun under the same settings runs nothing (no backend is even opened) and reports the same blocks
    def refuse(*a, **kw):
        raise AssertionError("a recorded block ran again")

    monkeypatch.setattr(frontend, "open_cpu", refuse)
    before = out.read_text()
    assert main(argv) == 0
    again = capsys.readouterr().out
    assert "6 block(s) already in" in again and "| cpu | mcts | 4 | 4 |" in again
    assert out.read_text() == before


@pytest.mark.parametrize("flag, value", [("--ks", "1,x"), ("--ks", "0"), ("--programs", "beam_search,dvts"),
                                         ("--backends", "gpu")])
def test_a_bad_list_value_is_one_line_naming_its_flag(tmp_path, capsys, flag, value):
    assert main([flag, value, "--out", str(tmp_path / "f.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"sgl-tts bench-frontend: error: {flag}: ") and repr(value.split(",")[-1]) in err
    assert not (tmp_path / "f.jsonl").exists()


def test_goals_worked_by_hand():
    def rec(backend, program, k, sps, share, frac=0.5):
        return {"backend": backend, "program": program, "k": k, "searches_per_s": sps, "client_system_share": share,
                "limit_fraction": frac, "tokens_per_s": 100 * frac, "limit_tokens_per_s": 100.0, "limit_batch": 256}

    records = [rec("cpu", "beam_search", 1, 1.0, 0.01), rec("cpu", "beam_search", 8, 2.0, 0.02),
               rec("cpu", "beam_search", 32, 1.85, 0.03), rec("cpu", "beam_search", 128, 1.79, 0.11),
               rec("server", "beam_search", 32, 3.0, 0.05, frac=0.9), rec("server", "mcts", 1, 1.0, 0.2)]
    lines = frontend.goals(records)
    # 1.85 >= 0.9 * 2.0 holds; 1.79 < 1.8 falls
    assert lines[0] == ("FAIL", "throughput never falls as K grows, cpu beam_search: K=128 1.790 < 90% of 2.000 (K=8)")
    assert [v for v, _ in lines] == ["FAIL", "PASS", "PASS", "FAIL", "PASS", "FAIL", "PASS"]
    assert lines[3][1].endswith("at K=128, cpu beam_search: 11.0%")
    assert "at K=1 (largest run; the goal names K=128), server mcts: 20.0%" in lines[5][1]
    assert lines[6][1].endswith("90% (90 of 100 tokens/s at B=256)")


@pytest.mark.server
def test_quick_beam_search_on_the_live_servers(live, tmp_path, capsys):
    out = tmp_path / "frontend.jsonl"
    assert main(["--backends", "server", "--programs", "beam_search", "--quick", "--no-progress", "--out", str(out),
                 "--generator-url", live.url("generator"), "--prm-url", live.url("prm"),
                 "--generator-metrics", str(live.metrics_prefix("generator"))]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["backend"], r["program"], r["k"]) for r in records] == [("server", "beam_search", 1),
                                                                        ("server", "beam_search", 4)]
    s = FrontendSettings(backends=("server",), programs=("beam_search",), **FrontendSettings.QUICK)
    for r in records:
        check_record(r, s, engine_threads=0)
        assert (r["engine_user_s"], r["engine_system_s"]) == (0, 0)
        assert r["client_user_s"] == r["cpu_user_s"] and r["max_running"] >= 4
    assert "on the server at K=32 beam search reaches >= 85% of the decode limit: not run" in capsys.readouterr().out


def test_decode_counts_come_from_the_decode_records_inside_the_block():
    records = [{"event": "start", "time": 0.5},
               {"event": "batch", "time": 0.9, "mode": "DECODE", "batch_size": 50},     # before the block
               {"event": "batch", "time": 1.0, "mode": "DECODE", "batch_size": 8},
               {"event": "batch", "time": 1.5, "mode": "EXTEND", "batch_size": 3},      # a prefill
               {"event": "prefill", "time": 1.5, "admitted": 3},
               {"event": "batch", "time": 1.7, "mode": "DECODE", "batch_size": 11},
               {"event": "batch", "time": 1.8, "mode": "MIXED", "batch_size": 12},
               {"event": "batch", "time": 2.0, "mode": "DECODE", "batch_size": 5},
               {"event": "batch", "time": 2.1, "mode": "DECODE", "batch_size": 70}]     # after it
    counts = frontend.records_decode_counts(records, 1.0, 2.0)
    assert counts == frontend.DecodeCounts(iterations=3, rows=24) and counts.mean_batch == 8.0
    assert frontend.records_decode_counts(records, 3.0, 4.0).mean_batch is None


def test_a_generator_metrics_prefix_with_no_files_names_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--generator-metrics: no file .*gen\.metrics\.<pid>"):
        frontend.metrics_file_records(str(tmp_path / "gen.metrics"))


def test_process_tree_cpu_counts_a_servers_children(tmp_path):
    """A launcher whose child does the work (SGLang's scheduler is the launcher's child): the child's
    CPU is the launcher's tree's, and a process gone by the second reading is not an error."""
    import subprocess
    import sys
    import time

    import psutil

    go, done = tmp_path / "go", tmp_path / "done"
    burn = ("import pathlib, time\n"
            f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.01)\n"
            "t = time.process_time()\n"
            "while time.process_time() - t < 0.5: pass\n"
            f"pathlib.Path({str(done)!r}).touch()\n"
            "time.sleep(60)\n")
    launcher = subprocess.Popen([sys.executable, "-c",
                                 f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"])

    def wait_for(cond):
        deadline = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    try:
        wait_for(lambda: psutil.Process(launcher.pid).children())
        u0, s0 = frontend.process_tree_cpu([launcher.pid])
        go.touch()
        wait_for(done.exists)
        u1, s1 = frontend.process_tree_cpu([launcher.pid])
        assert 0.45 < (u1 + s1) - (u0 + s0) < 1.0
    finally:
        for p in psutil.Process(launcher.pid).children(recursive=True):
            p.kill()
        launcher.kill()
        launcher.wait()
    assert frontend.process_tree_cpu([launcher.pid]) == (0.0, 0.0)
