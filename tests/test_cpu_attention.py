"""The ragged CPU attention (``--tts-cpu-attention ragged``) against attention's definition and
against SGLang's own ``torch_native`` backend, on pools laid out as SGLang lays them out."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_tts.plugin.attention import backend_choice, cpu_attention
from sgl_tts.plugin.attention.cpu_attention import backend_class, decode_rows, extend, gather
from sgl_tts.plugin.settings import TTSSettings, add_arguments, apply

HEADS, KV_HEADS, DIM = 4, 2, 16


def reference(query_pos: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float):
    """Attention by its definition, in float64, one query at position ``query_pos`` of a sequence
    whose keys/values are ``[length, kv_heads, dim]``: it sees positions 0..query_pos; query head h
    reads kv head h // (heads / kv_heads)."""
    out = torch.empty(q.shape[0], DIM, dtype=torch.float64)
    group = q.shape[0] // keys.shape[1]
    for h in range(q.shape[0]):
        kv = h // group
        scores = [scale * float(q[h].double() @ keys[j, kv].double()) for j in range(query_pos + 1)]
        top = max(scores)
        weights = [math.exp(s - top) for s in scores]
        total = sum(weights)
        out[h] = sum(w / total * values[j, kv].double() for j, w in enumerate(weights))
    return out


