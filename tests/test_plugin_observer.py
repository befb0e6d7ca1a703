"""The plugin's observation hooks and its observe-only mode (``SGLANG_TTS_OBSERVE_ONLY=1``): which hooks
each mode registers with SGLang's real ``HookRegistry``, the round timer, and the observer's
scheduler-init hook on a scheduler built from SGLang's own classes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sgl_tts.plugin import EVICT_TARGETS, TARGETS, hook_table, scheduling_hooks
from sgl_tts.plugin.scheduling import observer
from sgl_tts.plugin.scheduling.metrics import SchedulerMetrics, summarize

OBSERVED = {TARGETS["scheduler_init"], TARGETS["prefill"], TARGETS["next_batch"], TARGETS["flush"], *EVICT_TARGETS}


def test_both_modes_share_one_list_of_observation_hooks_without_duplicates():
    from sgl_tts.plugin.model_registry import is_generation_model, model_hooks

    full, observe = hook_table(observe_only=False), hook_table(observe_only=True)
    shared, models = observer.observation_hooks(), model_hooks()
    # both modes serve the plugin's PRM classes (they embed), first
    assert models == [(TARGETS["is_generation"], is_generation_model, "AROUND")] == full[:1]
    assert full[-len(shared):] == shared
    assert observe == [*models, (TARGETS["scheduler_init"], observer.scheduler_init, "AFTER"), *shared]
    assert len({(t, h) for t, h, _ in full}) == len(full) and len({(t, h) for t, h, _ in observe}) == len(observe)
    assert {t for t, _, _ in observe} == OBSERVED | {TARGETS["is_generation"]}
    # nothing that schedules, samples, aborts or adds flags in observe-only mode
    acting = {h for _, h, _ in scheduling_hooks()}
    assert not acting & {h for _, h, _ in observe}
    assert (TARGETS["next_batch"], observer.time_round, "AROUND") in full
    assert set(TARGETS.values()) <= {t for t, _, _ in full}


def test_observe_only_follows_its_variable():
    assert observer.observe_only({"SGLANG_TTS_OBSERVE_ONLY": "1"})
    assert not observer.observe_only({}) and not observer.observe_only({"SGLANG_TTS_OBSERVE_ONLY": "0"})
    assert observer.SERVER_ENV == {"SGLANG_PLUGINS": "sgl-tts", "SGLANG_TTS_OBSERVE_ONLY": "1"}


# what SGLang's plugin loader does in a launcher or scheduler process started with SERVER_ENV: then which
# targets hold which sgl-tts hooks, and what the launcher's parser makes of a --tts-* flag
REGISTERED = r"""
import json, pkgutil
from sglang.srt.plugins import load_plugins
load_plugins()
import sgl_tts.plugin as plugin
from sgl_tts.plugin import EVICT_TARGETS, TARGETS, missing_hooks
from sgl_tts.plugin.hooks import _hooks_in
hooked = {}
for target in sorted({*TARGETS.values(), *EVICT_TARGETS}):
    owner, name = target.rsplit(".", 1)
    found = sorted(f"{h.__module__}.{h.__qualname__}" for h in _hooks_in(getattr(pkgutil.resolve_name(owner), name))
                   if callable(h) and getattr(h, "__module__", "").startswith("sgl_tts"))
    if found:
        hooked[target] = found
from sglang.srt.server_args import prepare_server_args
try:
    prepare_server_args(["--model-path", "dummy", "--tts-policy", "prefix-aware"])
    flag = "accepted"
except SystemExit as exc:
    flag = f"exit {exc.code}"
