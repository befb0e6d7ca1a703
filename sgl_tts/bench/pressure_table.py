"""The pressure table (issue 32): every recorded ``sgl-tts bench --device cpu`` run at the measured
pressure budgets, one row per side, against the issue's two goals.

A run is one records file (one host, one hour): its sides are compared with the stock sides *of the
same run* only, since this host's speed moves by 5-25% within a day. For each (run, algorithm, n)
at the budget :data:`~sgl_tts.bench.command.CPU_PRESSURE_BUDGETS` names for n:

- **goodput vs best stock**: the side's precise goodput over the best stock side's (``stock``,
  ``stock-lpm``, ``stock-dfs-weight``: SGLang's own policies).
- **recomputed**: prompt tokens prefilled (SGLang's ``prompt_tokens - cached_tokens``, generator and
  PRM, per search) less the *floor*, what the same search prefills when nothing is evicted (a run of
  :data:`FLOOR_BUDGET`), so what remains is work done again because the cache had lost it.
- **vs least stock**: the change in recomputed tokens against the stock side that recomputed least
  (the harder of the stock sides to beat on this count).
- **both goals**: goodput at least :data:`GOAL_GOODPUT` times the best stock side's, at least
  :data:`GOAL_FEWER_RECOMPUTED` fewer recomputed tokens than the least stock side's, kept beams equal.

``benchmarks/pressure_table.py`` writes ``docs/benchmarks/cpu_pressure.{md,summary.json,png}`` from
``docs/benchmarks/cpu_pressure*.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from sgl_tts.bench.command import CPU_PRESSURE_BUDGETS, CPU_PRESSURE_STOCK_SPLITS
from sgl_tts.bench.goodput_report import summarize
from sgl_tts.bench.goodput_settings import BenchSettings
from sgl_tts.bench.sides import ALL_SIDES, is_baseline, is_stock
from sgl_tts.launch.memory import parse_bytes

GOAL_GOODPUT = 1.5            # the best sgl-tts side's goodput over the best stock side's
GOAL_FEWER_RECOMPUTED = 0.5   # fewer recomputed prompt tokens than the stock side that recomputed least
FLOOR_BUDGET = "1GiB"         # a run at this budget evicts nothing: its prefill is the floor
MODELS = ("tiny-cpu-generator", "tiny-cpu-prm")   # the pressure workload's pair (other pairs: other tables)


@dataclasses.dataclass(frozen=True)
class BenchRun:
    """One records file of ``sgl-tts bench``: its header and its searches."""

    name: str                 # the file's name
    machine: str
    date: str
    command: str
    models: tuple[str, str]   # generator, PRM
    budget_mib: float         # the KV budget of both pools, as the header states it (one decimal)
    stock_share: float | None  # the stock sides' generator share of it
    settings: BenchSettings
    records: tuple[dict, ...]


@dataclasses.dataclass(frozen=True)
class Floor:
    """Prompt tokens one search prefills with nothing evicted, per model."""

    generator: float
    prm: float

    @property
    def total(self) -> float:
        return self.generator + self.prm


@dataclasses.dataclass(frozen=True)
class PressureRow:
    """One side at one (run, algorithm, n) of the table."""

    run: str
    machine: str
    date: str
    algorithm: str
    n: int
    budget_mib: float
    side: str
    goodput: float            # precise goodput, tokens/s
    vs_best_stock: float      # goodput over the run's best stock side's
    latency: float            # seconds per search
    generator_prefilled: float
    prm_prefilled: float
    recomputed: float | None  # prefilled less the floor (None: no floor recorded for this search)
    vs_least_stock: float | None   # recomputed / the least stock side's - 1 (negative: fewer)
    kept_beams_match: bool | None

    @property
    def stock(self) -> bool:
        return is_stock(self.side)

    @property
    def goals_met(self) -> bool:
        """Both of the issue's goals on this row (never on a stock side)."""
        return (not self.stock and self.kept_beams_match is not False and self.vs_best_stock >= GOAL_GOODPUT
                and self.vs_least_stock is not None and self.vs_least_stock <= -GOAL_FEWER_RECOMPUTED)


