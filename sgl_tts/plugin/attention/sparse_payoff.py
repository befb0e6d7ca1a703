"""When sparse decode attention stands down (``--tts-sparse-stand-down auto``, the default).

Sparse attention does not pay at every context length: its fixed costs (finding the selection,
gathering the chosen keys one row per token and head, the async bookkeeping) outweigh the tokens it
skips below some length, and where that length lies depends on the machine, the model and the load
(on the 2-core CPU of ``docs/benchmarks/LOG.md`` it was between 4k and 16k, far above the 1024 of
``--tts-sparse-dense-below``). So the server decides from its own steps: per context bucket (the
largest power of two at or below a row's context), a moving average of a dense layer's and of a
sparse layer's attention seconds per context token, each as the decoder timed it
(:meth:`~sgl_tts.plugin.attention.sparse_counters.SparseCounters.time` reports the same timings). A bucket
where sparse measured no faster than dense stands down: its rows attend densely in every layer.

Estimates go stale as the load changes, so each side is measured again now and then: a stood-down
bucket runs sparse for one step every :attr:`SparsePayoff.probe_every` steps (async hands its
rows' jobs again a little before, so the probe has fresh selections), and a bucket running sparse
with no dense layers to time (``--tts-sparse-dense-layers 0``) runs one step dense as often.
"""

from __future__ import annotations

from typing import Optional

from sgl_tts.plugin.attention.sparse_counters import bucket_of


class SparsePayoff:
    """Per context bucket: whether sparse attention pays (see the module docstring).

    Args:
        probe_every: steps between measuring the side a bucket does not run.
        samples: timings of each side a bucket needs before it may stand down.
        smoothing: weight of a new timing in the moving averages.
        lead: steps before a stood-down bucket's probe from which async hands its jobs again.
    """

    def __init__(self, probe_every: int = 64, samples: int = 3, smoothing: float = 0.2, lead: int = 3):
        if probe_every < 2 or samples < 1 or not 0 < smoothing <= 1 or lead < 0:
            raise ValueError("SparsePayoff: probe_every >= 2, samples >= 1, 0 < smoothing <= 1, lead >= 0")
        self.probe_every, self.samples, self.smoothing, self.lead = probe_every, samples, smoothing, lead
        self._rate: dict[tuple[str, int], float] = {}    # (kind, bucket) -> seconds per context token
        self._count: dict[tuple[str, int], int] = {}
        self._last: dict[tuple[str, int], int] = {}      # (kind, bucket) -> step of its newest timing
        self._step = 0
        self._plan: dict[int, str] = {}                  # this step's choice per bucket: "sparse" or "dense"
        self.stood_down_steps = 0                        # bucket-steps run dense because sparse did not pay

    def record(self, kind: str, bucket: int, tokens: int, seconds: float) -> None:
        """One layer's ``seconds`` attending ``tokens`` context tokens of ``bucket``'s rows, ``kind``
        ``"dense"`` or ``"sparse"``."""
        if tokens <= 0:
            return
        key = (kind, bucket)
        rate = seconds / tokens
        old = self._rate.get(key)
        self._rate[key] = rate if old is None else old + self.smoothing * (rate - old)
        self._count[key] = self._count.get(key, 0) + 1
        self._last[key] = self._step

    def rate(self, kind: str, bucket: int) -> Optional[float]:
        """The moving average of ``kind``'s seconds per context token in ``bucket`` (``None``: unmeasured)."""
        return self._rate.get((kind, bucket))

    def pays(self, bucket: int) -> Optional[bool]:
        """Whether sparse measured faster than dense in ``bucket`` (``None``: not measured enough)."""
        if min(self._count.get(("dense", bucket), 0), self._count.get(("sparse", bucket), 0)) < self.samples:
            return None
        return self._rate[("sparse", bucket)] < self._rate[("dense", bucket)]

    def new_step(self, buckets: set[int], dense_layers: int) -> None:
        """Choose how this step's rows of ``buckets`` attend (``dense_layers``: the layers that time dense
        attention in every step)."""
        self._step += 1
        self._plan = {}
        for b in buckets:
            pays = self.pays(b)
            if pays is False:
                since = self._step - self._last.get(("sparse", b), 0)
                self._plan[b] = "sparse" if since >= self.probe_every else "dense"    # a probe of sparse
                self.stood_down_steps += self._plan[b] == "dense"
            elif dense_layers == 0 and self._count.get(("sparse", b), 0) >= self.samples and (
                    self._count.get(("dense", b), 0) < self.samples
                    or self._step - self._last.get(("dense", b), 0) >= self.probe_every):
                self._plan[b] = "dense"                                               # a probe of dense
            else:
                self._plan[b] = "sparse"

    def sparse(self, bucket: int) -> bool:
        """Whether this step's rows of ``bucket`` attend sparsely."""
        return self._plan.get(bucket, "sparse") == "sparse"

    def wants_selection(self, bucket: int) -> bool:
        """Async, after this step's timings: whether rows of ``bucket`` need a selection for the coming
        steps (a stood-down bucket's only in the :attr:`lead` steps before its probe)."""
        if self.pays(bucket) is not False:
            return True
        last = self._step if self.sparse(bucket) else self._last.get(("sparse", bucket), 0)   # (a probe now)
        return self._step - last >= self.probe_every - self.lead


__all__ = ["SparsePayoff", "bucket_of"]