class Pool:
    """A KV pool and a req_to_token table: each sequence's tokens at scattered pool slots, shared
    prefixes at the same slots (as the radix cache shares them)."""

    def __init__(self, lengths, *, shared: int = 0, seed: int = 0, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        size = 4096
        self.k = torch.randn(size, KV_HEADS, DIM, generator=g).to(dtype)
        self.v = torch.randn(size, KV_HEADS, DIM, generator=g).to(dtype)
        free = torch.randperm(size - 1, generator=g) + 1
        common = free[:shared]
        used = shared
        self.req_to_token = torch.zeros(len(lengths) + 3, 512, dtype=torch.int32)
        for i, n in enumerate(lengths):
            own = free[used:used + n - min(shared, n)]
            used += len(own)
            self.req_to_token[i + 2, :n] = torch.cat([common[:min(shared, n)], own]).to(torch.int32)
        self.pool_indices = torch.arange(len(lengths)) + 2
        self.lengths = torch.tensor(lengths)

    def sequence(self, i: int):
        slots = self.req_to_token[self.pool_indices[i], :int(self.lengths[i])].long()
        return self.k[slots], self.v[slots]


def test_gather_is_indexing():
    pool = Pool([7, 3])
    index = pool.req_to_token[pool.pool_indices, :3]
    assert torch.equal(gather(pool.k, index), pool.k[index.long()])


@pytest.mark.parametrize("lengths", [[1], [5, 5, 5], [3, 40, 41, 9, 120, 2, 64, 65]])
def test_decode_rows_is_attention_by_its_definition(lengths):
    pool = Pool(lengths, shared=2)
    q = torch.randn(len(lengths), HEADS, DIM, generator=torch.Generator().manual_seed(1))
    out = torch.full_like(q, float("nan"))
    decode_rows(q, out, pool.k, pool.v, pool.req_to_token, pool.pool_indices, pool.lengths, scale=0.3,
                enable_gqa=True)
    for i, n in enumerate(lengths):
        keys, values = pool.sequence(i)
        assert torch.allclose(out[i].double(), reference(n - 1, q[i], keys, values, 0.3), atol=1e-5)


def test_decode_rows_splits_buckets_by_length_and_gather_size(monkeypatch):
    lengths = [2, 3, 30, 31, 39, 40, 200, 255]
    pool = Pool(lengths, seed=3)
    q = torch.randn(len(lengths), HEADS, DIM, generator=torch.Generator().manual_seed(4))
    calls = []
    real = cpu_attention.scaled_dot_product_attention

    def counting(q_, k_, v_, **kw):
        calls.append((q_.shape[0], k_.shape[2]))
        return real(q_, k_, v_, **kw)

    monkeypatch.setattr(cpu_attention, "scaled_dot_product_attention", counting)
    out = torch.empty_like(q)
    decode_rows(q, out, pool.k, pool.v, pool.req_to_token, pool.pool_indices, pool.lengths, enable_gqa=True)
    # buckets whose longest row is at most 1.3x the shortest: {2} {3} {30, 31, 39} {40} {200, 255}
    assert calls == [(1, 2), (1, 3), (3, 39), (1, 40), (2, 255)]
    calls.clear()
    # a cap of two 31-token rows' key elements per call splits the buckets further
    monkeypatch.setattr(cpu_attention, "MAX_GATHER_ELEMENTS", 31 * KV_HEADS * DIM * 2)
    out2 = torch.empty_like(q)
    decode_rows(q, out2, pool.k, pool.v, pool.req_to_token, pool.pool_indices, pool.lengths, enable_gqa=True)
    assert calls == [(1, 2), (1, 3), (2, 31), (1, 39), (1, 40), (1, 200), (1, 255)]
    assert torch.allclose(out, out2, atol=1e-6)


def test_extend_is_causal_attention_over_the_cached_prefix():
    # new tokens per sequence: one (a beam step), several after a prefix, a whole prompt, a chunk
    lengths, new = [50, 12, 7, 90], [1, 5, 7, 33]
    pool = Pool(lengths, shared=4, seed=5)
    q = torch.randn(sum(new), HEADS, DIM, generator=torch.Generator().manual_seed(6))
    out = torch.full_like(q, float("nan"))
    new_t = torch.tensor(new)
    extend(q, out, pool.k, pool.v, pool.req_to_token, pool.pool_indices, pool.lengths, pool.lengths - new_t,
           new_t, scale=0.25, enable_gqa=True)
    row = 0
    for i, (n, e) in enumerate(zip(lengths, new)):
        keys, values = pool.sequence(i)
        for j in range(e):
            want = reference(n - e + j, q[row], keys, values, 0.25)
            assert torch.allclose(out[row].double(), want, atol=1e-5), (i, j)
            row += 1


def native_and_ragged():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    ragged = backend_class()
    assert issubclass(ragged, TorchNativeAttnBackend)
    # the sdpa loops use no state of the backend: the real classes, without a model runner
    return TorchNativeAttnBackend.__new__(TorchNativeAttnBackend), ragged.__new__(ragged)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ragged_backend_computes_what_torch_native_computes(dtype):
    native, ragged = native_and_ragged()
    lengths, new = [93, 93, 94, 61, 12, 150, 1], [1, 1, 2, 61, 1, 40, 1]
    pool = Pool(lengths, shared=60, seed=7, dtype=dtype)
    new_t = torch.tensor(new)
    q = torch.randn(sum(new), HEADS, DIM, generator=torch.Generator().manual_seed(8))
    want, got = torch.empty_like(q), torch.empty_like(q)
    args = (pool.k, pool.v, pool.req_to_token, pool.pool_indices, pool.lengths, pool.lengths - new_t, new_t)
    native._run_sdpa_forward_extend(q, want, *args, scaling=0.2, enable_gqa=True, causal=True)
    ragged._run_sdpa_forward_extend(q, got, *args, scaling=0.2, enable_gqa=True, causal=True)
    assert torch.allclose(got, want, atol=2e-6)
    qd = torch.randn(len(lengths), HEADS, DIM, generator=torch.Generator().manual_seed(9))
    want, got = torch.empty_like(qd), torch.empty_like(qd)
    args = (pool.k, pool.v, pool.req_to_token, pool.pool_indices, pool.lengths)
    native._run_sdpa_forward_decode(qd, want, *args, scaling=0.2, enable_gqa=True)
    ragged._run_sdpa_forward_decode(qd, got, *args, scaling=0.2, enable_gqa=True)
    assert torch.allclose(got, want, atol=2e-6)


def test_sliding_windows_and_cross_attention_stay_torch_natives(monkeypatch):
    native, ragged = native_and_ragged()
    monkeypatch.setattr(cpu_attention, "decode_rows", lambda *a, **k: pytest.fail("batched a window"))
    monkeypatch.setattr(cpu_attention, "extend", lambda *a, **k: pytest.fail("batched a window"))
    pool = Pool([20, 9], seed=10)
    q = torch.randn(2, HEADS, DIM, generator=torch.Generator().manual_seed(11))
    want, got = torch.empty_like(q), torch.empty_like(q)
    args = (pool.k, pool.v, pool.req_to_token, pool.pool_indices, pool.lengths)
    native._run_sdpa_forward_decode(q, want, *args, enable_gqa=True, sliding_window_size=4)
    ragged._run_sdpa_forward_decode(q, got, *args, enable_gqa=True, sliding_window_size=4)
    assert torch.equal(got, want)
    one = torch.ones(2, dtype=torch.long)
    native._run_sdpa_forward_extend(q, want, *args, pool.lengths - one, one, enable_gqa=True, causal=False)
    ragged._run_sdpa_forward_extend(q, got, *args, pool.lengths - one, one, enable_gqa=True, causal=False)
    assert torch.equal(got, want)


def test_the_flag_parses_renders_and_reaches_the_environment(monkeypatch):
    import argparse
    import os

    # apply() writes SGLANG_TTS_* into the environment: on a copy, so no later test inherits them
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_TTS_")})
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).tts_cpu_attention == "native"
    with pytest.raises(SystemExit):
        parser.parse_args(["--tts-cpu-attention", "flash"])
    args = parser.parse_args(["--tts-cpu-attention", "ragged"])

    class ServerArgs:
        disable_radix_cache = False
        sampling_backend = "pytorch"

    server_args = ServerArgs()
    settings = apply(server_args, args)
    assert settings.cpu_attention == "ragged" and settings.any_on
    assert TTSSettings.of(server_args).cpu_attention == "ragged"
    assert TTSSettings.from_env().cpu_attention == "ragged"
    assert settings.args() == ["--tts-cpu-attention", "ragged"]
    assert TTSSettings().args() == [] and not TTSSettings().any_on
    with pytest.raises(ValueError, match="--tts-cpu-attention must be one of native, ragged, got 'flash'"):
        TTSSettings(cpu_attention="flash")


