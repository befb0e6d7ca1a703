"""``sgl-tts serve-search``: test-time scaling behind an OpenAI-compatible HTTP endpoint.

Routes (FastAPI, served by uvicorn: SGLang's own stack):

- ``POST /v1/chat/completions``: one search per request (:mod:`sgl_tts.serving.api` reads it,
  :class:`~sgl_tts.serving.service.SearchService` runs it). The response is OpenAI's
  ``chat.completion`` with the answer(s) in ``choices``, every generated token in ``usage`` and the
  search's report in an extra ``sgl_tts`` field. With ``stream: true`` it is server-sent events:
  a role chunk, ``progress`` chunks (no choices; an ``sgl_tts`` field with generations, tokens,
  depth and elapsed seconds), the answer chunk(s), a chunk with ``finish_reason`` and the report,
  the ``usage`` chunk when ``stream_options.include_usage``, then ``[DONE]``.
  A client that disconnects has its search cancelled and its requests aborted on the generator.
- ``GET /v1/models``: the programs; ``GET /health``: 200 while the generator answers.

Bad requests get OpenAI's error object (``{"error": {"message", "type", "param", "code"}}``) with a
4xx status; a search that fails gets a 5xx with the cause.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import sys
import threading
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request   # at module level: FastAPI resolves the route's annotations here

from sgl_tts import registry
from sgl_tts.serving.api import APIError, Defaults, Limits, parse_request
from sgl_tts.serving.service import CancelEvent, Progress, SearchCancelled, SearchOutcome, SearchService

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 0.25   # at most this often a streaming client gets a progress event

# How long an idle keep-alive connection stays open. uvicorn's default (5 s) equals httpx's pool
# expiry (5 s; the openai client's): a client reusing a connection idle ~5 s can send its request
# just as the server closes it, and gets "Server disconnected without sending a response" (the
# openai client: APIConnectionError). The server must outlast its clients' pools: httpx 5 s,
# aiohttp 15 s; 75 s as nginx and gunicorn's proxies commonly use.
KEEP_ALIVE_S = 75


def completion_body(out: SearchOutcome, rid: str, created: int) -> dict[str, Any]:
    """The ``chat.completion`` object of a finished search."""
    r = out.result
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": out.request.model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                     "finish_reason": "stop" if c.finished else "length", "logprobs": None}
                    for i, c in enumerate(out.choices)],
        "usage": usage(out), "sgl_tts": out.report(), "system_fingerprint": None}


def usage(out: SearchOutcome) -> dict[str, int]:
    """Every token the search generated (pruned branches included) is a completion token."""
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.result.tokens_generated,
            "total_tokens": out.prompt_tokens + out.result.tokens_generated}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """A failed search as a status and OpenAI's error object."""
    from sgl_tts.backends.connection import ServerUnavailable

    if isinstance(exc, APIError):
        return exc.status, exc.body()
    if isinstance(exc, ServerUnavailable):
        return 502, APIError(502, str(exc), type="server_error", code="upstream_unavailable").body()
    if isinstance(exc, ValueError):
        return 400, APIError(400, str(exc)).body()
    return 500, APIError(500, f"the search failed: {type(exc).__name__}: {exc}", type="server_error").body()


