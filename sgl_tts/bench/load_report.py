"""The load mode's report (``sgl-tts bench --arrivals``): per (algorithm, n) a *cell* with every side's
points (one per offered rate), its maximum sustainable rate (:mod:`sgl_tts.bench.arrivals`), and the
three ratios that attribute a gain:

- ``best_vs_best_stock``: the best side on the sgl-tts servers over the best baseline (``stock``,
  ``stock-lpm``, ``stock-dfs-weight``), by maximum sustainable rate;
- ``ordering_vs_lpm``: the best side on the sgl-tts servers without overlapped verification over
  ``stock-lpm``: what the plugin's order (and admission) wins alone;
- ``plugin_vs_client``: the best side on the sgl-tts servers over ``stock+overlap`` (the sgl-tts client
  on stock servers): what the plugin adds to the client.

A ratio is ``None`` when a side it needs did not run or sustained not even the lowest rate; it is a
lower bound (``*_lower_bound: true``) when its numerator's side sustained every rate measured (its
real maximum lies higher). Only searches of finished blocks count (:mod:`sgl_tts.bench.goodput_load`).

One report can hold several records files (:class:`LoadSource`). A file whose (algorithm, n) the report
already holds, with the same settings, is *another run* of that cell (:class:`CellRun`): a repeat, or the
sgl-tts servers under another KV split. Its sides keep their own maxima and ratios, and its kept beams
are compared with the cell's first run, problem by problem, since the same problems, arrivals, trace and
seeds must keep the same beams whatever the pools.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from sgl_tts.bench import server_counters
from sgl_tts.bench.arrivals import RatePoint, latencies_growing, max_sustainable_rate, sustained, unloaded_latency
from sgl_tts.bench.goodput_load import UNLOADED, block_key
from sgl_tts.bench.goodput_store import GRID
from sgl_tts.bench.goodput_report import plot_title, provenance_lines, write_report_files
from sgl_tts.bench.sides import ALL_SIDES, BASELINES, SIDE_OPTIONS, is_stock
from sgl_tts.experiment import quantile

CLIENT_SIDE = "stock+overlap"
LPM_SIDE = "stock-lpm"


@dataclasses.dataclass
class LoadPoint:
    """One side at one offered rate (one finished block)."""

    rate: float
    problems: int
    offered: float               # the rate these arrivals really offered: searches over the last arrival's time
    span: float                  # first arrival to last answer, seconds
    throughput: float            # searches per second over the span
    goodput: float               # kept trajectories' tokens per second over the span
    p50: float                   # latency from arrival to answer, seconds
    p99: float
    growing: bool                # later arrivals waited longer (:func:`latencies_growing`)
    in_flight_max: int = 0       # the most searches in flight at once (arrived, not yet answered)
    sustained: bool | None = None
    tokens_generated: int = 0
    recomputed_tokens: float | None = None   # the generator's observer: prompt tokens computed again
    evicted_tokens: float | None = None
    retracted_requests: float | None = None
    queue: dict = dataclasses.field(default_factory=dict)   # per server: p50, max of the waiting queue
    client_cpu_per_1k_tokens: float | None = None
    requests_accounted: bool | None = None   # every step request sent was answered (and counted)
    # each search's latency over its problem's latency alone (the unloaded block): the rule reads these
    stretch_p50: float | None = None
    stretch_p99: float | None = None
    stretch_growing: bool | None = None


@dataclasses.dataclass
class SideCell:
    side: str
    points: list[LoadPoint]
    unloaded: float | None       # p50 at the lowest rate
    max_rate: float | None       # :func:`max_sustainable_rate`
    saturated: bool              # some measured rate was not sustained (the maximum is measured, not a floor)
    unloaded_measured: bool = True   # from the unloaded block (else: the p50 at the lowest rate)


@dataclasses.dataclass
class CellRun:
    """Another run of a cell, from another records file of the same settings (a repeat, another split)."""

    source: dict                 # :meth:`LoadSource.describe`
    sides: dict[str, SideCell]
    ratios: dict                 # its own, from its own sides (:func:`summarize_load`)
    kept_beams_match: bool | None            # within the run, side against side
    same_beams_as_first: bool | None = None  # against the cell's first run, same (rate, problem); None: none shared
    differ_from_first: list = dataclasses.field(default_factory=list)   # [rate, problem] whose beams differ


@dataclasses.dataclass
class LoadCell:
    algorithm: str
    n: int
    sides: dict[str, SideCell]
    kept_beams_match: bool | None
    mismatched: list
    ratios: dict
    source: dict | None = None   # the records file it came from and its regime (:meth:`LoadSource.describe`)
    runs: list[CellRun] = dataclasses.field(default_factory=list)   # other files' runs of this (algorithm, n)


@dataclasses.dataclass
class LoadSource:
    """One records file of the load mode: its records with its own settings and header, so one report
    can hold regimes of different budgets, rates or problems (e.g. n = 16 and n = 64, each with pools
    that hold the same share of the trees in flight)."""

    name: str
    settings: object           # :class:`sgl_tts.bench.goodput_settings.BenchSettings`
    header: dict               # the runs' header (:func:`sgl_tts.bench.command.measured_header`)
    records: Sequence[dict]

    def describe(self) -> dict:
        h = self.header
        return {"records": self.name, "budget": h.get("budget"), "pools": h.get("pools"), "splits": h.get("splits"),
                "arrivals": list(self.settings.arrivals), "problems": self.settings.problems,
                "latency_bound": self.settings.latency_bound, "machine": h.get("machine"), "date": h.get("date"),
                "commands": list(h.get("commands") or [h.get("command")])}

    def cells(self) -> list[LoadCell]:
        cells = summarize_load(self.records, self.settings.latency_bound)
        for cell in cells:
            cell.source = self.describe()
        return cells

    def regime(self) -> dict:
        """What a cell's runs must share: the settings but the grid (algorithms, n, offered rates), and the
        KV budget (its total; how the sgl-tts servers split it may differ)."""
        budget = str(self.header.get("budget") or "").split(";")[0]
        return {k: v for k, v in self.settings.to_json().items() if k not in GRID} | {"budget": budget}


def source_cells(sources: Sequence[LoadSource]) -> list[tuple[LoadSource, list[LoadCell]]]:
    """Each source with its new cells, in order. An (algorithm, n) that an earlier source holds becomes
    another run of that cell (:class:`CellRun`), its kept beams compared with the first run's; refused
    when the two files' settings differ (other problems, trace or seeds are not a run of the same cell)."""
    out, first = [], {}
    for src in sources:
        mine = []
        for cell in src.cells():
            key = (cell.algorithm, cell.n)
            if key not in first:
                first[key] = (src, cell)
                mine.append(cell)
                continue
            held_src, held = first[key]
            mine_regime, held_regime = src.regime(), held_src.regime()
            differ = sorted(k for k in mine_regime.keys() | held_regime.keys()
                            if mine_regime.get(k) != held_regime.get(k))
            if differ:
                raise ValueError(f"{cell.algorithm}, n = {cell.n} of {src.name} is not another run of "
                                 f"{held_src.name}'s cell: their settings differ in {', '.join(differ)}")
            run = CellRun(src.describe(), cell.sides, cell.ratios, cell.kept_beams_match)
            theirs = kept_by_problem(finished_searches(src.records), *key)
            ours = kept_by_problem(finished_searches(held_src.records), *key)
            shared = theirs.keys() & ours.keys()
            # differ: a side of this run kept, at a (rate, problem) both ran, beams no side of the first run kept
            run.differ_from_first = sorted([rate, problem] for rate, problem in shared
                                           if not _among(theirs[rate, problem], ours[rate, problem]))
            run.same_beams_as_first = (not run.differ_from_first) if shared else None
            held.runs.append(run)
        out.append((src, mine))
    return out


