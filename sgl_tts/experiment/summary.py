"""``sgl-tts run``'s summary, computed from the results file: accuracies per rule, pass@N, accuracy
at every N' <= N by subsampling, precise goodput, latency and tokens; and its plot."""

from __future__ import annotations

import collections
import dataclasses
import os
import statistics
from pathlib import Path
from typing import Any, Sequence

from sgl_tts import registry
from sgl_tts.experiment.config import RULES
from sgl_tts.experiment.records import subsample_sizes

# --------------------------------------------------------------------------------------- summary
@dataclasses.dataclass
class Summary:
    problems: int
    graded: int
    accuracy: dict[str, float]
    pass_at_n: float | None
    accuracy_at: dict[str, dict[str, float]]
    goodput_tokens_per_s: float
    mean_tokens_per_trajectory: float
    mean_trajectory_seconds: float
    latency_seconds: dict[str, float]
    tokens_generated: int
    tokens_kept: int
    n: int
    exact_subsampling: bool = True  # best-of-N: the first N' samples are a run at N'
    tokens_speculative: int = 0     # of tokens_generated: by speculative requests
    tokens_reused: int = 0          # of those: taken over by a kept child
    seconds_generating: float = 0.0  # summed over problems: waiting for steps (step-wise searches)
    seconds_verifying: float = 0.0   # waiting for scores once a depth's last step ended
    exits: dict[str, int] = dataclasses.field(default_factory=dict)   # MCTS: problems per exit reason
    # speculative branches (speculative: auto): started, declined (by reason), stopped at a barrier
    branches: dict[str, Any] = dataclasses.field(default_factory=dict)
    samples_stopped: int = 0        # DeepConf online: samples stopped below the threshold or at consensus

    def table(self) -> str:
        lines = [f"problems: {self.problems} ({self.graded} with a reference answer)"]
        if self.graded:
            rules = list(self.accuracy)
            lines.append("| selection | " + " | ".join(f"N={k}" for k in self.accuracy_at) + " |")
            lines.append("| --- |" + " ---: |" * len(self.accuracy_at))
            for r in rules:
                lines.append(f"| {r} | " + " | ".join("-" if v[r] is None else f"{100 * v[r]:.1f}%"
                                                        for v in self.accuracy_at.values()) + " |")
            lines.append(f"pass@{self.n}: {100 * (self.pass_at_n or 0):.1f}%")
            if not self.exact_subsampling:
                lines.append(f"(N < {self.n}: the first trajectories of the N={self.n} tree search, "
                             f"which share ancestors; not what a search with fewer beams would give)")
        lat = self.latency_seconds
        lines.append(f"precise goodput: {self.goodput_tokens_per_s:.1f} tokens/s "
                     f"({self.mean_tokens_per_trajectory:.1f} tokens per trajectory / "
                     f"{self.mean_trajectory_seconds:.2f} s mean trajectory completion)")
        lines.append(f"completion latency per problem: mean {lat['mean']:.2f} s, p50 {lat['p50']:.2f} s, "
                     f"p90 {lat['p90']:.2f} s, max {lat['max']:.2f} s")
        kept = self.tokens_kept / self.tokens_generated if self.tokens_generated else 0.0
        lines.append(f"tokens generated {self.tokens_generated}, kept in returned trajectories "
                     f"{self.tokens_kept} ({100 * kept:.0f}%; a shared ancestor counts once per "
                     f"trajectory)")
        if self.tokens_speculative:
            lines.append(f"speculative tokens {self.tokens_speculative} ({self.tokens_reused} reused by kept "
                         f"children, {self.tokens_speculative - self.tokens_reused} wasted); normal "
                         f"{self.tokens_generated - self.tokens_speculative}")
        if self.seconds_generating or self.seconds_verifying:
            lines.append(f"waiting per problem: generator {self.seconds_generating / max(1, self.problems):.2f} s, "
                         f"verifier {self.seconds_verifying / max(1, self.problems):.2f} s")
        if self.branches:
            b = self.branches
            lines.append(f"speculative branches: {b['started']} started, {b['stopped']} stopped at a barrier, "
                         f"{b['declined']} not started (why they stood down: "
                         + (", ".join(f"{why}: {k}" for why, k in sorted(b["stood_down"].items())) or "-") + ")")
        if self.samples_stopped:
            lines.append(f"samples stopped before they ended: {self.samples_stopped} (below the confidence "
                         f"threshold or dropped at consensus; their tokens: "
                         f"{self.tokens_generated - self.tokens_kept})")
        if self.exits:
            lines.append("exits: " + ", ".join(f"{k} {v}" for k, v in sorted(self.exits.items())))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default); 0 for no values."""
    xs = sorted(xs)
    if not xs:
        return 0.0
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(records: Sequence[dict], n: int, program: str = "best_of_n") -> Summary:
    """The run's summary from its output records (see the module docstring)."""
    graded = [r for r in records if r.get("reference") is not None]
    rules = list(records[0]["answers"]) if records else list(RULES)
    accuracy = {rule: sum(r["correct"][rule] for r in graded) / len(graded) if graded else 0.0
                for rule in rules}
    accuracy_at = {}
    for size in subsample_sizes(n):
        # a program's own rule is read at N only (None below it)
        accuracy_at[str(size)] = {
            rule: (sum(r["subsampled"][str(size)][rule] == r["reference"] for r in graded) / len(graded)
                   if graded else 0.0) if all(rule in r["subsampled"][str(size)] for r in graded) else None
            for rule in rules}
    trajs = [t for r in records for t in r["trajectories"]]
    mean_tokens = statistics.fmean(t["tokens"] for t in trajs) if trajs else 0.0
    mean_secs = statistics.fmean(t["seconds"] for t in trajs) if trajs else 0.0
    lat = [r["seconds"] for r in records]
    return Summary(
        problems=len(records), graded=len(graded), accuracy=accuracy,
        pass_at_n=(sum(r["pass"] for r in graded) / len(graded)) if graded else None,
        accuracy_at=accuracy_at, goodput_tokens_per_s=mean_tokens / mean_secs if mean_secs else 0.0,
        mean_tokens_per_trajectory=mean_tokens, mean_trajectory_seconds=mean_secs,
        latency_seconds={"mean": statistics.fmean(lat) if lat else 0.0, "p50": quantile(lat, 0.5),
                         "p90": quantile(lat, 0.9), "max": max(lat, default=0.0)},
        tokens_generated=sum(r["tokens_generated"] for r in records),
        tokens_kept=sum(r["tokens_kept"] for r in records), n=n,
        exact_subsampling=getattr(registry.find(program), "budget", None) == "samples",
        tokens_speculative=sum(r.get("tokens_speculative", 0) for r in records),
        tokens_reused=sum(r.get("tokens_reused", 0) for r in records),
        seconds_generating=sum(r.get("seconds_generating", 0.0) for r in records),
        seconds_verifying=sum(r.get("seconds_verifying", 0.0) for r in records),
        exits=dict(collections.Counter(r["exit_reason"] for r in records if "exit_reason" in r)),
        branches=_branches([r["branches"] for r in records if "branches" in r]),
        samples_stopped=sum(r.get("traces_stopped", 0) for r in records))


