"""Several copies of one CPU engine, with requests routed by the prompt prefixes each has seen.

A small model's decode step on the CPU is a few hundred tiny torch calls: one engine keeps one core
busy, and more torch threads do not help (the calls are too small to split). So the way to use a
second core is a second engine, each in a process of its own (data parallelism, as SGLang's
``--dp-size``). What must not be lost is the engines' prefix reuse: the samples of one fork share
their prompt, and a search step's prompt extends the sequences of the step before, whose KV the engine
that ran them still holds. :class:`PrefixRouter` therefore sends a request to the engine that has seen
the longest prefix of it, when that prefix covers at least half of the prompt and that engine is not
more than :data:`MAX_IMBALANCE` requests busier than the least busy one; otherwise to the engine with
the fewest requests in flight (the router of SGLang's model gateway decides the same way: cache
affinity above a match threshold, shortest queue below it or when the loads drift apart). The
imbalance bound is what spreads a long prompt template shared by every problem: the first request
sent away from the engine that has it puts it in the second engine's cache too, and from then on
the template no longer decides. Sampling is seeded per request, so
which engine runs a request does not change what it samples.

Nothing waits here: a finished request's future lowers its engine's count through a callback.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections import OrderedDict
from typing import Any, Sequence

from sgl_tts.backends.engine_request import EngineStats
from sgl_tts.backends.semantics import LogprobSpec, SamplingSpec

#: Tokens per hashed prefix block: a prefix is recognised in whole blocks.
BLOCK_TOKENS = 16
#: Share of a prompt a seen prefix must cover for the request to follow it (else: least loaded).
MIN_MATCH_SHARE = 0.5
#: How many more requests in flight than the least busy engine an engine may have and still be
#: followed for its prefix (more than a fork's siblings, so that one fork stays together).
MAX_IMBALANCE = 32
#: Prefix blocks remembered per engine (least recently used forgotten first): ~100 bytes each.
MAX_BLOCKS = 1 << 17


def block_keys(ids: Sequence[int], block: int = BLOCK_TOKENS) -> list[int]:
    """One key per whole ``block`` of ``ids``; key j stands for the prefix ``ids[: (j + 1) * block]``
    (each key chains the one before, so equal keys mean equal prefixes, up to hash collisions)."""
    keys: list[int] = []
    key = 0
    for end in range(block, len(ids) + 1, block):
        key = hash((key, tuple(ids[end - block:end])))
        keys.append(key)
    return keys


@dataclasses.dataclass
class PrefixRouter:
    """Chooses an engine for each prompt; see the module docstring for the rule.

    ``loads[i]`` is engine i's requests in flight (raise it with :meth:`choose`, lower it with
    :meth:`done`). Not thread-safe: :class:`EngineReplicas` holds a lock around it.
    """

    engines: int
    block: int = BLOCK_TOKENS
    min_match_share: float = MIN_MATCH_SHARE
    max_imbalance: int = MAX_IMBALANCE
    max_blocks: int = MAX_BLOCKS
    loads: list[int] = dataclasses.field(init=False)
    seen: list[OrderedDict[int, None]] = dataclasses.field(init=False)
    followed: int = dataclasses.field(init=False, default=0)   # requests sent where their prefix was
    balanced: int = dataclasses.field(init=False, default=0)   # requests sent to the least loaded

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError(f"a router needs at least one engine, got {self.engines}")
        if self.block < 1 or self.max_blocks < 1 or self.max_imbalance < 0 \
                or not 0.0 <= self.min_match_share <= 1.0:
            raise ValueError("block and max_blocks must be positive, max_imbalance at least 0 and "
                             "min_match_share in [0, 1]")
        self.loads = [0] * self.engines
        self.seen = [OrderedDict() for _ in range(self.engines)]

    def matched_blocks(self, engine: int, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its :func:`block_keys`) ``engine`` has seen."""
        seen = self.seen[engine]
        n = 0
        for key in keys:
            if key not in seen:
                break
            n += 1
        return n

    def choose(self, ids: Sequence[int]) -> int:
        """The engine for a prompt; counts the request in flight there and remembers its prefix."""
        keys = block_keys(ids, self.block)
        matched = [self.matched_blocks(e, keys) for e in range(self.engines)]
        best = max(matched)
        least = min(self.loads)
        pool = [e for e in range(self.engines) if matched[e] == best
                and self.loads[e] - least <= self.max_imbalance]
        if pool and best > 0 and best * self.block >= self.min_match_share * len(ids):
            self.followed += 1
        else:
            pool = list(range(self.engines))
            self.balanced += 1
        engine = min(pool, key=lambda e: (self.loads[e], e))
        self.loads[engine] += 1
        seen = self.seen[engine]
        for key in keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)
        return engine

    def done(self, engine: int) -> None:
        """A request sent to ``engine`` has finished."""
        self.loads[engine] -= 1

    def forget(self) -> None:
        """Forget every prefix (the engines flushed their caches)."""
        for seen in self.seen:
            seen.clear()