def _distinct(by_side: dict[str, list]) -> int:
    """How many different kept-beam lists these sides hold."""
    return len({json.dumps(v) for v in by_side.values()})


def _among(by_side: dict[str, list], first: dict[str, list]) -> bool:
    """Whether every side's kept beams here are beams some side kept in ``first``."""
    held = {json.dumps(v) for v in first.values()}
    return all(json.dumps(v) in held for v in by_side.values())


def kept_by_problem(searches: dict[tuple, list[dict]], algorithm: str, n: int) -> dict[tuple, dict[str, list]]:
    """(rate, problem) -> each side's kept beams, over the finished blocks (:func:`finished_searches`)
    at an offered rate."""
    kept: dict[tuple, dict[str, list]] = defaultdict(dict)
    for key, recs in searches.items():
        if key[1:3] == (algorithm, n) and key[3] != UNLOADED:
            for r in recs:
                kept[(key[3], r["problem"])][key[0]] = r["kept"]
    return kept


def finished_searches(records: Sequence[dict]) -> dict[tuple, list[dict]]:
    """Each finished block's searches (only the attempt its ``load_block`` record closed)."""
    attempts = {block_key(r): r["attempt"] for r in records if r.get("kind") == "load_block"}
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if r.get("kind") == "load_search" and attempts.get(block_key(r)) == r["attempt"]:
            out[block_key(r)].append(r)
    return out


