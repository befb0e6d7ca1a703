"""The sgl-tts SGLang scheduler plugin (entry point ``sgl-tts`` in the ``sglang.srt.plugins`` group).

SGLang 0.5.15 calls :func:`register` in every process that loads plugins (the launcher and each
scheduler process). It hooks, through SGLang's ``HookRegistry``:

- ``ServerArgs.add_cli_args`` (after): the "test-time scaling (sgl-tts)" flag group;
- ``ServerArgs.from_cli_args`` (after): validation, values onto ``ServerArgs`` + the environment;
- ``Scheduler.__init__`` (after): the prefix-aware policy attached to the scheduler's policy;
- ``SchedulePolicy.calc_priority`` and ``PrefillAdder.add_one_req`` (around): pass-through unless the
  policy is attached, so with no ``--tts-*`` flag the server schedules exactly as stock SGLang;
- ``Scheduler.get_new_batch_prefill``, ``Scheduler.get_next_batch_to_run`` and ``RadixCache.evict``
  with every tree cache's own ``evict`` (:data:`EVICT_TARGETS`) (after): metrics, only when a
  ``--tts-*`` flag asks: ``--tts-metrics-file`` writes JSONL, and
  ``--enable-metrics`` adds ``sgl_tts_*`` Prometheus series when ``--tts-metrics-file`` or
  ``--tts-policy prefix-aware`` is given (``--enable-metrics`` alone: none, stock SGLang);
- ``Scheduler.get_new_batch_prefill`` (after), ``Req.update_finish_state`` and
  ``ScheduleBatch.retract_decode`` (around), with the policy on: speculative requests are stopped
  when normal work was refused room, a stop never hides a natural finish, and retraction takes
  speculative requests first and never one being stopped (:mod:`sgl_tts.plugin.preemption`);
- ``SchedulerLoadInquirer.get_num_waiting_uncached_tokens`` (around), with the policy on: waiting
  requests' ``num_matched_prefix_tokens`` are filled before ``/v1/loads`` reads them;
- ``Scheduler.set_internal_state`` (around): ``{"tts_set_class": {...}}`` on SGLang's
  ``/set_internal_state`` changes the class of a group's requests (e.g. MCTS boosting), and
  ``TokenizerManager.set_internal_state`` (around) answers such a command with each scheduler's
  reply (how many requests it re-classed) instead of SGLang's bare ``updated`` flags;
- ``SamplingBatchInfo.from_schedule_batch`` (after), with ``--tts-seeded-sampling``: every
  request's ``sampling_seed`` decides its samples (:mod:`sgl_tts.plugin.seeding`), and
  ``multinomial_with_seed`` (around) draws seeded samples on the CPU, where SGLang's Triton hash
  cannot run;
- ``TokenizerManager.abort_request`` (around): an abort of a ``tts/<group>/`` rid prefix aborts every
  live request of that search group (:mod:`sgl_tts.plugin.abort`); other aborts are unchanged;
- ``ModelRunner._get_attention_backend_from_str`` (around), with ``--tts-cpu-attention ragged``:
  ``torch_native`` attention becomes :mod:`sgl_tts.plugin.cpu_attention`'s ragged backend
  (registered in SGLang's attention registry); every other backend is SGLang's.

``SGLANG_PLUGINS`` (a comma-separated whitelist of entry-point names) is SGLang's: leave ``sgl-tts``
out of it and none of this loads. SGLang's hook registry only logs a hook it could not apply; with
any ``--tts-*`` flag on, the launcher and every scheduler process check that every hook is in place
and refuse to serve otherwise (:func:`check_attached`), rather than run stock SGLang silently.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

TARGETS = {
    "add_cli_args": "sglang.srt.server_args.ServerArgs.add_cli_args",
    "from_cli_args": "sglang.srt.server_args.ServerArgs.from_cli_args",
    "scheduler_init": "sglang.srt.managers.scheduler.Scheduler.__init__",
    "calc_priority": "sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority",
    "add_one_req": "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
    "prefill": "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill",
    "next_batch": "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
    "evict": "sglang.srt.mem_cache.radix_cache.RadixCache.evict",
    "abort": "sglang.srt.managers.tokenizer_manager.TokenizerManager.abort_request",
    "retract": "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode",
    "finish_state": "sglang.srt.managers.schedule_batch.Req.update_finish_state",
    "loads": "sglang.srt.managers.scheduler_components.load_inquirer.SchedulerLoadInquirer."
             "get_num_waiting_uncached_tokens",
    "set_state": "sglang.srt.managers.scheduler.Scheduler.set_internal_state",
    "set_state_reply": "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.set_internal_state",
    "sampling_info": "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.from_schedule_batch",
    "seeded_draw": "sglang.srt.layers.sampler.multinomial_with_seed",
    "attention_backend": "sglang.srt.model_executor.model_runner.ModelRunner._get_attention_backend_from_str",
}

# Evictions are counted on every SGLang 0.5.15 tree cache that evicts by its own ``evict`` (a hook on
# ``RadixCache.evict`` never sees an override that does not call it). Left out on purpose: the ones
# whose evict ends in ``RadixCache.evict`` through ``super()`` (``PureSWARadixCache``,
# ``LMCRadixCache``: counted there, once), the chunk caches (no tree: evict returns nothing) and
# ``RadixCacheCpp`` (``SGLANG_EXPERIMENTAL_CPP_RADIX_TREE`` only; importing it builds a C++ extension).
# ``StreamingSession`` wraps another cache: its own hook counts (the metrics hang on the wrapper, the
# scheduler's ``tree_cache``), the inner cache's sees no metrics and does not.
EVICT_TARGETS = (
    TARGETS["evict"],
    "sglang.srt.mem_cache.hiradix_cache.HiRadixCache.evict",              # --enable-hierarchical-cache
    "sglang.srt.mem_cache.swa_radix_cache.SWARadixCache.evict",           # sliding-window hybrids
    "sglang.srt.mem_cache.mamba_radix_cache.MambaRadixCache.evict",       # Mamba hybrids
    "sglang.srt.mem_cache.hi_mamba_radix_cache.HiMambaRadixCache.evict",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.evict",   # hybrid hicache, unified tree
    "sglang.srt.session.streaming_session.StreamingSession.evict",        # --enable-streaming-session
)


def _add_cli_args(result, parser, *args, **kwargs):
    from sgl_tts.plugin.settings import add_arguments

    add_arguments(parser)
    return result


def _from_cli_args(server_args, cls, args, *rest, **kwargs):
    from sgl_tts.plugin.settings import apply

    settings = apply(server_args, args)
    if settings.any_on:
        check_attached()
    return server_args


def hook_table() -> list[tuple[str, object, str]]:
    """(target, hook function, hook type) of every hook the plugin registers."""
    from sgl_tts.plugin import abort, cpu_attention, policy, preemption, seeding

    return [
        (TARGETS["add_cli_args"], _add_cli_args, "AFTER"),
        (TARGETS["from_cli_args"], _from_cli_args, "AFTER"),
        (TARGETS["scheduler_init"], _scheduler_init, "AFTER"),
        (TARGETS["calc_priority"], policy.calc_priority, "AROUND"),
        (TARGETS["add_one_req"], policy.add_one_req, "AROUND"),
        (TARGETS["prefill"], preemption.after_prefill, "AFTER"),
        (TARGETS["prefill"], _after_prefill, "AFTER"),
        (TARGETS["retract"], preemption.retract_decode, "AROUND"),
        (TARGETS["finish_state"], preemption.update_finish_state, "AROUND"),
        (TARGETS["loads"], policy.fill_matched_prefixes, "AROUND"),
        (TARGETS["set_state"], policy.set_internal_state, "AROUND"),
        (TARGETS["set_state_reply"], policy.set_internal_state_reply, "AROUND"),
        (TARGETS["next_batch"], _after_next_batch, "AFTER"),
        *((target, _after_evict, "AFTER") for target in EVICT_TARGETS),
        (TARGETS["abort"], abort.abort_request, "AROUND"),
        (TARGETS["sampling_info"], seeding.seeded_batch_info, "AFTER"),
        (TARGETS["seeded_draw"], seeding.multinomial_with_seed, "AROUND"),
        (TARGETS["attention_backend"], cpu_attention.attention_backend_from_str, "AROUND"),
    ]


def _hooks_in(fn) -> set:
    """The hook functions found in ``fn``'s chain of SGLang hook wrappers (``__wrapped__``)."""
    found = set()
    fn = getattr(fn, "__func__", fn)
    while fn is not None:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                found.add(cell.cell_contents)
            except ValueError:   # an empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return found


