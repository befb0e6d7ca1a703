"""Draw an MCTS search tree: nodes coloured by their step's PRM score, finished ones outlined, the
pick ringed, and why the search stopped in the title."""

from __future__ import annotations

from typing import Any

from sgl_tts.mcts import MCTSTree


def layout(tree: MCTSTree) -> dict[int, tuple[float, float]]:
    """Node id -> (x, y): leaves side by side in depth-first order, a parent above the middle of its
    children, one row per depth (y = -depth)."""
    pos: dict[int, tuple[float, float]] = {}
    next_x = [0.0]

    def place(nid: int) -> float:
        node = tree.nodes[nid]
        if not node.children:
            x = next_x[0]
            next_x[0] += 1.0
        else:
            xs = [place(c) for c in node.children]
            x = (xs[0] + xs[-1]) / 2
        pos[nid] = (x, -float(node.depth))
        return x

    place(0)
    return pos


def draw_tree(tree: MCTSTree, ax: Any = None, title: str | None = None) -> Any:
    """Draw ``tree`` on ``ax`` (a new figure when ``None``); returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(min(14, 2 + 0.35 * sum(1 for n in tree.nodes if n.leaf)), 4.5))
    pos = layout(tree)
    for n in tree.nodes[1:]:
        (x0, y0), (x1, y1) = pos[n.parent], pos[n.id]
        ax.plot([x0, x1], [y0, y1], color="0.75", lw=0.8 + 0.4 * min(n.visits, 5), zorder=1)
    ids = [n.id for n in tree.nodes]
    colours = [n.step_score if n.step_score is not None else 0.5 for n in tree.nodes]
    dots = ax.scatter([pos[i][0] for i in ids], [pos[i][1] for i in ids], c=colours, cmap="RdYlGn", vmin=0,
                      vmax=1, s=60, zorder=2, edgecolors=["black" if n.finished else "none" for n in tree.nodes],
                      linewidths=1.5)
    best = tree.best()
    if best is not None:
        ax.scatter([pos[best.id][0]], [pos[best.id][1]], s=220, facecolors="none", edgecolors="tab:blue",
                   linewidths=2, zorder=3, label="pick")
        ax.legend(loc="lower right", fontsize=8)
    ax.figure.colorbar(dots, ax=ax, label="step score (PRM)")
    reason = tree.exit.reason if tree.exit is not None else "running"
    ax.set_title(title or f"MCTS tree: {len(tree.nodes)} nodes, {len(tree.returned)} rollouts returned, "
                          f"{len(tree.cancelled)} cancelled; exit: {reason}")
    ax.set_ylabel("depth")
    ax.set_xticks([])
    ax.set_yticks(sorted({y for _, y in pos.values()}))
    ax.set_yticklabels([str(int(-y)) for y in sorted({y for _, y in pos.values()})])
    return ax


__all__ = ["draw_tree", "layout"]