def _branches(per_problem: Sequence[dict]) -> dict[str, Any]:
    """The speculative branches of every problem, summed (empty when none speculated)."""
    if not per_problem:
        return {}
    reasons: collections.Counter = collections.Counter()
    for b in per_problem:
        reasons.update(b.get("stood_down", {}))
    return {k: sum(b.get(k, 0) for b in per_problem) for k in ("started", "declined", "stopped")} | {
        "stood_down": dict(reasons)}


def plot_summary(summary: Summary, records: Sequence[dict], path: str | os.PathLike, title: str) -> Path:
    """Two panels: accuracy vs N (each selection rule, subsampled) and per-problem precise goodput
    against completion latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (acc, gp) = plt.subplots(1, 2, figsize=(11, 4.2))
    sizes = [int(k) for k in summary.accuracy_at]
    for rule in summary.accuracy:
        pts = [(k, summary.accuracy_at[str(k)][rule]) for k in sizes if summary.accuracy_at[str(k)][rule] is not None]
        acc.plot([k for k, _ in pts], [100 * v for _, v in pts], marker="o", label=rule)
    if summary.pass_at_n is not None:
        acc.plot([sizes[-1]], [100 * summary.pass_at_n], marker="*", ls="", color="k",
                 label=f"pass@{summary.n}")
    acc.set_xscale("log", base=2)
    acc.set_ylim(0, 102)
    acc.set_xlabel("N (first N samples of one run)" if summary.exact_subsampling else
                   f"N (first N trajectories of one N={summary.n} tree search: not a search at N)")
    acc.set_ylabel("accuracy (%)")
    acc.grid(alpha=0.3)
    acc.legend()
    acc.set_title(f"accuracy vs N ({summary.graded} graded problems)")
    xs, ys = [], []
    for r in records:
        ts = r["trajectories"]
        secs = statistics.fmean(t["seconds"] for t in ts) if ts else 0.0
        if secs > 0:
            xs.append(r["seconds"])
            ys.append(statistics.fmean(t["tokens"] for t in ts) / secs)
    gp.scatter(xs, ys, s=12, alpha=0.6)
    gp.axhline(summary.goodput_tokens_per_s, color="C1", ls="--",
               label=f"run: {summary.goodput_tokens_per_s:.1f} tokens/s")
    gp.set_xlabel("problem completion latency (s)")
    gp.set_ylabel("precise goodput (tokens/s)")
    gp.grid(alpha=0.3)
    gp.legend()
    gp.set_title("precise goodput per problem")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