def missing_hooks() -> list[str]:
    """Targets on which one of the plugin's hooks is not in place in this process."""
    import pkgutil

    missing: list[str] = []
    for target, hook, _ in hook_table():
        owner, name = target.rsplit(".", 1)
        try:
            present = _hooks_in(getattr(pkgutil.resolve_name(owner), name))
        except (ImportError, AttributeError, ValueError):
            present = set()
        if hook not in present and target not in missing:
            missing.append(target)
    return missing


def check_attached() -> None:
    """Refuse to serve (``RuntimeError``) if a hook of the plugin is not in place in this process:
    SGLang's registry logs a hook it could not apply and goes on, which would run stock scheduling
    under ``--tts-*`` flags without a word."""
    missing = missing_hooks()
    if missing:
        raise RuntimeError(
            "sgl-tts: --tts-* flags are set but the plugin's hooks are not in place on "
            + ", ".join(missing) + " (see SGLang's 'Failed to apply hooks' log lines above; is this "
            "SGLang 0.5.15?). Refusing to serve stock scheduling under sgl-tts flags; drop the "
            "--tts-* flags to run stock SGLang.")


def _scheduler_init(result, scheduler, server_args, *args, **kwargs):
    from sgl_tts.plugin.policy import enable
    from sgl_tts.plugin.settings import TTSSettings

    from sgl_tts.plugin import seeding

    settings = TTSSettings.of(server_args)
    if settings.any_on:
        check_attached()
    seeding.ENABLED = settings.seeded_sampling
    state = enable(scheduler.policy, settings)
    if state is not None and getattr(scheduler, "load_inquirer", None) is not None:
        from sgl_tts.plugin.policy import LOAD_INQUIRERS

        LOAD_INQUIRERS[id(scheduler.load_inquirer)] = scheduler
    if state is not None:
        logger.info("sgl-tts: scheduler policy %s (dedup %d tokens)", settings.policy,
                    settings.dedup_tokens)
    scheduler.sgl_tts_metrics = None
    # only an explicit --tts-* flag: --enable-metrics alone leaves the server stock (no sgl_tts_*)
    if settings.metrics_file or (settings.active and getattr(server_args, "enable_metrics", False)):
        import os

        from sgl_tts.plugin.metrics import SchedulerMetrics

        path = f"{settings.metrics_file}.{os.getpid()}" if settings.metrics_file else None
        metrics = SchedulerMetrics(path, prometheus=bool(getattr(server_args, "enable_metrics", False)))
        scheduler.sgl_tts_metrics = metrics
        scheduler.tree_cache.sgl_tts_metrics = metrics
        # what this scheduler process runs with, read back from the process itself
        metrics.on_start(policy=settings.policy if state is not None else "off",
                         dedup_tokens=settings.dedup_tokens, seeded_sampling=settings.seeded_sampling,
                         schedule_policy=server_args.schedule_policy,
                         max_total_tokens=getattr(scheduler, "max_total_num_tokens", None))
        logger.info("sgl-tts: scheduler metrics to %s", path or "Prometheus")
    return result