def create_app(service: SearchService, limits: Limits = Limits(), defaults: Defaults = Defaults()):
    """The FastAPI application around ``service``."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="sgl-tts serve-search", version="1")
    app.state.service = service
    # a thread per search, running or waiting for its slot (asyncio's default pool has cpu + 4)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(64, 4 * service.max_concurrent),
                                                 thread_name_prefix="sgl-tts-request")

    @app.get("/health")
    def health():
        try:
            service.generator.get_server_info()
        except Exception as exc:
            return JSONResponse({"status": "unhealthy", "error": str(exc)}, status_code=503)
        return {"status": "ok", "running": len(service.running), "waiting": service.waiting,
                "served": service.served}

    @app.get("/v1/models")
    def models():
        now = int(time.time())
        return {"object": "list", "data": [{"id": p, "object": "model", "created": now, "owned_by": "sgl-tts"}
                                           for p in registry.names()]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return JSONResponse(APIError(400, "the request body is not valid JSON").body(), status_code=400)
        try:
            req = parse_request(body, limits, defaults)
            if req.config.uses_prm and service.prm is None:
                raise APIError(400, f"{req.config.program} needs a PRM and this server has none; use "
                               f"self_consistency or start serve-search with --prm-url", param="model")
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        cancel = CancelEvent()
        loop = asyncio.get_running_loop()
        if not req.stream:
            fut = loop.run_in_executor(pool, lambda: service.run(req, cancel=cancel))
            gone = asyncio.ensure_future(disconnected(request.receive))
            try:
                done, _ = await asyncio.wait({fut, gone}, return_when=asyncio.FIRST_COMPLETED)
                if gone in done:   # the client went away before its answer: cancel (wakes the search)
                    cancel.set()
                out = await fut
            except SearchCancelled:
                logger.info("request %s: the client went away; its search was cancelled", rid)
                return JSONResponse(APIError(499, "the client closed the request").body(), status_code=499)
            except asyncio.CancelledError:
                cancel.set()
                raise
            except Exception as exc:
                logger.exception("request %s failed", rid)
                status, err = error_body(exc)
                return JSONResponse(err, status_code=status)
            finally:
                gone.cancel()
            return JSONResponse(completion_body(out, rid, created))
        # streamed: Starlette's StreamingResponse (ASGI spec 2.3, as uvicorn serves it) awaits the
        # client's http.disconnect beside the stream and cancels the stream then; its finally cancels
        return StreamingResponse(stream_events(service, req, rid, created, cancel, pool),
                                 media_type="text/event-stream")

    return app


async def disconnected(receive) -> None:
    """Return once the client has gone away: awaits the ASGI ``receive()`` (the request's body read
    already) until its ``http.disconnect``; no polling, the server wakes it."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def stream_events(service: SearchService, req, rid: str, created: int,
                        cancel: threading.Event, pool=None) -> AsyncIterator[str]:
    """The server-sent events of one streamed search (see the module docstring)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    last = [0.0]

    def progressed(p: Progress) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S:
            last[0] = now
            loop.call_soon_threadsafe(queue.put_nowait, p)

    def chunk(choices: list, **extra: Any) -> str:
        obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
               "choices": choices, **extra}
        return f"data: {json.dumps(obj)}\n\n"

    fut = loop.run_in_executor(pool, lambda: service.run(req, cancel=cancel, on_progress=progressed))
    getter = None
    try:
        yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        while True:
            getter = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({fut, getter}, return_when=asyncio.FIRST_COMPLETED)
            if getter in done:
                p: Progress = getter.result()
                yield chunk([], sgl_tts={"event": "progress", "generations": p.generations, "tokens": p.tokens,
                                         "depth": p.depth, "elapsed_s": round(p.elapsed, 3)})
            else:
                getter.cancel()
            if fut.done():
                break
        try:
            out = fut.result()
        except Exception as exc:
            logger.exception("streamed request %s failed", rid)
            _, err = error_body(exc)
            yield f"data: {json.dumps(err)}\n\n"
            yield "data: [DONE]\n\n"
            return
        for i, c in enumerate(out.choices):
            if i:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            yield chunk([{"index": i, "delta": {"content": c.text}, "finish_reason": None}])
        last_i = len(out.choices) - 1
        for i, c in enumerate(out.choices):
            extra = {"sgl_tts": dict(out.report(), event="done")} if i == last_i else {}
            yield chunk([{"index": i, "delta": {}, "finish_reason": "stop" if c.finished else "length"}], **extra)
        if req.include_usage:
            yield chunk([], usage=usage(out))
        yield "data: [DONE]\n\n"
    finally:
        if getter is not None:
            getter.cancel()   # a no-op unless the client went away while it waited
        if not fut.done():   # the client went away (the response task was cancelled)
            cancel.set()
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())   # its SearchCancelled: expected
            logger.info("streamed request %s: the client went away; cancelling its search", rid)


class BackgroundSearchServer:
    """serve-search's app served by uvicorn in a thread of this process (a notebook, a test): the
    same routes as the command, on ``host:port`` (``port`` 0: a free one).

    Attributes:
        url: the server's base URL (``url + "/v1"`` is the OpenAI base URL).
    """

    def __init__(self, service: SearchService, *, host: str = "127.0.0.1", port: int = 0,
                 limits: Limits = Limits(), defaults: Defaults = Defaults(), log_level: str = "warning"):
        import uvicorn

        if port == 0:
            from sgl_tts.launch.live_servers import free_port
            port = free_port(host)
        self.service = service
        ready = threading.Event()   # set once uvicorn is listening, or has given up

        class Server(uvicorn.Server):
            async def startup(self, sockets=None) -> None:
                try:
                    await super().startup(sockets)
                finally:
                    ready.set()

        def serve() -> None:
            try:
                self.server.run()
            except SystemExit:   # uvicorn's failed start (logged by it); __init__ raises below
                pass
            finally:
                ready.set()   # it failed before its startup too (the app, the config)

        self.server = Server(uvicorn.Config(create_app(service, limits, defaults), host=host, port=port,
                                            log_level=log_level, timeout_keep_alive=KEEP_ALIVE_S))
        self.thread = threading.Thread(target=serve, name="sgl-tts-serve-search", daemon=True)
        self.thread.start()
        if not ready.wait(30) or not self.server.started:
            raise RuntimeError(f"serve-search did not start on {host}:{port}")
        self.url = f"http://{host}:{port}"

    def client(self, **kwargs: Any):
        """An ``openai.OpenAI`` client for this server."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", **{"max_retries": 0, "timeout": 600, **kwargs})

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> "BackgroundSearchServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------------- serving
def serve_search(generator_url: str | None, prm_url: str | None, *, host: str = "127.0.0.1", port: int = 30010,
                 max_concurrent: int = 8, prm_kind: str = "auto", prm_tokenizer: str | None = None,
                 limits: Limits = Limits(), defaults: Defaults = Defaults(), log_level: str = "info") -> None:
    """Serve the OpenAI endpoint (uvicorn) until stopped (``sgl-tts serve-search``). With no
    ``generator_url`` it starts the tiny generator, and the tiny PRM unless ``prm_url`` is given, on the
    CPU (stopped on return); ``prm_url`` ``"none"``: self_consistency only. ``ConnectionError`` when
    the generator or the PRM does not answer."""
    import uvicorn

    servers = None
    try:
        gen_url = generator_url
        if gen_url is None:
            servers, gen_url, started_prm = start_tiny_servers(need_prm=prm_url is None)
            prm_url = prm_url or started_prm
        if prm_url is not None and prm_url.lower() == "none":
            prm_url = None
        service = SearchService(gen_url, prm_url, max_concurrent=max_concurrent, prm_kind=prm_kind,
                                prm_tokenizer=prm_tokenizer)
        print(f"sgl-tts serve-search: generator {gen_url}, PRM {prm_url or 'none'}; "
              f"OpenAI endpoint http://{host}:{port}/v1", file=sys.stderr, flush=True)
        uvicorn.run(create_app(service, limits, defaults), host=host, port=port,
                    log_level=log_level.lower(), timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S)
    finally:
        if servers is not None:
            servers.stop_all()


def start_tiny_servers(need_prm: bool = True):
    """The tiny generator (with the sgl-tts plugin) and PRM as CPU SGLang servers, for trying
    serve-search with nothing else running. Returns the server set and both URLs."""
    import tempfile

    from sgl_tts.launch.live_servers import LiveServer, LiveServers
    from sgl_tts.models import shipped_model

    specs = {"generator": LiveServer(str(shipped_model("generator")), policy="prefix-aware", kv_bytes=256 << 20,
                                     seeded_sampling=True)}
    if need_prm:
        specs["prm"] = LiveServer(str(shipped_model("prm")), kv_bytes=256 << 20)
    servers = LiveServers(specs, tempfile.mkdtemp(prefix="sgl-tts-serve-search-"))
    print("sgl-tts serve-search: starting the tiny generator and PRM on the CPU (a minute or two)...",
          file=sys.stderr, flush=True)
    try:
        gen = servers.url("generator")
        prm = servers.url("prm") if need_prm else None
    except BaseException:
        servers.stop_all()
        raise
    return servers, gen, prm


__all__ = ["BackgroundSearchServer", "completion_body", "create_app", "disconnected", "error_body", "serve_search",
           "stream_events", "usage"]
