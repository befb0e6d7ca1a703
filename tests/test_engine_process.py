"""The CPU engine in a process of its own (``LocalBackend(engine_in="process")``): the same completions
and the same searches as the engine on a thread, its errors, its death and its close; and where
``auto`` puts it."""

from __future__ import annotations

import collections
import os
import select
import signal
import shutil
import socket
import subprocess
import time

import pytest

from sgl_tts import LocalBackend
from sgl_tts.backends import engine_zygote
from sgl_tts.backends.engine import LogprobSpec, SamplingSpec
from sgl_tts.backends.engine_process import EngineProcess, EngineSpec
from sgl_tts.backends.layout import (DEFAULT_RUNNING_CAP, PROCESS_ENGINE_MIN_IN_FLIGHT, TREE_SEARCH_RUNNING_CAP,
                                    TREE_SEARCH_REPLICAS_MAX_IN_FLIGHT, EngineLayout, choose_engine)
from sgl_tts.experiment import RunConfig, RunError
from sgl_tts.models import shipped_model
from sgl_tts.tiny import task
from search_outcomes import assert_same_outcomes, search_outcomes

PROMPT = "Question: compute ((3+4)*5)-6.\n\n"


@pytest.fixture(scope="module")
def pair(tiny_model_path):
    """The same tiny model behind a thread engine and a process engine, same seed."""
    thread = LocalBackend(tiny_model_path, seed=7)
    process = LocalBackend(tiny_model_path, seed=7, engine_in="process")
    yield thread, process
    thread.shutdown()
    process.shutdown()


def _comparable(comp):
    meta = {k: v for k, v in comp.meta_info.items() if k not in ("id", "e2e_latency")}
    return comp.text, comp.output_ids, meta


def test_the_child_returns_what_the_thread_engine_returns(pair):
    thread, process = pair
    assert process.model is None and isinstance(process.engine, EngineProcess)
    ids = thread.encode(PROMPT)
    requests = [
        (SamplingSpec(max_new_tokens=12, temperature=0.9, seed=s), LogprobSpec(return_logprob=True,
                                                                                  logprob_start_len=3,
                                                                                  top_logprobs_num=2))
        for s in range(6)
    ] + [(SamplingSpec(max_new_tokens=8, temperature=0), LogprobSpec(token_ids_logprob=(5, 9)))]
    thread.flush_cache()
    process.flush_cache()
    # one at a time on each side: the same batches, the same prefix-cache hits, bit for bit
    want = [_comparable(thread.engine.submit(ids, sp, lp).result()) for sp, lp in requests]
    got = [_comparable(process.engine.submit(ids, sp, lp).result(timeout=120)) for sp, lp in requests]
    assert got == want
    assert want[0][2]["cached_tokens"] == 0 and want[1][2]["cached_tokens"] > 0
    # all in flight together: each future gets its own request's answer
    futs = [process.engine.submit(ids, sp, lp) for sp, lp in requests]
    assert [len(f.result(timeout=120).output_ids) for f in futs] == [12] * 6 + [len(want[6][1])]
    # scores at positions (what a step-tag PRM reads) cross the pipe unchanged
    assert process.next_token_logprobs([PROMPT], [[-1, -3]], [5, 9]) == \
        thread.next_token_logprobs([PROMPT], [[-1, -3]], [5, 9])


def test_a_bad_request_fails_at_submit_with_the_thread_engines_message(pair):
    thread, process = pair
    for bad in ([], [10 ** 9]):
        with pytest.raises(ValueError) as in_thread:
            thread.engine.submit(bad, SamplingSpec())
        with pytest.raises(ValueError) as in_process:
            process.engine.submit(bad, SamplingSpec())
        assert str(in_process.value) == str(in_thread.value)
    with pytest.raises(ValueError, match="top_p must be in"):
        process.engine.submit([1, 2], SamplingSpec(top_p=0))


