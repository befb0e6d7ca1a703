"""The launch layer's one server-info reader and one radix-cache flush (sgl_tts.launch.server_api):
against small HTTP servers that serve one route or refuse (what a router or a busy server does), and
against the session's live SGLang server (marked ``server``)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sgl_tts.launch.server_api import (SERVER_INFO_ROUTES, CacheNotFlushed, flush_cache, running_request_cap,
                                       server_info)


@pytest.fixture
def http_server():
    """Start a local HTTP server answering ``routes`` (path without query -> (status, body)); yields a
    function that starts it and returns its URL; ``seen`` lists each request's method and full path."""
    servers, seen = [], []

    def start(routes: dict[str, tuple[int, bytes]]) -> str:
        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                seen.append((self.command, self.path))
                status, body = routes.get(self.path.split("?")[0], (404, b'{"detail": "Not Found"}'))
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    start.seen = seen
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


INFO = {"model_path": "m", "max_running_requests": 16,
        "internal_states": [{"effective_max_running_requests_per_dp": 12}], "version": "0.5.15"}


def test_server_info_reads_the_current_route_and_falls_back_to_the_old_one(http_server):
    assert SERVER_INFO_ROUTES == ("/server_info", "/get_server_info")
    both = http_server({"/server_info": (200, json.dumps(INFO).encode()), "/get_server_info": (200, b"{}")})
    assert server_info(both + "/") == INFO
    assert http_server.seen == [("GET", "/server_info")]   # the deprecated alias never asked (it logs a warning)
    http_server.seen.clear()
    old_only = http_server({"/get_server_info": (200, json.dumps(INFO).encode())})   # as sglang-router serves it
    assert server_info(old_only) == INFO
    assert http_server.seen == [("GET", "/server_info"), ("GET", "/get_server_info")]
    broken = http_server({"/server_info": (500, b"boom"), "/get_server_info": (200, b"{}")})
    with pytest.raises(urllib.error.HTTPError, match="500"):
        server_info(broken)   # a failing server is a failure, not a reason to ask the old route
    with pytest.raises(urllib.error.HTTPError, match="404"):
        server_info(http_server({}))


def test_the_running_request_cap_is_the_schedulers_else_the_flag():
    assert running_request_cap(INFO) == 12
    assert running_request_cap({**INFO, "internal_states": [{}]}) == 16
    assert running_request_cap({"internal_states": []}) is None


def test_a_flush_asks_the_server_to_wait_for_idle_and_a_refusal_names_its_reason(http_server):
    ok = http_server({"/flush_cache": (200, b"Cache flushed.\n")})
    flush_cache(ok + "/", timeout=7.5)
    assert http_server.seen == [("POST", "/flush_cache?timeout=7.5")]
    busy = http_server({"/flush_cache": (400, b"Timed out waiting for idle state.\n")})
    with pytest.raises(CacheNotFlushed) as err:
        flush_cache(busy)
    assert (err.value.status, err.value.reason) == (400, "Timed out waiting for idle state.")
    assert str(err.value) == f"{busy} did not flush its cache (HTTP 400): Timed out waiting for idle state."
    with pytest.raises(OSError):
        flush_cache(ok.rsplit(":", 1)[0] + ":1")   # nothing listens there


# ----------------------------------------------------------------------- the live SGLang server
def _generate(url: str, ids: list[int]) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as res:
        return json.loads(res.read())["meta_info"]


@pytest.mark.server
def test_the_live_server_reports_itself_and_empties_its_cache(live):
    import sglang

    url = live.url("generator")
    info = server_info(url)
    assert info["version"] == sglang.__version__ and info["model_path"] == live.specs["generator"].model
    assert running_request_cap(info) == int(info["internal_states"][0]["effective_max_running_requests_per_dp"])
    prompt = [17 + (i * 7) % 200 for i in range(96)]
    _generate(url, prompt)
    assert _generate(url, prompt)["cached_tokens"] > 0   # the prompt is in the radix cache
    flush_cache(url)
    assert _generate(url, prompt)["cached_tokens"] == 0   # and gone after the flush
