"""The goodput benchmark's report: its rows from the run's records (:func:`summarize`, which also checks
that every side kept the same beams, and the generator-bound limit), the Markdown table
(:func:`format_report`) and the plot (:func:`plot_report`)."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path
from typing import Sequence

from sgl_tts.bench.goodput_settings import BenchSettings
from sgl_tts.bench.sides import ALL_SIDES, is_baseline


@dataclasses.dataclass
class SideRow:
    """One side at one (algorithm, n), over its problems."""

    problems: int
    goodput: float              # precise goodput, tokens/s
    latency: float              # mean seconds per search
    generator_seconds: float    # of which waiting for the generator (mean)
    verifier_seconds: float     # of which waiting for the PRM (mean)
    tokens_generated: float     # mean per search
    tokens_kept: float
    generator_hit_rate: float | None   # cached / prompt tokens (None: the server never said its cached tokens)
    prm_hit_rate: float | None
    tokens_speculative: float = 0.0   # mean per search, of tokens_generated
    tokens_reused: float = 0.0        # of those, taken over by a kept child
    branches_started: float = 0.0     # speculative branches per search (a controlled side: started,
    branches_declined: float = 0.0    # and declined as costing more than they save)


@dataclasses.dataclass
class ReportRow:
    algorithm: str
    n: int
    sides: dict[str, SideRow]
    limit_goodput: float | None    # generator-bound limit (precise goodput), tokens/s
    limit_batch: int
    match: bool | None             # kept beams equal on every side (None: only one side ran)
    mismatched: list[int]          # problems whose kept beams differ


def _side_row(recs: list[dict]) -> SideRow:
    k = len(recs)
    mean = lambda f: sum(f(r) for r in recs) / k  # noqa: E731
    secs = sum(r["trajectory_seconds"] for r in recs)
    def rate(who: str) -> float | None:
        # records before cached_reported: every answer said it
        if not sum(r[who].get("cached_reported", r[who].get("requests", 1)) for r in recs):
            return None   # e.g. a step-pooled PRM's /classify answers
        return sum(r[who]["cached_tokens"] for r in recs) / max(1, sum(r[who]["prompt_tokens"] for r in recs))

    # what the program waited for, where it records it (older records: the PRM calls' time)
    split = all("waited_verifying" in r for r in recs)
    gen_s = mean(lambda r: r["seconds"] - r["waited_verifying"]) if split else mean(lambda r: r["generator_seconds"])
    ver_s = mean(lambda r: r["waited_verifying"]) if split else mean(lambda r: r["verifier_seconds"])
    return SideRow(k, sum(r["trajectory_tokens"] for r in recs) / secs if secs > 0 else 0.0,
                   mean(lambda r: r["seconds"]), gen_s, ver_s, mean(lambda r: r["tokens_generated"]),
                   mean(lambda r: r["tokens_kept"]), rate("generator"), rate("prm"),
                   mean(lambda r: r.get("tokens_speculative", 0)), mean(lambda r: r.get("tokens_reused", 0)),
                   mean(lambda r: r.get("branches", {}).get("started", 0)),
                   mean(lambda r: r.get("branches", {}).get("declined", 0)))


def _share(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def summarize(records: Sequence[dict], settings: BenchSettings) -> list[ReportRow]:
    """The report's rows, in (algorithm, n) order, from the run's records."""
    searches = [r for r in records if r.get("kind") == "search"]
    limits = {r["batch"]: r["tokens_per_s"] for r in records if r.get("kind") == "limit"}
    rows = []
    for algorithm in settings.algorithms:
        for n in settings.n:
            mine = [r for r in searches if r["algorithm"] == algorithm and r["n"] == n]
            if not mine:
                continue
            by_side = {s: sorted((r for r in mine if r["side"] == s), key=lambda r: r["problem"]) for s in ALL_SIDES}
            sides = {s: _side_row(rs) for s, rs in by_side.items() if rs}
            batch = min(n, settings.planned_batch)
            limit = None
            tps = limits.get(batch)
            # a side without speculation: its depth tokens are the search's own work
            ref = by_side["sgl-tts"] or by_side["stock"] or next((rs for rs in by_side.values() if rs), [])
            if tps:
                # depth by depth at ``tps``: a trajectory that ends at depth d is done when every
                # step of depths <= d is decoded
                tokens = secs = 0.0
                for r in ref:
                    through = [sum(r["depth_tokens"][:d + 1]) for d in range(len(r["depth_tokens"]))]
                    for path, _, kept_tokens, _ in r["kept"]:
                        tokens += kept_tokens
                        secs += through[len(path) - 1] / tps
                limit = tokens / secs if secs > 0 else None
            match, bad = None, []
            present = [s for s in ALL_SIDES if by_side[s]]
            if len(present) > 1:   # every side against the first (stock when it ran)
                a = {r["problem"]: r["kept"] for r in by_side[present[0]]}
                for other in present[1:]:
                    b = {r["problem"]: r["kept"] for r in by_side[other]}
                    bad += [p for p in set(a) & set(b) if a[p] != b[p]]
                bad = sorted(set(bad))
                match = not bad
            rows.append(ReportRow(algorithm, n, sides, limit, batch, match, bad))
    return rows


def _rate(tokens_per_s: float, decimals: int) -> str:
    """A goodput for the table: ``decimals`` places from 10 tok/s up, two below, so that the slow
    rows of a pressured CPU run (0.4 against 0.7 tok/s) keep their ratio readable."""
    return f"{tokens_per_s:.{decimals if tokens_per_s >= 10 else 2}f}"


def format_report(rows: Sequence[ReportRow]) -> str:
    """Markdown tables: one row per (algorithm, n, side)."""
    head = ("| algorithm | n | side | problems | goodput (tok/s) | vs best stock | latency (s) | generator (s) | "
            "verifier (s) | tokens generated | speculative (reused) | tokens kept | gen cache hit | PRM cache hit | "
            "limit (tok/s) | vs limit | kept beams |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for row in rows:
        # against the best stock side that ran (fcfs, lpm, dfs-weight): what a user would pick instead
        stock = max((r for side, r in row.sides.items() if is_baseline(side)), key=lambda r: r.goodput, default=None)
        for side in ALL_SIDES:
            r = row.sides.get(side)
            if r is None:
                continue
            vs = f"{r.goodput / stock.goodput:.2f}x" if stock and stock.goodput > 0 else "-"
            limit = f"{_rate(row.limit_goodput, 0)} (b={row.limit_batch})" if row.limit_goodput else "-"
            of_limit = f"{r.goodput / row.limit_goodput:.0%}" if row.limit_goodput else "-"
            spec = (f"{r.tokens_speculative:.0f} ({r.tokens_reused:.0f})"
                    if r.tokens_speculative or r.branches_declined else "-")
            if r.branches_declined:   # a controlled side: the branches it did not start
                spec += f"; {r.branches_declined:.0f} declined"
            kept = ("-" if row.match is None else "match" if row.match
                    else "DIFFER: problems " + ", ".join(map(str, row.mismatched)))
            lines.append(f"| {row.algorithm} | {row.n} | {side} | {r.problems} | {_rate(r.goodput, 1)} | {vs} | "
                         f"{r.latency:.2f} | {r.generator_seconds:.2f} | {r.verifier_seconds:.2f} | "
                         f"{r.tokens_generated:.0f} | {spec} | {r.tokens_kept:.0f} | {_share(r.generator_hit_rate)} | "
                         f"{_share(r.prm_hit_rate)} | {limit} | {of_limit} | {kept} |")
    return "\n".join(lines)


def plot_report(rows: Sequence[ReportRow], path: str | Path, title: str = "") -> Path:
    """Goodput vs n per algorithm (each side and the generator-bound limit) and the latency split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algorithms = list(dict.fromkeys(r.algorithm for r in rows))
    fig, axes = plt.subplots(2, max(1, len(algorithms)), figsize=(6 * max(1, len(algorithms)), 8),
                             squeeze=False)
    for col, algorithm in enumerate(algorithms):
        mine = [r for r in rows if r.algorithm == algorithm]
        ax = axes[0][col]
        # every side that ran, in ALL_SIDES's order (a marker each, cycling): a fixed list of styles
        # zipped with ALL_SIDES once dropped every side after the fifth from this panel
        shown = [side for side in ALL_SIDES if any(side in r.sides for r in mine)]
        for i, side in enumerate(shown):
            pts = [(r.n, r.sides[side].goodput) for r in mine if side in r.sides]
            ax.plot(*zip(*pts), "osv^dP*Xh<>p"[i % 12] + "-", color=f"C{i % 10}", label=side)
        lim = [(r.n, r.limit_goodput) for r in mine if r.limit_goodput]
        if lim:
            # a marker too: a run of one n is a single point, which a bare dashed line never draws
            ax.plot(*zip(*lim), "k_--", markersize=16, label="generator-bound limit")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("n (beams)")
        ax.set_ylabel("precise goodput (tokens/s)")
        ax.set_title(f"{algorithm}: goodput")
        ax.legend(fontsize=8)
        ax = axes[1][col]
        labels, gen, ver = [], [], []
        for r in mine:
            for side in ALL_SIDES:
                if side in r.sides:
                    labels.append(f"{r.n}\n{side.replace('sgl-tts', 'tts').replace('+lookahead', '+la')}")
                    gen.append(r.sides[side].generator_seconds)
                    ver.append(r.sides[side].verifier_seconds)
        xs = range(len(labels))
        ax.bar(xs, gen, label="generator")
        ax.bar(xs, ver, bottom=gen, label="verifier (PRM)")
        ax.set_xticks(list(xs), labels, fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("seconds per search (mean)")
        ax.set_title(f"{algorithm}: completion latency")
        ax.legend()
    if title:   # wrapped to the figure's width: long headers (the CPU run) would be cut
        fig.suptitle(textwrap.fill(title, int(15 * fig.get_figwidth())), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def provenance_lines(header: dict) -> list[str]:
    """A report's first lines: machine, date, every command, device, budget; a rebuilt report, runs
    that differ, the planner's workload, the split, the pools and the trace where the header has them."""
    lines = [f"- machine: {header['machine']}", f"- date: {header['date']}",
             "- command: " + "; then ".join(f"`{c}`" for c in header.get("commands") or [header["command"]]),
             f"- device: {header.get('device', 'cuda')}", f"- memory budget: {header['budget']}"]
    if header.get("rebuilt"):
        r = header["rebuilt"]
        lines.append(f"- report rebuilt from the records: {r['date']}, {r['machine']}, `{r['command']}`")
    if header.get("differ"):
        lines.append(f"- **the runs differ in {', '.join(header['differ'])}**: below is the first run's; "
                     "the figures mix settings")
    if header.get("workload") is not None:
        lines.append(f"- planner workload: {header['workload']}")
    if header.get("splits"):
        lines.append("- KV split (generator share): " + ", ".join(
            f"{side} {v['generator_share']} ({'planned' if v['planned'] else 'fixed'})"
            for side, v in header["splits"].items()))
    if header.get("pools"):
        lines.append(f"- KV pools (tokens): {json.dumps(header['pools'])}")
    if header.get("trace"):
        lines.append(f"- trace: `{json.dumps(header['trace'])}`")
    return lines


def plot_title(header: dict) -> str:
    return f"{header['generator']} + {header['prm']}, {header['budget']}, {header['machine']}"


def write_report_files(output: Path, text: str, summary: dict, plot=None) -> str:
    """Write the Markdown (``.md``), the summary (``.summary.json``) and, when ``plot`` is given, the plot
    (``plot(path)`` draws ``.png``) beside ``output``; return the Markdown."""
    output.with_suffix(".md").write_text(text)
    output.with_suffix(".summary.json").write_text(json.dumps(summary, indent=1))
    if plot is not None:
        plot(output.with_suffix(".png"))
    return text


__all__ = ["plot_title", "provenance_lines", "write_report_files", "ReportRow", "SideRow", "format_report", "plot_report", "summarize"]