def in_flight_max(searches: Sequence[dict]) -> int:
    """The most searches between arrival and answer at one time (an answer at the instant of another's
    arrival is counted first)."""
    events = sorted([(r["arrival"], 1) for r in searches] + [(r["answered"], -1) for r in searches])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def _point(block: dict, searches: list[dict], unloaded: dict[int, float] | None = None) -> LoadPoint:
    """One block's point; ``unloaded``: each problem's latency alone (its stretch is latency over it; a
    problem not in it is taken at their median)."""
    ordered = sorted(searches, key=lambda r: r["arrival"])
    latencies = [r["latency"] for r in ordered]
    stretch = None
    if unloaded:
        middle = quantile(sorted(unloaded.values()), 0.5)
        stretch = [r["latency"] / unloaded.get(r["problem"], middle) for r in ordered]
    lat = sorted(latencies)
    span = float(block["span"]) or 1e-9
    gen = (block.get("counters") or {}).get("generator") or {}
    tokens = sum(r["tokens_generated"] for r in searches)
    req = block.get("requests") or {}
    counted = (req.get("server_counted") or {}).get("generator")
    accounted = req.get("generator_sent") == req.get("generator_answered") and len(searches) == block["problems"]
    if counted is not None:
        accounted = accounted and counted >= req.get("generator_sent", 0)
    last = float(block.get("last_arrival") or 0.0)
    return LoadPoint(rate=float(block["rate"]), problems=len(searches),
                     offered=round(block["problems"] / last, 4) if last > 0 else float(block["rate"]), span=round(span, 3),
                     throughput=len(searches) / span, goodput=sum(r["trajectory_tokens"] for r in searches) / span,
                     p50=quantile(lat, 0.5), p99=quantile(lat, 0.99), growing=latencies_growing(latencies),
                     in_flight_max=in_flight_max(searches),
                     tokens_generated=tokens, recomputed_tokens=server_counters.recomputed_prompt_tokens(gen),
                     evicted_tokens=gen.get("evicted_tokens"), retracted_requests=gen.get("retracted_requests"),
                     queue={name: {"p50": q.get("p50"), "max": q.get("max")}
                            for name, q in (block.get("queue") or {}).items()},
                     client_cpu_per_1k_tokens=(1000 * block["client_cpu_seconds"] / tokens) if tokens else None,
                     requests_accounted=accounted,
                     stretch_p50=quantile(sorted(stretch), 0.5) if stretch else None,
                     stretch_p99=quantile(sorted(stretch), 0.99) if stretch else None,
                     stretch_growing=latencies_growing(stretch) if stretch else None)


def _ratio(num: SideCell | None, den: SideCell | None) -> tuple[float | None, bool]:
    """Max-rate ratio, and whether it is a lower bound (the numerator never saturated)."""
    if num is None or den is None or num.max_rate is None or den.max_rate is None:
        return None, False
    return num.max_rate / den.max_rate, not num.saturated


