"""The plugin under SGLang 0.5.15 modes other than the default (issue 16, item 14), settled on the
live CPU server where it runs the mode and through SGLang's own classes where it cannot:

(a) eviction metrics with tree caches other than ``RadixCache`` (the hierarchical cache, a streaming
    session wrapper, the hybrid caches): every cache that evicts by its own ``evict`` is hooked;
(b) admission counts with ``--enable-mixed-chunk``: the running decode requests SGLang mixes into a
    prefill batch are not admissions (live: a real server with the flag);
(c) retraction with speculative decoding (no algorithm starts on the CPU): SGLang 0.5.15 filters a
    speculative batch at any index, so the plugin's order (speculative requests first) can hold there.

The ``server`` tests share one server (``--enable-mixed-chunk --enable-streaming-session``, a
1024-token KV pool): one start (~30-90 s on 2 busy cores) and ~10-30 s of requests.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
import urllib.request
from array import array
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.plugins import load_plugins

load_plugins()  # as launch_server and every scheduler process do: the plugin's hooks are applied

from sglang.srt.managers.schedule_batch import ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import SchedulePolicy  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, EvictParams, InsertParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

from sgl_tts.plugin.scheduling import policy as tts_policy  # noqa: E402
from sgl_tts.plugin.scheduling.metrics import SchedulerMetrics  # noqa: E402
from sgl_tts.plugin.settings import TTSSettings  # noqa: E402
from sgl_tts.protocol import SearchTag  # noqa: E402
from test_scheduler_plugin import build_decode_state, extend_batch, make_req  # noqa: E402
from live_groups import ServerGroups  # noqa: E402

pytestmark = pytest.mark.live_servers("own")   # its live tests (below) stop the session's servers (mixed)

# page_size and attention_backend as a CPU scheduler would resolve them (as tests/test_scheduler_plugin.py)
SERVER_ARGS = ServerArgs(model_path="dummy", page_size=1, attention_backend="torch_native")
set_global_server_args_for_scheduler(SERVER_ARGS)

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="shows what fails on a machine without a GPU")


def pools(size=1000):
    allocator = TokenToKVPoolAllocator(size=size, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)
    pool = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
    return allocator, CacheInitParams(disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator,
                                      page_size=1)


def fill(cache, allocator, n=3, length=40):
    """``n`` disjoint cached sequences of ``length`` tokens (finished requests' prefixes)."""
    for s in range(n):
        cache.insert(InsertParams(key=RadixKey(array("q", [s * 100 + i + 1 for i in range(length)])),
                                  value=allocator.alloc(length)))


# ------------------------------------------------------------------------ (a) eviction metrics
CACHE_MODULES = ("sglang.srt.mem_cache.radix_cache", "sglang.srt.mem_cache.hiradix_cache",
                 "sglang.srt.mem_cache.swa_radix_cache", "sglang.srt.mem_cache.pure_swa_radix_cache",
                 "sglang.srt.mem_cache.mamba_radix_cache", "sglang.srt.mem_cache.hi_mamba_radix_cache",
                 "sglang.srt.mem_cache.unified_radix_cache", "sglang.srt.mem_cache.chunk_cache",
                 "sglang.srt.session.streaming_session")
# own evict, not hooked on purpose: it ends in RadixCache.evict through super() (hooked: counted
# there once), or the cache keeps nothing to evict
DELEGATES = {"PureSWARadixCache": "super().evict(", "LMCRadixCache": "super().evict(",
             "ChunkCache": "return EvictResult()", "SWAChunkCache": "return EvictResult()"}


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_tree_cache_that_evicts_by_itself_is_hooked():
    """SGLang 0.5.15's tree caches with an ``evict`` of their own: each is hooked, or its evict ends
    in ``RadixCache.evict`` (hooked) or evicts nothing. (``RadixCacheCpp``, behind
    SGLANG_EXPERIMENTAL_CPP_RADIX_TREE, is not imported: importing it builds a C++ extension.)"""
    import importlib
    import pkgutil

    for name in CACHE_MODULES:
        importlib.import_module(name)
    try:
        importlib.import_module("sglang.srt.mem_cache.storage.lmcache.lmc_radix_cache")
    except (ImportError, RuntimeError):   # needs the lmcache package
        pass
    own = {cls.__name__: cls for cls in _subclasses(BasePrefixCache) if "evict" in cls.__dict__
           and cls.__module__.startswith("sglang.")}
    assert {"RadixCache", "HiRadixCache", "SWARadixCache", "MambaRadixCache", "HiMambaRadixCache",
            "UnifiedRadixCache", "StreamingSession", "PureSWARadixCache", "ChunkCache"} <= set(own)
    hooked = {n for n, cls in own.items() if hasattr(cls.__dict__["evict"], "__wrapped__")}
    assert set(own) - hooked <= set(DELEGATES), sorted(set(own) - hooked - set(DELEGATES))
    for n in set(own) - hooked:
        assert DELEGATES[n] in inspect.getsource(own[n].evict), n
    assert hooked.isdisjoint(DELEGATES)   # hooking a delegating evict would count its tokens twice
    from sgl_tts.plugin import EVICT_TARGETS

    for target in EVICT_TARGETS:          # every target names a class's own evict
        owner, attr = target.rsplit(".", 1)
        assert attr in pkgutil.resolve_name(owner).__dict__, target


def hierarchical_cache(allocator, params):
    """SGLang's HiRadixCache with the state its tree and ``evict`` use; its ``__init__`` cannot run
    without a GPU (see the next test): the host pool and the cache controller are left out. Write
    policy ``write_through_selective``: a node inserted once is not backed up to host yet."""
    from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

    cache = object.__new__(HiRadixCache)
    cache.cache_controller = SimpleNamespace(write_policy="write_through_selective",
                                             mem_pool_device_allocator=allocator, reset=lambda: None)
    cache.token_to_kv_pool_host = SimpleNamespace(clear=lambda: None)
    cache.prefetch_loaded_tokens_by_reqid = {}
    cache.evictable_host_leaves = set()
    cache.ongoing_write_through = {}
    cache.enable_storage = False
    cache.write_through_threshold = 2
    RadixCache.__init__(cache, params)
    return cache


def test_hierarchical_cache_evictions_are_counted():
    """``HiRadixCache.evict`` (--enable-hierarchical-cache) overrides ``RadixCache.evict`` without
    calling it: before the fix the plugin recorded none of its evictions."""
    allocator, params = pools()
    cache = hierarchical_cache(allocator, params)
    metrics = SchedulerMetrics(None)
    cache.sgl_tts_metrics = metrics
    fill(cache, allocator)
    free = allocator.available_size()
    result = cache.evict(EvictParams(num_tokens=50))
    assert result.num_tokens_evicted == 80 and allocator.available_size() - free == 80   # two whole leaves
    assert metrics.totals["evicted_tokens"] == 80


def test_streaming_session_evictions_are_counted_once():
    """With --enable-streaming-session the scheduler's tree cache is a ``StreamingSession`` wrapping a
    ``RadixCache``: the metrics hang on the wrapper, the inner cache evicts. Before the fix: 0."""
    from sglang.srt.session.streaming_session import StreamingSession

    allocator, params = pools()
    cache = StreamingSession(RadixCache(params))
    metrics = SchedulerMetrics(None)
    cache.sgl_tts_metrics = metrics
    fill(cache, allocator)
    assert cache.evict(EvictParams(num_tokens=50)).num_tokens_evicted == 80
    assert metrics.totals["evicted_tokens"] == 80


@NO_GPU
def test_the_hierarchical_cache_cannot_start_on_the_cpu(monkeypatch):
    """Why (a) is not shown on the live CPU server: ``--enable-hierarchical-cache`` dies building the
    host KV pool (``HiRadixCache.__init__`` -> ``MHATokenToKVPoolHost`` -> ``alloc_with_host_register``
    -> ``cudaHostRegister``); SGLang has no CPU allocator for it (only npu/musa differ)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.memory_pool_host import MHATokenToKVPoolHost

    from sglang.srt.mem_cache.pool_host import base

    # SGLang keeps 10 GB of host memory in reserve: not the point here (a few KB are asked for)
    monkeypatch.setattr(base, "HICACHE_HOST_MEMORY_RESERVE_BYTES", 0)
    kv = MHATokenToKVPool(64, page_size=1, dtype=torch.float32, head_num=2, head_dim=8, layer_num=2,
                          device="cpu", enable_memory_saver=False)
    with pytest.raises(RuntimeError, match="Found no NVIDIA driver"):
        MHATokenToKVPoolHost(kv, 2.0, 0, 1, "layer_first")


# -------------------------------------------------------------------- (b) mixed chunked prefill
def decode_state(kv_size, waves, *, fill_pool=True):
    """tests/test_scheduler_plugin.py's real decode-time batch (running batch, tree, allocator,
    pool, model config)."""
    return build_decode_state(kv_size, waves, fill_pool)


def _after_prefill_hook():
    from sgl_tts.plugin.scheduling import observer

    return observer.after_prefill


def test_mixed_decode_requests_are_not_admissions():
    """``--enable-mixed-chunk``: Scheduler.get_new_batch_prefill (scheduler.py ~L2992) mixes the
    running decode requests into the new prefill batch (``mix_with_running`` + ``decoding_reqs``)
    and empties ``running_batch``. The metrics hook reads ``batch.reqs``: the decode requests would
    count as admitted again, their stale prefixes as cached, one token each as computed."""
    running, tree, allocator, pool, config = decode_state(
        4000, [([make_req(f"d{i}", [i * 20 + k + 1 for k in range(12)], max_new=64) for i in range(3)], 4)],
        fill_pool=False)
    new = extend_batch([make_req("n0", [200 + k for k in range(10)]), make_req("n1", [230 + k for k in range(7)])],
                       pool, allocator, tree, config)
    running.prepare_for_decode()            # what the scheduler does before mixing
    new.mix_with_running(running)
    new.decoding_reqs = running.reqs
    if [r.rid for r in new.reqs] != ["n0", "n1", "d0", "d1", "d2"]:   # SGLang's mixed batch
        pytest.fail(f"not the mixed batch this test expects: {[r.rid for r in new.reqs]}")
    metrics = SchedulerMetrics(None)
    scheduler = SimpleNamespace(sgl_tts_metrics=metrics, policy=SimpleNamespace(), waiting_queue=[],
                                running_batch=ScheduleBatch(reqs=[]), token_to_kv_pool_allocator=allocator)
    _after_prefill_hook()(new, scheduler)
    assert metrics.totals["admitted"] == 2
    assert (metrics.totals["cached_tokens"], metrics.totals["computed_tokens"]) == (0, 17)


# ---------------------------------------------------------------- (c) speculative decoding
@NO_GPU
def test_speculative_decoding_cannot_start_on_the_cpu(tiny_model_path):
    """Why (c) is not shown on the live CPU server: NGRAM is refused at argument parsing; every other
    algorithm (EAGLE, EAGLE3, STANDALONE, DFLASH...) builds its KV pool with ``enable_kv_cache_copy``
    (model_runner_kv_cache_mixin.py: ``speculative_algorithm is not None``), whose warm-up launches a
    Triton kernel (memory_pool.py ``_init_kv_copy_and_warmup``) and Triton finds no driver on a CPU."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    with pytest.raises(ValueError, match="Ngram speculative decoding only supports CUDA device"):
        ServerArgs(model_path=str(tiny_model_path), device="cpu", speculative_algorithm="NGRAM")
    with pytest.raises(RuntimeError, match="0 active drivers"):
        MHATokenToKVPool(64, page_size=1, dtype=torch.float32, head_num=2, head_dim=8, layer_num=2,
                         device="cpu", enable_memory_saver=False, enable_kv_cache_copy=True)