def _budget_mib(text: str) -> float:
    """The budget of a run header's ``budget`` line (``"11.1 MiB of KV on the CPU; ..."``)."""
    match = re.match(r"\s*([0-9.]+) MiB", text)
    if not match:
        raise ValueError(f"cannot read a KV budget from {text!r}")
    return float(match.group(1))


def same_budget(budget_mib: float, size: str) -> bool:
    """Whether a header's budget (one decimal) is ``size`` (e.g. ``11.125MiB``)."""
    return round(parse_bytes(size) / (1 << 20), 1) == round(budget_mib, 1)


def read_run(path: Path) -> BenchRun:
    """A records file as written by ``sgl-tts bench --output`` (settings line first, then a run
    header and the searches); a file that is not one raises :class:`ValueError` naming it."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines or lines[0].get("kind") != "settings":
        raise ValueError(f"{path}: not a benchmark output (its first line holds no settings)")
    header = next((r for r in lines if r.get("kind") == "run"), None)
    if header is None:
        raise ValueError(f"{path}: no run header (a run that never started)")
    share = header.get("splits", {}).get("stock", {}).get("generator_share")
    return BenchRun(Path(path).name, header.get("machine", "?"), header.get("date", "?"), header.get("command", ""),
                    (header.get("generator", "?"), header.get("prm", "?")), _budget_mib(header.get("budget", "")),
                    share, BenchSettings(**lines[0]["settings"]), tuple(lines[1:]))


def _searches(run: BenchRun, algorithm: str, n: int, side: str) -> list[dict]:
    return [r for r in run.records if r.get("kind") == "search" and r["algorithm"] == algorithm
            and r["n"] == n and r["side"] == side]


def prefilled(searches: Sequence[dict]) -> Floor:
    """Prompt tokens computed (``prompt_tokens - cached_tokens``) per search, per model."""
    if not searches:
        raise ValueError("no searches")
    per = lambda who: sum(s[who]["prompt_tokens"] - s[who]["cached_tokens"] for s in searches) / len(searches)  # noqa: E731
    return Floor(per("generator"), per("prm"))


# what makes two runs' searches at one (algorithm, n) the same searches: not which cells ran, nor
# the generator-bound limit's batch and length
_NOT_THE_SEARCH = ("algorithms", "n", "planned_batch", "limit_tokens")


def search_key(run: BenchRun, algorithm: str, n: int) -> tuple:
    """Which searches ``run`` ran at (algorithm, n): equal keys, equal searches (models and workload)."""
    workload = {k: v for k, v in run.settings.to_json().items() if k not in _NOT_THE_SEARCH}
    return algorithm, n, run.models, json.dumps(workload, sort_keys=True)


def floor_runs(runs: Sequence[BenchRun]) -> list[BenchRun]:
    """The runs at :data:`FLOOR_BUDGET`."""
    return [run for run in runs if same_budget(run.budget_mib, FLOOR_BUDGET)]


def floors(runs: Sequence[BenchRun]) -> dict[tuple, Floor]:
    """The floor per :func:`search_key`: from runs at :data:`FLOOR_BUDGET`, the stock side that
    prefilled least (the same search on every stock side; they differ only by what eviction costs)."""
    out: dict[tuple, Floor] = {}
    for run in floor_runs(runs):
        cells = {(r["algorithm"], r["n"]) for r in run.records if r.get("kind") == "search"}
        for algorithm, n in sorted(cells):
            found = [prefilled(s) for side in ALL_SIDES if is_baseline(side)
                     if (s := _searches(run, algorithm, n, side))]
            if found:
                key = search_key(run, algorithm, n)
                out[key] = min([*found, *([out[key]] if key in out else [])], key=lambda f: f.total)
    return out


def at_pressure(run: BenchRun, n: int, budgets: Mapping[int, str] = CPU_PRESSURE_BUDGETS,
                stock_splits: Mapping[int, float] = CPU_PRESSURE_STOCK_SPLITS) -> bool:
    """Whether ``run``'s searches at ``n`` ran the pressure workload: :data:`MODELS`, the budget
    measured for n, and that budget's stock split where one is set."""
    if n not in budgets or run.models != MODELS or not same_budget(run.budget_mib, budgets[n]):
        return False
    return n not in stock_splits or run.stock_share == stock_splits[n]


