"""The private SGLang internals the plugin relies on beyond its hooks (:mod:`sgl_tts.plugin.internals`),
on SGLang 0.5.15's real classes: every one is in place; with one removed from its class (or from the
live object) the feature that needs it refuses to start, naming exactly the (feature, class,
attribute) missing, at the launcher and where the feature binds to SGLang's objects; a feature that
does not need it starts; and nothing falls back quietly (issue 62, 8)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.server_args import prepare_server_args

from sgl_tts.plugin import internals
from sgl_tts.plugin.attention import backend_choice, cpu_attention, sparse_attention
from sgl_tts.plugin.scheduling import residency
from sgl_tts.plugin.internals import INTERNALS, MissingInternals
from sgl_tts.plugin.settings import SparseSettings, TTSSettings
from sgl_tts.plugin.attention.sparse_worker import share_key_pools
from test_scheduler_plugin import Cache, policy_for   # (applies the plugin's hooks, as a server does)

NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
BASE = "sglang.srt.layers.attention.base_attn_backend.AttentionBackend"
TREE = "sglang.srt.mem_cache.radix_cache.RadixCache"
ANY_TREE = "sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache"
KV_POOL = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool"
RAGGED_FLAG = "--tts-cpu-attention ragged (or --tts-sparse-attention, built on it)"


def entry(owner: str, attribute: str) -> internals.Internal:
    (found,) = [i for i in INTERNALS if (i.owner, i.attribute) == (owner, attribute)]
    return found


def kv_pool(layers: int = 3) -> MHATokenToKVPool:
    return MHATokenToKVPool(size=16, page_size=1, dtype=torch.float32, head_num=2, head_dim=4, layer_num=layers,
                            device="cpu", enable_memory_saver=False)


def runner(**flags) -> SimpleNamespace:
    """What the attention hook reads of a model runner: its server args."""
    return SimpleNamespace(server_args=SimpleNamespace(tts_policy="off", tts_dedup_tokens=32, **flags))


RAGGED = runner(tts_cpu_attention="ragged")
SPARSE = runner(tts_cpu_attention="native", tts_sparse=SparseSettings("async"))


# ------------------------------------------------------------------------------- all in place
def test_every_internal_is_in_place_in_sglang_0_5_15():
    every = [internals.POLICY, internals.LOCALITY, internals.RAGGED, internals.SPARSE, internals.SPARSE_PROCESS]
    assert {i.feature for i in INTERNALS} == set(every)
    assert internals.missing(every) == []
    internals.check(every)
    cache = Cache()
    for feature in (internals.POLICY, internals.LOCALITY):
        assert internals.missing_on(cache.tree, feature) == []
    assert internals.missing_on(kv_pool(), internals.SPARSE_PROCESS) == []
    # and the table's lines for the live objects really apply to them (by class, bases included)
    assert [str(i) for i in INTERNALS if i.feature == internals.POLICY] == [
        f"{internals.POLICY}: {ANY_TREE}.evict", f"{internals.POLICY}: {TREE}._delete_leaf"]
    # an attribute __init__ sets is looked for on the live object: a tree never initialised has none
    assert internals.missing_on(RadixCache.__new__(RadixCache), internals.LOCALITY) == [
        entry(TREE, "eviction_strategy")]


def test_which_features_each_setting_turns_on():
    f = internals.features
    assert f(TTSSettings()) == []
    assert f(TTSSettings("prefix-aware")) == [internals.POLICY]
    assert f(TTSSettings("locality")) == [internals.POLICY, internals.LOCALITY]
    assert f(TTSSettings("locality", locality_rules="order")) == [internals.POLICY]
    assert f(TTSSettings(cpu_attention="ragged")) == [internals.RAGGED]
    assert f(TTSSettings(sparse=SparseSettings("sync"))) == [internals.RAGGED, internals.SPARSE]
    assert f(TTSSettings(sparse=SparseSettings("async"))) == [internals.RAGGED, internals.SPARSE,
                                                              internals.SPARSE_PROCESS]
    assert f(TTSSettings(sparse=SparseSettings("async", worker="thread"))) == [internals.RAGGED, internals.SPARSE]


# ------------------------------------------------------------------------- attention overrides
@pytest.mark.parametrize("server, owner, cls, attribute", [
    (RAGGED, NATIVE, TorchNativeAttnBackend, "_run_sdpa_forward_extend"),
    (RAGGED, NATIVE, TorchNativeAttnBackend, "_run_sdpa_forward_decode"),
    (SPARSE, NATIVE, TorchNativeAttnBackend, "_run_sdpa_forward_decode"),   # the sparse backend is the ragged one
    (SPARSE, BASE, AttentionBackend, "forward_extend"),
    (SPARSE, BASE, AttentionBackend, "forward_decode"),
])
def test_a_renamed_attention_method_refuses_the_backend_naming_it(monkeypatch, server, owner, cls, attribute):
    called = []
    monkeypatch.delattr(cls, attribute)
    with pytest.raises(MissingInternals) as refused:
        backend_choice.attention_backend_from_str(lambda *a: called.append(a), server, "torch_native")
    want = entry(owner, attribute)
    assert refused.value.missing == [want] and called == []
    assert f"(feature: class.attribute): {want.feature}: {owner}.{attribute}. Is this SGLang 0.5.15? " \
           "Refusing to serve" in str(refused.value)


def test_a_method_only_sparse_attention_needs_does_not_stop_the_ragged_backend(monkeypatch):
    monkeypatch.delattr(AttentionBackend, "forward_extend")
    chosen = backend_choice.attention_backend_from_str(lambda runner, name, *a: name, RAGGED, "torch_native")
    assert chosen == cpu_attention.BACKEND_NAME
    # and nothing is checked where the server does not run torch_native (the flags do nothing there)
    monkeypatch.delattr(TorchNativeAttnBackend, "_run_sdpa_forward_extend")
    assert backend_choice.attention_backend_from_str(lambda runner, name, *a: name, RAGGED, "triton") == "triton"


# ---------------------------------------------------------------------------------- the launcher
ENV = list(TTSSettings(seeded_sampling=True, metrics_file="x").env())


@pytest.fixture
def launcher_env(monkeypatch):
    """prepare_server_args writes the plugin's settings into os.environ (a later call without flags
    reads them back): registered first, so that they are gone after the test."""
    for var in ENV:
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    return monkeypatch


def test_the_launcher_refuses_flags_whose_internals_are_gone_and_names_each(launcher_env):
    launcher_env.delattr(TorchNativeAttnBackend, "_run_sdpa_forward_extend")
    launcher_env.delattr(RadixCache, "_delete_leaf")
    with pytest.raises(MissingInternals) as refused:
        prepare_server_args(["--model-path", "dummy", "--tts-policy", "prefix-aware", "--tts-cpu-attention", "ragged"])
    assert refused.value.missing == [entry(TREE, "_delete_leaf"), entry(NATIVE, "_run_sdpa_forward_extend")]
    assert (f"{internals.POLICY}: {TREE}._delete_leaf; {RAGGED_FLAG}: {NATIVE}._run_sdpa_forward_extend. "
            in str(refused.value))
    for var in ENV:   # (written before the refusal)
        launcher_env.delenv(var, raising=False)
    # a flag that needs neither starts
    assert prepare_server_args(["--model-path", "dummy", "--tts-seeded-sampling"]).tts_seeded_sampling


def test_the_launcher_passes_every_feature_on_the_real_classes(launcher_env, caplog):
    caplog.set_level("INFO", logger=internals.__name__)
    # on the module's own logger: SGLang's argument handling may reconfigure the root logger's handlers
    launcher_env.setattr(internals.logger, "handlers", [caplog.handler])
    sa = prepare_server_args(["--model-path", "dummy", "--tts-policy", "locality", "--tts-sparse-attention", "async"])
    assert sa.tts_sparse.mode == "async"
    assert f"SGLang internals in place for {internals.POLICY}, {internals.LOCALITY}, {RAGGED_FLAG}, " \
           f"{internals.SPARSE}, {internals.SPARSE_PROCESS}" in caplog.text


# ---------------------------------------------------------------------------------- residency
@pytest.mark.parametrize("attribute, owner", [("_delete_leaf", TREE), ("evict", ANY_TREE)])
def test_a_tree_that_lost_what_the_eviction_count_wraps_is_refused_not_left_uncounted(monkeypatch, attribute, owner):
    # (without evict of its own, a RadixCache's is BasePrefixCache's abstract placeholder)
    monkeypatch.delattr(RadixCache, attribute)
    cache = Cache()
    with pytest.raises(MissingInternals) as refused:
        policy_for(cache)
    assert refused.value.missing == [entry(owner, attribute)]
    assert f"{internals.POLICY}: {owner}.{attribute} (on this server's RadixCache)" in str(refused.value)
    assert getattr(cache.tree, residency.EVICTIONS, None) is None   # no count that would stand still


def test_a_tree_without_its_eviction_strategy_is_refused_under_locality(monkeypatch):
    cache = Cache()
    monkeypatch.delattr(cache.tree, "eviction_strategy")
    policy_for(cache, settings=TTSSettings("locality", locality_rules="order"))   # rule 1 off: not needed
    with pytest.raises(MissingInternals) as refused:
        policy_for(cache, settings=TTSSettings("locality"))
    assert refused.value.missing == [entry(TREE, "eviction_strategy")]


def test_a_chunk_cache_needs_no_delete_leaf_and_its_evictions_are_counted():
    cache = Cache()
    chunk = ChunkCache(CacheInitParams(disable=True, req_to_token_pool=cache.pool,
                                       token_to_kv_pool_allocator=cache.allocator, page_size=1))
    assert not hasattr(chunk, "_delete_leaf")
    residency.count_evictions(chunk)
    assert getattr(chunk, residency.EVICTIONS) == 0 and residency.install(chunk) is None


# ------------------------------------------------------------------------------ the cache rank
def test_the_key_pools_move_into_shared_memory_with_their_pointer_tables():
    pool = kv_pool()
    before = pool.k_buffer[1].data_ptr()
    keys = share_key_pools(pool, [1, 2])
    assert pool.k_buffer[1].is_shared() and pool.k_buffer[2].is_shared() and not pool.k_buffer[0].is_shared()
    assert pool.k_buffer[1].data_ptr() != before           # moved: the old table would point at freed memory
    assert pool.k_data_ptrs.tolist() == [b.data_ptr() for b in pool.k_buffer]
    assert pool.data_ptrs.tolist() == pool.k_data_ptrs.tolist() + [b.data_ptr() for b in pool.v_buffer]
    assert set(keys) == {1, 2} and all(keys[i].data_ptr() == pool.k_buffer[i].data_ptr() for i in keys)


@pytest.mark.parametrize("attribute", ["k_data_ptrs", "data_ptrs", "start_layer"])
def test_a_pool_without_an_attribute_the_move_uses_is_refused_before_anything_moves(monkeypatch, attribute):
    pool = kv_pool()
    monkeypatch.delattr(pool, attribute)
    with pytest.raises(MissingInternals) as refused:
        share_key_pools(pool, [1])
    assert refused.value.missing == [entry(KV_POOL, attribute)]
    assert f"{internals.SPARSE_PROCESS}: {KV_POOL}.{attribute} (on this server's MHATokenToKVPool)" \
        in str(refused.value)
    assert not pool.k_buffer[1].is_shared()


def test_the_sparse_backend_checks_its_runner_before_it_binds(monkeypatch):
    """The backend's own check (an Engine starts schedulers without the launcher's): a backend whose
    request table SGLang no longer sets is refused naming it, not left to fail at its first step."""
    monkeypatch.setattr(TorchNativeAttnBackend, "__init__", lambda self, runner: None)   # sets no req_to_token_pool
    with pytest.raises(MissingInternals) as refused:
        sparse_attention.backend_class()(SPARSE)
    assert refused.value.missing == [entry(NATIVE, "req_to_token_pool")]
