"""Scheduler observability (seed 001 ch. 6): batch sizes, KV occupancy, prefill tokens per request,
prefix-cache hit rate, evictions and thrashing, per scheduler process.

:class:`SchedulerMetrics` is fed by the plugin's observation hooks (:mod:`sgl_tts.plugin.scheduling.observer`:
``Scheduler.get_new_batch_prefill``, the round timer around ``Scheduler.get_next_batch_to_run``,
``RadixCache.evict``), in full or observe-only mode, and writes one JSONL record per event to
``--tts-metrics-file`` (``<path>.<pid>`` per scheduler process, buffered, flushed at least every
second); with SGLang's ``--enable-metrics`` the same counters are Prometheus metrics (``sgl_tts_*``)
on the server's ``/metrics``. ``sgl-tts scheduler-stats FILE...`` summarises the records.

The round timer counts the scheduler rounds that formed a batch, prefill (extend) or decode, and the
seconds ``get_next_batch_to_run`` took for them: ``sgl_tts_scheduler_rounds`` and
``sgl_tts_scheduler_round_seconds`` (label ``mode``), and ``round`` / ``round_seconds`` on each
``batch`` record.

Thrashing follows seed 001 Alg. 1 on prefix blocks: a request's input is cut into ``block_tokens``
blocks, each identified by a hash of the whole prefix up to its end. When a request is admitted, its
blocks already in the radix cache are marked seen; each block it must compute that was seen before
(computed earlier, gone now: evicted, or computed by a concurrent request) is a recomputed block.
The ids are chained, ``id(block k) = hash((id(block k-1), tokens of block k))``, so a request costs
time linear in its length while an id still stands for the whole prefix (hashing every prefix anew
was quadratic: ~130 ms per prefill batch of 64 x 4,000 tokens against ~4 ms chained on a 2-core
Xeon, docs/benchmarks/plugin_costs.md).
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Sequence

from sgl_tts.plugin.scheduling.ordering import as_bytes

MAX_SEEN = 2_000_000   # block hashes remembered (oldest forgotten first)
ROUND_MODES = ("prefill", "decode")   # the round timer's ``mode`` label


class SchedulerMetrics:
    """Counters and an event log of one scheduler process."""

    def __init__(self, path: str | os.PathLike | None = None, *, block_tokens: int = 16,
                 prometheus: bool = False, flush_seconds: float = 1.0):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.path = Path(path) if path else None
        self.flush_seconds = flush_seconds
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._buffer: list[str] = []
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()
        self.totals = {"iterations": 0, "prefill_batches": 0, "admitted": 0, "cached_tokens": 0,
                       "computed_tokens": 0, "evicted_tokens": 0, "recomputed_blocks": 0,
                       "deferred": 0, "prefill_rounds": 0, "decode_rounds": 0,
                       "prefill_round_seconds": 0.0, "decode_round_seconds": 0.0}
        self._prom = _prometheus() if prometheus else None
        if self.path is not None:
            atexit.register(self.flush)  # what is buffered when the scheduler exits normally
            # an idle scheduler writes nothing that would flush the buffer: flush on a timer too,
            # so a reader sees a finished workload's records within ~flush_seconds
            threading.Thread(target=self._flush_every, name="sgl-tts-metrics", daemon=True).start()

    def _flush_every(self) -> None:
        while True:
            time.sleep(self.flush_seconds)
            self.flush()

    def on_start(self, **fields: Any) -> None:
        """The scheduler process attached the plugin (its settings and pid), written at once."""
        self._write({"event": "start", "time": time.time(), "pid": os.getpid(), **fields})
        self.flush()

    # ----------------------------------------------------------------------------- events
    def on_prefill(self, reqs: Sequence[Any], *, waiting: int, running: int, deferred: int = 0,
                   occupancy: float | None = None) -> dict:
        """A prefill batch was formed from ``reqs`` (SGLang ``Req`` after admission: their
        ``prefix_indices`` are the cached part, ``extend_range`` the part to compute)."""
        per_req, recomputed = [], 0
        cached_total = computed_total = 0
        for req in reqs:
            cached = len(req.prefix_indices)
            span = getattr(req, "extend_range", None)   # SGLang 0.5.15: Range(start, end) to compute
            computed = (span.end - span.start) if span is not None else int(getattr(req, "extend_input_len", 0))
            recomputed += self._blocks(prefix_bytes(req, cached + computed), cached)
            per_req.append({"rid": str(req.rid), "cached": cached, "computed": computed})
            cached_total += cached
            computed_total += computed
        t = self.totals
        t["prefill_batches"] += 1
        t["admitted"] += len(reqs)
        t["cached_tokens"] += cached_total
        t["computed_tokens"] += computed_total
        t["recomputed_blocks"] += recomputed
        t["deferred"] += deferred
        record = {"event": "prefill", "time": time.time(), "admitted": len(reqs), "waiting": waiting,
                  "running": running, "deferred": deferred, "cached_tokens": cached_total,
                  "computed_tokens": computed_total, "recomputed_blocks": recomputed,
                  "occupancy": occupancy, "requests": per_req}
        if self._prom:
            p = self._prom
            p["cached"].inc(cached_total)
            p["computed"].inc(computed_total)
            p["recomputed"].inc(recomputed)
            p["deferred"].inc(deferred)
            p["waiting"].set(waiting)
        self._write(record)
        return record

    def on_batch(self, mode: str, batch_size: int, *, occupancy: float | None = None,
                 seq_tokens: int | None = None, round_seconds: float | None = None,
                 prefill: bool | None = None) -> None:
        """A batch ran (``mode``: SGLang's forward mode name; ``seq_tokens``: its requests' sequence
        lengths summed, SGLang's ``seq_lens_sum``: a decode row's cost grows with its context).
        ``round_seconds``: the scheduler's time forming it (the round timer), a prefill round when
        ``prefill`` (an extend batch), else a decode round."""
        t = self.totals
        t["iterations"] += 1
        record = {"event": "batch", "time": time.time(), "mode": mode, "batch_size": batch_size,
                  "occupancy": occupancy, "seq_tokens": seq_tokens}
        if round_seconds is not None:
            kind = ROUND_MODES[0] if prefill else ROUND_MODES[1]
            t[kind + "_rounds"] += 1
            t[kind + "_round_seconds"] += round_seconds
            record["round"], record["round_seconds"] = kind, round_seconds
        if self._prom:
            p = self._prom
            p["batch"].observe(batch_size)
            if occupancy is not None:
                p["occupancy"].set(occupancy)
            if round_seconds is not None:
                p["rounds"][kind].inc()
                p["round_seconds"][kind].inc(round_seconds)
        self._write(record)

    def on_flush(self) -> None:
        """The radix cache was emptied (SGLang's ``/flush_cache``): what was computed before is gone
        by request, not by eviction, so no block seen before counts as recomputed."""
        with self._lock:
            self._seen.clear()
        self._write({"event": "flush", "time": time.time()})

    def on_evict(self, tokens: int) -> None:
        self.totals["evicted_tokens"] += tokens
        if self._prom:
            self._prom["evicted"].inc(tokens)
        self._write({"event": "evict", "time": time.time(), "tokens": tokens})

    # ---------------------------------------------------------------------------- helpers
    def _blocks(self, data: bytes, cached: int) -> int:
        """Mark the whole blocks of ``data`` (token ids, 8 bytes each) seen; count the blocks past the
        first ``cached`` tokens that were seen before.

        A block's id is ``hash((previous block's id, this block's bytes))`` (the first block's
        previous id is 0): one hash of ``block_tokens`` tokens per block, and equal ids mean equal
        whole prefixes up to the block's end (up to 64-bit hash collisions, as before)."""
        b = self.block_tokens * 8
        cached_end = cached * 8  # a block ending past the cached part is computed
        seen = self._seen
        recomputed = 0
        h = 0
        with self._lock:
            for end in range(b, len(data) + 1, b):
                h = hash((h, data[end - b:end]))
                if h in seen:
                    if end > cached_end:
                        recomputed += 1
                    seen.move_to_end(h)
                else:
                    seen[h] = None
            while len(seen) > MAX_SEEN:
                seen.popitem(last=False)
        return recomputed

    def _write(self, record: dict) -> None:
        if self.path is None:
            return
        with self._lock:
            self._buffer.append(json.dumps(record))
            if time.monotonic() - self._last_flush >= self.flush_seconds or len(self._buffer) >= 512:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._buffer and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as fh:
                fh.write("\n".join(self._buffer) + "\n")
            self._buffer.clear()
        self._last_flush = time.monotonic()


