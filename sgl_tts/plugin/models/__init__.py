"""SGLang model classes for the PRMs people use that SGLang 0.5.15 does not serve.

This package is an SGLang external-model package (``SGLANG_EXTERNAL_MODEL_PACKAGE``): SGLang's
``ModelRegistry`` imports every module in it and registers each module's ``EntryClass``. The plugin
points SGLang at it in every process that loads plugins (:mod:`sgl_tts.plugin.model_registry`).

- :mod:`~sgl_tts.plugin.models.qwen2_prm`: ``Qwen2ForProcessRewardModel`` (Qwen2.5-Math-PRM) and
  ``Qwen2ForPrmModel`` (Skywork-o1-Open-PRM), both step-pooled: one request answers the head's
  output at every step token it computes.
- :mod:`~sgl_tts.plugin.models.step_pooling` (no ``EntryClass``): the pooling they share.

Nothing here is imported at plugin load; the names below are plain data.
"""

from __future__ import annotations

PACKAGE = __name__

# architecture (config.json) -> the model module that serves it
ARCHITECTURES: dict[str, str] = {
    "Qwen2ForProcessRewardModel": f"{PACKAGE}.qwen2_prm",
    "Qwen2ForPrmModel": f"{PACKAGE}.qwen2_prm",
}

__all__ = ["ARCHITECTURES", "PACKAGE"]
