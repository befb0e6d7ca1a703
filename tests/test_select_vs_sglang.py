"""``LocalBackend.select`` decides exactly as SGLang's own client does against a server.

SGLang's real ``RuntimeEndpoint.select`` runs here against an HTTP shim whose ``/generate`` is served
by the same local engine; both paths must give the same decision and normalized logprobs.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import sglang as sgl
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.choices import unconditional_likelihood_normalized

from sgl_tts.backends.engine import LogprobSpec, SamplingSpec


@pytest.fixture
def shim(backend):
    engine = backend.engine

    def serve_one(ids, body):
        sp = body.get("sampling_params") or {}
        start = body.get("logprob_start_len")
        comp = engine.generate(ids, SamplingSpec(max_new_tokens=int(sp.get("max_new_tokens", 128)),
                                                 temperature=float(sp.get("temperature", 1.0))),
                               LogprobSpec(return_logprob=bool(body.get("return_logprob")),
                                           logprob_start_len=-1 if start is None else int(start),
                                           return_text_in_logprobs=bool(body.get("return_text_in_logprobs"))))
        return {"text": comp.text, "meta_info": comp.meta_info}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({"model_path": "tiny-shim"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if "input_ids" in body:
                self._send([serve_one(ids, body) for ids in body["input_ids"]])
            elif isinstance(body["text"], list):
                self._send([serve_one(backend.encode(t), body) for t in body["text"]])
            else:
                self._send(serve_one(backend.encode(body["text"]), body))

    class Server(ThreadingHTTPServer):
        request_queue_size = 64
        daemon_threads = True

    httpd = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


CASES = [
    ("Question: compute ((3+4)*5)-6.\n\nAnswer: ", ["seven", "thirty-five", "29"]),
    ("The best choice is", [" A", " B", " C", " D"]),
    ("x = ", ["1", "22", "333"]),
]


def run_state(program, backend):
    state = program.run(backend=backend)
    state.sync()
    return state


@pytest.mark.parametrize("prompt, choices", CASES)
def test_select_equals_sglang_runtime_endpoint(backend, shim, prompt, choices):
    @sgl.function
    def prog(s):
        s += prompt
        s += sgl.select("ans", choices=choices)

    results = []
    for be in (backend, RuntimeEndpoint(shim)):
        state = run_state(prog, be)
        assert state.error() is None, state.error()
        results.append((state["ans"], state.get_meta_info("ans")["normalized_prompt_logprobs"]))
    (ours, ours_norm), (server, server_norm) = results
    assert ours == server
    assert ours_norm == pytest.approx(server_norm, abs=1e-6)


def test_where_sglang_select_crashes_local_select_answers(backend, shim):
    """SGLang 0.5.15's client subtracts the healed token's logprob, which the server returns as None
    when the token before the prompt's last is also a suffix of the prompt ("aa"): TypeError. Its
    intent (that token never entered the mean) is what LocalBackend does."""
    choices = ["a", "b", "aaaa"]

    @sgl.function
    def prog(s):
        s += "aa"
        s += sgl.select("ans", choices=choices)

    assert isinstance(run_state(prog, RuntimeEndpoint(shim)).error(), TypeError)
    state = run_state(prog, backend)
    assert state.error() is None
    meta = state.get_meta_info("ans")
    # The mean over the choice's entries after the dropped first one equals the reported value.
    for lps, norm in zip(meta["input_token_logprobs"], meta["normalized_prompt_logprobs"]):
        values = [e[0] for e in lps if e[0]]
        assert norm == pytest.approx(sum(values) / len(values), abs=1e-9)
    assert state["ans"] == choices[max(range(3), key=meta["normalized_prompt_logprobs"].__getitem__)]


def test_unconditional_likelihood_gets_choice_logprobs_from_position_0(backend, shim, hf_model):
    """SGLang's client asks for unconditional logprobs with the default start, for which the server
    returns none; LocalBackend asks from position 0. (Prompt "aa": healing strips the None entry
    that SGLang's unconditional method cannot subtract; SGLang's own client fails earlier here.)"""
    import torch

    choices = ["a", "b", "aaaa"]

    @sgl.function
    def prog(s):
        s += "aa"
        s += sgl.select("ans", choices=choices, choices_method=unconditional_likelihood_normalized)

    assert isinstance(run_state(prog, RuntimeEndpoint(shim)).error(), TypeError)
    state = run_state(prog, backend)
    assert state.error() is None
    assert state["ans"] in choices
    uncond = state.get_meta_info("ans")["unconditional_token_logprobs"]
    for lps in uncond:
        ids = [e[1] for e in lps]
        with torch.no_grad():
            ref = hf_model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
        assert lps[0][0] is None
        assert [e[0] for e in lps[1:]] == pytest.approx([float(ref[k - 1, ids[k]]) for k in range(1, len(ids))], abs=1e-4)
