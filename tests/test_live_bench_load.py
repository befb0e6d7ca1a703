"""The load mode of ``sgl-tts bench`` on live CPU servers, run as a user runs it (issue 64): two rates, a
few problems arriving at once, the baseline and the sgl-tts client on one start of the stock servers,
the plugin's recommended load side (oldest search first, ``--tts-admission search``, with overlap) on
the sgl-tts servers. Checks the records, kept-beam equality across sides and
that every search and step request is accounted for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.test_bench_cpu import _answers, _free_ports

pytestmark = pytest.mark.server

SIDES = ("stock", "stock+overlap", "sgl-tts+search-first+overlap")
RATES = (0.5, 4.0)
PROBLEMS = 3


@pytest.mark.timeout(900)
def test_bench_arrivals_serves_searches_at_once_and_accounts_for_every_request(tmp_path):
    gen_port, prm_port = _free_ports(2)
    out = tmp_path / "load.jsonl"
    cmd = [sys.executable, "-m", "sgl_tts.cli", "bench", "--device", "cpu", "--arrivals", "4,0.5",
           "--problems", str(PROBLEMS), "--n", "4", "--algorithms", "beam_search", "--beam-width", "2",
           "--prompt-tokens", "16", "--trace-median", "8", "--trace-max-tokens", "24", "--trace-max-depth", "4",
           "--models-dir", str(tmp_path / "models"), "--output", str(out),
           "--generator-port", str(gen_port), "--prm-port", str(prm_port), "--health-timeout", "300",
           "--sgl-tts-split", "0.5", "--sides", *SIDES, "--no-progress", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stderr[-6000:]

    summary = json.loads(run.stdout)
    assert summary == json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["settings"]["arrivals"] == list(RATES) and summary["settings"]["latency_bound"] == 3.0
    [cell] = summary["cells"]
    assert (cell["algorithm"], cell["n"]) == ("beam_search", 4)
    assert cell["kept_beams_match"] is True and cell["mismatched"] == []
    assert set(cell["sides"]) == set(SIDES)
    for side, c in cell["sides"].items():
        assert [p["rate"] for p in c["points"]] == list(RATES), side
        for p in c["points"]:
            assert p["problems"] == PROBLEMS and p["requests_accounted"] is True, (side, p)
            assert p["stretch_p99"] > 0 and p["sustained"] in (True, False)
            assert 0 < p["p50"] <= p["p99"] and p["throughput"] > 0 and p["goodput"] > 0
            assert p["queue"]["generator"]["max"] is not None and p["queue"]["prm"]["max"] is not None
            assert p["client_cpu_per_1k_tokens"] > 0 and p["recomputed_tokens"] is not None
        assert c["unloaded_measured"] is True and c["unloaded"] > 0
    # the ratios that need stock+overlap and a baseline are there (their values are the run's)
    ratios = cell["ratios"]
    # (the sgl-tts side is named where it sustained the lowest rate: a few one-second searches are noisy)
    assert ratios["plugin_vs_client_sides"][0] in (None, "sgl-tts+search-first+overlap")
    assert ratios["plugin_vs_client_sides"][1] == "stock+overlap"
    assert ratios["best_vs_best_stock_sides"][1] in (None, "stock")
    assert ratios["ordering_vs_lpm"] is None   # no stock-lpm side ran

    records = [json.loads(x) for x in out.read_text().splitlines()][1:]
    blocks = [r for r in records if r["kind"] == "load_block"]
    # each side: the unloaded block (rate key 0: every problem alone, one after another), then each rate
    assert sorted((r["side"], r["rate"]) for r in blocks) == sorted((s, r) for s in SIDES for r in (0.0, *RATES))
    for block in blocks:
        searches = [r for r in records if r["kind"] == "load_search" and r["attempt"] == block["attempt"]]
        # every arrival answered, at or after its arrival; the same problems on every side
        assert sorted(r["problem"] for r in searches) == list(range(PROBLEMS))
        if block["rate"] == 0:   # one in flight: each arrived once the one before was answered
            alone = sorted(searches, key=lambda r: r["problem"])
            assert all(b["arrival"] >= a["answered"] for a, b in zip(alone, alone[1:]))
        assert all(r["answered"] >= r["arrival"] >= 0 and r["latency"] > 0 for r in searches)
        req = block["requests"]
        # every step request the client sent was answered, and the generator counted each one
        assert req["generator_sent"] == req["generator_answered"] > 0
        assert req["server_counted"]["generator"] == req["generator_sent"], block
        assert req["server_counted"]["prm"] == req["prm_answered"] > 0, block
        assert block["queue"]["generator"]["samples"] >= 1
    # the same arrival times on every side at a rate
    arrivals = {(r["side"], r["rate"]): sorted(x["arrival"] for x in records if x["kind"] == "load_search"
                                              and x["attempt"] == r["attempt"]) for r in blocks if r["rate"]}
    for rate in RATES:
        seen = {tuple(round(a, 1) for a in arrivals[s, rate]) for s in SIDES}
        assert len(seen) == 1, seen
    assert (tmp_path / "load.md").read_text().count("### beam_search, n = 4") == 1
    assert (tmp_path / "load.png").stat().st_size > 0
    assert not _answers(gen_port) and not _answers(prm_port)
