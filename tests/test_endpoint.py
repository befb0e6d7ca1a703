"""SGLangEndpoint sends per-call request fields; checked against a real HTTP server that records the
JSON it receives (no GPU: the server speaks SGLang's /get_model_info and /generate wire format)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import ThreadingHTTPServer

import pytest
import sglang as sgl

import sgl_tts
from http_lookalike import SGLangLookalikeHandler
from sgl_tts import SGLangEndpoint
from sgl_tts.backends.endpoint import COMMIT_SKIP_CHARS


STREAM_CHUNK_PAUSE_S = 0.3


class RecordingServer:
    """A minimal SGLang look-alike *server process side*; the client under test is the real one."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(SGLangLookalikeHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.bodies.append(body)
                    n = len(outer.bodies)
                meta = {"id": body.get("rid", f"auto-{n}"), "prompt_tokens": 3, "completion_tokens": 1,
                        "finish_reason": {"type": "length", "length": 1}}
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for text in ("ab", "abc"):
                        # Paced like a real server: SGLang's ``text_iter(var)`` looks for the variable's
                        # event and then returns "" at once if the program has already finished, so a
                        # stream answered in one burst races the iterator's start (seen under load).
                        time.sleep(STREAM_CHUNK_PAUSE_S)
                        self.wfile.write(f"data: {json.dumps({'text': text, 'meta_info': meta})}\n\n".encode())
                        self.wfile.flush()
                    self.wfile.write(b"data: [DONE]\n\n")
                    return
                self._send({"text": f"<{n}>", "meta_info": meta})

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # a 16-way fork connects all at once
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def generate_bodies(self):
        return [b for b in self.bodies if b.get("sampling_params", {}).get("max_new_tokens", 1) > 0]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    srv = RecordingServer()
    yield srv
    srv.close()


def test_connect_url_gives_the_endpoint_subclass(server):
    backend = sgl_tts.connect(server.url + "/")
    assert isinstance(backend, SGLangEndpoint)
    assert backend.base_url == server.url
    assert backend.get_model_name() == "tiny-test-model"


def test_extra_fields_reach_the_server_and_plain_gen_sends_none(server):
    backend = sgl_tts.connect(server.url)

    @sgl.function
    def prog(s):
        s += "Question: 2+2?\n\n"
        s += sgl_tts.gen("step", max_tokens=16, stop="\n\n", rid="q1-b0-d1", priority=7,
                         custom_params={"group": "q1", "parent": None, "depth": 1, "class": "normal"},
                         token_ids_logprob=[10, 11], seed=1234)
        s += sgl.gen("plain", max_tokens=4)

    state = prog.run(backend=backend)
    state.sync()
    assert state.error() is None
    first, second = server.generate_bodies()
    assert first["rid"] == "q1-b0-d1"
    assert first["priority"] == 7
    assert first["token_ids_logprob"] == [10, 11]
    assert first["return_logprob"] is True
    sp = first["sampling_params"]
    assert sp["custom_params"] == {"group": "q1", "parent": None, "depth": 1, "class": "normal"}
    assert sp["sampling_seed"] == 1234
    assert sp["max_new_tokens"] == 16 and sp["stop"] == "\n\n"
    assert first["text"] == "Question: 2+2?\n\n"
    for key in ("rid", "priority", "token_ids_logprob"):
        assert key not in second
    assert "custom_params" not in second["sampling_params"]
    assert "sampling_seed" not in second["sampling_params"]
    assert state["step"] == "<1>" and state["plain"] == "<2>"


def test_each_fork_sends_its_own_fields(server):
    backend = sgl_tts.connect(server.url)

    @sgl.function
    def prog(s):
        s += "Q\n\n"
        forks = s.fork(16)
        forks += lambda i: sgl_tts.gen("step", max_tokens=8, rid=f"beam-{i}", priority=i,
                                       custom_params={"beam": i})
        forks.join()

    state = prog.run(backend=backend)
    state.sync()
    assert state.error() is None
    bodies = [b for b in server.generate_bodies() if "rid" in b]
    assert len(bodies) == 16
    for b in bodies:
        i = int(b["rid"].split("-")[1])
        assert b["priority"] == i
        assert b["sampling_params"]["custom_params"] == {"beam": i}


def test_streaming_gen_sends_fields_too(server):
    backend = sgl_tts.connect(server.url)

    @sgl.function
    def prog(s):
        s += "Q\n\n"
        s += sgl_tts.gen("a", max_tokens=4, rid="streamed", custom_params={"k": "v"})

    state = prog.run(backend=backend, stream=True)
    chunks = list(state.text_iter("a"))
    assert "".join(chunks) == "abc"
    body = server.generate_bodies()[-1]
    assert body["stream"] is True and body["rid"] == "streamed"
    assert body["sampling_params"]["custom_params"] == {"k": "v"}


