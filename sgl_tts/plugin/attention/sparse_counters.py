"""What the sparse decode path did (:class:`SparseCounters`): rows sparse and dense, selections late
or missing, what the choices kept, and the attention's own seconds per context token, dense and
sparse, by context length: the server's measure of whether sparse attention pays at a length on
this machine (``docs/benchmarks/LOG.md``, "Sparse decoding", reads it per cell)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time

logger = logging.getLogger(__name__)


def bucket_of(length: int) -> int:
    """A context length's bucket: the largest power of two at or below it (1 for 0)."""
    return 1 << max(0, int(length).bit_length() - 1)


@dataclasses.dataclass
class SparseCounters:
    """What the decoder did, summed over layers and rows (one row of one layer counts once)."""

    dense_rows: int = 0          # attended densely: short, budget covers the context, or no selection
    sparse_rows: int = 0         # attended to a selection
    late: int = 0                # async: the newest finished selection was older than the previous step
    missing: int = 0             # async: no selection for the row yet (it attended densely)
    context_tokens: int = 0      # sparse rows: their contexts' tokens
    attended_tokens: int = 0     # sparse rows: the tokens they attended to
    selections: int = 0          # rows selected (by the worker or in the step)
    selection_seconds: float = 0.0
    dropped_jobs: int = 0        # async: a layer's job superseded by a newer one before the worker took it
    stood_down: int = 0          # rows dense because sparse measured slower at their context (stand-down)
    # measure: per layer, the summed overlap ratio (seed 003's Eq. 1) of a sparse row's selection with the
    # current query's choice (per KV head), and how many row-heads were compared
    overlap_sum: dict = dataclasses.field(default_factory=dict)
    overlap_count: dict = dataclasses.field(default_factory=dict)
    # measure, async: per layer, the summed cosine of the predicted query with the true one (per KV
    # head, its query heads as one vector), and of the previous step's query with the true one (what
    # a selection from the last query would have used: the value of predicting over not predicting)
    cosine_sum: dict = dataclasses.field(default_factory=dict)
    cosine_count: dict = dataclasses.field(default_factory=dict)
    previous_cosine_sum: dict = dataclasses.field(default_factory=dict)
    previous_cosine_count: dict = dataclasses.field(default_factory=dict)
    # measure: per layer, the overlap with the current query's choice of the previous step's query's
    # choice (token level, over the current context): a selection one step stale, without prediction
    previous_overlap_sum: dict = dataclasses.field(default_factory=dict)
    previous_overlap_count: dict = dataclasses.field(default_factory=dict)

    # per context bucket (the largest power of two <= the rows' mean context, as a string: JSON's keys),
    # a layer's attention seconds and the context tokens of the rows it attended, dense layers' and
    # sparse layers' apart (sparse: finding the selection, gathering, attending and, under async,
    # recording the queries and handing the job; not the measure work)
    dense_seconds: dict = dataclasses.field(default_factory=dict)
    dense_tokens: dict = dataclasses.field(default_factory=dict)
    sparse_seconds: dict = dataclasses.field(default_factory=dict)
    sparse_tokens: dict = dataclasses.field(default_factory=dict)

    def time(self, kind: str, bucket: int, tokens: int, seconds: float) -> None:
        """Add one layer's ``seconds`` attending rows of ``tokens`` context tokens in all, in ``bucket``
        (:func:`bucket_of` their mean context; ``kind``: ``"dense"`` or ``"sparse"``)."""
        bucket = str(bucket)
        secs, toks = (self.dense_seconds, self.dense_tokens) if kind == "dense" else (self.sparse_seconds,
                                                                                       self.sparse_tokens)
        secs[bucket] = secs.get(bucket, 0.0) + seconds
        toks[bucket] = toks.get(bucket, 0) + tokens

    def per_token(self) -> dict:
        """Microseconds per context token of a layer's attention, by bucket: ``{bucket: (dense, sparse)}``
        (``None`` where that kind has not run)."""
        out = {}
        for bucket in sorted(set(self.dense_tokens) | set(self.sparse_tokens), key=int):
            d, sp = self.dense_tokens.get(bucket), self.sparse_tokens.get(bucket)
            out[int(bucket)] = (self.dense_seconds[bucket] / d * 1e6 if d else None,
                                self.sparse_seconds[bucket] / sp * 1e6 if sp else None)
        return out

    def overlap(self) -> dict:
        """Mean overlap per layer."""
        return means(self.overlap_sum, self.overlap_count)

    def cosine(self) -> dict:
        """Mean cosine of the predicted query with the true one, per layer."""
        return means(self.cosine_sum, self.cosine_count)

    def previous_cosine(self) -> dict:
        """Mean cosine of the previous step's query with the true one, per layer."""
        return means(self.previous_cosine_sum, self.previous_cosine_count)

    def previous_overlap(self) -> dict:
        """Mean overlap of the previous step's query's choice with the current query's, per layer."""
        return means(self.previous_overlap_sum, self.previous_overlap_count)

    def line(self) -> str:
        share = self.attended_tokens / self.context_tokens if self.context_tokens else 0.0
        return (f"sgl-tts sparse attention: rows sparse {self.sparse_rows} dense {self.dense_rows}, "
                f"attended {share:.1%} of their context, late {self.late}, missing {self.missing}, "
                f"selections {self.selections} in {self.selection_seconds:.2f}s, dropped jobs {self.dropped_jobs}, "
                f"stood down {self.stood_down}")


def means(sums: dict, counts: dict) -> dict:
    return {layer: sums[layer] / counts[layer] for layer in sorted(sums) if counts.get(layer)}


def add_to_mean(sums: dict, counts: dict, layer: int, values) -> None:
    sums[layer] = sums.get(layer, 0.0) + float(values.sum())
    counts[layer] = counts.get(layer, 0) + int(values.numel())


class StatsFile:
    """``counters`` as JSON at ``path``, written by a thread of its own after :meth:`mark`, at most once
    per ``every`` seconds (replaced whole: a reader never sees half a file). Writing it in the step,
    every step, cost the step ~0.4 ms on the 2-core Xeon (``asdict``, ``json.dump``, a rename): more
    than a sparse layer's bookkeeping. A reader sees counts at most ``every`` seconds old (wait that
    long after the work to read it whole); an idle server's thread blocks, using no CPU."""

    def __init__(self, counters: SparseCounters, path: str, every: float = 0.2):
        self.counters, self.path, self.every = counters, path, every
        self._dirty = False
        self._changed = threading.Condition()
        threading.Thread(target=self._loop, name="sgl-tts-sparse-stats", daemon=True).start()

    def mark(self) -> None:
        """The counters changed (one step): the thread writes them soon."""
        with self._changed:
            if not self._dirty:
                self._dirty = True
                self._changed.notify()

    def write(self) -> None:
        """Write now (the thread's work; a test may call it)."""
        try:
            data = json.dumps(dataclasses.asdict(self.counters))
        except RuntimeError:   # a dict grew a bucket while being copied (the step runs on): next time
            self.mark()
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            f.write(data)
        os.replace(tmp, self.path)

    def _loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._dirty)
                self._dirty = False
            try:
                self.write()
            except OSError:
                logger.exception("sgl-tts sparse attention: could not write its counters to %s", self.path)
            time.sleep(self.every)   # the rate limit: marks meanwhile make one more write, not many


__all__ = ["StatsFile", "SparseCounters", "add_to_mean", "bucket_of", "means"]
