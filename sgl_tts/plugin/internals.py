"""The private SGLang internals the plugin relies on beyond its hooks, in one table, checked at start.

:func:`sgl_tts.plugin.check_attached` verifies the plugin's hooks. Some features also lean on SGLang
internals that no hook covers: the ragged and sparse attention backends override
``TorchNativeAttnBackend``'s private per-sequence loops, the eviction count wraps a radix tree's
``evict`` and ``_delete_leaf``, the locality policy wraps its ``eviction_strategy``, and the sparse
cache rank moves the KV pool's key buffers into shared memory and rebuilds its pointer tables by
attribute name. An SGLang release that renames one of them would otherwise turn the feature off
without a word (an override never called, a count that misses removals, pointer tables left on freed
memory). :data:`INTERNALS` lists each one with the feature (flag) that needs it; the launcher checks
the class-level ones of every feature its flags turn on (:func:`check_settings`, beside
``check_attached``), and each feature checks its own again where it binds to SGLang's live objects
(:func:`check_object`: instance attributes too), all at server start, never per step. A missing one
raises :class:`MissingInternals`, naming each (feature, class, attribute): the server refuses to start.

This module imports nothing of SGLang or torch until a check runs (the plugin package loads neither
in the launcher: ``tests/test_layering.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import pkgutil
from typing import Any, Iterable

logger = logging.getLogger(__name__)

# the features, as the flags that turn them on
POLICY = "--tts-policy prefix-aware|locality"
LOCALITY = "--tts-policy locality (eviction by next use)"
RAGGED = "--tts-cpu-attention ragged (or --tts-sparse-attention, built on it)"
SPARSE = "--tts-sparse-attention"
SPARSE_PROCESS = "--tts-sparse-attention async --tts-sparse-worker process"

_TREE = "sglang.srt.mem_cache.radix_cache.RadixCache"
_ANY_TREE = "sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache"
_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
_BACKEND = "sglang.srt.layers.attention.base_attn_backend.AttentionBackend"
_KV_POOL = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"


@dataclasses.dataclass(frozen=True)
class Internal:
    """One SGLang internal a feature relies on.

    Attributes:
        feature: the flag(s) that turn the feature on.
        owner: the SGLang class, as a dotted path (``module.Class``).
        attribute: the attribute's name.
        use: what the plugin does with it.
        live_only: checked on live objects only (:func:`check_object`), not on the class at launch:
            an attribute the owner's ``__init__`` sets, or a method the owner (an abstract base)
            leaves to its subclasses.
    """

    feature: str
    owner: str
    attribute: str
    use: str
    live_only: bool = False

    def __str__(self) -> str:
        return f"{self.feature}: {self.owner}.{self.attribute}"


INTERNALS: tuple[Internal, ...] = (
    # (RadixCache.evict, the default tree's, is also a hook target: check_attached sees it at launch)
    Internal(POLICY, _ANY_TREE, "evict", "the eviction count wraps the tree cache's own "
             "(residency.count_evictions; the deferral check keeps its matches while the count stands still)",
             live_only=True),
    Internal(POLICY, _TREE, "_delete_leaf", "the eviction count wraps it: a radix tree frees nodes "
             "outside evict through it (session release)"),
    Internal(LOCALITY, _TREE, "eviction_strategy", "eviction by next use wraps it (residency.install)",
             live_only=True),
    Internal(RAGGED, _NATIVE, "_run_sdpa_forward_extend", "the ragged backend overrides it "
             "(cpu_attention): extends over their new tokens only"),
    Internal(RAGGED, _NATIVE, "_run_sdpa_forward_decode", "the ragged backend overrides it "
             "(cpu_attention): decode rows batched by length; the sparse backend's decode path"),
    Internal(SPARSE, _BACKEND, "forward_extend", "an attention layer's extend goes through it "
             "(AttentionBackend.forward); the sparse backend overrides it to record the prompts' queries"),
    Internal(SPARSE, _BACKEND, "forward_decode", "an attention layer's decode goes through it; the sparse "
             "backend overrides it to know the step's layer"),
    Internal(SPARSE, _NATIVE, "req_to_token_pool", "the sparse decoder's slots and the cache rank's "
             "request table", live_only=True),
    Internal(SPARSE_PROCESS, _KV_POOL, "k_buffer", "the key buffers moved into shared memory "
             "(sparse_worker.share_key_pools)", live_only=True),
    Internal(SPARSE_PROCESS, _KV_POOL, "start_layer", "the first layer k_buffer holds", live_only=True),
    Internal(SPARSE_PROCESS, _KV_POOL, "layer_num", "the layers k_buffer holds", live_only=True),
    Internal(SPARSE_PROCESS, _KV_POOL, "k_data_ptrs", "the key pointer table, rebuilt after the move "
             "(left alone it points at freed memory)", live_only=True),
    Internal(SPARSE_PROCESS, _KV_POOL, "v_data_ptrs", "joined with the new key pointers", live_only=True),
    Internal(SPARSE_PROCESS, _KV_POOL, "data_ptrs", "the joint pointer table, rebuilt after the move",
             live_only=True),
    Internal(SPARSE_PROCESS, _KV_POOL, "get_key_buffer", "each layer's key tensor handed to the cache rank"),
)


class MissingInternals(RuntimeError):
    """SGLang lacks internals that features turned on rely on; ``missing`` lists them."""

    def __init__(self, missing: list[Internal], where: str = ""):
        self.missing = missing
        super().__init__(
            "sgl-tts: this SGLang lacks what the plugin's features rely on (feature: class.attribute): "
            + "; ".join(map(str, missing)) + (f" (on this server's {where})" if where else "")
            + ". Is this SGLang 0.5.15? Refusing to serve rather than run those features without them; "
            "drop their flags to serve without them.")


def features(settings: Any) -> list[str]:
    """The features of :data:`INTERNALS` that ``settings`` (a :class:`~sgl_tts.plugin.settings.TTSSettings`)
    turn on."""
    sparse = settings.sparse.mode != "off"
    on = {POLICY: settings.active, LOCALITY: settings.evicts_by_next_use,
          RAGGED: settings.cpu_attention == "ragged" or sparse, SPARSE: sparse,
          SPARSE_PROCESS: settings.sparse.mode == "async" and settings.sparse.worker == "process"}
    return [feature for feature, yes in on.items() if yes]


def _present(holder: Any, attribute: str) -> bool:
    """``holder`` has ``attribute``, and not as an abstract method (a base's placeholder is no
    implementation to wrap or override)."""
    found = getattr(holder, attribute, _MISSING)
    return found is not _MISSING and not getattr(found, "__isabstractmethod__", False)


_MISSING = object()


def missing(feature_list: Iterable[str]) -> list[Internal]:
    """The class-level internals of these features that SGLang's classes lack (imports the owners)."""
    wanted = set(feature_list)
    out = []
    for internal in INTERNALS:
        if internal.feature not in wanted or internal.live_only:
            continue
        try:
            owner = pkgutil.resolve_name(internal.owner)
        except (ImportError, AttributeError, ValueError):
            owner = None
        if owner is None or not _present(owner, internal.attribute):
            out.append(internal)
    return out