def test_stats_and_flush_reach_the_child(pair):
    _, process = pair
    ids = process.encode(PROMPT + "again")
    before = process.engine.stats
    process.engine.generate(ids, SamplingSpec(max_new_tokens=4, temperature=0))
    process.engine.generate(ids, SamplingSpec(max_new_tokens=4, temperature=0))
    after = process.engine.stats
    assert after.requests == before.requests + 2
    assert after.cached_tokens > before.cached_tokens          # the second reused the first's prefix
    process.flush_cache()
    third = process.engine.generate(ids, SamplingSpec(max_new_tokens=4, temperature=0))
    assert third.meta_info["cached_tokens"] == 0


def test_the_same_searches_on_a_thread_engine_and_on_process_engines():
    """Beam search (and MCTS) keep the same beams, answers and token counts wherever the engines
    run: equal algorithm output, given the same seeds."""
    problems = task.test_split()[:3]
    outcomes = {}
    for where in ("thread", "process"):
        gen = LocalBackend(shipped_model("generator"), seed=0, engine_in=where)
        prm_backend = LocalBackend(shipped_model("prm"), seed=0, engine_in=where)
        try:
            for program in ("beam_search", "mcts"):
                cfg = RunConfig(program=program, n=4, beam_width=2, max_depth=6, parallel=2,
                                cpu_engine=where)
                assert cfg.engine_layout.engine_in == where
                outcomes[(where, program)] = search_outcomes(cfg, problems, gen, prm_backend, in_flight=3)
        finally:
            gen.shutdown()
            prm_backend.shutdown()
    assert_same_outcomes(outcomes[("process", "beam_search")], outcomes[("thread", "beam_search")], "beam_search")
    assert_same_outcomes(outcomes[("process", "mcts")], outcomes[("thread", "mcts")], "mcts")
    assert all(len(v) == 3 for v in outcomes.values())


def test_a_killed_child_fails_what_is_in_flight_and_what_comes_after(tiny_model_path):
    be = LocalBackend(tiny_model_path, seed=0, engine_in="process")
    try:
        ids = be.encode(PROMPT)
        be.engine.generate(ids, SamplingSpec(max_new_tokens=2))       # loaded and serving
        fut = be.engine.submit(ids, SamplingSpec(max_new_tokens=1500, ignore_eos=True))
        os.kill(be.engine.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"the engine process for .* exited \(exit code -9\)"):
            fut.result(timeout=60)
        with pytest.raises(RuntimeError, match=r"exited \(exit code -9\)"):
            be.engine.submit(ids, SamplingSpec(max_new_tokens=2))
    finally:
        be.shutdown()


def test_close_fails_the_unfinished_and_ends_the_child(tiny_model_path):
    be = LocalBackend(tiny_model_path, seed=0, engine_in="process")
    ids = be.encode(PROMPT)
    be.engine.generate(ids, SamplingSpec(max_new_tokens=2))
    futs = [be.engine.submit(ids, SamplingSpec(max_new_tokens=120, ignore_eos=True)) for _ in range(4)]
    t0 = time.perf_counter()
    be.shutdown()
    assert time.perf_counter() - t0 < 30
    assert be.engine._process.poll() == 0                 # it exited by itself, cleanly
    for f in futs:
        with pytest.raises(RuntimeError, match="the engine was closed"):
            f.result(timeout=1)
    with pytest.raises(RuntimeError, match="the engine is closed"):
        be.engine.submit(ids, SamplingSpec(max_new_tokens=2))
    be.shutdown()                                          # twice is fine


def test_a_model_the_child_cannot_load_names_the_folder_and_the_error(tiny_model_path, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_path, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    engine = EngineProcess(EngineSpec(str(broken)))        # returns at once; the load runs in the child
    try:
        with pytest.raises(RuntimeError, match=rf"the engine process could not load {broken}: "):
            engine.wait_ready()
        with pytest.raises(RuntimeError, match="could not load"):   # and stays failed
            engine.submit([1, 2], SamplingSpec(max_new_tokens=1))
    finally:
        engine.close()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="engine_in must be 'thread' or 'process', got 'gpu'"):
        LocalBackend(shipped_model("generator"), engine_in="gpu")
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineProcess(EngineSpec("/nowhere", dtype="int8"))
    with pytest.raises(RunError, match="unknown cpu_engine 'fast'; choose auto, thread or process"):
        RunConfig(cpu_engine="fast").validate()


