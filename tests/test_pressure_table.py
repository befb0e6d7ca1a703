"""The pressure table (issue 32): which recorded runs it reads, and each row's figures worked out by
hand from the issue's definitions (goodput against the same run's best stock side; recomputed =
prefilled less the 1 GiB floor, against the stock side that recomputed least; both goals at once)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from sgl_tts.bench.goodput_settings import BenchSettings
from sgl_tts.bench.pressure_table import best_per_cell, format_table, pressure_rows, read_run, write

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = BenchSettings(algorithms=("dvts",), n=(64,), problems=1, prompt_tokens=512)


def _search(side: str, goodput: float, gen: tuple[int, int], prm: tuple[int, int], kept=((0,),), n: int = 64) -> dict:
    """One search's record: ``goodput`` over 12 s, ``gen``/``prm`` = (prompt, cached) tokens."""
    return {"kind": "search", "algorithm": "dvts", "n": n, "side": side, "problem": 0, "seconds": 12.0,
            "waited_verifying": 2.0, "trajectory_seconds": 12.0, "trajectory_tokens": goodput * 12.0,
            "tokens_generated": 100, "tokens_kept": 50, "kept": [list(kept)],
            "generator": {"prompt_tokens": gen[0], "cached_tokens": gen[1]},
            "prm": {"prompt_tokens": prm[0], "cached_tokens": prm[1]}}


def _run(path: Path, budget: str, searches: list[dict], *, stock_share: float = 0.37,
         prm: str = "tiny-cpu-prm", settings: BenchSettings = SETTINGS) -> Path:
    header = {"kind": "run", "machine": "test host", "date": "2026-11-29", "command": f"sgl-tts bench ({path.name})",
              "generator": "tiny-cpu-generator", "prm": prm, "budget": f"{budget} of KV on the CPU; generator share: ...",
              "splits": {"stock": {"generator_share": stock_share, "planned": False}}}
    lines = [{"kind": "settings", "settings": settings.to_json()}, header, *searches]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture
def records(tmp_path) -> list[Path]:
    floor = _run(tmp_path / "floor.jsonl", "1024.0 MiB",
                 [_search("stock-dfs-weight", 5.0, (1000, 900), (2000, 1000))], stock_share=0.5)   # 100 + 1,000
    pressed = _run(tmp_path / "pressed.jsonl", "11.1 MiB", [
        _search("stock-lpm", 10.0, (1000, 400), (5000, 2000)),         # prefilled 600 + 3,000: recomputed 2,500
        _search("stock-dfs-weight", 12.0, (1000, 500), (5000, 2900)),  # 500 + 2,100: 1,500, the least stock side
        _search("sgl-tts+locality+overlap", 18.0, (1000, 700), (5000, 3450)),   # 1.50x; 300 + 1,550: 750, -50%
        _search("sgl-tts+locality", 17.9, (1000, 700), (5000, 3450)),  # 1.49x, -50%: one goal
        _search("sgl-tts+locality+overlap-by-family", 20.0, (1000, 700), (5000, 3449)),   # 1.67x, 751: -49.9%
    ])
    other = [  # not the pressure workload: another budget, another stock split, another PRM
        _run(tmp_path / "twelve.jsonl", "12.0 MiB", [_search("stock-lpm", 1.0, (9, 0), (9, 0)),
                                                      _search("sgl-tts+locality", 9.0, (9, 9), (9, 9))]),
        _run(tmp_path / "split.jsonl", "11.1 MiB", [_search("stock-lpm", 1.0, (9, 0), (9, 0)),
                                                     _search("sgl-tts+locality", 9.0, (9, 9), (9, 9))], stock_share=0.5),
        _run(tmp_path / "wide.jsonl", "11.1 MiB", [_search("stock-lpm", 1.0, (9, 0), (9, 0)),
                                                    _search("sgl-tts+locality", 9.0, (9, 9), (9, 9))],
             prm="tiny-cpu-prm-wide"),
        _run(tmp_path / "no_stock.jsonl", "11.1 MiB", [_search("sgl-tts+locality", 9.0, (9, 9), (9, 9))]),
    ]
    return [floor, pressed, *other]