def _best(cells: dict[str, SideCell], sides) -> SideCell | None:
    found = [cells[s] for s in sides if s in cells and cells[s].max_rate is not None]
    return max(found, key=lambda c: (c.max_rate, -(c.points[-1].p99 if c.points else 0)), default=None)


def summarize_load(records: Sequence[dict], bound: float) -> list[LoadCell]:
    """Every (algorithm, n) of the records, in order of first appearance."""
    searches = finished_searches(records)
    blocks = {block_key(r): r for r in records if r.get("kind") == "load_block"}
    by_cell: dict[tuple, dict[str, list[LoadPoint]]] = {}
    # (algorithm, n, side) -> each problem's latency in the unloaded block
    alone = {(key[1], key[2], key[0]): {r["problem"]: r["latency"] for r in searches[key]}
             for key in blocks if key[3] == UNLOADED and searches[key]}
    for key, block in blocks.items():
        side, algorithm, n, rate = key
        cell = by_cell.setdefault((algorithm, n), {}).setdefault(side, [])
        if rate != UNLOADED:
            cell.append(_point(block, searches[key], alone.get((algorithm, n, side))))
    cells = []
    for (algorithm, n), per_side in by_cell.items():
        sides = {}
        for side in sorted(per_side, key=lambda s: ALL_SIDES.index(s) if s in ALL_SIDES else len(ALL_SIDES)):
            points = sorted(per_side[side], key=lambda p: p.rate)
            solo = alone.get((algorithm, n, side))
            measured = bool(solo)
            if measured:   # the rule on each search's stretch: its latency over its own problem's alone
                rate_points = [RatePoint(p.rate, p.stretch_p50, p.stretch_p99, p.stretch_growing) for p in points]
                unloaded, rule_unit = quantile(sorted(solo.values()), 0.5), 1.0
            else:          # no unloaded block: latencies against the p50 at the lowest rate
                rate_points = [RatePoint(p.rate, p.p50, p.p99, p.growing) for p in points]
                unloaded = rule_unit = unloaded_latency(rate_points)
            for p, rp in zip(points, rate_points):
                p.sustained = rule_unit is not None and sustained(rp, rule_unit, bound)
            sides[side] = SideCell(side, points, unloaded, max_sustainable_rate(rate_points, bound, rule_unit),
                                   saturated=not all(p.sustained for p in points), unloaded_measured=measured)
        # kept beams: the same problem at the same rate, every side alike
        kept = kept_by_problem(searches, algorithm, n)
        mismatched = sorted([rate, problem] for (rate, problem), by_side in kept.items() if _distinct(by_side) > 1)
        compared = any(len(v) > 1 for v in kept.values())
        plugin_sides = [s for s in sides if not is_stock(s)]
        no_overlap = [s for s in plugin_sides if not SIDE_OPTIONS.get(s, {}).get("overlap_verification")]
        best_plugin, best_stock = _best(sides, plugin_sides), _best(sides, BASELINES)
        ratios = {}
        for name, num, den in (("best_vs_best_stock", best_plugin, best_stock),
                               ("ordering_vs_lpm", _best(sides, no_overlap), sides.get(LPM_SIDE)),
                               ("plugin_vs_client", best_plugin, sides.get(CLIENT_SIDE))):
            value, lower = _ratio(num, den)
            ratios[name] = None if value is None else round(value, 3)
            ratios[name + "_sides"] = [num.side if num else None, den.side if den else None]
            ratios[name + "_lower_bound"] = lower
        # latency at the best baseline's maximum rate: each side's p99 there, and the best plugin side's over it
        at = best_stock.max_rate if best_stock else None
        p99_at = {s: next((p.p99 for p in c.points if p.rate == at), None) for s, c in sides.items()} if at else {}
        if at and best_plugin and p99_at.get(best_plugin.side) and p99_at.get(best_stock.side):
            ratios["p99_best_stock_over_best"] = round(p99_at[best_stock.side] / p99_at[best_plugin.side], 3)
        else:
            ratios["p99_best_stock_over_best"] = None
        # that ratio if the best side's searches each took their problem's time alone (the unloaded block's
        # p99): a reference for what ordering can win, not a hard bound (a host that speeds up beats it)
        solo = alone.get((algorithm, n, best_plugin.side)) if best_plugin else None
        ratios["p99_ratio_if_alone"] = (round(p99_at[best_stock.side] / quantile(sorted(solo.values()), 0.99), 3)
                                        if solo and at and p99_at.get(best_stock.side) else None)
        ratios["at_rate"] = at
        cells.append(LoadCell(algorithm, n, sides, (not mismatched) if compared else None, mismatched, ratios))
    return cells


