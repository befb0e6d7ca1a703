"""Faults while many searches are in flight (issue 30, deliverable 6), short: a real ``sgl-tts run`` of
24 problems, 16 in flight, against live CPU servers whose generator is SIGKILLed twice at seeded
random points (finished-line counts) and restarted, the same command rerun each time. Every killed
run exits by itself, soon, with code 1 and one error line, leaving nothing on the PRM; the output
ends with every problem exactly once and no corrupt line; no request is left on either server.

The driver is ``benchmarks/fault_resume.py``'s (the long run: 1,000 problems, 32 in flight, 3 kills);
this test asserts each property on the facts it returns."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.server, pytest.mark.live_servers("own-but-prm")]

ROOT = Path(__file__).resolve().parents[1]
# the smallest run that keeps the scenario: kill points 4 and 5 finished lines (drawn up to PROBLEMS -
# IN_FLIGHT = 8, so each kill cuts a full 16 searches in flight), a rerun killed again after resuming
PROBLEMS, IN_FLIGHT, KILLS, SEED = 24, 16, 2, 3
POLL = 0.1            # s between the driver's looks at the output's line count (its default: 0.5)
EXIT_BOUND = 60.0     # s from the kill to the killed run's exit (measured: a few seconds)


def _driver():
    name = "benchmarks_fault_resume"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "fault_resume.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module   # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture
def fault_servers(live, tmp_path):
    """A generator of this test's own (plugin, prefix-aware, seeded sampling), killed and restarted
    by the test, and the session's PRM; the session's other servers are stopped to make room."""
    from sgl_tts.launch.live_servers import LiveServer, LiveServers
    from sgl_tts.models import shipped_model

    live.stop(*(set(live.running()) - {"prm"}))
    spec = LiveServer(str(shipped_model("generator")), policy="prefix-aware", kv_bytes=128 << 20,
                      seeded_sampling=True)
    servers = LiveServers({"fault_generator": spec}, tmp_path / "servers")
    servers.prm_url = live.url("prm")
    yield servers
    servers.stop_all()


def test_a_run_with_many_searches_in_flight_survives_generator_kills_exactly(fault_servers, tmp_path):
    fr = _driver()
    points = fr.draw_kill_points(PROBLEMS, IN_FLIGHT, KILLS, SEED)
    assert points == fr.draw_kill_points(PROBLEMS, IN_FLIGHT, KILLS, SEED) == [4, 5]
    gen_url = fault_servers.url("fault_generator")
    report = fr.fault_run(fault_servers, "fault_generator", fault_servers.prm_url, tmp_path / "work",
                          problems=PROBLEMS, in_flight=IN_FLIGHT, kills=KILLS, seed=SEED, program="best_of_n",
                          n=4, poll=POLL, exit_timeout=300, log=lambda msg: print(msg, flush=True))
    runs = report["runs"]
    detail = json.dumps(runs, indent=1)[-6000:]
    assert report["kills"] == KILLS and report["reruns"] == KILLS and len(runs) == KILLS + 1, detail

    for run in runs[:-1]:            # each killed run ended by itself, soon, with one clear error
        assert run["killed_at_lines"] is not None and run["killed_at_lines"] < PROBLEMS, detail
        assert run["exit_code"] == 1, run["stderr_tail"]
        assert run["exit_seconds"] <= EXIT_BOUND, run["slow_exit_stacks"] or run
        assert len(run["error_lines"]) == 1 and not run["traceback"], run["stderr_tail"]
        assert run["stderr_lines"] == 1, run["stderr_tail"]   # that line and nothing else (no per-search log)
        error = run["error_lines"][0]
        assert gen_url in error and "rerun the same command" in error, error
        assert run["prm_leftover"] == 0, run          # nothing of it left waiting on the PRM
    final = runs[-1]
    assert final["kill_at"] is None and final["exit_code"] == 0, final["stderr_tail"]
    assert final["resuming"].endswith(f": {final['lines_at_start']} of {PROBLEMS} problems already done"), final
    # each run kept what the runs before it wrote, byte for byte, and added to it
    assert all(r["prefix_kept"] for r in runs), detail
    assert [r["lines_at_start"] for r in runs[1:]] == [r["lines_at_end"] for r in runs[:-1]], detail
    assert all(r["lines_at_end"] > r["lines_at_start"] for r in runs), detail

    # every problem exactly once, every line valid JSON, the summary counts them all
    assert (report["lost"], report["duplicated"], report["corrupt"], report["unknown_ids"]) == (0, 0, 0, []), report
    assert report["lines"] == report["summary_problems"] == report["summary_graded"] == PROBLEMS, report
    # nothing running or waiting on either server once the last run is done
    assert report["leftover_requests"] == {"generator": 0, "prm": 0}, report
    assert fr.failed_checks(report, EXIT_BOUND) == []
