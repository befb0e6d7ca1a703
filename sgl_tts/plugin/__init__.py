"""The sgl-tts SGLang scheduler plugin (entry point ``sgl-tts`` in the ``sglang.srt.plugins`` group).

SGLang 0.5.15 calls :func:`register` in every process that loads plugins (the launcher and each
scheduler process). It registers the PRM architectures SGLang does not serve
(:mod:`sgl_tts.plugin.model_registry`, :mod:`sgl_tts.plugin.models`: ``Qwen2ForProcessRewardModel``,
``Qwen2ForPrmModel``, step-pooled) and hooks, through SGLang's ``HookRegistry``:

- ``is_generation_model`` (around), in every mode: those architectures embed;
- ``ServerArgs.add_cli_args`` (after): the "test-time scaling (sgl-tts)" flag group;
- ``ServerArgs.from_cli_args`` (after): validation, values onto ``ServerArgs`` + the environment;
- ``Scheduler.__init__`` (after): the prefix-aware policy attached to the scheduler's policy;
- ``SchedulePolicy.calc_priority`` and ``PrefillAdder.add_one_req`` (around): pass-through unless the
  policy is attached, so with no ``--tts-*`` flag the server schedules exactly as stock SGLang;
- the observation hooks (:func:`sgl_tts.plugin.scheduling.observer.observation_hooks`):
  ``Scheduler.get_new_batch_prefill`` and ``RadixCache.evict`` with every tree cache's own ``evict``
  (:data:`EVICT_TARGETS`) (after), and the round timer on ``Scheduler.get_next_batch_to_run``
  (around): metrics, only when a ``--tts-*`` flag asks: ``--tts-metrics-file`` writes JSONL, and
  ``--enable-metrics`` adds ``sgl_tts_*`` Prometheus series when ``--tts-metrics-file`` or
  ``--tts-policy prefix-aware`` is given (``--enable-metrics`` alone: none, stock SGLang);
- ``Scheduler.get_new_batch_prefill`` (after), ``Req.update_finish_state`` and
  ``ScheduleBatch.retract_decode`` (around), with the policy on: speculative requests are stopped
  when normal work was refused room, a stop never hides a natural finish, and retraction takes
  speculative requests first and never one being stopped (:mod:`sgl_tts.plugin.scheduling.preemption`);
- ``Req.reset_for_retract`` (after): a retracted request's cached order information goes (it comes
  back to the waiting queue with more output; the order does not re-read requests that stayed);
- ``SchedulerLoadInquirer.get_num_waiting_uncached_tokens`` (around), with the policy on: waiting
  requests' ``num_matched_prefix_tokens`` are filled before ``/v1/loads`` reads them;
- ``Scheduler.set_internal_state`` (around): ``{"tts_set_class": {...}}`` on SGLang's
  ``/set_internal_state`` changes the class of a group's requests (e.g. MCTS boosting), and
  ``TokenizerManager.set_internal_state`` (around) answers such a command with each scheduler's
  reply (how many requests it re-classed) instead of SGLang's bare ``updated`` flags;
- ``SamplingBatchInfo.from_schedule_batch`` (after), with ``--tts-seeded-sampling``: every
  request's ``sampling_seed`` decides its samples (:mod:`sgl_tts.plugin.scheduling.seeding`), and
  ``multinomial_with_seed`` (around) draws seeded samples on the CPU, where SGLang's Triton hash
  cannot run;
- ``TokenizerManager.abort_request`` (around): an abort of a ``tts/<group>/`` rid prefix aborts every
  live request of that search group (:mod:`sgl_tts.plugin.scheduling.abort`); other aborts are unchanged;
- ``ModelRunner._get_attention_backend_from_str`` (around), with ``--tts-cpu-attention ragged``:
  ``torch_native`` attention becomes :mod:`sgl_tts.plugin.attention.cpu_attention`'s ragged backend
  (registered in SGLang's attention registry), or with ``--tts-sparse-attention`` the sparse one
  (:mod:`sgl_tts.plugin.attention.backend_choice` chooses); every other backend is SGLang's.

With ``SGLANG_TTS_OBSERVE_ONLY=1`` in the environment the plugin registers only the observation hooks
and an observer's ``Scheduler.__init__`` hook (:mod:`sgl_tts.plugin.scheduling.observer`): no flags, stock
scheduling, metrics when the server runs ``--enable-metrics`` (or ``SGLANG_TTS_METRICS_FILE`` is set).

``SGLANG_PLUGINS`` (a comma-separated whitelist of entry-point names) is SGLang's: leave ``sgl-tts``
out of it and none of this loads. SGLang's hook registry only logs a hook it could not apply; with
any ``--tts-*`` flag on, the launcher and every scheduler process check that every hook is in place
and refuse to serve otherwise (:func:`check_attached`), rather than run stock SGLang silently. So it
goes for the private SGLang internals some features rely on beyond the hooks (overridden backend
methods, the radix tree's ``evict`` / ``_delete_leaf``, the KV pool's buffers): one table in
:mod:`sgl_tts.plugin.internals`, checked by the launcher and again where each feature binds to them.
"""

