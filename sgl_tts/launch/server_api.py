"""What sgl-tts asks of a running SGLang server (or sglang-router) over HTTP beside generating: what
it reports of itself (:func:`server_info`) and to empty its radix cache (:func:`flush_cache`), so that a
benchmark block or a profile repeat starts cold. Standard library only: a benchmark, the CPU profiler
and the live-server tests import it without the client.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

#: the routes that answer :func:`server_info`, tried in order: SGLang 0.5.15 serves both (the second
#: is its deprecated alias, which logs a warning at every call); sglang-router 0.3.2 only the second
SERVER_INFO_ROUTES = ("/server_info", "/get_server_info")


def server_info(url: str, timeout: float = 30.0) -> dict:
    """What the server at ``url`` reports of itself: its arguments, the scheduler's info (e.g.
    ``max_total_num_tokens``), each scheduler's ``internal_states`` and the ``version``. The first of
    :data:`SERVER_INFO_ROUTES` it serves answers (a 404 tries the next); any other failure raises
    (``urllib.error.URLError`` or ``HTTPError``, both ``OSError``; ``ValueError`` for a body that is not JSON)."""
    base = url.rstrip("/")
    for route in SERVER_INFO_ROUTES[:-1]:
        try:
            return _get_json(base + route, timeout)
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
    return _get_json(base + SERVER_INFO_ROUTES[-1], timeout)


def model_info(url: str, timeout: float = 30.0) -> dict:
    """What the server at ``url`` serves (``GET /model_info``: model path, ``architectures``,
    ``is_generation``, ...); failures raise as :func:`server_info`'s."""
    return _get_json(url.rstrip("/") + "/model_info", timeout)


def running_request_cap(info: dict) -> int | None:
    """How many requests the server whose :func:`server_info` is ``info`` decodes at once: the
    scheduler's effective limit, else its ``--max-running-requests``; None when it reports neither."""
    for state in info.get("internal_states") or []:
        cap = state.get("effective_max_running_requests_per_dp")
        if cap:
            return int(cap)
    cap = info.get("max_running_requests")
    return int(cap) if cap else None


def _get_json(url: str, timeout: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as res:
        return json.loads(res.read() or b"{}")


class CacheNotFlushed(RuntimeError):
    """A server refused to flush its cache; ``reason`` is its answer (SGLang: ``Timed out waiting for
    idle state.`` when requests still ran)."""

    def __init__(self, url: str, status: int, reason: str):
        self.url, self.status, self.reason = url, status, reason
        super().__init__(f"{url} did not flush its cache (HTTP {status}): {reason}")


def flush_cache(url: str, timeout: float = 30.0) -> None:
    """Empty the radix cache of the server at ``url`` (``POST /flush_cache?timeout=``; sglang-router
    passes it on to its workers). SGLang refuses to flush while a request runs or waits, and a block's
    last answers can reach the client before the scheduler has retired their requests (aborted ones
    included), so the server is asked to hold the flush until it is idle, for up to ``timeout``
    seconds. Raises :class:`CacheNotFlushed` when it refuses, an ``OSError`` when it cannot be reached."""
    req = urllib.request.Request(f"{url.rstrip('/')}/flush_cache?timeout={timeout:g}", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout + 30) as res:
            res.read()
    except urllib.error.HTTPError as exc:
        raise CacheNotFlushed(url, exc.code, exc.read().decode(errors="replace").strip()) from None


__all__ = ["CacheNotFlushed", "SERVER_INFO_ROUTES", "flush_cache", "model_info", "running_request_cap", "server_info"]
