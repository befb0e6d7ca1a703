"""The benchmarks' error, below every module of ``sgl_tts.bench`` that raises or catches it (the goodput
benchmark's modules, its sides, ``sgl-tts bench``'s command), so none of them imports another for it."""

from __future__ import annotations


class BenchError(RuntimeError):
    """The benchmark cannot go on; the message says why and what to do."""


__all__ = ["BenchError"]
