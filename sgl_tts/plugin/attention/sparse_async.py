"""The asynchronous side of sparse decoding (``--tts-sparse-attention async``, seed 003's cache rank):
what the decode step records, what a job carries, how the cache rank answers it, and how the step
turns an answer into the pool rows it attends to.

The split between the step and the cache rank keeps the step's own work small (it is on the
critical path; the choice is not):

- **The step records each sparse layer's query as it is** (:class:`QueryHistory`, a ring of the
  last ``h`` per pool slot: one indexed write). Ordering the ring and turning it into the
  prediction's rotary frame is the cache rank's work (:func:`history_in_frame`).
- **A job carries no context index**: the cache rank reads the rows' pool slots from the server's own
  ``req_to_token`` (shared with the process: :func:`~sgl_tts.plugin.attention.sparse_worker.share_key_pools`'
  neighbour ``share_tensor``), so a job is the rows, their lengths and their recent queries.
- **An answer is pool rows, not positions** (:func:`choose`): for each layer and row, the flat rows
  of the layer's pool viewed ``[tokens * kv_heads, dim]`` (``token slot * kv_heads + head``) of the
  chosen tokens, exactly the row's budget per KV head, so the step gathers keys and values with it
  as it is. The step adds the tokens written since the choice was made (:func:`new_rows`) and
  attends (:func:`assemble`); positions travel only under ``--tts-sparse-measure``.

torch is imported inside the functions (the plugin package loads no torch in the launcher).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

if TYPE_CHECKING:
    import torch

    from sgl_tts.plugin.attention.sparse_decoding import KeyMirror, Rotary


class QueryHistory:
    """Each pool slot's last ``h`` queries for one layer, as the step saw them (rotated by position),
    in a ring: the query at position ``p`` sits at column ``p % h``. With each slot, how many queries
    are real (the newest ``available``, at consecutive positions) and the context length at the newest
    (a row's next query continues the history only at length + 1)."""

    def __init__(self, slots: int, h: int, heads: int, dim: int, dtype, device):
        import torch

        self.q = torch.zeros(slots, h, heads, dim, dtype=dtype, device=device)
        self.available = torch.zeros(slots, dtype=torch.long, device=device)
        self.length = torch.full((slots,), -1, dtype=torch.long, device=device)

    @property
    def h(self) -> int:
        return int(self.q.shape[1])

    def append(self, slots: torch.Tensor, queries: torch.Tensor, lengths: torch.Tensor) -> None:
        """Record ``queries`` [rows, heads, dim], the queries at positions ``lengths - 1``."""
        import torch

        continues = self.length[slots] == lengths - 1
        self.q[slots, (lengths - 1) % self.h] = queries
        self.available[slots] = torch.where(continues, torch.clamp(self.available[slots] + 1, max=self.h),
                                            torch.ones_like(lengths))
        self.length[slots] = lengths

    def reset(self, slot: int, queries: torch.Tensor, length: int) -> None:
        """A slot's context was (re)filled to ``length``: its history is the newest of ``queries``
        [n, heads, dim] (the queries of the context's last ``n`` positions)."""
        import torch

        n = min(self.h, int(queries.shape[0]))
        if n:
            self.q[slot, torch.arange(length - n, length) % self.h] = queries[-n:]
        self.available[slot] = n
        self.length[slot] = length

    def ordered(self, slots: torch.Tensor) -> torch.Tensor:
        """The slots' histories oldest first, ``[rows, h, heads, dim]`` (the last column the newest)."""
        return history_in_frame(self.q[slots][None], self.length[slots], None)[0]


def history_positions(lengths: torch.Tensor, h: int) -> torch.Tensor:
    """``[rows, h]``: the position of each entry of a history ordered oldest first (the newest at
    ``length - 1``; entries before position 0 hold no query and read position 0)."""
    import torch

    return torch.clamp(lengths[:, None] - h + torch.arange(h, device=lengths.device)[None, :], min=0)


def history_in_frame(ring: torch.Tensor, lengths: torch.Tensor, rotary: Optional["Rotary"]) -> torch.Tensor:
    """Rings ``[layers, rows, h, heads, dim]`` (:class:`QueryHistory` columns) ordered oldest first
    and, with ``rotary``, each query rotated back from its position to 0 (the prediction's frame)."""
    import torch

    from sgl_tts.plugin.attention.sparse_decoding import rotate

    layers, rows, h, heads, dim = ring.shape
    cols = (lengths[:, None] - h + torch.arange(h, device=lengths.device)[None, :]) % h        # [rows, h]
    ordered = ring.gather(2, cols[None, :, :, None, None].expand(layers, rows, h, heads, dim))
    if rotary is None:
        return ordered
    positions = history_positions(lengths, h)[None].expand(layers, rows, h).reshape(-1)
    return rotate(ordered.reshape(-1, heads, dim), positions, rotary, inverse=True).view_as(ordered)


@dataclasses.dataclass
class Job:
    """The next step's choice for the same rows in one or more layers (a step's sparse layers, one
    unit as seed 003's cache rank takes them: one prediction, one choice)."""

    layers: list                 # layer ids
    slots: list                  # pool slots of the rows
    epochs: list                 # each slot's epoch when the job was made
    lengths: "torch.Tensor"      # [rows] context length at the newest query
    ring: "torch.Tensor"         # [layers, rows, h, heads, dim]: the rows' QueryHistory columns
    available: "torch.Tensor"    # [layers, rows]
    scale: Optional[float]
    k_caches: list               # each layer's key pool
    req_to_token: "torch.Tensor"  # the server's table: the rows' contexts at req_to_token[slot, :length]
    rotary: Optional["Rotary"] = None   # predict in the rotary frame of this embedding


class Answer(NamedTuple):
    """A job's choice: ``rows`` ``[layers * rows, kv_heads, k]`` (layer-major) the chosen tokens as
    flat pool rows (``token slot * kv_heads + head``), the first ``counts[i]`` of each real (a row's
    budget; the rest padding); under measure ``positions`` (the same tokens as context positions,
    ``mask`` marking the real ones) and the predicted ``query`` ``[layers, rows, heads, dim]``."""

    layers: list
    slots: list
    epochs: list
    lengths: list
    rows: "torch.Tensor"
    counts: list
    positions: Optional["torch.Tensor"]
    mask: Optional["torch.Tensor"]
    query: Optional["torch.Tensor"]
    seconds: float


def choose(s: Any, layers: Sequence[int], slots: Sequence[int], epochs: Sequence[int], lengths: torch.Tensor,
           ring: torch.Tensor, available: torch.Tensor, scale: Optional[float], k_caches: Sequence[torch.Tensor],
           req_to_token: torch.Tensor, rotary: Optional["Rotary"], mirror: Optional["KeyMirror"]) -> Answer:
    """The cache rank's work for one job (a thread's or the process's): the history ordered and in
    its frame, :func:`~sgl_tts.plugin.attention.sparse_decoding.choose_next` (keys from ``mirror`` if given),
    and the choice as flat pool rows. ``s``: the :class:`~sgl_tts.plugin.settings.SparseSettings`."""
    import time

    import torch

    from sgl_tts.plugin.attention import sparse_decoding as sd

    t0 = time.perf_counter()
    n = int(lengths.max())
    index = req_to_token[torch.as_tensor(list(slots), dtype=torch.long), :n]
    keys_of = None if mirror is None else mirror.source(layers, slots, epochs, k_caches, index)
    query, selection = sd.choose_next(history_in_frame(ring, lengths, rotary), available, lengths, index, k_caches,
                                      scale, windows=s.windows, ridge=s.ridge, budget=s.budget, sink=s.sink,
                                      recent=s.recent, rotary=rotary, keys_of=keys_of)
    kv = int(k_caches[0].shape[1])
    pool = torch.gather(index.long().repeat(len(layers), 1), 1, selection.positions.flatten(1))
    flat = pool.view_as(selection.positions) * kv + torch.arange(kv)[None, :, None]
    flat = flat.to(torch.int32) if int(k_caches[0].shape[0]) * kv < 2 ** 31 else flat
    counts = selection.mask[:, 0].sum(-1).tolist()
    measure = bool(s.measure)
    return Answer(list(layers), list(slots), list(epochs), lengths.tolist(), flat, counts,
                  selection.positions if measure else None, selection.mask if measure else None,
                  query if measure else None, time.perf_counter() - t0)


class Entry(NamedTuple):
    """One layer's finished choice for one row: made for ``epoch`` at context ``made``; ``rows``
    ``[kv_heads, k]`` flat pool rows; under measure the positions ``[kv_heads, k]`` and the predicted
    query ``[heads, dim]``."""

    epoch: int
    made: int
    rows: "torch.Tensor"
    positions: Optional["torch.Tensor"]
    query: Optional["torch.Tensor"]


def entries(answer: Answer) -> list[tuple[int, int, Entry]]:
    """``(layer, slot, entry)`` for each layer and row of ``answer``."""
    out = []
    n = len(answer.slots)
    for i, layer in enumerate(answer.layers):
        for r, (slot, epoch) in enumerate(zip(answer.slots, answer.epochs)):
            at = i * n + r
            k = answer.counts[at]
            out.append((layer, slot, Entry(epoch, int(answer.lengths[r]), answer.rows[at, :, :k],
                                           None if answer.positions is None else answer.positions[at, :, :k],
                                           None if answer.query is None else answer.query[i, r])))
    return out


def new_rows(req_to_token: torch.Tensor, slot: int, made: int, length: int, kv: int, dtype) -> torch.Tensor:
    """``[kv_heads, length - made]``: the flat pool rows of the tokens a row wrote at positions
    ``made .. length - 1`` (after its choice was made), every KV head."""
    import torch

    tokens = req_to_token[slot, made:length].to(dtype)
    return tokens[None, :] * kv + torch.arange(kv, dtype=dtype)[:, None]


def assemble(parts: list[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rows' pool rows ``[kv_heads, k_r]`` as one ``[rows, kv_heads, k]`` index (shorter rows padded
    with their first entry) and the mask of the real ones, ``None`` when every row is as long (no mask:
    the CPU's attention kernel is ~1.7x slower with one)."""
    import torch

    sizes = [int(p.shape[1]) for p in parts]
    k = max(sizes)
    if min(sizes) == k:
        return torch.stack(parts), None
    index = torch.stack([torch.cat((p, p[:, :1].expand(-1, k - p.shape[1])), dim=1) for p in parts])
    mask = torch.arange(k)[None, None, :] < torch.tensor(sizes)[:, None, None]
    return index, mask.expand(-1, index.shape[1], -1)


__all__ = ["Answer", "Entry", "Job", "QueryHistory", "assemble", "choose", "entries", "history_in_frame",
           "history_positions", "new_rows"]