def speculative_batch():
    """A full decode batch of three requests (the speculative one in the middle), switched to EAGLE
    speculative decoding as SGLang runs it: server args with an algorithm, the batch's
    ``spec_algorithm`` and an ``EagleDraftInput`` with one row per request (row i holds i). The next
    decode step reserves draft tokens (the spec v2 estimate), so it does not fit."""
    import copy

    from sglang.srt.speculative.eagle_info import EagleDraftInput
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    def req(rid, seed, n, cls):
        return make_req(rid, [(seed * 31 + 7 * i) % 270 + 1 for i in range(n)],
                        SearchTag("g", 0, -1, seed, cls), max_new=60)

    reqs = [req("norm", 2, 12, "normal"), req("spec", 1, 12, "speculative"), req("late", 3, 10, "normal")]
    running, tree, allocator, _, _ = decode_state(60, [(reqs[:2], 6), (reqs[2:], 0)])
    args = copy.copy(SERVER_ARGS)
    args.__dict__.pop("max_speculative_num_draft_tokens", None)   # a cached property
    args.speculative_algorithm, args.speculative_num_steps = "EAGLE", 2
    args.speculative_eagle_topk, args.speculative_num_draft_tokens = 1, 3
    running.spec_algorithm = SpeculativeAlgorithm.EAGLE
    n = len(running.reqs)
    running.spec_info = EagleDraftInput(topk_p=torch.ones(n, 1), topk_index=torch.arange(n).view(n, 1),
                                        hidden_states=torch.arange(n, dtype=torch.float32).view(n, 1).repeat(1, 4),
                                        bonus_tokens=torch.arange(n))
    assert [r.rid for r in running.reqs] == ["norm", "spec", "late"]
    return running, tree, allocator, args