from __future__ import annotations

import logging

from sgl_tts.plugin.hooks import EVICT_TARGETS, TARGETS, missing_from, refuse_missing

logger = logging.getLogger(__name__)


def _add_cli_args(result, parser, *args, **kwargs):
    from sgl_tts.plugin.settings import add_arguments

    add_arguments(parser)
    return result


def _from_cli_args(server_args, cls, args, *rest, **kwargs):
    from sgl_tts.plugin.settings import apply

    settings = apply(server_args, args)
    if settings.any_on:
        check_attached()
        from sgl_tts.plugin.internals import check_settings

        check_settings(settings)   # the private SGLang internals the flags' features rely on
    return server_args


def scheduling_hooks() -> list[tuple[str, object, str]]:
    """(target, hook function, hook type) of the hooks that act: flags, policy, preemption, the loads
    inquirer, class changes, group abort, seeded sampling, CPU attention (full mode only)."""
    from sgl_tts.plugin.attention import backend_choice
    from sgl_tts.plugin.scheduling import abort, policy, preemption, reclass, seeding

    return [
        (TARGETS["add_cli_args"], _add_cli_args, "AFTER"),
        (TARGETS["from_cli_args"], _from_cli_args, "AFTER"),
        (TARGETS["scheduler_init"], _scheduler_init, "AFTER"),
        (TARGETS["calc_priority"], policy.calc_priority, "AROUND"),
        (TARGETS["add_one_req"], policy.add_one_req, "AROUND"),
        (TARGETS["prefill"], preemption.after_prefill, "AFTER"),   # before the observer's prefill hook
        (TARGETS["retract"], preemption.retract_decode, "AROUND"),
        (TARGETS["finish_state"], preemption.update_finish_state, "AROUND"),
        (TARGETS["reset_retract"], policy.forget_on_retract, "AFTER"),
        (TARGETS["loads"], policy.fill_matched_prefixes, "AROUND"),
        (TARGETS["set_state"], reclass.set_internal_state, "AROUND"),
        (TARGETS["set_state_reply"], reclass.set_internal_state_reply, "AROUND"),
        (TARGETS["abort"], abort.abort_request, "AROUND"),
        (TARGETS["sampling_info"], seeding.seeded_batch_info, "AFTER"),
        (TARGETS["seeded_draw"], seeding.multinomial_with_seed, "AROUND"),
        (TARGETS["attention_backend"], backend_choice.attention_backend_from_str, "AROUND"),
    ]