def _f(value, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def format_load_report(cells: Sequence[LoadCell], bound: float) -> str:
    """Markdown: per cell the sides' maximum rates and ratios, then every point."""
    lines = []
    for cell in cells:
        r = cell.ratios
        lines += [f"### {cell.algorithm}, n = {cell.n}", "",
                  f"Maximum sustainable rate: the p99 of the searches' stretch (a search's latency over its "
                  f"problem's latency alone, from the unloaded block) within {bound:g}x, and stretches not "
                  "growing, at that rate and every lower one; `-`: not even the lowest; `>=`: sustained every "
                  "rate measured.", "",
                  "| side | unloaded, median (s) | max sustainable rate (/s) | p99 at best stock's max rate (s) |",
                  "|---|---|---|---|"]
        at = r.get("at_rate")
        for side, c in cell.sides.items():
            p99 = next((p.p99 for p in c.points if p.rate == at), None) if at else None
            rate = "-" if c.max_rate is None else ("" if c.saturated else ">= ") + f"{c.max_rate:g}"
            unloaded = _f(c.unloaded) + ("" if c.unloaded_measured else " (p50 at the lowest rate)")
            lines.append(f"| {side} | {unloaded} | {rate} | {_f(p99)} |")
        lines.append("")
        for name in ("best_vs_best_stock", "ordering_vs_lpm", "plugin_vs_client"):
            num, den = r[name + "_sides"]
            value = "-" if r[name] is None else (">= " if r[name + "_lower_bound"] else "") + f"{r[name]:.2f}x"
            lines.append(f"- `{name}`: {value} ({num} over {den})")
        lines.append(f"- p99 of the best stock side over the best sgl-tts side's at {_f(at, 'g')}/s: "
                     f"{_f(r['p99_best_stock_over_best'])}x ({_f(r.get('p99_ratio_if_alone'))}x if the best side's "
                     "searches each took their time alone)")
        lines.append(f"- kept beams: {'match' if cell.kept_beams_match else 'not compared' if cell.kept_beams_match is None else 'DIFFER at ' + json.dumps(cell.mismatched)}")
        lines += _runs_lines(cell)
        lines += ["", "| side | rate (/s) | offered (/s) | searches | most in flight | throughput (/s) | goodput (tok/s) | p50 (s) | p99 (s) | p99 stretch | growing "
                  "| sustained | gen queue p50 / max | PRM queue p50 / max | recomputed prompt tokens | evicted "
                  "| retracted | client CPU s / 1k tok | requests accounted |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for side, c in cell.sides.items():
            for p in c.points:
                q = {k: f"{_f(v.get('p50'), '.0f')} / {_f(v.get('max'), '.0f')}" for k, v in p.queue.items()}
                lines.append(f"| {side} | {p.rate:g} | {p.offered:.3g} | {p.problems} | {p.in_flight_max} | {p.throughput:.3f} | {p.goodput:.1f} | {p.p50:.2f} "
                             f"| {p.p99:.2f} | {_f(p.stretch_p99)} | {'yes' if (p.growing if p.stretch_growing is None else p.stretch_growing) else 'no'} | {'yes' if p.sustained else 'no'} "
                             f"| {q.get('generator', '-')} | {q.get('prm', '-')} | {_f(p.recomputed_tokens, '.0f')} "
                             f"| {_f(p.evicted_tokens, '.0f')} | {_f(p.retracted_requests, '.0f')} "
                             f"| {_f(p.client_cpu_per_1k_tokens, '.3f')} | {'yes' if p.requests_accounted else 'NO'} |")
        lines.append("")
    return "\n".join(lines)


def split_label(source: dict | None) -> str:
    """The sgl-tts servers' generator share in a source, and whether the planner chose it."""
    split = ((source or {}).get("splits") or {}).get("sgl-tts")
    if not split:
        return "-"
    return f"{split['generator_share']:g} ({'planned' if split.get('planned') else 'given'})"


def _runs_lines(cell: LoadCell) -> list[str]:
    """A cell's other runs: each side's maximum rate and p99 stretch per rate, beside the first run's."""
    if not cell.runs:
        return []
    lines = ["", f"Runs of this cell (the first is the one above; the same problems, arrivals, trace and seeds; "
                 "per offered rate):", "",
             "| records | sgl-tts split | machine, date | side | alone, median (s) | max sustainable rate (/s) "
             "| p99 (s) by rate | p99 stretch by rate | recomputed prompt tokens by rate | kept beams as the first run |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for src, sides, same in ((cell.source or {}, cell.sides, None),
                             *((r.source, r.sides, r) for r in cell.runs)):
        kept = ("(first)" if same is None else "not compared" if same.same_beams_as_first is None
                else "same" if same.same_beams_as_first else "DIFFER at " + json.dumps(same.differ_from_first))
        for side, c in sides.items():
            rate = "-" if c.max_rate is None else ("" if c.saturated else ">= ") + f"{c.max_rate:g}"
            p99 = ", ".join(f"{p.rate:g}: {p.p99:.1f}" for p in c.points)
            stretch = ", ".join(f"{p.rate:g}: {_f(p.stretch_p99)}" for p in c.points)
            recomputed = ", ".join(f"{p.rate:g}: {_f(p.recomputed_tokens, '.0f')}" for p in c.points)
            lines.append(f"| `{src.get('records', '-')}` | {split_label(src)} | {src.get('machine')}, "
                         f"{src.get('date')} | {side} | {_f(c.unloaded, '.1f')} | {rate} | {p99} | {stretch} "
                         f"| {recomputed} | {kept} |")
    return lines


def _side_json(v: SideCell) -> dict:
    return {"unloaded": v.unloaded, "unloaded_measured": v.unloaded_measured, "max_sustainable_rate": v.max_rate,
            "saturated": v.saturated, "points": [dataclasses.asdict(p) for p in v.points]}


def load_summary(cells: Sequence[LoadCell]) -> list[dict]:
    """The cells as JSON (the summary file's ``cells``; a cell's other runs under ``runs``)."""
    return [{"algorithm": c.algorithm, "n": c.n, "kept_beams_match": c.kept_beams_match, "mismatched": c.mismatched,
             "ratios": c.ratios, "sides": {s: _side_json(v) for s, v in c.sides.items()}}
            | ({"source": c.source} if c.source else {})
            | ({"runs": [{"source": r.source, "kept_beams_match": r.kept_beams_match,
                          "same_beams_as_first": r.same_beams_as_first, "differ_from_first": r.differ_from_first,
                          "ratios": r.ratios, "sides": {s: _side_json(v) for s, v in r.sides.items()}}
                         for r in c.runs]} if c.runs else {}) for c in cells]


def side_colours(cells: Sequence[LoadCell]) -> dict[str, str]:
    """One colour per side in every panel (and every run), in the sides' registry order."""
    sides = sorted({s for c in cells for holder in (c, *c.runs) for s in holder.sides},
                   key=lambda s: (*ALL_SIDES, s).index(s))
    return {s: f"C{k % 10}" for k, s in enumerate(sides)}


def plot_load(cells: Sequence[LoadCell], path: Path, title: str = "") -> Path:
    """p99 latency against offered rate, one line per side, one panel per (algorithm, n)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # cells of several records files: each panel names its own budget and machine
    several = len({json.dumps(c.source) for c in cells}) > 1
    colour = side_colours(cells)
    fig, axes = plt.subplots(1, len(cells), figsize=(5.5 * len(cells), 4.2), squeeze=False)
    for ax, cell in zip(axes[0], cells):
        for side, c in cell.sides.items():
            style = "--" if is_stock(side) else "-"
            label = f"{side}, split {split_label(cell.source)}" if cell.runs else side
            ax.plot([p.rate for p in c.points], [p.p99 for p in c.points], style, marker="o", label=label,
                    color=colour[side])
        for k, run in enumerate(cell.runs):   # other runs: the side's colour, their own line style and marker
            for side, c in run.sides.items():
                ax.plot([p.rate for p in c.points], [p.p99 for p in c.points], (":", "-.")[k % 2],
                        marker="sxd^v"[k % 5], color=colour[side], label=f"{side}, split {split_label(run.source)}")
        ax.set_xlabel("offered rate (searches / s)")
        ax.set_ylabel("p99 latency, arrival to answer (s)")
        where = f"{str(cell.source['budget']).split(';')[0]}, {cell.source['machine']}" if several else None
        ax.set_title(f"{cell.algorithm}, n = {cell.n}" + (f"\n{where}" if where else ""), fontsize=9)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _summary(header: dict, settings, cells: Sequence[LoadCell]) -> dict:
    return {"header": header, "settings": settings.to_json(), "cells": load_summary(cells)}


def load_json(records: Sequence[dict], settings, header: dict, extra: Sequence[LoadSource] = (),
              name: str = "") -> dict:
    """The load mode's ``.summary.json``: the header, the settings and the cells (``extra``'s after
    those of this file, ``name``; each cell names its source)."""
    own = LoadSource(name, settings, header, records)
    return _summary(header, settings, [c for _, cells in source_cells([own, *extra]) for c in cells])


def _regime_lines(settings) -> list[str]:
    return [f"- offered rates (searches / s): {', '.join(f'{r:g}' for r in settings.arrivals)}; "
            f"{settings.problems} Poisson arrivals per (algorithm, n) and rate, the same on every side",
            f"- settings: `{json.dumps(settings.to_json())}`"]


def write_load_report(records: Sequence[dict], settings, output: Path, header: dict,
                      extra: Sequence[LoadSource] = ()) -> str:
    """Write ``.md``, ``.summary.json`` and ``.png`` beside ``output``; return the Markdown. ``extra``:
    other records files whose cells the report adds after this file's, each under its own header."""
    own = LoadSource(output.name, settings, header, records)
    per_source = source_cells([own, *extra])
    cells = [c for _, mine in per_source for c in mine]
    lines = [f"# sgl-tts bench, many searches at once: {header['generator']} + {header['prm']}", "",
             *provenance_lines(header), *_regime_lines(settings)]
    if extra:
        lines.append("- also the cells of " + ", ".join(f"`{src.name}`" for src in extra)
                     + " (their own runs, budgets and rates: each under its header below)")
    lines += ["", "Latency runs from a search's arrival to its answer (queueing included); throughput and goodput "
              "are over a block's span (first arrival to last answer); queues are SGLang's waiting-queue gauge "
              "read every 0.25 s; recomputed prompt tokens are the generator's observer's (block-granular).", ""]
    for src, mine in per_source:
        if src is not own and mine:
            lines += [f"## The cells of `{src.name}`", "", *provenance_lines(src.header), *_regime_lines(src.settings), ""]
        lines.append(format_load_report(mine, src.settings.latency_bound))
    runs = [src for src, mine in per_source if src is not own and not mine]
    if runs:   # files that only hold other runs of cells above: their provenance once, at the end
        lines += ["## Other runs", "", "Files whose cells are other runs of the cells above (in each cell's runs table):", ""]
        for src in runs:
            lines += [f"### `{src.name}`", "", *provenance_lines(src.header), *_regime_lines(src.settings), ""]
    summary = _summary(header, settings, cells)
    title = f"{header['generator']} + {header['prm']}" if extra else plot_title(header)   # several budgets
    return write_report_files(output, "\n".join(lines), summary,
                              (lambda path: plot_load(cells, path, title)) if cells else None)


__all__ = ["CellRun", "LoadCell", "LoadPoint", "LoadSource", "source_cells", "SideCell", "finished_searches", "format_load_report", "in_flight_max", "kept_by_problem", "load_json", "load_summary",
           "plot_load", "side_colours", "split_label", "summarize_load", "write_load_report"]