def draft_rows_follow(batch, rids):
    """Each kept request still has its own draft row (row i held the i-th of ``rids``)."""
    ids = [rids.index(r.rid) for r in batch.reqs]
    rows = batch.spec_info
    return (rows.topk_index.view(-1).tolist() == ids and rows.bonus_tokens.tolist() == ids
            and rows.hidden_states[:, 0].tolist() == [float(i) for i in ids])


def retract_speculative_batch(with_plugin):
    running, tree, allocator, args = speculative_batch()
    if with_plugin:
        tts_policy.enable(SchedulePolicy("lpm", tree, False, False, False), TTSSettings("prefix-aware"))
    set_global_server_args_for_scheduler(args)   # read by check_decode_mem and release_kv_cache
    try:
        if running.check_decode_mem():
            pytest.fail("the next speculative decode step fits: nothing to retract")
        free = allocator.available_size()
        retracted, _, aborted = running.retract_decode(args)
    finally:
        set_global_server_args_for_scheduler(SERVER_ARGS)
    if not draft_rows_follow(running, ["norm", "spec", "late"]):
        pytest.fail("a draft row no longer belongs to its request")
    if aborted or allocator.available_size() <= free:
        pytest.fail(f"aborted {aborted}, or the retracted KV was not freed")
    return [r.rid for r in retracted], [r.rid for r in running.reqs]


