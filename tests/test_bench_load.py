"""The load mode of ``sgl-tts bench`` (``--arrivals``, issue 64): the arrival process, the maximum-
sustainable-rate rule and the report's cells and ratios, against hand-worked cases."""

from __future__ import annotations

import argparse
import statistics

import pytest

from sgl_tts.bench.arrivals import (RatePoint, latencies_growing, max_sustainable_rate, poisson_arrivals,
                                    scaled_poisson_arrivals, sustained, unloaded_latency)
from sgl_tts.bench.goodput_settings import BenchSettings
from sgl_tts.bench.load_report import finished_searches, in_flight_max, summarize_load
from sgl_tts.cli.bench import rates


def test_poisson_arrivals_are_seeded_increasing_and_at_their_rate():
    a = poisson_arrivals(0.5, 4000, seed=3)
    assert a == poisson_arrivals(0.5, 4000, seed=3) and a != poisson_arrivals(0.5, 4000, seed=4)
    assert a[:5] != poisson_arrivals(0.25, 5, seed=3)   # another rate, other times
    gaps = [b - x for x, b in zip([0.0] + a, a)]
    assert all(g > 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(2.0, rel=0.05)      # mean gap 1 / rate
    assert statistics.stdev(gaps) == pytest.approx(2.0, rel=0.08)     # exponential: sd = mean
    with pytest.raises(ValueError, match="rate > 0"):
        poisson_arrivals(0.0, 3, seed=0)


def test_scaled_arrivals_are_one_pattern_compressed_by_the_rate():
    slow, fast = scaled_poisson_arrivals(0.1, 2000, seed=0), scaled_poisson_arrivals(0.4, 2000, seed=0)
    assert fast == pytest.approx([t / 4 for t in slow])          # the same pattern, 4x denser
    assert slow != scaled_poisson_arrivals(0.1, 2000, seed=1)
    gaps = [b - x for x, b in zip([0.0] + fast, fast)]
    assert statistics.mean(gaps) == pytest.approx(2.5, rel=0.06) and min(gaps) > 0
    with pytest.raises(ValueError, match="rate > 0"):
        scaled_poisson_arrivals(-1.0, 3, seed=0)


def test_latencies_grow_when_the_later_half_waits_longer():
    assert latencies_growing([10, 10, 10, 10]) is False
    assert latencies_growing([10, 10, 20, 30]) is True       # 25 > 1.5 * 10
    assert latencies_growing([10, 10, 14, 15]) is False      # 14.5 <= 15
    assert latencies_growing([10, 99, 14]) is False          # odd: the middle arrival in neither half
    assert latencies_growing([10, 99, 16]) is True
    assert latencies_growing([10]) is False and latencies_growing([]) is False


def test_max_sustainable_rate_is_the_highest_rate_passing_with_every_lower_one():
    light, mid, high = RatePoint(0.1, 10, 12, False), RatePoint(0.2, 14, 25, False), RatePoint(0.4, 20, 31, False)
    assert unloaded_latency([high, light, mid]) == 10            # the median at the lowest rate
    assert max_sustainable_rate([high, mid, light]) == 0.2       # 31 > 3 x 10
    assert max_sustainable_rate([high, mid, light], bound=3.2) == 0.4
    # a pass above a failure does not count
    assert max_sustainable_rate([light, RatePoint(0.2, 20, 40, False), RatePoint(0.4, 10, 20, False)]) == 0.1
    # within the bound but growing: not sustained
    assert sustained(RatePoint(0.2, 12, 20, True), unloaded=10) is False
    assert max_sustainable_rate([light, RatePoint(0.2, 12, 20, True), high]) == 0.1
    # even the lowest fails: none
    assert max_sustainable_rate([RatePoint(0.1, 10, 31, False)]) is None
    assert max_sustainable_rate([]) is None


def _block(side, rate, latencies, *, kept=None, attempt="a", algorithm="beam_search", n=16, problems=None):
    """A finished block: its searches arrive one second apart, in order, with these latencies."""
    out = [{"kind": "load_search", "side": side, "algorithm": algorithm, "n": n, "rate": rate, "problem": k,
            "attempt": attempt, "arrival": float(k), "answered": k + lat, "latency": lat, "tokens_generated": 100,
            "tokens_kept": 50, "trajectory_tokens": 40, "prm_requests": 3,
            "kept": (kept or {}).get(k, [[[0, k], True, 40, 0.5]])} for k, lat in enumerate(latencies)]
    span = max(k + lat for k, lat in enumerate(latencies))
    out.append({"kind": "load_block", "side": side, "algorithm": algorithm, "n": n, "rate": rate, "attempt": attempt,
                "problems": len(latencies) if problems is None else problems, "span": span,
                "last_arrival": float(len(latencies) - 1) or 0.5,
                "client_cpu_seconds": 2.0, "queue": {"generator": {"p50": 3, "max": 150}, "prm": {"p50": 0, "max": 9}},
                "counters": {"generator": {"recomputed_blocks": 5, "evicted_tokens": 700, "retracted_requests": 1}},
                "requests": {"generator_sent": 12, "generator_answered": 12, "prm_answered": 4,
                             "server_counted": {"generator": 12, "prm": 4}}})
    return out


def _records():
    rec = []
    for side, per_rate in {
        "stock": {0.1: [10] * 4, 0.2: [35] * 4},
        "stock-lpm": {0.1: [10] * 4, 0.2: [12] * 4, 0.4: [40] * 4},
        "stock+overlap": {0.1: [8] * 4, 0.2: [9] * 4, 0.4: [10, 10, 20, 20]},   # within 24 s but growing
        "sgl-tts+locality": {0.1: [10] * 4, 0.2: [11] * 4, 0.4: [29] * 4},
        "sgl-tts+locality+overlap": {0.1: [8] * 4, 0.2: [8] * 4, 0.4: [9] * 4},
    }.items():
        for rate, lat in per_rate.items():
            kept = {1: [[[3, 1], True, 40, 0.5]]} if (side, rate) == ("sgl-tts+locality", 0.2) else None
            rec += _block(side, rate, lat, kept=kept)
    # an attempt the run did not finish (its block redone after a crash): never counted
    rec.insert(0, {**rec[0], "attempt": "stale", "latency": 1000.0})
    return rec


def test_the_report_reads_max_rates_ratios_and_kept_beams_from_the_records():
    [cell] = summarize_load(_records(), bound=3.0)
    assert (cell.algorithm, cell.n) == ("beam_search", 16)
    got = {side: (c.unloaded, c.max_rate, c.saturated) for side, c in cell.sides.items()}
    assert got == {"stock": (10, 0.1, True), "stock-lpm": (10, 0.2, True), "stock+overlap": (8, 0.2, True),
                   "sgl-tts+locality": (10, 0.4, False), "sgl-tts+locality+overlap": (8, 0.4, False)}
    r = cell.ratios
    # the best plugin side: both locality sides sustain 0.4; the one with the lower p99 there wins the tie
    assert (r["best_vs_best_stock"], r["best_vs_best_stock_sides"], r["best_vs_best_stock_lower_bound"]) == (
        2.0, ["sgl-tts+locality+overlap", "stock-lpm"], True)
    assert (r["ordering_vs_lpm"], r["ordering_vs_lpm_sides"]) == (2.0, ["sgl-tts+locality", "stock-lpm"])
    assert (r["plugin_vs_client"], r["plugin_vs_client_sides"]) == (2.0, ["sgl-tts+locality+overlap", "stock+overlap"])
    # at the best stock side's maximum rate (0.2/s): stock-lpm's p99 12 s over the best side's 8 s
    assert (r["at_rate"], r["p99_best_stock_over_best"]) == (0.2, 1.5)
    assert cell.kept_beams_match is False and cell.mismatched == [[0.2, 1]]
    lpm = cell.sides["stock-lpm"].points[2]
    assert (lpm.rate, lpm.p99, lpm.sustained, lpm.growing) == (0.4, 40, False, False)
    assert lpm.offered == round(4 / 3, 4)    # four searches by the last arrival at 3 s
    assert lpm.in_flight_max == 4            # each arrives before the first answer (at 40 s)
    assert in_flight_max([{"arrival": 0, "answered": 2}, {"arrival": 2, "answered": 3},
                          {"arrival": 2.5, "answered": 4}]) == 2   # the first left as the second came
    assert lpm.throughput == pytest.approx(4 / 43) and lpm.goodput == pytest.approx(160 / 43)
    assert (lpm.recomputed_tokens, lpm.evicted_tokens, lpm.queue["generator"]["max"]) == (80, 700, 150)
    assert lpm.client_cpu_per_1k_tokens == pytest.approx(5.0) and lpm.requests_accounted is True


def test_the_report_drops_unfinished_attempts_and_flags_lost_searches():
    records = _records()
    assert all(r["attempt"] == "a" for recs in finished_searches(records).values() for r in recs)
    [cell] = summarize_load(records, bound=3.0)
    assert cell.sides["stock"].points[0].p99 == 10    # the stale 1000 s search is not there
    # a block whose record names more problems than finished searches: not every request accounted for
    lost = [r for r in _block("stock", 0.1, [10, 10], problems=3)]
    [cell] = summarize_load(lost, bound=3.0)
    assert cell.sides["stock"].points[0].requests_accounted is False
    assert cell.kept_beams_match is None                # one side: nothing compared


def test_a_ratio_is_none_when_a_side_it_needs_is_missing_or_never_sustained():
    rec = _block("stock-lpm", 0.1, [10, 40]) + _block("sgl-tts", 0.1, [10, 10])
    [cell] = summarize_load(rec, bound=3.0)
    assert cell.sides["stock-lpm"].max_rate is None       # within 3 x 25 s, but the later arrival waited 4x longer
    assert cell.ratios["ordering_vs_lpm"] is None and cell.ratios["plugin_vs_client"] is None
    assert cell.ratios["best_vs_best_stock"] is None and cell.ratios["p99_best_stock_over_best"] is None


def test_load_settings_keep_the_one_at_a_time_header_and_refuse_bad_rates():
    plain = BenchSettings(n=(8,)).to_json()
    assert "arrivals" not in plain and "latency_bound" not in plain   # earlier records still resume
    load = BenchSettings(n=(8,), arrivals=(0.1, 0.2)).to_json()
    assert load["arrivals"] == [0.1, 0.2] and load["latency_bound"] == 3.0
    with pytest.raises(ValueError, match="arrival rate must be > 0"):
        BenchSettings(n=(8,), arrivals=(0.1, 0.0))
    with pytest.raises(ValueError, match="given once"):
        BenchSettings(n=(8,), arrivals=(0.1, 0.1))
    with pytest.raises(ValueError, match="latency bound must be > 1"):
        BenchSettings(n=(8,), arrivals=(0.1,), latency_bound=1.0)
    assert rates("0.2, 0.05,0.1") == [0.05, 0.1, 0.2]
    for bad in ("0,1", "a,b", "0.1,0.1", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            rates(bad)


def test_vs_best_stock_is_against_the_baselines_not_the_sgl_tts_client_on_stock_servers():
    """stock+overlap runs on the stock servers, but with the sgl-tts client: the goodput report's
    ``vs best stock`` is against stock SGLang's own policies only."""
    from sgl_tts.bench.goodput_report import ReportRow, SideRow, format_report
    from sgl_tts.bench.sides import BASELINES, is_baseline, is_stock

    assert is_stock("stock+overlap") and not is_baseline("stock+overlap")
    assert all(is_stock(s) and is_baseline(s) for s in BASELINES) and not is_baseline("sgl-tts")

    def side(goodput):
        return SideRow(1, goodput, 1.0, 0.5, 0.5, 100, 50, 0.9, 0.8)

    row = ReportRow("beam_search", 8, {"stock-lpm": side(10.0), "stock+overlap": side(20.0), "sgl-tts": side(15.0)},
                    None, 8, True, [])
    table = format_report([row])
    assert "| sgl-tts | 1 | 15.0 | 1.50x |" in table and "| stock+overlap | 1 | 20.0 | 2.00x |" in table


def test_the_unloaded_block_sets_each_search_s_stretch_and_is_not_a_rate_point():
    """With an unloaded block (rate key 0: each problem alone, one after another) the rule reads each
    search's stretch, its latency over its own problem's alone; that block is no point of the curve."""
    rec = (_block("stock-lpm", 0.0, [3, 4, 3.5, 3.5]) + _block("stock-lpm", 0.1, [9] * 4)
           + _block("stock-lpm", 0.2, [12] * 4) + _block("sgl-tts", 0.1, [10] * 4) + _block("sgl-tts", 0.2, [12] * 4))
    [cell] = summarize_load(rec, bound=3.0)
    lpm, tts = cell.sides["stock-lpm"], cell.sides["sgl-tts"]
    assert [p.rate for p in lpm.points] == [0.1, 0.2]
    # at 0.1/s the stretches are 9/3, 9/4, 9/3.5, 9/3.5: p99 2.987 <= 3; at 0.2/s 12/3 = 4 > 3
    first, second = lpm.points
    assert first.stretch_p99 == pytest.approx(9 / 3.5 + 0.97 * (3 - 9 / 3.5))   # linear between ranks
    assert (first.sustained, second.sustained, second.stretch_p50) == (True, False, pytest.approx(12 / 3.5))
    assert (lpm.unloaded, lpm.unloaded_measured, lpm.max_rate, lpm.saturated) == (3.5, True, 0.1, True)
    # no unloaded block: its latencies against its p50 at the lowest rate (10 s), said so
    assert (tts.unloaded, tts.unloaded_measured, tts.max_rate) == (10, False, 0.2)
    assert tts.points[0].stretch_p99 is None
    assert cell.ratios["ordering_vs_lpm"] == 2.0
    assert cell.kept_beams_match is True   # the unloaded block's searches are not compared by rate
    # a problem missing from the unloaded block is taken at its median
    [cell] = summarize_load(_block("stock", 0.0, [2, 4]) + _block("stock", 0.1, [6, 6, 6]), bound=3.0)
    assert cell.sides["stock"].points[0].stretch_p50 == pytest.approx(2.0)   # 6/2, 6/4, 6/3 -> median 2


def test_the_p99_ratio_if_the_best_side_s_searches_took_their_time_alone():
    """``p99_ratio_if_alone``: the best stock side's p99 at its maximum rate over the p99 the best sgl-tts
    side would have there if each search took its problem's time alone (the unloaded block)."""
    rec = (_block("stock-lpm", 0.0, [3, 4, 3.5, 3.5]) + _block("stock-lpm", 0.1, [9] * 4)
           + _block("stock-lpm", 0.2, [12] * 4) + _block("sgl-tts", 0.0, [2, 5, 3, 3])
           + _block("sgl-tts", 0.1, [6] * 4) + _block("sgl-tts", 0.2, [7] * 4))
    [cell] = summarize_load(rec, bound=3.0)
    r = cell.ratios
    # lpm holds 0.1/s (p99 9 s there); sgl-tts's p99 there is 6 s; alone its problems take 2, 3, 3, 5 s:
    # p99 4.94 s (linear between ranks): searches as fast as alone would give 9 / 4.94
    assert (r["at_rate"], r["p99_best_stock_over_best"]) == (0.1, 1.5)
    assert r["p99_ratio_if_alone"] == round(9 / (3 + 0.97 * 2), 3) == 1.822
    # no unloaded block for the best side: no bound
    assert summarize_load(_records(), bound=3.0)[0].ratios["p99_ratio_if_alone"] is None


def _header(budget, command):
    return {"generator": "g", "prm": "p", "machine": "2-core CPU", "date": "2026-12-03", "command": command,
            "budget": budget}


def test_a_load_report_adds_the_cells_of_other_records_files_each_under_its_regime(tmp_path):
    import json

    from sgl_tts.bench.goodput_store import RecordWriter, read_with_settings
    from sgl_tts.bench.load_report import LoadSource, write_load_report

    s16 = BenchSettings(algorithms=("beam_search",), n=(16,), problems=4, arrivals=(0.1, 0.2, 0.4))
    s64 = BenchSettings(algorithms=("beam_search",), n=(64,), problems=4, arrivals=(0.05, 0.1))
    # n = 64 in its own file (another budget and rates): lpm holds 0.05, the plugin side both rates
    r64 = (_block("stock-lpm", 0.05, [10] * 4, n=64) + _block("stock-lpm", 0.1, [50] * 4, n=64)
           + _block("sgl-tts+locality", 0.05, [10] * 4, n=64) + _block("sgl-tts+locality", 0.1, [12] * 4, n=64))
    path = tmp_path / "n64.jsonl"
    write = RecordWriter(path, s64)
    for r in [{"kind": "run", **_header("64 MiB of KV; split 0.5", "bench --n 64")}, *r64]:
        write(r)
    settings, records = read_with_settings(path)
    assert settings == s64 and records == [{"kind": "run", **_header("64 MiB of KV; split 0.5", "bench --n 64")}, *r64]
    extra = LoadSource(path.name, settings, _header("64 MiB of KV; split 0.5", "bench --n 64"), records)
    out = tmp_path / "load.jsonl"
    md = write_load_report(_records(), s16, out, _header("16 MiB of KV", "bench --n 16"), [extra])
    cells = json.loads(out.with_suffix(".summary.json").read_text())["cells"]
    assert [(c["algorithm"], c["n"], c["source"]["records"]) for c in cells] == [
        ("beam_search", 16, "load.jsonl"), ("beam_search", 64, "n64.jsonl")]
    assert cells[0]["source"]["budget"] == "16 MiB of KV" and cells[0]["source"]["arrivals"] == [0.1, 0.2, 0.4]
    src = cells[1]["source"]
    assert (src["budget"], src["arrivals"], src["problems"], src["commands"]) == (
        "64 MiB of KV; split 0.5", [0.05, 0.1], 4, ["bench --n 64"])
    # the n = 64 cell's ratios from its own records: 0.1 (never saturated) over lpm's 0.05
    r = cells[1]["ratios"]
    assert (r["best_vs_best_stock"], r["best_vs_best_stock_lower_bound"], r["at_rate"]) == (2.0, True, 0.05)
    assert cells[0]["ratios"]["best_vs_best_stock"] == 2.0   # the first file's cell as alone
    assert "\n## The cells of `n64.jsonl`\n" in md and "- command: `bench --n 64`" in md
    assert "- offered rates (searches / s): 0.05, 0.1; 4 Poisson arrivals" in md
    assert md.index("### beam_search, n = 16") < md.index("## The cells of") < md.index("### beam_search, n = 64")
    assert out.with_suffix(".png").stat().st_size > 10_000
    # one colour per side in every panel, in the sides' registry order, whichever panel a side is in
    from sgl_tts.bench.load_report import side_colours, summarize_load

    both = summarize_load(_records(), 3.0) + summarize_load(r64, 3.0)
    assert side_colours(both) == {"stock": "C0", "stock-lpm": "C1", "stock+overlap": "C2",
                                  "sgl-tts+locality": "C3", "sgl-tts+locality+overlap": "C4"}
    assert side_colours(summarize_load(r64, 3.0)) == {"stock-lpm": "C0", "sgl-tts+locality": "C1"}


def test_a_file_repeating_a_cell_is_another_run_of_it_with_its_beams_compared_to_the_first(tmp_path):
    """A records file of the same settings holding an (algorithm, n) the report holds (a repeat, or the
    sgl-tts servers under another KV split) is another run of that cell: its sides keep their own
    maxima, its beams are compared with the first run's; other settings are refused."""
    import dataclasses
    import json

    from sgl_tts.bench.load_report import LoadSource, write_load_report

    s16 = BenchSettings(algorithms=("beam_search",), n=(16,), problems=4, arrivals=(0.1, 0.2, 0.4))
    header = {**_header("16 MiB of KV", "bench --n 16"), "splits": {"sgl-tts": {"generator_share": 0.5, "planned": False}}}
    # the split-0.3 run: one side, two of the rates (the grid may differ); at 0.2 its p99 30 s passes 3x its
    # 8 s p50 at the lowest rate. Problem 2 at 0.2 kept other beams than every side of the first run kept;
    # problem 1 at 0.2 kept what stock kept there (the first run's own sides disagree on it: not this run's doing)
    run = (_block("sgl-tts+locality+overlap", 0.1, [8] * 4)
           + _block("sgl-tts+locality+overlap", 0.2, [30] * 4, kept={2: [[[9, 9], True, 40, 0.5]]}))
    s03 = BenchSettings(algorithms=("beam_search",), n=(16,), problems=4, arrivals=(0.1, 0.2))
    header03 = {**_header("16 MiB of KV", "bench --sgl-tts-split 0.3"), "date": "2026-12-04",
                "splits": {"sgl-tts": {"generator_share": 0.3, "planned": False}}}
    out = tmp_path / "load.jsonl"
    md = write_load_report(_records(), s16, out, header, [LoadSource("split03.jsonl", s03, header03, run)])
    [cell] = json.loads(out.with_suffix(".summary.json").read_text())["cells"]
    assert cell["source"]["records"] == "load.jsonl" and cell["ratios"]["best_vs_best_stock"] == 2.0   # the first run's
    [r] = cell["runs"]
    assert (r["source"]["records"], r["source"]["splits"]["sgl-tts"]["generator_share"]) == ("split03.jsonl", 0.3)
    assert (r["same_beams_as_first"], r["differ_from_first"], r["kept_beams_match"]) == (False, [[0.2, 2]], None)
    side = r["sides"]["sgl-tts+locality+overlap"]
    assert (side["max_sustainable_rate"], side["saturated"]) == (0.1, True)
    assert r["ratios"]["best_vs_best_stock"] is None   # no stock side in this run
    assert ("| `load.jsonl` | 0.5 (given) | 2-core CPU, 2026-12-03 | sgl-tts+locality+overlap | 8.0 | >= 0.4 | "
            "0.1: 8.0, 0.2: 8.0, 0.4: 9.0 | 0.1: -, 0.2: -, 0.4: - | 0.1: 80, 0.2: 80, 0.4: 80 | (first) |") in md
    assert ("| `split03.jsonl` | 0.3 (given) | 2-core CPU, 2026-12-04 | sgl-tts+locality+overlap | 8.0 | 0.1 | "
            "0.1: 8.0, 0.2: 30.0 | 0.1: -, 0.2: - | 0.1: 80, 0.2: 80 | DIFFER at [[0.2, 2]] |") in md
    assert "## Other runs" in md and "### `split03.jsonl`" in md and "## The cells of" not in md
    # the same beams everywhere: the run is the same as the first
    same = LoadSource("repeat.jsonl", s03, header03, _block("sgl-tts+locality+overlap", 0.1, [8] * 4))
    md = write_load_report(_records(), s16, out, header, [same])
    assert "| sgl-tts+locality+overlap | 8.0 | >= 0.1 | 0.1: 8.0 | 0.1: - | 0.1: 80 | same |" in md
    # other problems (or trace, seeds) are not a run of the same cell
    other = LoadSource("other.jsonl", dataclasses.replace(s03, seed=1), header03, run)
    with pytest.raises(ValueError, match=r"^beam_search, n = 16 of other.jsonl is not another run of load.jsonl's "
                                         r"cell: their settings differ in seed$"):
        write_load_report(_records(), s16, out, header, [other])
    # nor another KV budget (its split may differ: "16 MiB of KV; split 0.3" is a run of "16 MiB of KV")
    bigger = LoadSource("bigger.jsonl", s03, {**header03, "budget": "32 MiB of KV"}, run)
    with pytest.raises(ValueError, match=r"their settings differ in budget$"):
        write_load_report(_records(), s16, out, header, [bigger])
    split = LoadSource("split.jsonl", s03, {**header03, "budget": "16 MiB of KV; split 0.3"}, run)
    assert "| `split.jsonl` | 0.3 (given) |" in write_load_report(_records(), s16, out, header, [split])


def test_with_records_is_for_a_rebuilt_load_report_and_reads_only_benchmark_records(tmp_path, capsys):
    from sgl_tts.bench.errors import BenchError
    from sgl_tts.bench.goodput_store import read_with_settings
    from sgl_tts.cli.bench import main

    for argv in (["--device", "cpu", "--arrivals", "0.1", "--with-records", "x.jsonl"],
                 ["--device", "cpu", "--report-only", "--with-records", "x.jsonl"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert "--with-records needs --report-only and --arrivals" in capsys.readouterr().err
    with pytest.raises(BenchError, match=r"missing.jsonl: no such records file$"):
        read_with_settings(tmp_path / "missing.jsonl")
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"kind": "note"}\n')
    with pytest.raises(BenchError, match=r"notes.jsonl does not start with a benchmark's settings line"):
        read_with_settings(notes)
    from sgl_tts.bench.goodput_store import RecordWriter
    from sgl_tts.cli.bench import _other_records

    one_at_a_time = tmp_path / "goodput.jsonl"
    RecordWriter(one_at_a_time, BenchSettings(algorithms=("beam_search",), n=(16,)))({"kind": "run"})
    with pytest.raises(BenchError, match=r"goodput.jsonl holds searches run one at a time, not the load mode"):
        _other_records([one_at_a_time], _header("x", "bench"))