def test_the_hook_swaps_torch_native_only_when_asked():
    from types import SimpleNamespace

    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    seen = []

    def original(runner, name, *args, **kwargs):
        seen.append(name)
        return name

    on = SimpleNamespace(server_args=SimpleNamespace(tts_policy="off", tts_dedup_tokens=32,
                                                     tts_cpu_attention="ragged"))
    off = SimpleNamespace(server_args=SimpleNamespace(tts_policy="off", tts_dedup_tokens=32,
                                                      tts_cpu_attention="native"))
    assert backend_choice.attention_backend_from_str(original, on, "torch_native") == cpu_attention.BACKEND_NAME
    assert backend_choice.attention_backend_from_str(original, on, "triton") == "triton"
    assert backend_choice.attention_backend_from_str(original, off, "torch_native") == "torch_native"
    assert seen == [cpu_attention.BACKEND_NAME, "triton", "torch_native"]
    assert isinstance(ATTENTION_BACKENDS[cpu_attention.BACKEND_NAME](
        SimpleNamespace(device="cpu", req_to_token_pool=None, token_to_kv_pool=None)), backend_class())


def test_one_plan_per_forward_pass_and_a_new_one_after_any_in_place_step(monkeypatch):
    native, ragged = native_and_ragged()
    made = []
    real = cpu_attention.plan_rows

    def counting(*args):
        made.append(1)
        return real(*args)

    monkeypatch.setattr(cpu_attention, "plan_rows", counting)
    pool = Pool([30, 31, 45, 8], seed=12)
    lengths = pool.lengths.clone()
    for step in range(3):
        q = torch.randn(4, HEADS, DIM, generator=torch.Generator().manual_seed(20 + step))
        args = (pool.k, pool.v, pool.req_to_token, pool.pool_indices, lengths)
        for _layer in range(4):   # every layer of one forward pass: one plan
            want, got = torch.empty_like(q), torch.empty_like(q)
            native._run_sdpa_forward_decode(q, want, *args, enable_gqa=True)
            ragged._run_sdpa_forward_decode(q, got, *args, enable_gqa=True)
            assert torch.allclose(got, want, atol=2e-6), (step, _layer)
        assert len(made) == step + 1
        # the next decode step as SGLang makes it: each row's new token gets a slot written into the
        # table and the lengths grow, both in place
        for i in range(4):
            pool.req_to_token[pool.pool_indices[i], int(lengths[i])] = 4000 + 4 * step + i
        lengths.add_(1)
    # a table write alone (same lengths) makes a new plan too
    pool.req_to_token[pool.pool_indices[0], 0] = 3999
    ragged._run_sdpa_forward_decode(q, torch.empty_like(q), *args, enable_gqa=True)
    assert len(made) == 4
