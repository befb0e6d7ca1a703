"""One SGLang server's HTTP side, or a router's: POSTs whose errors name the server and the route,
and the servers behind a URL. The generation backend (:mod:`sgl_tts.backends.endpoint`), the plugin's
control plane (:mod:`sgl_tts.backends.control`) and PRM reads (:mod:`sgl_tts.backends.scoring`) each
talk to a server through one of these."""

from __future__ import annotations

import contextlib
import http.client
from typing import Any

from sglang.utils import http_request


class ServerError(RuntimeError):
    """The SGLang server answered with an error status; the message names the server."""


class ServerUnavailable(ConnectionError):
    """The SGLang server stopped answering (refused, reset or closed the connection); the message
    names the server and the route."""


class ServerConnection:
    """HTTP to the SGLang server (or router) at ``base_url``."""

    def __init__(self, base_url: str, api_key: str | None = None, verify: str | None = None):
        self.base_url, self.api_key, self.verify = base_url, api_key, verify
        self._router: bool | None = None   # unknown until workers() asks

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        """POST ``payload`` to ``path`` on the server and return the decoded JSON answer."""
        res = self.request(path, payload)
        self.check(res)
        return res.json()

    def request(self, path: str, payload: dict[str, Any], *, stream: bool = False, base: str | None = None):
        """POST ``payload`` to ``path`` on ``base`` (default: this URL) and return the raw response."""
        with self.answering(f"POST {path}", base):
            return http_request((base or self.base_url) + path, json=payload, stream=stream, api_key=self.api_key,
                                verify=self.verify)

    def check(self, res, base: str | None = None) -> None:
        """An error status names the server and its answer (SGLang's own client raises the bare answer)."""
        if res.status_code != 200:
            try:
                content = res.json()
            except ValueError:
                content = res.text
            raise ServerError(f"the SGLang server at {base or self.base_url} answered HTTP {res.status_code}: "
                              f"{content}")

    @contextlib.contextmanager
    def answering(self, what: str, base: str | None = None):
        """A server that is gone raises :class:`ServerUnavailable` naming it (urllib's own errors say
        neither which server nor what was asked)."""
        import requests

        try:
            yield
        except (OSError, http.client.HTTPException, requests.ConnectionError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise ServerUnavailable(f"the SGLang server at {base or self.base_url} did not answer {what} "
                                    f"({type(reason).__name__}: {reason}); is it still running?") from exc

    def workers(self) -> list[str]:
        """The SGLang servers behind this URL: the URL itself, or, for an SGLang router
        (``sglang-router``), its workers as ``GET /workers`` lists them now (they may change)."""
        import requests

        if self._router is False:
            return [self.base_url]
        with self.answering("GET /workers"):
            res = requests.get(self.base_url + "/workers", timeout=30, verify=self.verify,
                               headers={"Authorization": f"Bearer {self.api_key}"} if self.api_key else None)
        try:
            listed = res.json().get("workers") if res.status_code == 200 else None
        except ValueError:
            listed = None
        if not isinstance(listed, list):      # a server, not a router
            self._router = False
            return [self.base_url]
        self._router = True
        urls = [w["url"].rstrip("/") for w in listed if isinstance(w, dict) and w.get("url")]
        if not urls:
            raise ServerUnavailable(f"the router at {self.base_url} has no workers")
        return urls


__all__ = ["ServerConnection", "ServerError", "ServerUnavailable"]