def prefix_bytes(req: Any, n: int) -> bytes:
    """The first ``n`` token ids of ``req``'s prompt + output so far, as bytes (8 per token)."""
    data = as_bytes(req.origin_input_ids)
    if len(data) < n * 8:
        data += as_bytes(req.output_ids)
    return data[:n * 8]


_PROMETHEUS: dict | None = None


def _prometheus() -> dict:
    """The plugin's Prometheus collectors, created once per process (a registry refuses duplicates;
    SGLang's multiprocess collector merges the scheduler processes' values on /metrics)."""
    global _PROMETHEUS
    if _PROMETHEUS is None:
        _PROMETHEUS = _make_prometheus()
    return _PROMETHEUS


def _make_prometheus() -> dict:
    from prometheus_client import Counter, Gauge, Histogram

    rounds = Counter("sgl_tts_scheduler_rounds", "scheduler rounds that formed a batch (get_next_batch_to_run)",
                     ["mode"])
    round_seconds = Counter("sgl_tts_scheduler_round_seconds", "seconds the scheduler spent forming those batches",
                            ["mode"])
    return {
        # one child per mode, made now: both series exist (0) from the start, and an increment is no lookup
        "rounds": {m: rounds.labels(mode=m) for m in ROUND_MODES},
        "round_seconds": {m: round_seconds.labels(mode=m) for m in ROUND_MODES},
        "cached": Counter("sgl_tts_prefill_cached_tokens", "prompt tokens served from the prefix cache"),
        "computed": Counter("sgl_tts_prefill_computed_tokens", "prompt tokens prefilled"),
        "recomputed": Counter("sgl_tts_recomputed_blocks", "prefix blocks computed again (thrashing)"),
        "deferred": Counter("sgl_tts_deferred_requests", "admissions deferred so one sibling prefills"),
        "evicted": Counter("sgl_tts_evicted_tokens", "tokens evicted from the radix cache"),
        "waiting": Gauge("sgl_tts_waiting_requests", "waiting queue length at the last prefill",
                         multiprocess_mode="livesum"),
        "occupancy": Gauge("sgl_tts_kv_occupancy", "fraction of KV slots in use",
                           multiprocess_mode="livemax"),
        "batch": Histogram("sgl_tts_batch_size", "requests per forward batch",
                           buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)),
    }


