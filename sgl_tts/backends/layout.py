"""Where the CPU backend's engines run: threads or processes, how many generator engines, how many
rows each (:func:`choose_engine`, the one rule ``sgl-tts run``, ``bench-frontend``, ``demo`` and
``quality`` follow).

Standard library only: a command can decide its layout (and start the engine zygote) before its
own heavy imports.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

EngineIn = Literal["thread", "process"]

#: In-flight searches from which ``auto`` lays the CPU engines out for many searches: each in a
#: process of its own, a tree search's with room for up to :data:`TREE_SEARCH_RUNNING_CAP` requests.
#: Measured with ``sgl-tts bench-frontend --backends cpu`` (2-core CPU, 2026-11-26,
#: docs/benchmarks/LOG.md): in one process each, beam search and MCTS gained 4-22% at every K (most at
#: K = 128, where hundreds of fork threads share the interpreter with an in-process engine) while
#: best-of-N, whose client is nearly idle, lost 1-12% (with a generator engine per core it gains, see
#: below). 1,024 running rows instead of 256 took MCTS at K = 128 from 2.65 to 3.04 searches/s and
#: beam search from 2.64 to 2.81, but best-of-16 at K = 32 from 2.63-2.95 to 2.52-2.58 (all its
#: samples then decode at once and meet the PRM at once, instead of overlapping with the PRM's
#: scoring of the first ones).
#: From this many in flight, ``auto`` also gives the generator one engine per core
#: (:mod:`sgl_tts.backends.replicas`), except to a tree search with
#: :data:`TREE_SEARCH_REPLICAS_MAX_IN_FLIGHT` or more in flight. Measured with ``sgl-tts bench-frontend
#: --backends cpu`` one engine against two (2-core AMD EPYC, 2026-11-28, docs/benchmarks/LOG.md), searches/s:
#: beam search +18% / +7% / -1% / -7% at K = 8 / 32 / 64 / 128, MCTS +8% / +13% / -6% / -7%; best-of-16
#: against its thread engine +5% / +3% / +16% at K = 8 / 32 / 128. Two engines spend more CPU per token
#: than one with twice the batch; with many tree searches the client's fork threads need that CPU.
PROCESS_ENGINE_MIN_IN_FLIGHT = 8
TREE_SEARCH_REPLICAS_MAX_IN_FLIGHT = 64
DEFAULT_RUNNING_CAP = 256
TREE_SEARCH_RUNNING_CAP = 1024


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """Where a :class:`LocalBackend`'s engine runs, the most requests it may decode together
    (``running_cap``; the KV budget may allow fewer) and how many engines the generator runs
    (``replicas``, each in a process of its own). A PRM runs one engine: it does a forward pass per
    step and no decoding, and a second PRM engine made the main job slower (``sgl-tts demo`` on 2
    cores, generator in two processes: 134.8 s of runs with the PRM in two, 127.4 s in one;
    2026-11-28)."""

    engine_in: EngineIn
    running_cap: int
    replicas: int = 1

    def options(self) -> dict[str, object]:
        """The generator's :class:`LocalBackend` keyword arguments."""
        return {"engine_in": self.engine_in, "running_cap": self.running_cap, "replicas": self.replicas}

    def prm_options(self) -> dict[str, object]:
        """The PRM's :class:`LocalBackend` keyword arguments (one engine)."""
        return {"engine_in": self.engine_in, "running_cap": self.running_cap}


def choose_engine(setting: str, *, tree_search: bool, in_flight: int, replicas: int | None = None,
                  cores: int | None = None) -> EngineLayout:
    """The CPU engines' layout for a setting ``thread``, ``process`` or ``auto`` and a workload.

    With at least :data:`PROCESS_ENGINE_MIN_IN_FLIGHT` searches in flight ``auto`` puts the engines in
    processes and the generator in one per core (``cores``; default: this process's usable cores),
    one only for a tree search (beam search, DVTS, MCTS) with
    :data:`TREE_SEARCH_REPLICAS_MAX_IN_FLIGHT` or more; with fewer, threads. A tree search with that
    many gets :data:`TREE_SEARCH_RUNNING_CAP` running rows per engine, anything else
    :data:`DEFAULT_RUNNING_CAP`, whatever the setting. ``replicas`` overrides the count (more than one
    needs processes)."""
    if setting not in ("auto", "thread", "process"):
        raise ValueError(f"cpu engine must be auto, thread or process, got {setting!r}")
    many = in_flight >= PROCESS_ENGINE_MIN_IN_FLIGHT
    engine_in = setting if setting != "auto" else ("process" if many else "thread")
    if replicas is None:
        spread = setting == "auto" and many and not (tree_search and in_flight >= TREE_SEARCH_REPLICAS_MAX_IN_FLIGHT)
        if spread:
            from sgl_tts.machine import usable_cores

            replicas = cores or usable_cores()
        else:
            replicas = 1
    elif replicas < 1:
        raise ValueError(f"cpu replicas must be at least 1, got {replicas}")
    elif replicas > 1 and engine_in != "process":
        raise ValueError(f"{replicas} cpu replicas need engines in processes, and this layout has "
                         f"threads (cpu engine {setting!r})")
    cap = TREE_SEARCH_RUNNING_CAP if tree_search and many else DEFAULT_RUNNING_CAP
    return EngineLayout(engine_in, cap, replicas)  # type: ignore[arg-type]


__all__ = ["DEFAULT_RUNNING_CAP", "EngineIn", "EngineLayout", "PROCESS_ENGINE_MIN_IN_FLIGHT",
           "TREE_SEARCH_REPLICAS_MAX_IN_FLIGHT", "TREE_SEARCH_RUNNING_CAP", "choose_engine"]
