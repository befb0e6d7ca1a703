"""Batching never changes results: heterogeneous requests run together (arriving all at once or
joining mid-flight, with prefix reuse on) give exactly what each gives alone."""

from __future__ import annotations

import dataclasses
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


def test_prefix_cache_lookup_is_the_longest_common_prefix_over_all_entries():
    """Against the definition: for random token sequences that share prefixes of every length (within
    a block, across blocks, none), after inserts, LRU evictions and prefix replacements, a lookup
    returns max over the cached sequences s of the common prefix of s and the query, capped at the
    limit, and that entry's KV for it."""
    import numpy as np

    from sgl_tts.backends.engine import PrefixCache

    rng = np.random.default_rng(0)
    stems = [rng.integers(0, 50, size=n) for n in (5, 16, 40, 70)]

    def seq():
        stem = stems[rng.integers(len(stems))]
        cut = int(rng.integers(0, len(stem) + 1))
        return np.concatenate([stem[:cut], rng.integers(0, 50, size=int(rng.integers(0, 40)))]).astype(np.int64)

    def kv(ids):   # a token's KV is its value and position: a returned slice can be checked exactly
        t = torch.tensor(ids, dtype=torch.float32)[None, :, None] + 1000 * torch.arange(len(ids))[None, :, None]
        return [(t, -t)]

    cache = PrefixCache(max_bytes=1 << 30, max_entries=12)
    cached: list[np.ndarray] = []   # the reference: what is in the cache, least recently used first
    for step in range(400):
        ids = seq()
        if len(ids) and rng.random() < 0.5:
            cache.insert(ids, kv(ids))
            if not any(np.array_equal(c, ids) for c in cached):
                cached = [c for c in cached if not (len(c) <= len(ids) and np.array_equal(c, ids[:len(c)]))]
                cached.append(ids)
                cached = cached[-12:]
            else:
                cached.append(cached.pop(next(i for i, c in enumerate(cached) if np.array_equal(c, ids))))
            continue
        limit = int(rng.integers(0, len(ids) + 2))

        def lcp(c):
            m = min(len(c), limit, len(ids))
            n = 0
            while n < m and c[n] == ids[n]:
                n += 1
            return n
        want = max([lcp(c) for c in cached], default=0)
        n, got = cache.lookup(ids, limit)
        assert n == want, step
        assert len(cache) == len(cached) and sorted(map(bytes, cached)) == sorted(cache._entries)
        if n:
            assert torch.equal(got[0][0], kv(ids[:n])[0][0])
            # the entry used (any of those with the longest prefix) is now the most recently used
            used = next(reversed(cache._entries))
            hit = next(i for i, c in enumerate(cached) if c.tobytes() == used)
            assert lcp(cached[hit]) == n
            cached.append(cached.pop(hit))
        else:
            assert got is None


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


def _rows_kv(seed, lengths, heads=2, dim=4, layers=2):
    """Per request, per layer, its own (keys, values) [heads, n, dim]: distinct numbers per token."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(heads, n, dim, generator=g), torch.randn(heads, n, dim, generator=g))
             for _ in range(layers)] for n in lengths]


def _batch_of(rows, reqs):
    """A _Batch holding exactly these requests' KV, left-padded (what a prefill leaves)."""
    from sgl_tts.backends.engine import _Batch, _SlabLayer

    length = max(kv[0][0].shape[1] for kv in rows)
    layers = []
    for li in range(len(rows[0])):
        heads, _, dim = rows[0][li][0].shape
        k = torch.zeros(len(rows), heads, length, dim)
        v = torch.zeros_like(k)
        for i, kv in enumerate(rows):
            n = kv[li][0].shape[1]
            k[i, :, length - n:], v[i, :, length - n:] = kv[li]
        layers.append(_SlabLayer(k, v, length))
    valid = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, kv in enumerate(rows):
        valid[i, length - kv[0][0].shape[1]:] = True
    return _Batch(layers, valid, list(reqs), torch.tensor([kv[0][0].shape[1] for kv in rows]))


def _assert_rows(batch, expected):
    """Row i of the batch holds exactly request batch.reqs[i]'s tokens' KV, in order, nothing else."""
    assert [lay.rows for lay in batch.layers] == [len(batch.reqs)] * len(batch.layers)
    assert all(lay.length == batch.valid.shape[1] for lay in batch.layers)
    for i, name in enumerate(batch.reqs):
        got = batch.row_kv(i)
        for (gk, gv), (wk, wv) in zip(got, expected[name]):
            torch.testing.assert_close(gk, wk, rtol=0, atol=0)
            torch.testing.assert_close(gv, wv, rtol=0, atol=0)


