"""`sgl-tts bench-frontend`: a --quick run on the CPU backend in this process (its records, that its
tokens and searches are what the programs return, skipping on a rerun, bad flags), and one on the live
CPU servers."""

from __future__ import annotations

import json

import pytest

from sgl_tts.bench import frontend
from sgl_tts.bench.frontend import FrontendSettings
from sgl_tts.cli.bench_frontend import main

FIELDS = {
    "backend", "program", "k", "searches", "wall_s", "searches_per_s", "tokens", "tokens_per_s",
    "cpu_user_s", "cpu_system_s", "engine_threads", "engine_user_s", "engine_system_s", "client_user_s",
    "client_system_s", "cpu_user_per_1k_tokens", "cpu_system_per_1k_tokens", "client_user_per_1k_tokens",
    "client_system_per_1k_tokens", "system_share", "client_system_share", "peak_threads", "correct", "accuracy",
    "key", "limit_batch", "limit_new_tokens", "limit_tokens_per_s", "limit_fraction", "max_running", "options",
    "settings", "machine", "command", "date", "decode_iterations", "decode_rows", "decode_batch_mean",
    "limit_batch_source", "nominal_batch", "nominal_limit_tokens_per_s", "nominal_limit_fraction",
    "server_processes", "server_user_s", "server_system_s", "client_own_system_share", "started_at", "ended_at",
    "decode_context_mean", "decode_s", "extend_s", "extend_iterations", "engine_processes", "cpu_engine", "cpu_replicas",
    "cpu_running_cap", "server_attention"}
# the server's records also have the limit at the searches' context (the plugin's records give it)
CONTEXT_FIELDS = {"context_limit_prompt_tokens", "context_limit_tokens_per_s", "context_limit_fraction"}


def check_record(r: dict, s: FrontendSettings, engine_threads: int) -> None:
    if r["backend"] == "server":
        assert set(r) == FIELDS | CONTEXT_FIELDS
        # contexts: the prompt plus what was decoded; the limit's prompts are cut to leave the mean
        # context over its 64 decoded tokens equal to the block's
        assert r["decode_context_mean"] > 20 and r["context_limit_fraction"] > 0
        assert r["context_limit_prompt_tokens"] == max(1, round(r["decode_context_mean"] - 32.5))
        assert r["context_limit_fraction"] == pytest.approx(r["tokens_per_s"] / r["context_limit_tokens_per_s"], rel=0.01)
        assert r["extend_iterations"] >= 1 and 0 < r["extend_s"] and 0 < r["decode_s"]
        assert r["decode_s"] + r["extend_s"] <= r["wall_s"] + 0.1
    else:   # the CPU engine counts no context nor time per iteration
        assert set(r) == FIELDS
        assert (r["decode_context_mean"], r["decode_s"], r["extend_s"], r["extend_iterations"]) == (None,) * 4
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
    assert r["engine_threads"] == engine_threads and r["engine_processes"] == 0
    # --quick's K <= 4: auto keeps the cpu backend's engines on threads (a process from K = 8)
    assert r["cpu_engine"] == (None if r["backend"] == "server" else "thread")
    assert r["cpu_running_cap"] == (None if r["backend"] == "server" else 256)
    assert 0 <= r["client_user_s"] <= r["cpu_user_s"] and 0 <= r["client_system_s"] <= r["cpu_system_s"]
    assert r["cpu_user_s"] > 0 and 0 <= r["system_share"] <= 1 and 0 <= r["client_system_share"] <= r["system_share"]
    # servers given by URL (and the cpu backend) have no processes of the run's to measure
    assert (r["server_processes"], r["server_user_s"], r["server_system_s"]) == (0, 0, 0)
    # ... nor an attention this run chose (only the servers it starts run --server-attention)
    assert r["server_attention"] is None
    # the seconds are rounded to 1 ms each: the share lies within what those roundings allow
    own, system = r["client_user_s"] + r["client_system_s"], r["client_system_s"]
    low, high = max(0.0, system - 5e-4) / (own + 1e-3), (system + 5e-4) / max(1e-9, own - 1e-3)
    assert low - 1e-4 <= r["client_own_system_share"] <= high + 1e-4
    assert r["cpu_user_per_1k_tokens"] == pytest.approx(1000 * r["cpu_user_s"] / r["tokens"], abs=1e-3)
    assert r["peak_threads"] >= r["k"] + 1
    assert r["accuracy"] == pytest.approx(r["correct"] / r["searches"], abs=1e-4)
    assert r["command"].startswith("sgl-tts bench-frontend ") and "--quick" in r["command"]
    assert r["machine"] and r["date"].endswith("UTC")


