"""How well a PRM's step scores separate good steps from bad ones: :func:`auc`, the step-classification
AUC that the training (:mod:`sgl_tts.tiny.training`), the hardness measure (:mod:`sgl_tts.tiny.hardness`)
and the programs' comparison (:mod:`sgl_tts.quality`) report. Stdlib only."""

from __future__ import annotations

from typing import Sequence


def auc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """Area under the ROC curve (Mann-Whitney U with tied ranks averaged)."""
    pairs = sorted(zip(scores, labels))
    n_pos = sum(labels)
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    rank_sum, i = 0.0, 0
    while i < len(pairs):
        j = i
        while j < len(pairs) and pairs[j][0] == pairs[i][0]:
            j += 1
        avg_rank = (i + j + 1) / 2.0
        rank_sum += avg_rank * sum(lab for _, lab in pairs[i:j])
        i = j
    return (rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


__all__ = ["auc"]