def test_batch_rows_join_leave_and_grow_in_place_keeping_each_requests_kv():
    """Joins into spare rows (shorter and longer rows), finishes, leading-column trimming and column
    growth keep every request's KV its own; only a join that does not fit reallocates."""
    from sgl_tts.backends.engine import BatchEngine, _Batch, _stack_rows

    expected = {}
    first = _rows_kv(0, [5, 9, 7])
    expected.update(zip("abc", first))
    batch = _batch_of(first, "abc")
    second = _rows_kv(1, [4, 12])
    expected.update(zip("de", second))
    new = _batch_of(second, "de")
    assert not batch.can_take(new)          # exact-size prefill buffers: no spare rows
    layers, valid = _stack_rows([(batch.layers, batch.valid), (new.layers, new.valid)],
                                row_capacity=9, slack=6, headroom=3)
    batch = _Batch(layers, valid, batch.reqs + new.reqs, torch.cat([batch.next_pos, new.next_pos]))
    _assert_rows(batch, expected)
    assert batch.layers[0].kbuf.shape[0] == 9 and batch.layers[0].start == 6

    # A shorter row and a longer one (by 4 <= slack 6) join without a new buffer.
    for name, n in (("f", 3), ("g", 16)):
        kv = _rows_kv(ord(name), [n])
        expected[name] = kv[0]
        joining = _batch_of(kv, name)
        assert batch.can_take(joining)
        buf = batch.layers[0].kbuf
        batch.take(joining)
        assert batch.layers[0].kbuf is buf
        _assert_rows(batch, expected)
    assert batch.layers[0].start == 2 and batch.length == 16

    # Decode-style appends grow every row by one column; past the capacity the buffer is regridded.
    for step in range(6):
        kv = _rows_kv(100 + step, [1] * len(batch.reqs))
        for li, lay in enumerate(batch.layers):
            lay.update(torch.stack([r[li][0] for r in kv]), torch.stack([r[li][1] for r in kv]))
        batch.valid = torch.cat([batch.valid, torch.ones(len(batch.reqs), 1, dtype=torch.bool)], dim=1)
        for name, r in zip(batch.reqs, kv):
            expected[name] = [(torch.cat([ek, k], 1), torch.cat([ev, v], 1))
                              for (ek, ev), (k, v) in zip(expected[name], r)]
        _assert_rows(batch, expected)
    assert batch.layers[0].start == 0       # the growth regridded to a buffer without left slack

    # The longest row finishes: the last row moves into its hole, leading padding columns go.
    batch = BatchEngine._drop_rows(batch, [batch.reqs.index("g"), batch.reqs.index("a")])
    assert sorted(batch.reqs) == list("bcdef")
    _assert_rows(batch, expected)
    assert batch.length == 12 + 6 and batch.valid[:, 0].any()
    assert BatchEngine._drop_rows(batch, list(range(len(batch.reqs)))) is None


def test_requests_joining_a_running_batch_mostly_reuse_its_buffers(backend):
    """Requests that join a running batch one after another (same and longer prompts) write into its
    spare rows and columns: at most one reallocation, and every output equals the request alone."""
    engine = backend.engine
    prompt = backend.encode("Question: compute ((3+4)*5)-6.\n\n")
    long_spec = SamplingSpec(max_new_tokens=200, ignore_eos=True, temperature=0.7, seed=7)
    joiners = [(prompt + backend.encode("x" * extra), SamplingSpec(max_new_tokens=n, temperature=0.7, seed=s))
               for s, (extra, n) in enumerate([(0, 30), (0, 25), (6, 40), (2, 20), (9, 35), (0, 10), (4, 28)])]
    backend.flush_cache()
    solo = [engine.generate(ids, spec).output_ids for ids, spec in joiners]
    backend.flush_cache()

    stats = engine.stats
    joined, reallocs = stats.joined_running, stats.kv_reallocations
    running = [engine.submit(prompt, dataclasses.replace(long_spec, seed=i)) for i in range(4)]
    engine.generate(prompt, SamplingSpec(max_new_tokens=2, ignore_eos=True))  # decoding has begun
    futs = []
    for ids, spec in joiners:
        futs.append(engine.submit(ids, spec))
        futs[-1].result(timeout=60)          # one at a time, while the long requests keep decoding
    assert not any(f.done() for f in running)
    assert [f.result().output_ids for f in futs] == solo
    assert stats.joined_running - joined >= len(joiners)
    assert stats.kv_reallocations - reallocs <= 1
    for f in running:
        f.result(timeout=120)
