"""``speculative: auto`` on the live CPU servers (issue 33): the generator's decode curve measured on
its own server and cached, and ``sgl-tts run``'s beam search under the controller, which keeps
exactly the plain search's trajectories. On this CPU a row costs time (the curve rises with the
batch): auto stood down on nearly every branch when measured (2026-11-27: 216 of 216 declined;
2026-12-02: 207 of 216). A measured batch that timed under a smaller one no longer reads as free rows
(the controller decides on the curve's non-decreasing fit). ``auto`` from Python on an ``SGLangEndpoint``
and through ``serve-search`` decides on the same cached measurements (seeded here, so nothing is
measured). That a controlled search keeps the plain search's beams while it does start branches is
tests/test_speculation_cost.py's (scripted curves)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest

from sgl_tts.experiment import RunConfig, run
from sgl_tts.launch.decode_curve import curve_for_server
from sgl_tts.launch.live_servers import settled_loads
from sgl_tts.launch.verifier_slowdown import slowdown_for_servers
from sgl_tts.search.speculation_cost import COSTS_MORE, SLOWS_VERIFIER
from sgl_tts.server_costs import DecodeCurve

pytestmark = pytest.mark.server


def test_the_decode_curve_is_measured_on_the_server_and_then_read_from_the_cache(live, tmp_path):
    url = live.url("generator")
    first = curve_for_server(url, batches=(1, 4, 16), context=128, cache_dir=tmp_path)
    assert [b for b, _ in first.curve.points] == [1, 4, 16] and all(s > 0 for _, s in first.curve.points)
    # a CPU decode step grows with the batch: 16 rows take longer than 1
    assert first.curve.step(16) > first.curve.step(1)
    assert first.server["model_path"] == str(live.specs["generator"].model) and first.context == 128
    saved = os.stat(first.path).st_mtime_ns
    again = curve_for_server(url, batches=(1, 4, 16), context=128, cache_dir=tmp_path)
    assert again == first and os.stat(first.path).st_mtime_ns == saved        # read, not measured
    other = curve_for_server(url, batches=(1, 2), context=128, cache_dir=tmp_path)
    assert other.path != first.path and [b for b, _ in other.curve.points] == [1, 2]
    assert json.loads(open(first.path).read())["points"] == [list(p) for p in first.curve.points]


def test_the_prms_slowdown_beside_decoding_is_measured_on_the_pair_and_then_read_from_the_cache(live, tmp_path):
    gen, prm = live.url("generator"), live.url("prm")
    first = slowdown_for_servers(gen, prm, rows=(0, 4), prm_batch=4, context=128, cache_dir=tmp_path)
    assert [b for b, _ in first.slowdown.points] == [0, 4] and all(t > 0 for _, t in first.slowdown.points)
    assert first.slowdown.per_row >= 0 and first.prm["model_path"] == str(live.specs["prm"].model)
    assert first.generator["model_path"] == str(live.specs["generator"].model)
    # the generator's requests were aborted once the PRM's batch was timed: nothing is left running
    assert (settled_loads(gen)["num_running_reqs"], settled_loads(gen)["num_waiting_reqs"]) == (0, 0)
    saved = os.stat(first.path).st_mtime_ns
    again = slowdown_for_servers(gen, prm, rows=(0, 4), prm_batch=4, context=128, cache_dir=tmp_path)
    assert again == first and os.stat(first.path).st_mtime_ns == saved        # read, not measured
    data = json.loads(open(first.path).read())
    assert data["points"] == [list(p) for p in first.slowdown.points] and data["per_row"] == round(first.slowdown.per_row, 6)


def test_the_slowdown_rows_stop_at_the_generators_running_request_limit(live, tmp_path):
    # 2026-11-27, H200: 16 rows asked of a generator capped at 8 requests left 8 queued; they started
    # only when the first 8 ran out of context, and the measurement failed. Rows beyond the limit are
    # measured at the limit (4 here) and every request is gone afterwards.
    gen, prm = live.url("generator_4slots"), live.url("prm")
    got = slowdown_for_servers(gen, prm, rows=(0, 2, 8), prm_batch=4, context=128, cache_dir=tmp_path)
    assert [b for b, _ in got.slowdown.points] == [0, 2, 4]
    assert (settled_loads(gen)["num_running_reqs"], settled_loads(gen)["num_waiting_reqs"]) == (0, 0)


def _trajectories(records):
    return [[(t["steps"], t["step_scores"], t["answer"]) for t in r["trajectories"]] for r in records]


def test_auto_keeps_the_plain_searchs_trajectories_and_stands_down_where_rows_cost_time(live, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TTS_CACHE", str(tmp_path / "cache"))   # the measured curve goes here
    base = RunConfig(program="beam_search", n=8, beam_width=2, max_depth=10, limit=3, in_flight=3, seed=5,
                     progress=False, generator=live.url("generator"), prm=live.url("prm"))
    origin = tmp_path / "through-origin.json"   # every row costs 10 ms: never pays
    origin.write_text(json.dumps({"points": [[1, 0.01], [64, 0.64]]}))
    out = {}
    for name, opts in (("plain", {}), ("measured", {"speculative": "auto"}),
                       ("origin", {"speculative": "auto", "speculation_curve": str(origin)})):
        _, records = run(dataclasses.replace(base, output=str(tmp_path / f"{name}.jsonl"), **opts))
        out[name] = records
    for name in ("measured", "origin"):
        assert _trajectories(out[name]) == _trajectories(out["plain"]), name
    assert all("branches" not in r for r in out["plain"])
    # measure resolved to the server's curve and (the PRM on the same host) the PRM's slowdown beside
    # it, both cached under SGLANG_TTS_CACHE
    cached = sorted(p.name.startswith("slowdown-") for p in (tmp_path / "cache" / "curves").glob("*.json"))
    assert cached == [False, True]
    branches = {name: [r["branches"] for r in out[name]] for name in ("measured", "origin")}
    origin_b = branches["origin"]
    assert sum(b["started"] for b in origin_b) == 0 and sum(b["declined"] for b in origin_b) > 0
    assert all(b["stood_down"] == {COSTS_MORE: b["declined"]} for b in origin_b)
    # the measured CPU curve decided every branch on cost, and the measured slowdown every stop at the
    # barrier (both were there: none stood down for the want of one). Its fit charges every row from
    # its first point on (2026-11-28 CI: batch 16 timed under batch 8, and rows between them were read
    # as free, so branches started there); how many started on this machine's curve is printed
    curve = DecodeCurve.load(next(p for p in (tmp_path / "cache" / "curves").glob("*.json")
                                  if not p.name.startswith("slowdown-")))
    assert all(curve.marginal(b) > 0 for b in range(math.ceil(curve.fitted[0][0]), 2 * curve.points[-1][0])), curve
    measured = branches["measured"]
    assert sum(b["started"] + b["declined"] for b in measured) > 0
    for b in measured:
        assert set(b["stood_down"]) <= {COSTS_MORE, SLOWS_VERIFIER}, b
        assert (b["stood_down"].get(COSTS_MORE, 0), b["stood_down"].get(SLOWS_VERIFIER, 0)) == (b["declined"], b["stopped"]), b
    print(f"\nmeasured CPU curve: {sum(b['started'] for b in measured)} branches started, "
          f"{sum(b['declined'] for b in measured)} declined, {sum(b['stopped'] for b in measured)} stopped")


# ------------------------------------------- auto from Python and through serve-search (issue 62)
FLAT = [[1, 0.02], [64, 0.02]]   # every row free: a branch with any chance of a take-over starts


def _seed_measurements(generator: str, prm: str | None = None) -> Path:
    """Hand-written measurements of these live servers where ``sgl-tts run`` caches them (under
    SGLANG_TTS_CACHE, keyed by what each server reports of itself): the generator's decode curve
    (:data:`FLAT`) and, given the PRM, a slowdown beside it too small to stop a branch. Nothing is
    measured on them; returns the curve's file."""
    from sgl_tts.launch.cpu_profile import machine_identity, write_json_atomically
    from sgl_tts.launch.decode_curve import (DEFAULT_BATCHES, DEFAULT_CONTEXT, MeasuredCurve, curve_dir, curve_key,
                                             server_identity)
    from sgl_tts.launch import verifier_slowdown as vs
    from sgl_tts.server_costs import VerifierSlowdown

    gen_id = server_identity(generator)
    path = curve_dir() / f"{curve_key(gen_id, DEFAULT_BATCHES, DEFAULT_CONTEXT, 16)}.json"
    write_json_atomically(path, MeasuredCurve(DecodeCurve.of(FLAT), gen_id, machine_identity(), DEFAULT_CONTEXT, 16,
                                              "2026-11-29").to_json())
    if prm is not None:
        prm_id = server_identity(prm)
        key = vs.slowdown_key(gen_id, prm_id, vs.DEFAULT_ROWS, vs.DEFAULT_PRM_BATCH, vs.DEFAULT_CONTEXT)
        slow = VerifierSlowdown.of([(0, 1.0), (16, 1.0 + 1e-9)])
        write_json_atomically(curve_dir() / f"{key}.json", vs.MeasuredSlowdown(
            slow, gen_id, prm_id, machine_identity(), vs.DEFAULT_PRM_BATCH, vs.DEFAULT_CONTEXT, "2026-11-29").to_json())
    return path