def test_quick_cpu_run_records_what_the_programs_returned_and_skips_it_on_rerun(tmp_path, capsys, monkeypatch):
    from sgl_tts import LocalBackend
    from sgl_tts.tiny import task
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
    assert "| cpu | beam_search | 4 | 1 | 4 |" in printed
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
    assert "6 run(s) already in" in again and "| cpu | mcts | 4 | 1 | 4 |" in again
    assert out.read_text() == before


@pytest.mark.parametrize("flag, value", [("--ks", "1,x"), ("--ks", "0"), ("--programs", "beam_search,dvts"),
                                         ("--backends", "gpu")])
def test_a_bad_list_value_is_one_line_naming_its_flag(tmp_path, capsys, flag, value):
    assert main([flag, value, "--out", str(tmp_path / "f.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"sgl-tts bench-frontend: error: {flag}: ") and repr(value.split(",")[-1]) in err
    assert not (tmp_path / "f.jsonl").exists()


def test_repeats_add_runs_and_the_report_takes_each_blocks_median(tmp_path, capsys):
    out = tmp_path / "frontend.jsonl"
    argv = ["--backends", "cpu", "--quick", "--programs", "best_of_n", "--ks", "1", "--out", str(out), "--no-progress"]
    assert main(argv + ["--repeats", "2"]) == 0
    assert len(out.read_text().splitlines()) == 2
    capsys.readouterr()
    assert main(argv + ["--repeats", "3"]) == 0   # one more run
    printed = capsys.readouterr().out
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 3 and "2 run(s) already in" in printed
    low, mid, high = sorted(r["searches_per_s"] for r in recs)
    assert f"| cpu | best_of_n | 1 | 3 | 4 | " in printed and f"| {mid:.3f} | {low:.3f}-{high:.3f} |" in printed
    assert main(argv + ["--repeats", "0"]) == 2
    assert "--repeats: must be at least 1, got 0" in capsys.readouterr().err


def test_median_runs_by_hand():
    def rec(k, sps):
        return {"backend": "cpu", "program": "mcts", "k": k, "searches_per_s": sps}

    picked = frontend.median_runs([rec(1, 3.0), rec(1, 1.0), rec(8, 5.0), rec(1, 2.0), rec(1, 4.0)])
    # four runs of K=1: the lower middle one (2.0); K=8 ran once
    assert picked == [rec(1, 2.0) | {"runs": 4, "searches_per_s_min": 1.0, "searches_per_s_max": 4.0},
                      rec(8, 5.0) | {"runs": 1, "searches_per_s_min": 5.0, "searches_per_s_max": 5.0}]


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
    # with the limit at the searches' context, that one decides; the bare-question one is shown too
    server = records[4] | {"context_limit_fraction": 0.8, "context_limit_tokens_per_s": 112.5,
                           "decode_context_mean": 97.4, "limit_batch_source": "observed"}
    assert frontend.goals([server])[-1] == (
        "FAIL", "on the server at K=32 beam search reaches >= 85% of the decode limit at the running batch it had "
                "and the context it had: 80% (90 of 112 tokens/s at B=256, 97 tokens of context per row); "
                "on bare questions: 90% (90 of 100 tokens/s at B=256)")


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
    # decode 1.0-1.5 and 1.7-1.8 (the block ends at its last record), extend 1.5-1.7 (MIXED: neither);
    # records from before the plugin wrote seq_tokens give no context
    assert counts == frontend.DecodeCounts(iterations=3, rows=24, context_tokens=None, decode_s=0.6, extend_s=0.2,
                                           extend_iterations=1)
    assert counts.mean_batch == 8.0 and counts.mean_context is None
    for r, tokens in zip(records[2:], (400, 90, None, 660, 700, 100)):
        r["seq_tokens"] = tokens
    counts = frontend.records_decode_counts(records, 1.0, 2.0)
    assert counts.context_tokens == 1160 and counts.mean_context == 1160 / 24
    assert frontend.records_decode_counts(records, 3.0, 4.0).mean_batch is None


def test_context_prompts_cut_the_searches_texts_to_the_length_asked():
    from transformers import AutoTokenizer

    from sgl_tts.models import shipped_model

    tok = AutoTokenizer.from_pretrained(str(shipped_model("generator")))
    texts = ["Compute 2+3.\n\nStep 1: 2+3=5\n\nThe answer is \\boxed{5}", "Compute 7*8."]
    prompts = frontend.context_prompts(tok, texts, 40, 3)
    first = tok.encode(texts[0], add_special_tokens=False)
    second = tok.encode(texts[1], add_special_tokens=False)
    assert len(first) < 40 and len(second) < 20   # both repeat to reach 40
    assert prompts == [tok.decode((first * 2)[:40]), tok.decode((second * 8)[:40]), tok.decode((first * 2)[:40])]
    assert prompts[0].startswith(texts[0] + "Compute")
    with pytest.raises(ValueError, match="text 0 has no tokens"):
        frontend.context_prompts(tok, [""], 4, 1)


def test_a_generator_metrics_prefix_with_no_files_names_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--generator-metrics: no file .*gen\.metrics\.<pid>"):
        frontend.metrics_file_records(str(tmp_path / "gen.metrics"))


def _burner(tmp_path):
    """A script that waits for file ``go``, burns 0.5 s of CPU, touches ``done`` and sleeps on."""
    go, done = tmp_path / "go", tmp_path / "done"
    return go, done, ("import pathlib, time\n"
                      f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.01)\n"
                      "t = time.process_time()\n"
                      "while time.process_time() - t < 0.5: pass\n"
                      f"pathlib.Path({str(done)!r}).touch()\n"
                      "time.sleep(60)\n")


def _wait_for(cond, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_process_tree_cpu_counts_a_servers_children(tmp_path):
    """A launcher whose child does the work (SGLang's scheduler is the launcher's child): the child's
    CPU is the launcher's tree's, and a process gone by the second reading is not an error."""
    import subprocess
    import sys
    import time

    import psutil

    go, done, burn = _burner(tmp_path)
    launcher = subprocess.Popen([sys.executable, "-c",
                                 f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"])
    try:
        _wait_for(lambda: psutil.Process(launcher.pid).children())
        u0, s0 = frontend.process_tree_cpu([launcher.pid])
        go.touch()
        _wait_for(done.exists)
        u1, s1 = frontend.process_tree_cpu([launcher.pid])
        assert 0.45 < (u1 + s1) - (u0 + s0) < 1.0
    finally:
        for p in psutil.Process(launcher.pid).children(recursive=True):
            p.kill()
        launcher.kill()
        launcher.wait()
    assert frontend.process_tree_cpu([launcher.pid]) == (0.0, 0.0)


def test_auto_puts_the_engines_in_processes_from_k_8():
    s = FrontendSettings()
    assert s.cpu_engine == "auto"
    assert [frontend.cpu_engine_for(s, p, k).engine_in for p in ("beam_search", "mcts", "best_of_n")
            for k in (4, 8)] == ["thread", "process", "thread", "process", "thread", "process"]
    assert [frontend.cpu_engine_for(s, p, 8).running_cap for p in ("beam_search", "mcts", "best_of_n")] == \
        [1024, 1024, 256]
    # processes chosen by auto: one engine per core of each model (cores read, not assumed)
    from sgl_tts.machine import usable_cores

    assert [frontend.cpu_engine_for(s, p, k).replicas for p in ("beam_search", "mcts", "best_of_n")
            for k in (8, 128)] == [usable_cores(), 1, usable_cores(), 1, usable_cores(), usable_cores()]
    assert frontend.cpu_engine_for(FrontendSettings(cpu_replicas=1), "mcts", 8).replicas == 1
    assert FrontendSettings(cpu_replicas=1).key() != s.key()
    with pytest.raises(ValueError, match="--cpu-replicas must be at least 1, got 0"):
        FrontendSettings(cpu_replicas=0)
    thread = FrontendSettings(cpu_engine="thread")
    assert frontend.cpu_engine_for(thread, "mcts", 128).engine_in == "thread"
    assert frontend.cpu_engine_for(thread, "mcts", 128).replicas == 1
    # each placement has its own key, and none reuses the records from before layouts existed (threads
    # with 256 rows everywhere, key 9516a6ebd41a): "thread" now gives tree searches 1,024 rows
    keys = {FrontendSettings(cpu_engine=e).key() for e in ("auto", "thread", "process")}
    assert len(keys) == 3 and "9516a6ebd41a" not in keys
    # the servers' attention is in the key too; a bad one is refused by name
    assert FrontendSettings(server_attention="native").key() != FrontendSettings().key()
    with pytest.raises(ValueError, match="--server-attention must be one of native, ragged, got 'flash'"):
        FrontendSettings(server_attention="flash")


def test_the_cpu_meter_counts_engine_processes_as_the_engines_and_the_runs(tmp_path):
    """With the engines in child processes their CPU is the engines' CPU, and the run's too; what
    this process spends is the client's."""
    import subprocess
    import sys
    import time

    go, done, burn = _burner(tmp_path)
    engine = subprocess.Popen([sys.executable, "-c", burn])
    try:
        with frontend.CPUMeter(engine_pids=[engine.pid]) as cpu:
            go.touch()
            _wait_for(done.exists)
        assert 0.45 < cpu.engine_user + cpu.engine_system < 1.0
        assert cpu.user >= cpu.engine_user and cpu.system >= cpu.engine_system
        assert cpu.user + cpu.system - cpu.engine_user - cpu.engine_system < 0.3   # this process waited
    finally:
        engine.kill()
        engine.wait()
