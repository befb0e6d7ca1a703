"""Serving searches: the OpenAI-compatible layer over the programs (``sgl-tts serve-search``).

- :mod:`sgl_tts.serving.api`: the request and response schema (pure: no backend, no SGLang);
- :mod:`sgl_tts.serving.service`: ``SearchService``, which runs one search per request on a backend;
- :mod:`sgl_tts.serving.server`: the HTTP server and the command.

An application of the programs and their registry, like ``sgl-tts run``.
"""