# ------------------------------------------------------------------------------------ the policy
MANY, FEW = TREE_SEARCH_RUNNING_CAP, DEFAULT_RUNNING_CAP


@pytest.mark.parametrize("setting, tree_search, in_flight, expected", [
    ("auto", True, PROCESS_ENGINE_MIN_IN_FLIGHT, ("process", MANY, 3)),   # a generator engine per core
    ("auto", True, TREE_SEARCH_REPLICAS_MAX_IN_FLIGHT - 1, ("process", MANY, 3)),
    ("auto", True, TREE_SEARCH_REPLICAS_MAX_IN_FLIGHT, ("process", MANY, 1)),  # the client needs the CPU
    ("auto", True, PROCESS_ENGINE_MIN_IN_FLIGHT - 1, ("thread", FEW, 1)),
    ("auto", False, PROCESS_ENGINE_MIN_IN_FLIGHT - 1, ("thread", FEW, 1)),
    ("auto", False, 128, ("process", FEW, 3)),         # best-of-N: 256 rows per engine (more: slower)
    ("thread", True, 128, ("thread", MANY, 1)),        # the setting places the engines; the workload sizes them
    ("process", False, 1, ("process", FEW, 1)),        # processes asked for by name: one each unless told
])
def test_how_the_engines_are_laid_out(setting, tree_search, in_flight, expected):
    layout = choose_engine(setting, tree_search=tree_search, in_flight=in_flight, cores=3)
    assert (layout.engine_in, layout.running_cap, layout.replicas) == expected
    assert layout.options() == {"engine_in": expected[0], "running_cap": expected[1], "replicas": expected[2]}
    assert layout.prm_options() == {"engine_in": expected[0], "running_cap": expected[1]}   # one PRM engine
    with pytest.raises(ValueError, match="cpu engine must be auto, thread or process, got 'gpu'"):
        choose_engine("gpu", tree_search=True, in_flight=8)


def test_replicas_can_be_asked_for_and_need_processes():
    assert choose_engine("process", tree_search=False, in_flight=1, replicas=2).replicas == 2
    assert choose_engine("auto", tree_search=True, in_flight=8, replicas=1, cores=4).replicas == 1
    from sgl_tts.machine import usable_cores

    assert choose_engine("auto", tree_search=True, in_flight=8).replicas == usable_cores()
    with pytest.raises(ValueError, match=r"2 cpu replicas need engines in processes, and this layout has "
                                         r"threads \(cpu engine 'auto'\)"):
        choose_engine("auto", tree_search=False, in_flight=4, replicas=2)
    with pytest.raises(ValueError, match="cpu replicas must be at least 1, got 0"):
        choose_engine("process", tree_search=True, in_flight=8, replicas=0)
    with pytest.raises(RunError, match="cpu_replicas: 2 cpu replicas need engines in processes"):
        RunConfig(program="best_of_n", in_flight=4, cpu_replicas=2).engine_layout
    with pytest.raises(RunError, match="cpu_replicas must be at least 1, got 0"):
        RunConfig(cpu_replicas=0).validate()
    assert RunConfig(cpu_replicas=2).run_key() == RunConfig().run_key()   # placement changes no result