def occupancy(allocator) -> float | None:
    size = getattr(allocator, "size", None)
    if not size:
        return None
    return 1.0 - allocator.available_size() / size


def _after_prefill(batch, scheduler, *args, **kwargs):
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


def _after_next_batch(batch, scheduler, *args, **kwargs):
    metrics = getattr(scheduler, "sgl_tts_metrics", None)
    if metrics is not None and batch is not None:
        metrics.on_batch(getattr(batch.forward_mode, "name", str(batch.forward_mode)), len(batch.reqs),
                         occupancy=occupancy(scheduler.token_to_kv_pool_allocator), seq_tokens=seq_tokens(batch))
    return batch


def seq_tokens(batch) -> int | None:
    """The batch's sequence lengths summed: SGLang's ``seq_lens_sum``, which a decode batch leaves
    unset until its forward pass (then its host copy of the lengths, ``seq_lens_cpu``: no device sync)."""
    total = getattr(batch, "seq_lens_sum", None)
    if total is None:
        lengths = getattr(batch, "seq_lens_cpu", None)
        total = lengths.sum() if lengths is not None else None
    return None if total is None else int(total)


def _after_evict(result, cache, *args, **kwargs):
    # the KV tokens the call freed; a call that freed none (a Mamba-state-only evict) is not recorded
    metrics = getattr(cache, "sgl_tts_metrics", None)
    tokens = int(getattr(result, "num_tokens_evicted", 0) or 0) if result is not None else 0
    if metrics is not None and tokens:
        metrics.on_evict(tokens)
    return result


def register() -> None:
    """Register the hooks (SGLang applies them after every plugin has registered)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in hook_table():
        HookRegistry.register(target, hook, HookType[kind])


__all__ = ["EVICT_TARGETS", "TARGETS", "check_attached", "hook_table", "missing_hooks", "register"]