def hook_table(observe_only: bool | None = None) -> list[tuple[str, object, str]]:
    """(target, hook function, hook type) of every hook the plugin registers: in full mode its
    scheduling hooks and :func:`sgl_tts.plugin.scheduling.observer.observation_hooks`; observe-only
    (``observe_only``, by default ``SGLANG_TTS_OBSERVE_ONLY=1`` in the environment) the observer's
    scheduler-init hook and the same observation hooks, nothing else."""
    from sgl_tts.plugin.model_registry import model_hooks
    from sgl_tts.plugin.scheduling import observer

    if observe_only is None:
        observe_only = observer.observe_only()
    if observe_only:
        return [*model_hooks(), *observer.observer_hook_table()]
    return [*model_hooks(), *scheduling_hooks(), *observer.observation_hooks()]


def missing_hooks(observe_only: bool | None = None) -> list[str]:
    """Targets on which one of the plugin's hooks (of :func:`hook_table` for ``observe_only``, by
    default this process's mode) is not in place in this process."""
    return missing_from(hook_table(observe_only))


def check_attached(reason: str | None = None) -> None:
    """Refuse to serve (``RuntimeError``) if a hook of the plugin is not in place in this process:
    SGLang's registry logs a hook it could not apply and goes on, which would run stock scheduling
    under ``--tts-*`` flags (or, observe-only, report no metrics) without a word. ``reason``: what
    asked for the plugin (default: ``--tts-*`` flags)."""
    refuse_missing(missing_hooks(), reason)


def _scheduler_init(result, scheduler, server_args, *args, **kwargs):
    from sgl_tts.plugin.scheduling.policy import enable
    from sgl_tts.plugin.settings import TTSSettings

    from sgl_tts.plugin.scheduling import seeding

    settings = TTSSettings.of(server_args)
    if settings.any_on:
        check_attached()
    seeding.ENABLED = settings.seeded_sampling
    state = enable(scheduler.policy, settings)
    if state is not None and getattr(scheduler, "load_inquirer", None) is not None:
        from sgl_tts.plugin.scheduling.policy import LOAD_INQUIRERS

        LOAD_INQUIRERS[id(scheduler.load_inquirer)] = scheduler
    if state is not None:
        logger.info("sgl-tts: scheduler policy %s (dedup %d tokens)", settings.policy,
                    settings.dedup_tokens)
    scheduler.sgl_tts_metrics = None
    # only an explicit --tts-* flag: --enable-metrics alone leaves the server stock (no sgl_tts_*)
    if settings.metrics_file or (settings.active and getattr(server_args, "enable_metrics", False)):
        import os

        from sgl_tts.plugin.scheduling.observer import attach_metrics

        # what this scheduler process runs with, read back from the process itself
        attach_metrics(scheduler, path=f"{settings.metrics_file}.{os.getpid()}" if settings.metrics_file else None,
                       prometheus=bool(getattr(server_args, "enable_metrics", False)),
                       policy=settings.policy if state is not None else "off", dedup_tokens=settings.dedup_tokens,
                       seeded_sampling=settings.seeded_sampling, schedule_policy=server_args.schedule_policy)
    return result


def register() -> None:
    """Register the PRM model classes (:mod:`sgl_tts.plugin.model_registry`) and the hooks (SGLang
    applies them after every plugin has registered): all of them, or with ``SGLANG_TTS_OBSERVE_ONLY=1``
    the model hooks and the observation hooks only (:mod:`sgl_tts.plugin.scheduling.observer`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_tts.plugin.model_registry import register_models
    from sgl_tts.plugin.scheduling.observer import OBSERVE_ONLY_ENV, observe_only

    register_models()
    if observe_only():
        logger.info("sgl-tts: observe-only (%s=1): observation hooks only, stock scheduling", OBSERVE_ONLY_ENV)
    for target, hook, kind in hook_table():
        HookRegistry.register(target, hook, HookType[kind])


__all__ = ["EVICT_TARGETS", "TARGETS", "check_attached", "hook_table", "missing_hooks", "register", "scheduling_hooks"]
