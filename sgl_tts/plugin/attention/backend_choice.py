"""Which attention backend a model runner builds: the plugin's hook on SGLang's
``ModelRunner._get_attention_backend_from_str``.

Where the server asked for ``torch_native`` (SGLang's CPU attention), the sparse backend
(:mod:`sgl_tts.plugin.attention.sparse_attention`, ``--tts-sparse-attention``) or the ragged one
(:mod:`sgl_tts.plugin.attention.cpu_attention`, ``--tts-cpu-attention ragged``) takes its place; every other
choice is SGLang's. The choice sits above both backends (the sparse one is the ragged one with its
decode path replaced), so neither imports the other for it. Neither backend module imports torch
or SGLang on import, so the plugin package still loads neither in the launcher; the sparse modules
load only where a server asks for sparse attention.
"""

from __future__ import annotations

import logging

from sgl_tts.plugin import internals
from sgl_tts.plugin.attention import cpu_attention
from sgl_tts.plugin.settings import TTSSettings

logger = logging.getLogger(__name__)


def attention_backend_from_str(original, runner, backend_str, *args, **kwargs):
    """AROUND hook on ``ModelRunner._get_attention_backend_from_str``: ``torch_native`` becomes the
    sparse backend (:mod:`sgl_tts.plugin.attention.sparse_attention`) when ``--tts-sparse-attention`` is on, else
    the ragged backend when ``--tts-cpu-attention ragged`` is; every other choice is SGLang's. Either
    one first checks the ``TorchNativeAttnBackend`` methods it overrides (an SGLang that renamed them
    would never call the overrides): missing ones refuse the server
    (:class:`~sgl_tts.plugin.internals.MissingInternals`)."""
    if backend_str == "torch_native":
        settings = TTSSettings.of(runner.server_args)
        wanted = [f for f in internals.features(settings) if f in (internals.RAGGED, internals.SPARSE)]
        internals.check(wanted)
        if settings.sparse.mode != "off":
            from sgl_tts.plugin.attention import sparse_attention   # loaded where it is asked for, as before

            sparse_attention.register_backend()
            logger.info("sgl-tts: sparse decode attention (%s) in place of torch_native (--tts-sparse-attention)",
                        settings.sparse)
            backend_str = sparse_attention.BACKEND_NAME
        elif settings.cpu_attention == "ragged":
            cpu_attention.register_backend()
            logger.info("sgl-tts: ragged CPU attention in place of torch_native (--tts-cpu-attention ragged)")
            backend_str = cpu_attention.BACKEND_NAME
    return original(runner, backend_str, *args, **kwargs)


__all__ = ["attention_backend_from_str"]