def test_rows_are_worked_out_against_the_same_runs_stock_sides(records):
    rows = pressure_rows([read_run(p) for p in records])
    assert {r.run for r in rows} == {"pressed.jsonl"}   # the floor, other budgets/splits/PRMs, no stock: out
    by = {r.side: r for r in rows}
    assert list(by) == ["stock-lpm", "stock-dfs-weight", "sgl-tts+locality", "sgl-tts+locality+overlap",
                        "sgl-tts+locality+overlap-by-family"]   # the bench's side order
    assert [by[s].vs_best_stock for s in by] == pytest.approx([10 / 12, 1.0, 17.9 / 12, 1.5, 20 / 12])
    assert [by[s].recomputed for s in by] == [2500, 1500, 750, 750, 751]
    assert (by["stock-lpm"].generator_prefilled, by["stock-lpm"].prm_prefilled) == (600, 3000)
    assert by["sgl-tts+locality+overlap"].vs_least_stock == pytest.approx(-0.5)
    assert by["stock-lpm"].vs_least_stock == pytest.approx(2500 / 1500 - 1)
    # both goals: only where 1.5x and -50% hold together (each at its bound counts)
    assert [s for s, r in by.items() if r.goals_met] == ["sgl-tts+locality+overlap"]
    assert all(r.kept_beams_match for r in rows) and all(r.budget_mib == 11.1 for r in rows)


def test_differing_kept_beams_or_a_missing_floor_meet_no_goal(records, tmp_path):
    runs = [read_run(p) for p in records]
    pressed = runs[1]
    differ = [dict(r, kept=[[1]]) if r.get("side") == "sgl-tts+locality+overlap" else r for r in pressed.records]
    rows = pressure_rows([runs[0], replace(pressed, records=tuple(differ))])
    assert {r.kept_beams_match for r in rows} == {False}
    assert not any(r.goals_met for r in rows)
    assert "DIFFER" in format_table(rows)
    alone = pressure_rows([pressed])   # no floor run: prefilled only
    assert {r.recomputed for r in alone} == {None} and not any(r.goals_met for r in alone)
    assert alone[0].generator_prefilled == 600
    # a floor of other searches (another prompt length) is not this search's floor; another limit batch is
    for settings, applies in ((BenchSettings(algorithms=("dvts",), n=(64,), problems=1, prompt_tokens=200), False),
                              (BenchSettings(algorithms=("dvts",), n=(64, 128), problems=1, prompt_tokens=512,
                                             planned_batch=128), True)):
        other = read_run(_run(tmp_path / "other_floor.jsonl", "1024.0 MiB",
                              [_search("stock-lpm", 5.0, (1000, 900), (2000, 1000))], settings=settings))
        assert {r.recomputed is not None for r in pressure_rows([other, pressed])} == {applies}


def test_the_best_per_cell(records):
    cell, = best_per_cell(pressure_rows([read_run(p) for p in records]))
    assert (cell.algorithm, cell.n, cell.runs) == ("dvts", 64, 1)
    assert cell.best_goodput.side == "sgl-tts+locality+overlap-by-family"
    assert cell.fewest_recomputed.side == "sgl-tts+locality"   # 750, as the overlap side: the first in side order
    assert [r.side for r in cell.both_goals] == ["sgl-tts+locality+overlap"]


def test_a_file_that_is_not_a_benchmark_output_is_named(tmp_path):
    bad = tmp_path / "notes.jsonl"
    bad.write_text(json.dumps({"kind": "search"}) + "\n")
    with pytest.raises(ValueError, match="notes.jsonl: not a benchmark output"):
        read_run(bad)
    with pytest.raises(ValueError, match="nothing to tabulate"):
        write([_run(tmp_path / "lone.jsonl", "12.0 MiB", [_search("stock-lpm", 1.0, (9, 0), (9, 0))])],
              tmp_path / "t.md", "test")


def test_the_shipped_table_is_the_one_its_records_give(tmp_path):
    shipped = json.loads((ROOT / "docs" / "benchmarks" / "cpu_pressure.summary.json").read_text())
    records = sorted((ROOT / "docs" / "benchmarks").glob("cpu_pressure*.jsonl"))
    write(records, tmp_path / "cpu_pressure.md", "test")
    again = json.loads((tmp_path / "cpu_pressure.summary.json").read_text())
    stale = "docs/benchmarks/cpu_pressure.* is not what its records give: ./dev.sh run python benchmarks/pressure_table.py"
    assert (again["rows"], again["best"]) == (shipped["rows"], shipped["best"]), stale
    assert (tmp_path / "cpu_pressure.png").stat().st_size > 10_000
