"""The CPU seeded draw of ``--tts-seeded-sampling`` against MurmurHash3 re-derived from its definition."""

from __future__ import annotations

import random

import torch

from sgl_tts.plugin.scheduling.seeding import murmur_hash32_torch, multinomial_with_seed, seed_of


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3_x86_32 (Austin Appleby's reference), for keys whose length is a multiple of 4."""
    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    h = seed
    for i in range(0, len(data), 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * 0xCC9E2D51) & 0xFFFFFFFF
        k = rotl(k, 15)
        k = (k * 0x1B873593) & 0xFFFFFFFF
        h ^= k
        h = rotl(h, 13)
        h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_torch_hash_is_murmur3_of_seed_position_token():
    rng = random.Random(0)
    seeds = [0, 1, 2 ** 32 - 1, 2 ** 32, 2 ** 62 - 1] + [rng.getrandbits(62) for _ in range(5)]
    positions = [rng.randrange(0, 5000) for _ in seeds]
    cols = [0, 1, 7, 283, 4095, 2 ** 20]
    got = murmur_hash32_torch(torch.tensor(seeds), torch.tensor(positions), torch.tensor(cols))
    for i, (seed, pos) in enumerate(zip(seeds, positions)):
        for j, col in enumerate(cols):
            key = seed.to_bytes(8, "little") + pos.to_bytes(4, "little") + col.to_bytes(4, "little")
            assert int(got[i, j]) == murmur3_x86_32(key), (seed, pos, col)


def test_seeded_draw_depends_on_seed_and_position_only():
    torch.manual_seed(0)
    logprobs = torch.log_softmax(torch.randn(3, 50, dtype=torch.float64), dim=-1)
    seeds, positions = torch.tensor([5, 6, 5]), torch.tensor([10, 10, 10])

    def never(*args, **kwargs):
        raise AssertionError("CPU tensors must not reach SGLang's Triton kernel")

    a = multinomial_with_seed(never, logprobs, seeds, positions)
    b = multinomial_with_seed(never, logprobs[[2, 1, 0]], seeds[[2, 1, 0]], positions)   # another batch order
    assert a.tolist() == b[[2, 1, 0]].tolist()
    # rows 0 and 2 have the same seed and position, so the same noise: the Gumbel-max of the same
    # noise over their own distributions
    noise = murmur_hash32_torch(seeds[:1], positions[:1], torch.arange(50)).double() / (2 ** 32 - 1)
    gumbel = -torch.log(-torch.log(noise))
    assert a[0].item() == int(torch.argmax(logprobs[0] + gumbel[0]))
    assert a[2].item() == int(torch.argmax(logprobs[2] + gumbel[0]))
    # many seeds at one position sample the distribution: a near-certain token wins almost always
    sure = torch.log(torch.tensor([[0.98] + [0.02 / 49] * 49], dtype=torch.float64)).repeat(400, 1)
    draws = multinomial_with_seed(never, sure, torch.arange(400), torch.zeros(400, dtype=torch.int64))
    assert 370 <= int((draws == 0).sum()) <= 400


class _Req:
    def __init__(self, seed):
        self.sampling_params = type("SP", (), {"sampling_seed": seed})()


def test_unseeded_requests_keep_one_random_seed_each():
    seeded, unseeded_a, unseeded_b = _Req(7), _Req(None), _Req(None)
    assert seed_of(seeded) == 7
    first = seed_of(unseeded_a)
    assert seed_of(unseeded_a) == first            # kept across batch rebuilds
    assert seed_of(unseeded_b) != first            # independent of other requests
