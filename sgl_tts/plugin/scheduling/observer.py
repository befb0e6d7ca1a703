"""The plugin's observation hooks, and its observe-only mode.

The hooks here only read what SGLang's scheduler did and feed :class:`SchedulerMetrics`; they never
change an argument, a return value or the order of anything:

- ``Scheduler.get_new_batch_prefill`` (after): a prefill batch was formed (admissions, cached and
  computed prompt tokens, recomputed blocks: the thrashing measure);
- ``Scheduler.get_next_batch_to_run`` (around): the round timer, ``time.perf_counter()`` around
  SGLang's call; a round that returned a batch counts as a prefill round (an extend batch, mixed or
  not) or a decode round, with its seconds, and the batch is recorded (size, occupancy, context);
- every tree cache's ``evict`` (:data:`sgl_tts.plugin.hooks.EVICT_TARGETS`, after): tokens evicted;
- ``Scheduler.flush_cache`` (after): a flush that emptied the radix cache clears the thrashing
  measure's seen blocks (a fresh start, not an eviction).

:func:`observation_hooks` is that list; the full plugin (:func:`sgl_tts.plugin.hook_table`) registers it
beside its scheduling hooks. With ``SGLANG_TTS_OBSERVE_ONLY=1`` in the server's environment
(:data:`OBSERVE_ONLY_ENV`) :func:`sgl_tts.plugin.register` registers these and :func:`scheduler_init`
only (:func:`observer_hook_table`): no ``--tts-*`` flag exists (the launcher refuses them), no
scheduling, retraction, abort, sampling or attention hook is in place, so the server schedules as stock
SGLang and is measured by the same code as a server running the plugin. ``sgl-tts bench`` runs its
stock sides so. Metrics are on when the server runs ``--enable-metrics`` (``sgl_tts_*`` Prometheus
series on ``/metrics``) or when ``SGLANG_TTS_METRICS_FILE`` names a JSONL prefix; otherwise the hooks
pass every call through.

The round timer's time is the scheduler's own time per round: forming the batch (the waiting queue's
order, admission, retraction checks, the plugin's own hooks inside the call, this module's prefill
accounting included), not the forward pass. It costs two ``perf_counter`` calls and a few counter
additions per round.
"""

from __future__ import annotations

import logging
import os
from time import perf_counter
from typing import Any, Mapping

from sgl_tts.plugin.hooks import EVICT_TARGETS, TARGETS, missing_from, refuse_missing
from sgl_tts.plugin.scheduling.metrics import SchedulerMetrics

logger = logging.getLogger(__name__)

OBSERVE_ONLY_ENV = "SGLANG_TTS_OBSERVE_ONLY"   # "1": register the observation hooks only
METRICS_FILE_ENV = "SGLANG_TTS_METRICS_FILE"   # the JSONL prefix (as --tts-metrics-file sets it)
#: a server's environment for observe-only: SGLang's allow-list loads sgl-tts (and no other plugin)
SERVER_ENV = {"SGLANG_PLUGINS": "sgl-tts", OBSERVE_ONLY_ENV: "1"}