def test_auto_from_python_decides_on_the_endpoints_server_curve_read_once(live, tmp_path, monkeypatch):
    """``speculative="auto"`` given to a program on an SGLangEndpoint: the search takes its server's
    decode curve (cached per server as ``sgl-tts run`` caches it; a flat one here) and starts the
    branches it pays for, where it used to start none for the want of a curve. The process keeps what
    it read: the file gone, another endpoint onto the server still gets the same curve."""
    from programs.beam_search import beam_search
    from sgl_tts.backends import SGLangEndpoint
    from sgl_tts.prm import StepTagPRM
    from sgl_tts.tiny import task

    monkeypatch.setenv("SGLANG_TTS_CACHE", str(tmp_path))
    url = live.url("generator")
    path = _seed_measurements(url)
    gen = SGLangEndpoint(url)
    got = beam_search.run(question=task.test_split()[3].question, prm=StepTagPRM(SGLangEndpoint(live.url("prm"))),
                          backend=gen, speculative="auto", num_beams=8, beam_width=2, max_depth=4, step_tokens=24,
                          seed=5).ret_value
    assert got.branches_started > 0 and got.tokens_speculative > 0 and got.stood_down == {}, got.stood_down
    path.unlink()
    assert SGLangEndpoint(url).decode_curve() == DecodeCurve.of(FLAT)


def test_serve_search_decides_auto_on_its_generators_curve_and_the_prms_slowdown(live, tmp_path, monkeypatch):
    """A serve-search request with ``speculative: auto``: the service resolves it on its own servers
    as ``sgl-tts run`` does (the generator's cached curve, and the PRM's slowdown since both share this
    host), so branches start where the flat curve says they pay and keep running through the
    verification (the slowdown too small to stop them); it used to start none for the want of a curve."""
    from sgl_tts.serving.api import parse_request
    from sgl_tts.serving.service import SearchService
    from sgl_tts.tiny import task

    monkeypatch.setenv("SGLANG_TTS_CACHE", str(tmp_path))
    _seed_measurements(live.url("generator"), live.url("prm"))
    service = SearchService(live.url("generator"), live.url("prm"))
    body = {"model": "beam_search", "messages": [{"role": "user", "content": task.test_split()[3].question}],
            "seed": 5, "budget": 8, "beam_width": 2, "max_depth": 4, "step_tokens": 24, "speculative": "auto"}
    got = service.run(parse_request(body)).result
    assert got.branches_started > 0 and got.stood_down == {}, got.stood_down
