"""Batching never changes results: heterogeneous requests run together (arriving all at once or
joining mid-flight, with prefix reuse on) give exactly what each gives alone."""

from __future__ import annotations

import random
import time

import pytest
import torch

from sgl_tts.backends.engine import LogprobSpec, SamplingSpec

BASES = ["Question: compute ((3+4)*5)-6.\n\n", "Another problem entirely.\n", "x"]


def make_requests(backend, seed, count):
    rng = random.Random(seed)
    reqs = []
    for i in range(count):
        text = rng.choice(BASES) + "".join(rng.choice("ab +=\n0123") for _ in range(rng.randint(0, 30)))
        spec = SamplingSpec(
            max_new_tokens=rng.randint(1, 24),
            temperature=rng.choice([0.0, 0.7, 1.0]),
            top_k=rng.choice([-1, 5]),
            stop_token_ids=frozenset(rng.sample(range(256), 40)),
            stop=rng.choice([(), ("a",), ("b", "0")]),
            ignore_eos=rng.random() < 0.2,
            seed=1000 + i,
        )
        lp = LogprobSpec(return_logprob=rng.random() < 0.5, logprob_start_len=rng.choice([-1, 0, 2]),
                         token_ids_logprob=(10, 43) if rng.random() < 0.3 else None)
        reqs.append((backend.encode(text), spec, lp))
    return reqs


def outcome(comp):
    meta = comp.meta_info
    lps = [e[0] for e in meta.get("output_token_logprobs", [])]
    ins = [e[0] for e in meta.get("input_token_logprobs", [])]
    return comp.text, comp.output_ids, meta["finish_reason"], lps, ins


def assert_same(a, b):
    assert a[:3] == b[:3]
    assert a[3] == pytest.approx(b[3], abs=1e-4)
    assert a[4] == pytest.approx(b[4], abs=1e-4)


@pytest.mark.parametrize("seed", [0, 1])
def test_concurrent_and_staggered_requests_equal_solo_runs(backend, seed):
    reqs = make_requests(backend, seed, 32)
    backend.flush_cache()
    solo = [outcome(backend.engine.generate(ids, spec, lp)) for ids, spec, lp in reqs]
    assert len({len(o[1]) for o in solo}) > 5  # the mix really has different lengths

    backend.flush_cache()
    joined = backend.engine.stats.joined_running
    futs = [backend.engine.submit(ids, spec, lp) for ids, spec, lp in reqs[:16]]
    time.sleep(0.02)  # the rest join while the first half is decoding
    futs += [backend.engine.submit(ids, spec, lp) for ids, spec, lp in reqs[16:]]
    together = [outcome(f.result(timeout=120)) for f in futs]
    for a, b in zip(solo, together):
        assert_same(a, b)
    assert backend.engine.stats.cached_tokens > 0
    assert backend.engine.stats.joined_running > joined  # some requests joined mid-flight


def test_prefix_cache_finds_the_longest_prefix_and_evicts_lru():
    import numpy as np
    import torch

    from sgl_tts.backends.engine import PrefixCache

    def kv(n):
        t = torch.arange(n, dtype=torch.float32)[None, :, None].expand(1, n, 2).contiguous()
        return [(t, t + 100)]

    cache = PrefixCache(max_bytes=1 << 20, max_entries=3)
    cache.insert(np.array([1, 2, 3]), kv(3))
    cache.insert(np.array([1, 2, 3, 4, 5]), kv(5))   # replaces its own prefix [1, 2, 3]
    assert len(cache) == 1
    cache.insert(np.array([1, 9]), kv(2))
    n, got = cache.lookup(np.array([1, 2, 3, 4, 7, 7]), limit=5)
    assert n == 4 and got[0][0].shape == (1, 4, 2) and float(got[0][1][0, 3, 0]) == 103.0
    assert cache.lookup(np.array([1, 2, 3, 4, 5]), limit=2)[0] == 2   # limit respected
    cache.insert(np.array([7]), kv(1))
    cache.insert(np.array([8]), kv(1))                 # 4 entries > 3: least recently used goes
    assert cache.lookup(np.array([1, 9]), limit=2)[0] == 1  # [1, 9] was evicted; [1,2,...] remains
    assert len(cache) == 3


def test_grouped_kv_decode_attention_equals_transformers_sdpa():
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from sgl_tts.backends.engine import _sdpa_gqa_decode

    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, length, dim = 5, 8, 2, 13, 16
    q = torch.randn(b, heads, 1, dim, generator=g)
    k = torch.randn(b, kv_heads, length, dim, generator=g)
    v = torch.randn(b, kv_heads, length, dim, generator=g)
    allow = torch.rand(b, length, generator=g) > 0.3
    allow[:, -1] = True
    mask = torch.where(allow, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    got, _ = _sdpa_gqa_decode(module, q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape == (b, 1, heads, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