print(json.dumps({"hooked": hooked, "missing": missing_hooks(), "flag": flag}))
"""


def test_observe_only_registers_the_observation_hooks_and_nothing_else():
    """Through SGLang's own plugin loader and ``HookRegistry`` in a fresh process: only the observer's
    hooks are on SGLang's functions (``SchedulePolicy.calc_priority``, ``PrefillAdder.add_one_req`` and
    the rest are SGLang's own, so the order is stock), besides the one that serves the plugin's PRM
    classes; none is missing, and the launcher knows no ``--tts-*`` flag."""
    env = {k: v for k, v in os.environ.items() if "TTS_" not in k}
    run = subprocess.run([sys.executable, "-c", REGISTERED], capture_output=True, text=True, timeout=300,
                         env={**env, **observer.SERVER_ENV})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    name = "sgl_tts.plugin.scheduling.observer."
    assert got["hooked"] == {TARGETS["scheduler_init"]: [name + "scheduler_init"],
                             TARGETS["prefill"]: [name + "after_prefill"],
                             TARGETS["next_batch"]: [name + "time_round"],
                             TARGETS["flush"]: [name + "after_flush"],
                             **{t: [name + "after_evict"] for t in EVICT_TARGETS},
                             TARGETS["is_generation"]: ["sgl_tts.plugin.model_registry.is_generation_model"]}
    assert got["missing"] == [] and got["flag"] == "exit 2"
    assert "unrecognized arguments: --tts-policy prefix-aware" in run.stderr


# ----------------------------------------------------------------------------------- round timer
def _scheduler(metrics):
    allocator = TokenToKVPoolAllocator(size=100, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)
    return SimpleNamespace(sgl_tts_metrics=metrics, token_to_kv_pool_allocator=allocator)


def _batch(mode: ForwardMode, n: int) -> ScheduleBatch:
    batch = ScheduleBatch(reqs=[SimpleNamespace(rid=str(i)) for i in range(n)])
    batch.forward_mode, batch.seq_lens_sum = mode, 10 * n
    return batch


def test_the_round_timer_counts_rounds_that_formed_a_batch_by_mode():
    metrics = SchedulerMetrics(None)
    scheduler = _scheduler(metrics)
    rounds = [(_batch(ForwardMode.EXTEND, 2), 0.02), (None, 0.2), (_batch(ForwardMode.DECODE, 2), 0.0),
              (_batch(ForwardMode.MIXED, 3), 0.0), (_batch(ForwardMode.DECODE, 3), 0.0)]
    calls = []

    def get_next_batch_to_run(sched, *args):
        calls.append((sched, args))
        batch, wait = rounds[len(calls) - 1]
        time.sleep(wait)
        return batch

    out = [observer.time_round(get_next_batch_to_run, scheduler, "x") for _ in rounds]
    assert out == [b for b, _ in rounds] and calls == [(scheduler, ("x",))] * 5   # passed through untouched
    t = metrics.totals
    assert (t["prefill_rounds"], t["decode_rounds"], t["iterations"]) == (2, 2, 4)   # MIXED is an extend
    assert 0.02 <= t["prefill_round_seconds"] < 1 and 0 < t["decode_round_seconds"] < 0.1   # the idle 0.2 s not counted
    # no metrics on the scheduler: the call goes straight through, nothing recorded
    assert observer.time_round(lambda s: rounds[0][0], _scheduler(None)) is rounds[0][0]


def test_the_summary_has_the_rounds_and_old_records_have_none(tmp_path):
    metrics = SchedulerMetrics(tmp_path / "m")
    metrics.on_batch("EXTEND", 2, round_seconds=0.004, prefill=True)
    metrics.on_batch("DECODE", 2, round_seconds=0.001, prefill=False)
    metrics.on_batch("DECODE", 2, round_seconds=0.003, prefill=False)
    metrics.on_batch("DECODE", 2)   # a batch without the timer (as records written before it)
    metrics.flush()
    records = [json.loads(x) for x in (tmp_path / "m").read_text().splitlines()]
    assert [(r.get("round"), r.get("round_seconds")) for r in records] == [
        ("prefill", 0.004), ("decode", 0.001), ("decode", 0.003), (None, None)]
    summary = summarize(records)
    assert summary["rounds"] == {"prefill": 1, "decode": 2} and summary["batches"] == 4
    assert summary["round_seconds"] == {"prefill": 0.004, "decode": pytest.approx(0.004)}
    old = summarize([{k: v for k, v in r.items() if not k.startswith("round")} for r in records])
    assert old["rounds"] == {"prefill": 0, "decode": 0}


# ------------------------------------------------------------------ the observer's scheduler init
def test_the_observer_attaches_metrics_when_enable_metrics_or_a_file_asks(monkeypatch, tmp_path):
    """On a scheduler built from SGLang's own classes (tests/test_plugin_metrics.py's stand-in
    ``__init__`` body): nothing without ``--enable-metrics`` or a file; Prometheus with the flag; the
    JSONL file from ``SGLANG_TTS_METRICS_FILE``, its start record saying observe-only."""
    from sglang.srt.server_args import ServerArgs
    from test_plugin_metrics import _stock_init

    monkeypatch.delenv("SGLANG_TTS_METRICS_FILE", raising=False)

    def start(**kwargs):
        server_args = ServerArgs(model_path="dummy", **kwargs)
        scheduler = SimpleNamespace()
        _stock_init(scheduler, server_args)
        assert observer.scheduler_init(None, scheduler, server_args) is None
        return scheduler

    assert start().sgl_tts_metrics is None
    scheduler = start(enable_metrics=True)
    metrics = scheduler.sgl_tts_metrics
    assert metrics is not None and scheduler.tree_cache.sgl_tts_metrics is metrics
    assert metrics._prom is not None and metrics.path is None
    monkeypatch.setenv("SGLANG_TTS_METRICS_FILE", str(tmp_path / "obs"))
    metrics = start(schedule_policy="lpm").sgl_tts_metrics
    assert metrics.path == tmp_path / f"obs.{os.getpid()}" and metrics._prom is None
    start_record = json.loads(metrics.path.read_text().splitlines()[0])
    assert {k: start_record[k] for k in ("event", "policy", "schedule_policy", "max_total_tokens")} == {
        "event": "start", "policy": "observe-only", "schedule_policy": "lpm", "max_total_tokens": 1024}


def test_observe_only_metrics_refuse_a_process_whose_observation_hooks_are_not_in_place():
    """In a process where SGLang applied none of the plugin's hooks, the observer's scheduler init
    refuses to start a scheduler that asks for metrics, naming each observation target (it would
    otherwise report nothing, unmeasured); without metrics asked for it goes on."""
    script = (
        "from types import SimpleNamespace\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "from sgl_tts.plugin.scheduling import observer\n"
        "s = SimpleNamespace()\n"
        "assert observer.scheduler_init(None, s, ServerArgs(model_path='dummy')) is None\n"
        "assert s.sgl_tts_metrics is None\n"
        "try:\n"
        "    observer.scheduler_init(None, s, ServerArgs(model_path='dummy', enable_metrics=True))\n"
        "except RuntimeError as e:\n"
        "    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_TTS_METRICS_FILE"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    message = out.stdout.strip()
    assert message.startswith("sgl-tts: SGLANG_TTS_OBSERVE_ONLY=1 asks for scheduler metrics but the "
                              "plugin's hooks are not in place on ")
    named = message.split(" are not in place on ", 1)[1].split(" (see SGLang", 1)[0].split(", ")
    assert named == list(dict.fromkeys(t for t, _, _ in observer.observation_hooks()))
    assert message.endswith("Refusing to serve unmeasured.")
