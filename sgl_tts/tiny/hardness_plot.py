"""Seed 004's Fig. 6a on a problem set: first step score against trajectory score (``sgl-tts workload``)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from sgl_tts.tiny.hardness import Cutoff, FirstStep


def plot_first_step(points: Sequence[FirstStep], cut: Cutoff, path: str | Path, title: str = "") -> Path:
    """Left: every T-sampled trajectory as (first step score, aggregated score), right answers in one
    colour; the threshold and the chosen cut-off as lines. Right: the share of trajectories that
    reach the threshold, per first-step-score bin (with the count per bin)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.2))
    for ok, color, label in ((False, "C3", "wrong answer"), (True, "C2", "right answer")):
        pts = [p for p in points if p.correct == ok]
        ax.scatter([p.first for p in pts], [p.final for p in pts], s=8, alpha=0.4, color=color, label=label)
    ax.axhline(cut.threshold, color="k", lw=0.8, ls="--", label=f"threshold {cut.threshold:g}")
    if cut.cutoff is not None:
        ax.axvline(cut.cutoff, color="C0", lw=0.8, label=f"cut-off {cut.cutoff:.3f}")
    ax.set_xlabel("first step score")
    ax.set_ylabel("trajectory score (aggregated)")
    ax.set_title(title or "first step vs trajectory")
    ax.legend(fontsize=7)
    edges = [i / 10 for i in range(11)]
    rates, counts, mids = [], [], []
    for lo, hi in zip(edges, edges[1:]):
        b = [p for p in points if lo <= p.first < hi or (hi == 1.0 and p.first == 1.0)]
        if b:
            mids.append((lo + hi) / 2)
            rates.append(sum(p.final >= cut.threshold for p in b) / len(b))
            counts.append(len(b))
    bars = bx.bar(mids, rates, width=0.09, color="C0")
    for rect, n in zip(bars, counts):
        bx.annotate(str(n), (rect.get_x() + rect.get_width() / 2, rect.get_height()), ha="center",
                    va="bottom", fontsize=7)
    bx.set_xlim(0, 1)
    bx.set_ylim(0, 1.1)
    bx.set_xlabel("first step score (bins of 0.1; n above each)")
    bx.set_ylabel(f"share reaching {cut.threshold:g}")
    bx.set_title(f"Spearman {cut.spearman:.2f}, Pearson {cut.pearson:.2f}")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


__all__ = ["plot_first_step"]