def test_a_speculative_batch_is_filtered_at_any_index():
    """The code fact under (c): SGLang 0.5.15's ``ScheduleBatch.filter_batch(keep_indices)`` calls
    ``spec_info.filter_batch(new_indices, has_been_filtered=False)``, and every spec input (EAGLE's
    here; NGRAM's and DFLASH's likewise) indexes its rows by the kept indices: dropping the middle
    request keeps each draft row with its request (SGLang does this every step for finished requests
    anywhere in the batch). Stock retraction with an algorithm set still takes the back of the batch
    (schedule_batch.py ``retract_decode``: "filter_batch API can only filter requests from the back")."""
    running, _, _, _ = speculative_batch()
    running.filter_batch(keep_indices=[0, 2])
    assert [r.rid for r in running.reqs] == ["norm", "late"] and draft_rows_follow(running, ["norm", "spec", "late"])
    assert retract_speculative_batch(False) == (["late"], ["norm", "spec"])


def test_retraction_under_speculative_decoding_takes_speculative_requests_first():
    """With the prefix-aware policy the speculative request goes first under speculative decoding too
    (the batch allows it, see above); the draft rows stay with their requests."""
    assert retract_speculative_batch(True) == (["spec"], ["norm", "late"])


# ------------------------------------------------------------------------ live: one server
LIVE_KV_TOKENS = 1024   # the generator's context is 512 tokens; float32 KV: 4096 bytes a token


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, live):
    """A real CPU server with --enable-mixed-chunk --enable-streaming-session and a 1024-token pool
    (plugin loaded, --tts-policy off, metrics on); the session's idle servers stopped to make room."""
    from sgl_tts.launch.live_servers import LiveServer
    from sgl_tts.models import shipped_model

    spec = LiveServer(str(shipped_model("generator")), policy="off", metrics=True, kv_bytes=LIVE_KV_TOKENS * 4096,
                      extra=("--enable-mixed-chunk", "--enable-streaming-session"))
    live.stop(*live.running())
    servers = ServerGroups({"mixed": {"mixed": spec}}, tmp_path_factory.mktemp("live-modes"))
    yield servers   # started on first use, stopped without SGLang's 5 s of crash diagnostics
    servers.stop_all()