def check(feature_list: Iterable[str]) -> None:
    """Raise :class:`MissingInternals` if SGLang's classes lack an internal of these features."""
    feature_list = list(feature_list)
    lacking = missing(feature_list)
    if lacking:
        raise MissingInternals(lacking)
    if feature_list:
        logger.info("sgl-tts: SGLang internals in place for %s", ", ".join(feature_list))


def check_settings(settings: Any) -> None:
    """:func:`check` of every feature ``settings`` turn on (the launcher, beside ``check_attached``)."""
    check(features(settings))


def _class_names(obj: Any) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(obj).__mro__}


def missing_on(obj: Any, feature: str) -> list[Internal]:
    """The internals of ``feature`` owned by ``obj``'s class or one of its bases that ``obj`` lacks
    (instance attributes included). Owners ``obj`` is no instance of do not apply (a chunk cache
    has no radix tree's ``_delete_leaf``)."""
    names = _class_names(obj)
    return [i for i in INTERNALS if i.feature == feature and i.owner in names and not _present(obj, i.attribute)]


def check_object(obj: Any, feature: str) -> None:
    """Raise :class:`MissingInternals` if ``obj`` (a live SGLang object ``feature`` binds to, at start)
    lacks one of ``feature``'s internals."""
    lacking = missing_on(obj, feature)
    if lacking:
        raise MissingInternals(lacking, where=type(obj).__name__)


__all__ = ["INTERNALS", "LOCALITY", "POLICY", "RAGGED", "SPARSE", "SPARSE_PROCESS", "Internal", "MissingInternals",
           "check", "check_object", "check_settings", "features", "missing", "missing_on"]