def cell_rows(run: BenchRun, algorithm: str, n: int,
              floor: Floor | None) -> list[PressureRow]:
    """The rows of one (run, algorithm, n); none when the run has no stock side there to compare with."""
    report = next((r for r in summarize(run.records, dataclasses.replace(run.settings, algorithms=(algorithm,), n=(n,)))
                   if r.algorithm == algorithm and r.n == n), None)
    if report is None or not any(is_baseline(s) for s in report.sides):
        return []
    best = max(row.goodput for s, row in report.sides.items() if is_baseline(s))
    spent = {side: prefilled(_searches(run, algorithm, n, side)) for side in report.sides}
    again = {side: None if floor is None else p.total - floor.total for side, p in spent.items()}
    least = None if floor is None else min(v for s, v in again.items() if is_baseline(s))
    rows = []
    for side, row in report.sides.items():
        vs = None if least is None or again[side] is None or least <= 0 else again[side] / least - 1
        rows.append(PressureRow(run.name, run.machine, run.date, algorithm, n, run.budget_mib, side,
                                row.goodput, row.goodput / best if best > 0 else 0.0, row.latency,
                                spent[side].generator, spent[side].prm, again[side], vs, report.match))
    return rows


def pressure_rows(runs: Sequence[BenchRun]) -> list[PressureRow]:
    """Every side of every run at the pressure budgets, in (algorithm, n, run, side) order."""
    bottom = floors(runs)
    rows = []
    for run in runs:
        cells = sorted({(r["algorithm"], r["n"]) for r in run.records if r.get("kind") == "search"})
        for algorithm, n in cells:
            if at_pressure(run, n):
                rows += cell_rows(run, algorithm, n, bottom.get(search_key(run, algorithm, n)))
    order = {s: i for i, s in enumerate(ALL_SIDES)}
    return sorted(rows, key=lambda r: (r.algorithm, r.n, r.date, r.run, order.get(r.side, len(order))))


@dataclasses.dataclass(frozen=True)
class CellBest:
    """What the sgl-tts sides reached at one (algorithm, n), over every run there."""

    algorithm: str
    n: int
    runs: int
    best_goodput: PressureRow | None      # the sgl-tts row with the highest goodput ratio
    fewest_recomputed: PressureRow | None  # the sgl-tts row with the largest cut in recomputed tokens
    both_goals: tuple[PressureRow, ...]    # rows that meet both goals


def best_per_cell(rows: Sequence[PressureRow]) -> list[CellBest]:
    """Per (algorithm, n): the best goodput ratio, the largest recomputation cut, the rows meeting both."""
    out = []
    for algorithm, n in dict.fromkeys((r.algorithm, r.n) for r in rows):
        ours = [r for r in rows if (r.algorithm, r.n) == (algorithm, n) and not r.stock]
        cut = [r for r in ours if r.vs_least_stock is not None]
        out.append(CellBest(algorithm, n, len({r.run for r in rows if (r.algorithm, r.n) == (algorithm, n)}),
                            max(ours, key=lambda r: r.vs_best_stock, default=None),
                            min(cut, key=lambda r: r.vs_least_stock, default=None),
                            tuple(r for r in ours if r.goals_met)))
    return out


# ---------------------------------------------------------------------------------- the report
MARKERS = "osv^dP*Xh<>p"   # one per sgl-tts side in the plot, cycling