def _post(url, path, body, timeout=300):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as res:
        return res.read()


def _generate(url, rid, text, new, out, started=None):
    """/generate, streamed: ``started`` is set at the first decoded chunk."""
    body = {"rid": rid, "text": text, "stream": True,
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as res:
        for line in res:
            if line.startswith(b"data:") and b"[DONE]" not in line:
                out[rid] = json.loads(line[5:])
                if started is not None:
                    started.set()


def _records_since(servers, start, wait=1.5):
    time.sleep(wait)   # the plugin flushes its records about every second
    return servers.metrics_records("mixed")[start:]


@pytest.mark.server
def test_live_mixed_chunk_admissions_count_each_request_once(mixed):
    """Three long requests decode; four short ones arrive meanwhile and are prefilled in MIXED
    batches with them. Every request was admitted once: the prefill records must say 7."""
    url = mixed.url("mixed")
    if "impl=StreamingSession" not in mixed.log_text("mixed"):   # the wrapper the next test relies on
        pytest.fail("the server's tree cache is not a StreamingSession")
    start = len(mixed.metrics_records("mixed"))
    out, started = {}, threading.Event()
    longs = [threading.Thread(target=_generate, args=(url, f"long-{i}", f"Long {i}: count from {i} to {i + 90}.",
                                                      200, out, started)) for i in range(3)]
    for t in longs:
        t.start()
    if not started.wait(120):
        pytest.fail("no long request started decoding")
    shorts = [threading.Thread(target=_generate, args=(url, f"short-{i}", f"Short {i}: what is {i} + {i * 7}?", 4, out))
              for i in range(4)]
    for t in shorts:
        t.start()
    for t in shorts:
        t.join(300)
    for i in range(3):   # the long ones need not finish
        _post(url, "/abort_request", {"rid": f"long-{i}"})
    for t in longs:
        t.join(60)
    records = _records_since(mixed, start)
    modes = {r["mode"] for r in records if r["event"] == "batch"}
    if "MIXED" not in modes or any(out[f"short-{i}"]["meta_info"]["completion_tokens"] != 4 for i in range(4)):
        pytest.fail(f"no mixed batch ran ({modes}) or a short request did not finish: the test saw nothing")
    prefills = [r for r in records if r["event"] == "prefill"]
    admitted = [q["rid"] for r in prefills for q in r["requests"]]
    assert sorted(set(admitted)) == sorted([f"long-{i}" for i in range(3)] + [f"short-{i}" for i in range(4)])
    assert sum(r["admitted"] for r in prefills) == 7, admitted


@pytest.mark.server
def test_live_streaming_session_evictions_are_counted(mixed):
    """Five distinct ~420-token prompts, one after another, on a 1024-token pool: each finished prompt
    stays cached, so the later ones must evict at least what they computed less the pool. Through the
    StreamingSession wrapper the plugin recorded none of them before the fix."""
    url = mixed.url("mixed")
    start = len(mixed.metrics_records("mixed"))
    prompts = [f"Case {k}: " + " ".join(f"{i}+{k}={i + k};" for i in range(10 + k, 70 + k))[:410] for k in range(5)]
    total = 0   # KV tokens the prompts took (what was not already cached)
    for k, text in enumerate(prompts):
        res = json.loads(_post(url, "/generate", {"rid": f"evict-{k}", "text": text,
                                                  "sampling_params": {"max_new_tokens": 1, "temperature": 0}}))
        total += res["meta_info"]["prompt_tokens"] - res["meta_info"]["cached_tokens"]
    evicted = sum(r["tokens"] for r in _records_since(mixed, start) if r["event"] == "evict")
    assert total > 1900 and evicted >= total - LIVE_KV_TOKENS, (total, evicted)