def test_a_run_resolves_auto_from_its_program_and_in_flight():
    from sgl_tts.machine import usable_cores

    cores = usable_cores()
    assert RunConfig(program="beam_search", in_flight=8).engine_layout == EngineLayout("process", MANY, cores)
    assert RunConfig(program="dvts", in_flight=32).engine_layout == EngineLayout("process", MANY, cores)
    assert RunConfig(program="mcts", in_flight=8).engine_layout == EngineLayout("process", MANY, cores)
    assert RunConfig(program="mcts", in_flight=4).engine_layout == EngineLayout("thread", FEW)
    assert RunConfig(program="beam_search", in_flight=64).engine_layout == EngineLayout("process", MANY)
    assert RunConfig(program="best_of_n", in_flight=64).engine_layout == EngineLayout("process", FEW, cores)
    assert RunConfig(program="best_of_n", in_flight=4).engine_layout == EngineLayout("thread", FEW)
    assert RunConfig(program="beam_search", in_flight=64, cpu_engine="thread").engine_layout == \
        EngineLayout("thread", MANY)
    # where the engines run changes no result: a run resumes under another placement
    assert RunConfig(cpu_engine="process").run_key() == RunConfig().run_key()


def test_running_rows_come_from_the_kv_budget_up_to_the_cap():
    from transformers import Qwen2Config

    from sgl_tts.backends.kv import kv_bytes_per_token, running_rows

    tiny = Qwen2Config(num_hidden_layers=4, num_key_value_heads=2, num_attention_heads=4, hidden_size=256,
                       head_dim=64, max_position_embeddings=512)
    assert kv_bytes_per_token(tiny, 4) == 2 * 4 * 2 * 64 * 4          # K and V, 4 layers, 2 heads, fp32
    # 2 GiB / (4 KiB x 512 tokens) = 1,024 rows: the cap decides
    assert running_rows(tiny, 4, 2 << 30, cap=256) == 256 and running_rows(tiny, 4, 2 << 30, cap=4096) == 1024
    big = Qwen2Config(num_hidden_layers=24, num_key_value_heads=2, num_attention_heads=14, hidden_size=896,
                      max_position_embeddings=32768)
    # rows planned at 2,048 tokens, not the model's 32k: 2 GiB / (24 KiB x 2,048) = 42
    assert running_rows(big, 4, 2 << 30) == 42 and running_rows(big, 2, 2 << 30) == 85
    assert running_rows(big, 4, 1 << 20) == 16                           # never below 16
    assert LocalBackend(shipped_model("generator")).engine.max_running == DEFAULT_RUNNING_CAP
    assert LocalBackend(shipped_model("generator"), running_cap=4096).engine.max_running == 1024
    assert LocalBackend(shipped_model("generator"), max_running=3).engine.max_running == 3
    with pytest.raises(ValueError, match="max_running must be at least 1, got 0"):
        LocalBackend(shipped_model("generator"), max_running=0)


# ----------------------------------------------------------------------------------- the zygote
def _parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_engines_are_forked_by_one_zygote_and_survive_its_end(tiny_model_path):
    a = LocalBackend(tiny_model_path, seed=0, engine_in="process")
    b = LocalBackend(tiny_model_path, seed=0, engine_in="process")
    try:
        ids = a.encode(PROMPT)
        first = a.engine.generate(ids, SamplingSpec(max_new_tokens=6, seed=3))
        zygote = engine_zygote.start()
        assert isinstance(a.engine._process, engine_zygote.ForkedChild)
        assert _parent_pid(a.engine.pid) == _parent_pid(b.engine.pid) == zygote._process.pid
        os.kill(zygote._process.pid, signal.SIGKILL)        # the zygote dies; its engines go on
        zygote._reader.join(30)
        assert not zygote.alive
        assert b.engine.generate(ids, SamplingSpec(max_new_tokens=6, seed=3)).text == first.text
        c = LocalBackend(tiny_model_path, seed=0, engine_in="process")   # a new zygote forks this one
        try:
            assert c.engine.generate(ids, SamplingSpec(max_new_tokens=6, seed=3)).text == first.text
            assert _parent_pid(c.engine.pid) == engine_zygote.start()._process.pid != zygote._process.pid
        finally:
            c.shutdown()
    finally:
        a.shutdown()
        b.shutdown()
    assert b.engine._process.wait(5) is None     # it has ended; its exit code went with the zygote