def commits(server) -> list[str]:
    """The texts of the prefix commits (``max_new_tokens: 0``) the server got, in order."""
    return [b["text"] for b in server.bodies if b.get("sampling_params", {}).get("max_new_tokens", 1) == 0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_fork_right_after_a_gen_sends_no_prefix_commit(server, stream):
    backend = sgl_tts.connect(server.url)
    long_tail = "x" * (COMMIT_SKIP_CHARS + 1)

    @sgl.function
    def prog(s):
        s += "Q\n\n"
        s.text()                               # (SGLang commits only a text its executor has taken in)
        a, b = s.fork(2)                       # a fresh prompt: committed, as SGLang does
        a += sgl.gen("x", max_tokens=4)
        a += "\n\n"                           # what a search appends after a step
        a.fork(2)                              # the server has a's text: no commit
        b += sgl.gen("y", max_tokens=4)
        b += long_tail                         # more than the allowance: committed
        b.fork(2)
        s += "!"                               # no gen on s since its commit: committed again
        s.fork(2)

    state = prog.run(backend=backend, stream=stream)
    if stream:
        list(state.text_iter())                # to the program's end (it runs on its own thread)
    state.sync()
    assert state.error() is None
    sent = commits(server)
    assert sent[0] == "Q\n\n" and sent[2] == "Q\n\n!" and len(sent) == 3, sent
    assert sent[1].startswith("Q\n\n") and sent[1].endswith(long_tail) and sent[1] != "Q\n\n" + long_tail, sent


def test_fields_are_refused_on_select():
    with pytest.raises(ValueError, match="request fields .* apply to generation calls"):
        sgl_tts.gen("x", choices=["a", "b"], rid="nope")


def test_unreachable_server_gives_one_clear_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectionError, match=rf"cannot reach an SGLang server at http://127.0.0.1:{port}"):
        sgl_tts.connect(f"http://127.0.0.1:{port}")


def test_connect_routes_paths_to_the_cpu_backend(tiny_model_path):
    backend = sgl_tts.connect(tiny_model_path, runtime="cpu")
    try:
        assert isinstance(backend, sgl_tts.LocalBackend)
    finally:
        backend.shutdown()
    with pytest.raises(ValueError, match="runtime='server' needs an http"):
        sgl_tts.connect(tiny_model_path, runtime="server")


def test_fields_sent_to_a_stock_backend_are_reported(server):
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    stock = RuntimeEndpoint(server.url)

    @sgl.function
    def prog(s):
        s += "Q\n\n"
        s += sgl_tts.gen("a", max_tokens=4, rid="one")
        s += sgl_tts.gen("b", max_tokens=4, rid="two")

    with pytest.warns(RuntimeWarning, match="never sent: its backend is not an sgl-tts backend"):
        state = prog.run(backend=stock, use_thread=False)
        state.sync()
    assert all("rid" not in b for b in server.generate_bodies())


class ModelServer(RecordingServer):
    """A look-alike serving one model: ``/get_model_info`` names it, every POST is recorded (its path
    in ``paths``, its body in ``bodies``) and answered by :meth:`respond` ``(path, body) -> answer``."""

    is_generation = True

    def __init__(self, model, model_path):
        self.model = model
        self.model_path = str(model_path)
        self.paths: list[str] = []
        super().__init__()
        outer = self

        class Handler(self.httpd.RequestHandlerClass):
            def do_GET(self):
                self._send({"model_path": outer.model_path, "is_generation": outer.is_generation})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.paths.append(self.path)
                outer.bodies.append(body)
                self._send(*outer.respond(self.path, body))

        self.httpd.RequestHandlerClass = Handler

    def respond(self, path, body):
        raise NotImplementedError


class LogprobServer(ModelServer):
    """Answers ``/generate`` logprob requests the way SGLang 0.5.15 lays them out (read from its
    ``logprob_result_processor``: entry k of ``input_token_ids_logprobs`` is the token at
    ``logprob_start_len + k``, entry 0 is None, the distribution after the last token is dropped),
    computing them with the real tiny PRM through transformers."""

    def __init__(self, model_path):
        import torch
        from transformers import AutoModelForCausalLM

        super().__init__(AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32), model_path)

    def respond(self, path, body):
        return ([self.answer(ids, start, wanted) for ids, start, wanted in
                 zip(body["input_ids"], body["logprob_start_len"], body["token_ids_logprob"])],)

    def answer(self, ids, start, wanted):
        import torch

        with torch.no_grad():
            logp = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), dim=-1)
        entries = [None] + [[[float(logp[q - 1, t]), t, None] for t in wanted]
                            for q in range(start + 1, len(ids))]
        return {"text": "", "meta_info": {"input_token_ids_logprobs": entries}}


def test_step_tag_prm_reads_the_same_scores_through_an_sglang_endpoint():
    from sgl_tts import LocalBackend
    from sgl_tts.tiny import task
    from sgl_tts.models import shipped_model
    from sgl_tts.prm import StepTagPRM, tag_positions

    srv = LogprobServer(shipped_model("prm"))
    local = LocalBackend(shipped_model("prm"))
    try:
        endpoint = SGLangEndpoint(srv.url)
        assert endpoint.tokenizer.name_or_path == str(shipped_model("prm"))
        remote, here = StepTagPRM(endpoint, cache=False), StepTagPRM(local, cache=False)
        for p in task.test_split()[:4]:
            steps = [p.step_texts(), p.step_texts()[:2], [p.step_texts()[0].replace("=", "=1")]]
            for got, want in zip(remote.score(p.question, steps), here.score(p.question, steps)):
                assert got == pytest.approx(want, abs=1e-5)
        body = srv.bodies[-1]
        assert body["sampling_params"] == {"max_new_tokens": 0} and body["return_logprob"] == [True] * 3
        plus, minus = endpoint.tokenizer.convert_tokens_to_ids(["+", "-"])
        assert body["token_ids_logprob"] == [[plus, minus]] * 3
        ids, tags = tag_positions(endpoint.tokenizer, p.question, steps[0])
        assert body["input_ids"][0] == ids + [endpoint.tokenizer.pad_token_id]  # one pad after the last tag
        assert body["logprob_start_len"][0] == tags[0]
        with pytest.raises(ValueError, match=r"positions \[9\] out of range for a prompt of 3 tokens"):
            endpoint.next_token_logprobs([[1, 2, 3]], [[9]], [plus])
    finally:
        local.shutdown()
        srv.close()
