"""Test-time scaling algorithms written as SGLang programs (``@sgl.function`` with fork/join).

Each module holds one algorithm; its parameters are ordinary program arguments, so the same program
runs on any backend from :func:`sgl_tts.connect` (CPU ``LocalBackend``, an SGLang server, or an
in-process SGLang runtime). Note: program argument names must not clash with ``SglFunction.run``'s
own keywords (``n``, ``top_k``, ``temperature``, ``ignore_eos``, ...).
"""