def test_without_a_zygote_the_engine_is_started_afresh(tiny_model_path, monkeypatch, caplog):
    def broken():
        raise RuntimeError("no zygote here")

    monkeypatch.setattr(engine_zygote, "start", broken)
    be = LocalBackend(tiny_model_path, seed=0, engine_in="process")
    try:
        assert isinstance(be.engine._process, subprocess.Popen)
        assert "the engine zygote failed (no zygote here)" in caplog.text
        ids = be.encode(PROMPT)
        assert be.engine.generate(ids, SamplingSpec(max_new_tokens=3, seed=1)).meta_info["completion_tokens"] == 3
    finally:
        be.shutdown()
    assert be.engine._process.poll() == 0


def _zygote_child(zygote: engine_zygote.Zygote, *, live: bool):
    """An engine process from the real zygote and our end of its socket: a live one waits there for
    its engine's settings (no model loaded); one whose socket we close at once ends with code 0."""
    ours, theirs = socket.socketpair()
    child = zygote.spawn(theirs.fileno())
    theirs.close()
    if not live:
        ours.close()
    assert child.pid > 0                         # forked
    return child, ours


def _tables(zygote: engine_zygote.Zygote) -> dict[str, int]:
    """The size of every table the caller's side of the zygote keeps."""
    return {name: len(v) for name, v in vars(zygote).items()
            if isinstance(v, (dict, list, set, collections.deque))}


def test_an_engine_given_an_ended_engines_pid_reads_as_running():
    """Exits are keyed by a serial the zygote assigns, not by the pid, which the kernel hands on once
    a process is reaped. The collision is made where the caller holds the pid: the running engine's
    is set to the ended one's, as if the kernel had reused it."""
    zygote = engine_zygote.start()
    ended, _ = _zygote_child(zygote, live=False)
    assert ended.wait(60) == 0 and ended.poll() == 0
    running, conn = _zygote_child(zygote, live=True)
    try:
        running._pid = ended.pid
        assert running.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            running.wait(0.2)
        running.kill()
        assert running.wait(60) == -signal.SIGKILL and running.poll() == -signal.SIGKILL
        assert ended.poll() == 0
    finally:
        conn.close()


def test_kill_reaches_its_engine_and_never_a_process_that_took_its_pid():
    """A kill goes to the engine the handle was forked as: a running engine dies, and one that has
    ended (its exit not read yet, or read) is left alone, even when the pids the caller holds now
    name another process (set here as if the kernel had reused them)."""
    zygote = engine_zygote.start()
    stranger = subprocess.Popen(["sleep", "300"])
    running, conn = _zygote_child(zygote, live=True)
    ended, _ = _zygote_child(zygote, live=False)
    ended_fd = os.pidfd_open(ended.pid)
    try:
        with zygote._cond:                             # holds the reader: no exit is read meanwhile
            assert select.select([ended_fd], [], [], 60)[0]    # it has ended
            assert ended.poll() is None                # and the caller does not know yet
            for child in (running, ended):
                child._pid = stranger.pid
                child.kill()
        assert running.wait(30) == -signal.SIGKILL
        assert ended.wait(30) == 0
        ended.kill()                                   # its exit is known now: nothing to do
        running.kill()
        assert stranger.poll() is None
    finally:
        os.close(ended_fd)
        stranger.kill()
        stranger.wait()
        conn.close()


def test_the_zygotes_tables_hold_only_running_engines():
    """Each table the caller keeps drops an engine once its exit is read (the zygote's own drops it
    when it reaps it): many engines started and ended leave them as they were."""
    zygote = engine_zygote.start()
    before = _tables(zygote)
    running = [_zygote_child(zygote, live=True) for _ in range(3)]
    ended = [_zygote_child(zygote, live=False)[0] for _ in range(24)]
    assert [child.wait(60) for child in ended] == [0] * 24
    assert sum(_tables(zygote).values()) <= sum(before.values()) + 3   # the running engines at most
    for child, conn in running:
        conn.close()
    assert [child.wait(60) for child, _ in running] == [0] * 3
    assert _tables(zygote) == before
