"""The SGLang functions the plugin hooks (:data:`TARGETS`, :data:`EVICT_TARGETS`) and the check that
a table of hooks is in place in this process (:func:`missing_from`, :func:`refuse_missing`).

Below both the package's hook table (:mod:`sgl_tts.plugin`) and the observer
(:mod:`sgl_tts.plugin.scheduling.observer`), which checks its own observe-only table: neither imports
the other for it. Imports nothing of SGLang at import time."""

from __future__ import annotations

from typing import Iterable

TARGETS = {
    "add_cli_args": "sglang.srt.server_args.ServerArgs.add_cli_args",
    "from_cli_args": "sglang.srt.server_args.ServerArgs.from_cli_args",
    "scheduler_init": "sglang.srt.managers.scheduler.Scheduler.__init__",
    "calc_priority": "sglang.srt.managers.schedule_policy.SchedulePolicy.calc_priority",
    "add_one_req": "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
    "prefill": "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill",
    "next_batch": "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
    "flush": "sglang.srt.managers.scheduler.Scheduler.flush_cache",
    "evict": "sglang.srt.mem_cache.radix_cache.RadixCache.evict",
    "abort": "sglang.srt.managers.tokenizer_manager.TokenizerManager.abort_request",
    "retract": "sglang.srt.managers.schedule_batch.ScheduleBatch.retract_decode",
    "finish_state": "sglang.srt.managers.schedule_batch.Req.update_finish_state",
    "reset_retract": "sglang.srt.managers.schedule_batch.Req.reset_for_retract",
    "loads": "sglang.srt.managers.scheduler_components.load_inquirer.SchedulerLoadInquirer."
             "get_num_waiting_uncached_tokens",
    "set_state": "sglang.srt.managers.scheduler.Scheduler.set_internal_state",
    "set_state_reply": "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.set_internal_state",
    "sampling_info": "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.from_schedule_batch",
    "seeded_draw": "sglang.srt.layers.sampler.multinomial_with_seed",
    "attention_backend": "sglang.srt.model_executor.model_runner.ModelRunner._get_attention_backend_from_str",
    "is_generation": "sglang.srt.configs.model_config.is_generation_model",
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


def missing_from(table: Iterable[tuple[str, object, str]]) -> list[str]:
    """Targets of ``table`` ((target, hook function, hook type), as :func:`sgl_tts.plugin.hook_table`
    gives it) on which the hook is not in place in this process, each once, in table order."""
    import pkgutil

    missing: list[str] = []
    for target, hook, _ in table:
        owner, name = target.rsplit(".", 1)
        try:
            present = _hooks_in(getattr(pkgutil.resolve_name(owner), name))
        except (ImportError, AttributeError, ValueError):
            present = set()
        if hook not in present and target not in missing:
            missing.append(target)
    return missing


def refuse_missing(missing: list[str], reason: str | None = None) -> None:
    """Raise ``RuntimeError`` naming ``missing`` (targets whose hook is not in place), if any:
    SGLang's registry logs a hook it could not apply and goes on. ``reason``: what asked for the
    plugin (default: ``--tts-*`` flags)."""
    if missing:
        if reason is None:
            raise RuntimeError(
                "sgl-tts: --tts-* flags are set but the plugin's hooks are not in place on "
                + ", ".join(missing) + " (see SGLang's 'Failed to apply hooks' log lines above; is this "
                "SGLang 0.5.15?). Refusing to serve stock scheduling under sgl-tts flags; drop the "
                "--tts-* flags to run stock SGLang.")
        raise RuntimeError(f"sgl-tts: {reason} but the plugin's hooks are not in place on "
                           + ", ".join(missing) + " (see SGLang's 'Failed to apply hooks' log lines above; "
                           "is this SGLang 0.5.15?). Refusing to serve unmeasured.")