def observe_only(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the plugin runs observe-only (``SGLANG_TTS_OBSERVE_ONLY=1`` in ``environ``, by default
    this process's environment, which SGLang's scheduler processes inherit from the launcher)."""
    env = os.environ if environ is None else environ
    return env.get(OBSERVE_ONLY_ENV, "").strip() == "1"


def observation_hooks() -> list[tuple[str, Any, str]]:
    """(target, hook, hook type) of the hooks that observe: the same in full and observe-only mode."""
    return [
        (TARGETS["prefill"], after_prefill, "AFTER"),
        (TARGETS["next_batch"], time_round, "AROUND"),
        *((target, after_evict, "AFTER") for target in EVICT_TARGETS),
        (TARGETS["flush"], after_flush, "AFTER"),
    ]


def observer_hook_table() -> list[tuple[str, Any, str]]:
    """Every hook of observe-only mode: :func:`scheduler_init` and :func:`observation_hooks`."""
    return [(TARGETS["scheduler_init"], scheduler_init, "AFTER"), *observation_hooks()]


def attach_metrics(scheduler: Any, *, path: str | None, prometheus: bool, **start: Any) -> SchedulerMetrics:
    """Hang a :class:`SchedulerMetrics` on ``scheduler`` and its tree cache (where the hooks look for
    it), writing JSONL to ``path`` (or none) and Prometheus series when ``prometheus``; its start record
    carries ``start`` and the scheduler's pool size."""
    metrics = SchedulerMetrics(path, prometheus=prometheus)
    scheduler.sgl_tts_metrics = metrics
    scheduler.tree_cache.sgl_tts_metrics = metrics
    metrics.on_start(**start, max_total_tokens=getattr(scheduler, "max_total_num_tokens", None))
    logger.info("sgl-tts: scheduler metrics to %s", path or "Prometheus")
    return metrics


def scheduler_init(result: Any, scheduler: Any, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on ``Scheduler.__init__`` in observe-only mode: metrics on ``scheduler`` when the
    server runs ``--enable-metrics`` or ``SGLANG_TTS_METRICS_FILE`` is set (then the observation hooks
    must be in place, else the scheduler refuses to start rather than report nothing), none otherwise."""
    scheduler.sgl_tts_metrics = None
    prometheus = bool(getattr(server_args, "enable_metrics", False))
    prefix = os.environ.get(METRICS_FILE_ENV) or None
    if not (prometheus or prefix):
        return result
    # this hook runs, so it is in place: what the metrics need besides is the observation hooks
    refuse_missing(missing_from(observation_hooks()), f"{OBSERVE_ONLY_ENV}=1 asks for scheduler metrics")
    logger.info("sgl-tts: observe-only (%s=1): stock scheduling, observation hooks only", OBSERVE_ONLY_ENV)
    attach_metrics(scheduler, path=f"{prefix}.{os.getpid()}" if prefix else None, prometheus=prometheus,
                   policy="observe-only", schedule_policy=getattr(server_args, "schedule_policy", None))
    return result


# ------------------------------------------------------------------------------------ the hooks
def occupancy(allocator: Any) -> float | None:
    """The fraction of the KV pool's slots in use (``None``: the allocator has no size)."""
    size = getattr(allocator, "size", None)
    if not size:
        return None
    return 1.0 - allocator.available_size() / size


def seq_tokens(batch: Any) -> int | None:
    """The batch's sequence lengths summed: SGLang's ``seq_lens_sum``, which a decode batch leaves
    unset until its forward pass (then its host copy of the lengths, ``seq_lens_cpu``: no device sync)."""
    total = getattr(batch, "seq_lens_sum", None)
    if total is None:
        lengths = getattr(batch, "seq_lens_cpu", None)
        total = lengths.sum() if lengths is not None else None
    return None if total is None else int(total)


def after_prefill(batch: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on ``Scheduler.get_new_batch_prefill``: the admissions of the batch it formed."""
    metrics = getattr(scheduler, "sgl_tts_metrics", None)
    if metrics is not None and batch is not None:
        state = getattr(scheduler.policy, "sgl_tts", None)
        # --enable-mixed-chunk: SGLang mixed the running decode requests into this batch
        # (``decoding_reqs``) and emptied ``running_batch``: they run, they were not admitted
        decoding = getattr(batch, "decoding_reqs", None) or []
        mixed = {id(r) for r in decoding}
        metrics.on_prefill([r for r in batch.reqs if id(r) not in mixed], waiting=len(scheduler.waiting_queue),
                           running=len(scheduler.running_batch.reqs) + len(decoding),
                           deferred=state.last_deferred if state is not None else 0,
                           occupancy=occupancy(scheduler.token_to_kv_pool_allocator))
    return batch


def time_round(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook on ``Scheduler.get_next_batch_to_run``: the round's seconds and its batch. A round
    that returned no batch (idle) is not counted; an extend batch (``ForwardMode.is_extend``: prefill,
    mixed) makes a prefill round, any other a decode round."""
    metrics = getattr(scheduler, "sgl_tts_metrics", None)
    if metrics is None:
        return original(scheduler, *args, **kwargs)
    start = perf_counter()
    batch = original(scheduler, *args, **kwargs)
    seconds = perf_counter() - start
    if batch is not None:
        mode = batch.forward_mode
        metrics.on_batch(getattr(mode, "name", str(mode)), len(batch.reqs),
                         occupancy=occupancy(scheduler.token_to_kv_pool_allocator), seq_tokens=seq_tokens(batch),
                         round_seconds=seconds, prefill=bool(mode.is_extend()))
    return batch


def after_evict(result: Any, cache: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on a tree cache's ``evict``: the KV tokens the call freed (a call that freed none,
    a Mamba-state-only evict, is not recorded)."""
    metrics = getattr(cache, "sgl_tts_metrics", None)
    tokens = int(getattr(result, "num_tokens_evicted", 0) or 0) if result is not None else 0
    if metrics is not None and tokens:
        metrics.on_evict(tokens)
    return result


def after_flush(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook on ``Scheduler.flush_cache``: a flush that emptied the radix cache (it returns True)
    makes the server as cold as a fresh one, so the thrashing measure forgets the blocks it saw
    computed: a prefix computed again after a flush is not a recomputation caused by eviction
    (``sgl-tts bench`` flushes between two sides on the same servers)."""
    metrics = getattr(scheduler, "sgl_tts_metrics", None)
    if metrics is not None and result:
        metrics.on_flush()
    return result


__all__ = ["METRICS_FILE_ENV", "OBSERVE_ONLY_ENV", "SERVER_ENV", "after_evict", "after_flush", "after_prefill", "attach_metrics",
           "observation_hooks", "observe_only", "observer_hook_table", "occupancy", "scheduler_init",
           "seq_tokens", "time_round"]