def tabulated(runs: Sequence[BenchRun], rows: Sequence[PressureRow]) -> list[BenchRun]:
    """The runs that gave ``rows``."""
    names = {r.run for r in rows}
    return [run for run in runs if run.name in names]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def _count(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def format_table(rows: Sequence[PressureRow]) -> str:
    """The Markdown table, one row per side (the last column: both goals held, in bold, or not)."""
    lines = ["| algorithm, n | budget | run (date) | side | goodput (tok/s) | vs best stock | latency (s) | "
             "generator / PRM prefilled | recomputed | vs least stock | kept beams | both goals |",
             "|---|---|---|---|---:|---:|---:|---|---:|---:|---|---|"]
    for r in rows:
        mark = "**yes**" if r.goals_met else ("" if r.stock else "no")
        match = {True: "match", False: "DIFFER", None: "-"}[r.kept_beams_match]
        lines.append(f"| {r.algorithm} {r.n} | {r.budget_mib:g} MiB | {r.run} ({r.date}) | "
                     f"{r.side} | {r.goodput:.2f} | {r.vs_best_stock:.2f}x | {r.latency:.1f} | "
                     f"{_count(r.generator_prefilled)} / {_count(r.prm_prefilled)} | {_count(r.recomputed)} | "
                     f"{_pct(r.vs_least_stock)} | {match} | {mark} |")
    return "\n".join(lines)


def format_best(cells: Sequence[CellBest]) -> str:
    """Per (algorithm, n): what the best sgl-tts rows reached against the goals."""
    lines = [f"| algorithm, n | runs | best goodput vs best stock (its recomputed) | largest cut in recomputed "
             f"(its goodput) | rows with both goals ({GOAL_GOODPUT:g}x and -{GOAL_FEWER_RECOMPUTED:.0%}) |",
             "|---|---:|---|---|---|"]
    for c in cells:
        g, f = c.best_goodput, c.fewest_recomputed
        lines.append(f"| {c.algorithm} {c.n} | {c.runs} | "
                     + (f"{g.vs_best_stock:.2f}x, {g.side} ({_pct(g.vs_least_stock)}; {g.run})" if g else "-") + " | "
                     + (f"{_pct(f.vs_least_stock)}, {f.side} ({f.vs_best_stock:.2f}x; {f.run})" if f else "-") + " | "
                     + (", ".join(f"{r.side} ({r.run})" for r in c.both_goals) or "none") + " |")
    return "\n".join(lines)


def summary(rows: Sequence[PressureRow], sources: Sequence[BenchRun]) -> dict:
    """The JSON summary: the goals, each run's command, every row and the per-cell best."""
    return {"goals": {"goodput_vs_best_stock": GOAL_GOODPUT, "fewer_recomputed_than_least_stock": GOAL_FEWER_RECOMPUTED},
            "budgets": dict(CPU_PRESSURE_BUDGETS), "stock_splits": dict(CPU_PRESSURE_STOCK_SPLITS),
            "runs": {run.name: {"machine": run.machine, "date": run.date, "command": run.command}
                     for run in tabulated(sources, rows)},
            "floors": {run.name: {"machine": run.machine, "date": run.date, "command": run.command}
                       for run in floor_runs(sources)},
            "rows": [dataclasses.asdict(r) | {"goals_met": r.goals_met} for r in rows],
            "best": [{"algorithm": c.algorithm, "n": c.n, "runs": c.runs,
                      "best_goodput": c.best_goodput and dataclasses.asdict(c.best_goodput),
                      "fewest_recomputed": c.fewest_recomputed and dataclasses.asdict(c.fewest_recomputed),
                      "both_goals": [dataclasses.asdict(r) for r in c.both_goals]} for c in best_per_cell(rows)]}


def plot(rows: Sequence[PressureRow], path: str | Path) -> Path:
    """Each sgl-tts row as a point: recomputed tokens against the least stock side (x) and goodput
    against the best stock side (y), the goals' corner shaded; one colour per (algorithm, n)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 6))
    ax.fill_between([-1.0, -GOAL_FEWER_RECOMPUTED], GOAL_GOODPUT, 3.0, color="C2", alpha=0.15, label="both goals")
    cells = list(dict.fromkeys((r.algorithm, r.n) for r in rows))
    sides = list(dict.fromkeys(r.side for r in rows if not r.stock))
    for r in rows:
        if r.stock or r.vs_least_stock is None:
            continue
        ax.plot(r.vs_least_stock, r.vs_best_stock, MARKERS[sides.index(r.side) % len(MARKERS)],
                color=f"C{cells.index((r.algorithm, r.n)) % 10}", alpha=0.8, markersize=7)
    for i, (algorithm, n) in enumerate(cells):   # legend entries: colours are cells, markers sides
        ax.plot([], [], "s", color=f"C{i % 10}", label=f"{algorithm} n = {n}")
    for i, side in enumerate(sides):
        ax.plot([], [], MARKERS[i % len(MARKERS)], color="grey", label=side)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axvline(0.0, color="k", lw=0.8)
    ax.set_xlim(-1.0, 0.5)
    ax.set_ylim(0.5, max([2.0] + [r.vs_best_stock + 0.1 for r in rows]))
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel("recomputed prompt tokens vs the stock side that recomputed least")
    ax.set_ylabel("goodput vs the best stock side (same run)")
    ax.set_title("CPU under memory pressure: every sgl-tts side of every recorded run", fontsize=10)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))   # outside: points reach every corner
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(record_paths: Iterable[Path], out: Path, command: str) -> str:
    """Read the records, write ``out`` (Markdown) with ``.summary.json`` and ``.png`` beside it; the
    Markdown's text is returned. Files that are not benchmark outputs are refused, naming them."""
    runs = [read_run(p) for p in sorted(record_paths)]
    rows = pressure_rows(runs)
    if not rows:
        raise ValueError("no run at the pressure budgets with a stock side: nothing to tabulate")
    cells = best_per_cell(rows)
    budgets = ", ".join(f"n = {n}: {b}" + (f" (stock split {CPU_PRESSURE_STOCK_SPLITS[n]})"
                                             if n in CPU_PRESSURE_STOCK_SPLITS else "")
                        for n, b in CPU_PRESSURE_BUDGETS.items())
    text = "\n".join([
        "# CPU under memory pressure: every recorded run at the pressure budgets", "",
        f"Written by `{command}` from the records beside this file. Budgets ({budgets}) as `sgl-tts bench "
        "--pressure` sets them; each run's sides are compared with its own stock sides only. "
        "Recomputed = prompt tokens prefilled (generator + PRM, SGLang's `prompt_tokens - cached_tokens`) "
        f"less the same search's prefill at {FLOOR_BUDGET} (nothing evicted). Goals (issue 32): "
        f"goodput >= {GOAL_GOODPUT:g}x the best stock side and >= {GOAL_FEWER_RECOMPUTED:.0%} fewer recomputed "
        "tokens than the stock side that recomputed least, kept beams equal.", "",
        "## What the sgl-tts sides reached", "", format_best(cells), "",
        "## Every row", "", format_table(rows), "",
        "## The runs", "",
        *[f"- `{run.name}`: {run.machine}, {run.date}: `{run.command}`" for run in tabulated(runs, rows)],
        *[f"- floor `{run.name}`: {run.machine}, {run.date}: `{run.command}`" for run in floor_runs(runs)], ""])
    out = Path(out)
    out.write_text(text)
    out.with_suffix(".summary.json").write_text(json.dumps(summary(rows, runs), indent=1))
    plot(rows, out.with_suffix(".png"))
    return text


__all__ = ["BenchRun", "CellBest", "FLOOR_BUDGET", "Floor", "GOAL_FEWER_RECOMPUTED", "GOAL_GOODPUT", "MODELS",
           "PressureRow", "at_pressure", "best_per_cell", "cell_rows", "floor_runs", "floors", "format_best",
           "format_table", "plot", "prefilled", "pressure_rows", "read_run", "same_budget", "search_key", "summary", "tabulated", "write"]
