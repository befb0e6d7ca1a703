"""The plugin's PRM model classes (:mod:`sgl_tts.plugin.models`) made known to SGLang.

- :func:`register_models`, called by :func:`sgl_tts.plugin.register` in every process that loads
  plugins (the launcher, each scheduler): SGLang's own external-model mechanism,
  ``SGLANG_EXTERNAL_MODEL_PACKAGE``, names the package, so ``ModelRegistry`` registers its classes
  when it is first imported, in this process and in the processes it starts. Where the registry is
  already imported, or the variable already names another package, the classes are registered
  directly as well.
- :func:`is_generation_model`, a hook around SGLang's function of that name: SGLang decides from a
  fixed list of names whether a model generates or embeds, so its answer for these architectures is
  "embeds" (no ``--is-embedding`` needed), after checking that their classes import: a server asked
  for one that cannot be served refuses to start, naming the cause.
"""

from __future__ import annotations

import importlib
import os
import sys

from sgl_tts.plugin.models import ARCHITECTURES, PACKAGE

ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"
REGISTRY_MODULE = "sglang.srt.models.registry"


def register_models() -> None:
    """Make SGLang's ``ModelRegistry`` list the plugin's architectures in this process and its children."""
    current = os.environ.get(ENV, "")
    if not current:
        os.environ[ENV] = PACKAGE
    if (current and current != PACKAGE) or REGISTRY_MODULE in sys.modules:
        from sglang.srt.models.registry import ModelRegistry

        ModelRegistry.register(PACKAGE, overwrite=True)


class UnservablePRM(RuntimeError):
    """A PRM architecture of the plugin's whose class could not be loaded in this process."""


def check_servable(architectures) -> list[str]:
    """The plugin's architectures among ``architectures``, after importing their classes; raises
    :class:`UnservablePRM` naming the architecture and the cause when one cannot be imported."""
    ours = [a for a in (architectures or []) if a in ARCHITECTURES]
    for arch in ours:
        try:
            module = importlib.import_module(ARCHITECTURES[arch])
            if arch not in {c.__name__ for c in module.EntryClass}:
                raise ImportError(f"{ARCHITECTURES[arch]} has no EntryClass {arch}")
        except Exception as exc:   # any import failure: the server must not start without it
            raise UnservablePRM(f"sgl-tts cannot serve {arch}: its model class ({ARCHITECTURES[arch]}) "
                                f"failed to load: {type(exc).__name__}: {exc}") from exc
    return ours


def is_generation_model(original, model_architectures, is_embedding: bool = False, *args, **kwargs):
    """SGLang's answer, except that the plugin's PRM architectures embed (and must be servable)."""
    if check_servable(model_architectures):
        return False
    return original(model_architectures, is_embedding, *args, **kwargs)


def model_hooks() -> list[tuple[str, object, str]]:
    """(target, hook, type) of the hooks that serve the plugin's model classes, in every mode."""
    from sgl_tts.plugin.hooks import TARGETS

    return [(TARGETS["is_generation"], is_generation_model, "AROUND")]


__all__ = ["ENV", "UnservablePRM", "check_servable", "is_generation_model", "model_hooks", "register_models"]
