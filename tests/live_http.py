"""What the live-server tests share to talk to a real SGLang server directly (not through a backend)."""

from __future__ import annotations

import asyncio


async def post_all(url: str, bodies: list[dict]) -> list[dict]:
    """POST every body to ``url``/generate at once (no connection limit: aiohttp's default is 100)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(body):
            async with session.post(url + "/generate", json=body) as res:
                return await res.json()
        return await asyncio.gather(*(one(b) for b in bodies))


def greedy_body(tag, ids: list[int], new: int) -> dict:
    """A ``/generate`` body: ``ids`` as input, ``new`` greedy tokens (EOS ignored), tagged with the
    :class:`~sgl_tts.protocol.SearchTag` ``tag`` (its rid and custom params)."""
    return {"input_ids": ids, "rid": tag.request_id(), "sampling_params": {
        "max_new_tokens": new, "temperature": 0.0, "ignore_eos": True, "custom_params": tag.custom_params()}}


def family_paths(seed: int, shared: int, own: int, families: int, children: int
                 ) -> tuple[list[list[int]], list[list[list[int]]]]:
    """``families`` parents' paths (a ``shared``-token prompt, then ``own`` tokens of each parent's
    own) and ``children`` children of each, whose input is the parent's path and one token of the
    child's own (token ids of the shipped tiny models' vocabulary)."""
    import random

    rng = random.Random(seed)
    tokens = lambda k: [rng.randrange(10, 270) for _ in range(k)]   # noqa: E731 (the vocabulary has 284)
    prompt = tokens(shared)
    parents = [prompt + tokens(own) for _ in range(families)]
    kids = [[p + [10 + 7 * f + c] for c in range(children)] for f, p in enumerate(parents)]
    return parents, kids
