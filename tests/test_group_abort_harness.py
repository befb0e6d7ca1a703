"""The group-abort harness's one resend: a request whose connection the server resets before
answering (what a connection the server never accepted gets once the kernel gives it up) is sent
once more; any other failure is not. A real SGLang server cannot be made to reset a connection on
demand, so a bare socket server plays that part."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import pytest

from sgl_tts.bench.group_abort import Flight, session


async def _serve(resets: int):
    """An HTTP server on a free port: the first ``resets`` connections are reset after their
    request arrived (SO_LINGER 0 then close sends RST), later ones answer ``{"ok": n}``."""
    seen = {"connections": 0}

    async def handle(reader, writer):
        seen["connections"] += 1
        n = seen["connections"]
        await reader.readuntil(b"\r\n\r\n")
        if n <= resets:
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                      struct.pack("ii", 1, 0))
            writer.transport.abort()
            return
        body = json.dumps({"ok": n}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


@pytest.mark.parametrize("resets, outcome", [(0, (200, {"ok": 1})), (1, (200, {"ok": 2}))])
def test_a_reset_request_is_sent_once_more(resets, outcome):
    async def scenario():
        server, url, seen = await _serve(resets)
        async with server, session(total_timeout=30) as sess:
            flight = Flight()
            flight.start(sess, url, [{"rid": "tts/g/0/-1/0"}])
            got = await flight.results(["tts/g/0/-1/0"])
            return got, flight, seen

    got, flight, seen = asyncio.run(scenario())
    assert got == {"tts/g/0/-1/0": outcome}
    assert flight.resent == ["tts/g/0/-1/0"] * resets and seen["connections"] == resets + 1
    assert set(flight.answered_at) == {"tts/g/0/-1/0"}


def test_a_second_reset_fails_the_request():
    async def scenario():
        server, url, seen = await _serve(2)
        async with server, session(total_timeout=30) as sess:
            flight = Flight()
            flight.start(sess, url, [{"rid": "tts/g/0/-1/0"}])
            with pytest.raises(OSError) as err:
                await flight.results(["tts/g/0/-1/0"])
            return err.value, flight, seen

    err, flight, seen = asyncio.run(scenario())
    assert err.errno == 104 and seen["connections"] == 2 and flight.resent == ["tts/g/0/-1/0"]
