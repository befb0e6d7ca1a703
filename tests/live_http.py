"""What the live-server tests share to talk to a real SGLang server directly (not through a backend)."""

from __future__ import annotations

import asyncio
import urllib.request


async def post_all(url: str, bodies: list[dict]) -> list[dict]:
    """POST every body to ``url``/generate at once (no connection limit: aiohttp's default is 100)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(body):
            async with session.post(url + "/generate", json=body) as res:
                return await res.json()
        return await asyncio.gather(*(one(b) for b in bodies))


def flush_cache(url: str) -> None:
    """Empty the server's radix cache (SGLang's ``/flush_cache``)."""
    urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST"), timeout=60).read()
