"""What the tests' SGLang HTTP look-alikes share: JSON answers and SGLang's ``/get_model_info``.

A look-alike stands in only where a real server cannot be made to show the behaviour under test
(exact request bodies, requests held until an abort, a request that arrives late)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


class SGLangLookalikeHandler(BaseHTTPRequestHandler):
    """Answers ``GET /get_model_info`` as a generation model at ``model_path``; subclasses add POSTs."""

    model_path = "tiny-test-model"

    def log_message(self, *args):
        pass

    def _send(self, obj, status: int = 200) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/get_model_info":
            self._send({"model_path": self.model_path, "is_generation": True})
        else:
            self._send({"error": "not found"}, 404)