# ------------------------------------------------------------------------------------- summary
def scheduler_files(prefix: str | os.PathLike) -> list[Path]:
    """The files a server started with ``--tts-metrics-file PREFIX`` wrote: ``PREFIX.<scheduler pid>``
    (not the sparse attention's ``PREFIX.sparse.<pid>`` counters)."""
    prefix = Path(prefix)
    return sorted(p for p in prefix.parent.glob(prefix.name + ".*") if p.name[len(prefix.name) + 1:].isdigit())


def read_records(paths: Iterable[str | os.PathLike]) -> list[dict]:
    out = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"no metrics file {path}; start the server with "
                                    f"--tts-metrics-file PATH (each scheduler writes PATH.<pid>)")
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line torn by a killed server
    return out


def summarize(records: Sequence[dict]) -> dict:
    """What the records say: batch sizes, occupancy, prefix hit rate, evictions, thrashing."""
    batches = [r for r in records if r.get("event") == "batch"]
    prefills = [r for r in records if r.get("event") == "prefill"]
    sizes = [r["batch_size"] for r in batches]
    occ = [r["occupancy"] for r in records if r.get("occupancy") is not None]
    cached = sum(r["cached_tokens"] for r in prefills)
    computed = sum(r["computed_tokens"] for r in prefills)
    per_req = [q["cached"] + q["computed"] for r in prefills for q in r.get("requests", [])]
    rounds = {m: [r["round_seconds"] for r in batches if r.get("round") == m] for m in ROUND_MODES}
    return {
        "batches": len(batches),
        "batch_size": {"mean": statistics.fmean(sizes) if sizes else 0.0,
                       "p50": statistics.median(sizes) if sizes else 0, "max": max(sizes, default=0)},
        "kv_occupancy": {"mean": statistics.fmean(occ) if occ else None, "max": max(occ, default=None)},
        "prefill_batches": len(prefills),
        "admitted": sum(r["admitted"] for r in prefills),
        "deferred": sum(r.get("deferred", 0) for r in prefills),
        "prefix_hit_rate": cached / (cached + computed) if cached + computed else None,
        "cached_tokens": cached, "computed_tokens": computed,
        "prompt_tokens_per_admission": {"mean": statistics.fmean(per_req) if per_req else 0.0,
                                        "max": max(per_req, default=0)},
        "evicted_tokens": sum(r["tokens"] for r in records if r.get("event") == "evict"),
        "recomputed_blocks": sum(r["recomputed_blocks"] for r in prefills),
        # the round timer (records written before it have none: 0 rounds)
        "rounds": {m: len(rounds[m]) for m in ROUND_MODES},
        "round_seconds": {m: sum(rounds[m]) for m in ROUND_MODES},
    }


__all__ = ["ROUND_MODES", "SchedulerMetrics", "read_records", "scheduler_files", "summarize"]