class EngineReplicas:
    """The interface of :class:`~sgl_tts.backends.engine.BatchEngine` over several engines of the
    same model (:class:`~sgl_tts.backends.engine_process.EngineProcess` each, in practice), each
    request routed by a :class:`PrefixRouter`."""

    def __init__(self, engines: Sequence[Any]):
        if not engines:
            raise ValueError("EngineReplicas needs at least one engine")
        self.engines = list(engines)
        self.router = PrefixRouter(len(self.engines))
        self._lock = threading.Lock()

    @property
    def max_running(self) -> int:
        return sum(e.max_running for e in self.engines)

    @property
    def pids(self) -> tuple[int, ...]:
        """The engines' process ids (those that run in processes)."""
        return tuple(p for p in (getattr(e, "pid", None) for e in self.engines) if p is not None)

    @property
    def native_thread_id(self) -> None:
        """None: several engines (their CPU is their processes', :attr:`pids`)."""
        return None

    def wait_ready(self) -> None:
        """Block until every engine has loaded its model (raise the first load error)."""
        for e in self.engines:
            wait = getattr(e, "wait_ready", None)
            if wait is not None:
                wait()

    def submit(self, input_ids: Sequence[int], sampling: SamplingSpec,
               logprobs: LogprobSpec | None = None, **kw: Any) -> concurrent.futures.Future:
        """As :meth:`BatchEngine.submit <sgl_tts.backends.engine.BatchEngine.submit>`, on the engine
        the router picks."""
        with self._lock:
            engine = self.router.choose(input_ids)
        try:
            fut = self.engines[engine].submit(input_ids, sampling, logprobs, **kw)
        except BaseException:
            self._done(engine)
            raise
        fut.add_done_callback(lambda _f, e=engine: self._done(e))
        return fut

    def generate(self, input_ids: Sequence[int], sampling: SamplingSpec,
                 logprobs: LogprobSpec | None = None, **kw: Any) -> Any:
        """Blocking :meth:`submit`."""
        return self.submit(input_ids, sampling, logprobs, **kw).result()

    def flush_prefix_cache(self) -> None:
        """Drop every engine's cached prefixes (and what the router remembers of them)."""
        with self._lock:
            self.router.forget()
        for e in self.engines:
            e.flush_prefix_cache()

    @property
    def stats(self) -> EngineStats:
        """The engines' counters added up (``max_running``: the largest of theirs)."""
        total = EngineStats()
        for e in self.engines:
            s = e.stats
            for f in dataclasses.fields(EngineStats):
                if f.name == "max_running":
                    total.max_running = max(total.max_running, s.max_running)
                else:
                    setattr(total, f.name, getattr(total, f.name) + getattr(s, f.name))
        return total

    def close(self) -> None:
        """Close every engine (requests not finished fail as each engine's ``close`` says)."""
        for e in self.engines:
            e.close()

    def _done(self, engine: int) -> None:
        with self._lock:
            self.router.done(engine)


__all__ = ["BLOCK_TOKENS", "EngineReplicas", "MAX_IMBALANCE", "MIN_MATCH_SHARE", "PrefixRouter", "block_keys"]
