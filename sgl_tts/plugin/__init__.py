"""The sgl-tts SGLang scheduler plugin (entry point ``sgl-tts`` in the ``sglang.srt.plugins`` group).

SGLang 0.5.15 calls :func:`register` in every process that loads plugins (the launcher and each
scheduler process). It hooks, through SGLang's ``HookRegistry``:

- ``ServerArgs.add_cli_args`` (after): the "test-time scaling (sgl-tts)" flag group;
- ``ServerArgs.from_cli_args`` (after): validation, values onto ``ServerArgs`` + the environment;
- ``Scheduler.__init__`` (after): the prefix-aware policy attached to the scheduler's policy;
- ``SchedulePolicy.calc_priority`` and ``PrefillAdder.add_one_req`` (around): pass-through unless the
  policy is attached, so with no ``--tts-*`` flag the server schedules exactly as stock SGLang.

``SGLANG_PLUGINS`` (a comma-separated whitelist of entry-point names) is SGLang's: leave ``sgl-tts``
out of it and none of this loads.
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
}


def _add_cli_args(result, parser, *args, **kwargs):
    from sgl_tts.plugin.settings import add_arguments

    add_arguments(parser)
    return result


def _from_cli_args(server_args, cls, args, *rest, **kwargs):
    from sgl_tts.plugin.settings import apply

    apply(server_args, args)
    return server_args


def _scheduler_init(result, scheduler, server_args, *args, **kwargs):
    from sgl_tts.plugin.policy import enable
    from sgl_tts.plugin.settings import TTSSettings

    settings = TTSSettings.of(server_args)
    if enable(scheduler.policy, settings) is not None:
        logger.info("sgl-tts: scheduler policy %s (dedup %d tokens)", settings.policy,
                    settings.dedup_tokens)
    return result


def register() -> None:
    """Register the hooks (SGLang applies them after every plugin has registered)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_tts.plugin import policy

    HookRegistry.register(TARGETS["add_cli_args"], _add_cli_args, HookType.AFTER)
    HookRegistry.register(TARGETS["from_cli_args"], _from_cli_args, HookType.AFTER)
    HookRegistry.register(TARGETS["scheduler_init"], _scheduler_init, HookType.AFTER)
    HookRegistry.register(TARGETS["calc_priority"], policy.calc_priority, HookType.AROUND)
    HookRegistry.register(TARGETS["add_one_req"], policy.add_one_req, HookType.AROUND)


__all__ = ["TARGETS", "register"]
