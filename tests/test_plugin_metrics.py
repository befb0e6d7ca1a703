"""The plugin's scheduler metrics: recomputed-block counting with chained block hashes (linear in a
request's length) against the definition, and which flags switch metrics on."""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

from sgl_tts.plugin.scheduling.metrics import SchedulerMetrics


# ------------------------------------------------------------------------ recomputed blocks
class Definition:
    """seed 001 Alg. 1 as the docs state it, with whole prefixes as keys (no hashing): a block is
    recomputed iff the exact prefix up to its end was seen before and the block ends past the cached
    part; every whole block of an admitted request's computed span is then seen."""

    def __init__(self, block_tokens: int):
        self.block_tokens = block_tokens
        self.seen: set[tuple[int, ...]] = set()

    def admit(self, tokens: list[int], cached: int) -> int:
        recomputed = 0
        for end in range(self.block_tokens, len(tokens) + 1, self.block_tokens):
            prefix = tuple(tokens[:end])
            if end > cached and prefix in self.seen:
                recomputed += 1
            self.seen.add(prefix)
        return recomputed


def fake_req(rid, prompt, output, cached, computed):
    """What ``on_prefill`` reads of an SGLang ``Req`` after admission."""
    return SimpleNamespace(rid=rid, origin_input_ids=array("q", prompt), output_ids=array("q", output),
                           prefix_indices=[0] * cached,
                           extend_range=SimpleNamespace(start=cached, end=cached + computed))


def random_workload(rng: random.Random, n: int):
    """Requests that share prefixes the way tree searches do: each extends, or branches off, an
    earlier one (prompt + output), with a cached part that is any prefix of it."""
    pool: list[list[int]] = []
    for i in range(n):
        if pool and rng.random() < 0.85:
            base = rng.choice(pool)
            cut = rng.randrange(len(base) + 1)
            tokens = base[:cut] + [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        else:
            tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        if not tokens:
            tokens = [rng.randrange(4)]
        pool.append(tokens)
        split = rng.randrange(len(tokens) + 1)              # prompt | output so far
        total = rng.randrange(len(tokens) + 1)              # the part this admission covers
        cached = rng.randrange(total + 1)
        yield fake_req(f"r{i}", tokens[:split], tokens[split:], cached, total - cached), tokens[:total], cached


def test_chained_block_ids_count_recomputed_blocks_as_the_definition():
    for seed in range(30):
        rng = random.Random(seed)
        block = rng.choice([1, 2, 3, 4, 16])
        metrics, definition = SchedulerMetrics(block_tokens=block), Definition(block)
        batch: list = []
        expected = 0
        for req, tokens, cached in random_workload(rng, 150):
            batch.append(req)
            expected += definition.admit(tokens, cached)
            if rng.random() < 0.3:     # a prefill batch of several requests
                record = metrics.on_prefill(batch, waiting=0, running=0)
                assert record["recomputed_blocks"] == expected, (seed, block)
                batch, expected = [], 0
        if batch:
            assert metrics.on_prefill(batch, waiting=0, running=0)["recomputed_blocks"] == expected
        assert metrics.totals["recomputed_blocks"] > 0     # the workloads do recompute


def test_equal_blocks_after_different_prefixes_are_different_blocks():
    metrics = SchedulerMetrics(block_tokens=2)
    assert metrics.on_prefill([fake_req("a", [1, 2, 3, 4], [], 0, 4)], waiting=0, running=0)["recomputed_blocks"] == 0
    # block [3, 4] again, after another first block: a new prefix, not a recomputation
    assert metrics.on_prefill([fake_req("b", [9, 9, 3, 4], [], 0, 4)], waiting=0, running=0)["recomputed_blocks"] == 0
    # the same prefix again: both blocks past the cached part recomputed; a cached one is not
    assert metrics.on_prefill([fake_req("c", [1, 2, 3, 4], [], 0, 4)], waiting=0, running=0)["recomputed_blocks"] == 2
    assert metrics.on_prefill([fake_req("d", [1, 2, 3], [4], 2, 2)], waiting=0, running=0)["recomputed_blocks"] == 1
    # a block only partly cached counts as computed
    assert metrics.on_prefill([fake_req("e", [1, 2, 3, 4], [], 1, 3)], waiting=0, running=0)["recomputed_blocks"] == 2


# --------------------------------------------------------------------- which flags switch them on
import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()  # as launch_server and every scheduler process do: the plugin's hooks are applied

from sglang.srt.managers.schedule_policy import SchedulePolicy  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

import sgl_tts.plugin as plugin  # noqa: E402


@pytest.fixture
def clean_env():
    """The flags mirror themselves into the environment (``apply``), and the flag defaults read it:
    start from no plugin variables and put the environment back afterwards."""
    saved = dict(os.environ)
    for key in [k for k in os.environ if "TTS_" in k]:
        del os.environ[key]
    yield
    os.environ.clear()
    os.environ.update(saved)


def _stock_init(self, server_args, *args, **kwargs):
    """Stands in for the body of SGLang's ``Scheduler.__init__`` (which loads a model): the state
    the plugin's hook reads, built from SGLang's own classes."""
    allocator = TokenToKVPoolAllocator(size=1024, dtype=torch.float16, device="cpu", kvcache=None,
                                       need_sort=False)
    pool = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
    self.tree_cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=pool,
                                                 token_to_kv_pool_allocator=allocator, page_size=1))
    self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache, False, False, False)
    self.max_total_num_tokens = 1024


def start_scheduler(monkeypatch, argv):
    """Parse ``argv`` as ``python -m sglang.launch_server`` does (SGLang's parser with the plugin's
    flag group and its ``from_cli_args`` hook), then run the hooked ``Scheduler.__init__`` with those
    ``ServerArgs``: SGLang's wrapper calls the plugin's ``_scheduler_init`` after the (stand-in) body."""
    from sgl_tts.plugin.scheduling import seeding

    monkeypatch.setattr(seeding, "ENABLED", seeding.ENABLED)   # the hook sets it process-wide
    server_args = prepare_server_args(["--model-path", "dummy", *argv])
    fn = Scheduler.__init__
    while fn is not None:    # the hook wrapper around SGLang's __init__ that runs _scheduler_init
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        if "hook" in cells and cells["hook"].cell_contents is plugin._scheduler_init:
            break
        fn = getattr(fn, "__wrapped__", None)
    assert fn is not None, "the plugin's hook is not on Scheduler.__init__"
    monkeypatch.setattr(cells["original_fn"], "cell_contents", _stock_init)
    scheduler = object.__new__(Scheduler)
    Scheduler.__init__(scheduler, server_args, None, 0, 0, 0, 0, 0, 0, None)
    return server_args, scheduler


def test_enable_metrics_alone_keeps_the_scheduler_stock(monkeypatch, clean_env):
    """SGLang's own --enable-metrics (no --tts-* flag) attaches no sgl-tts metrics: no counters, no
    sgl_tts_* Prometheus series, nothing on the prefill/batch/evict hooks."""
    server_args, scheduler = start_scheduler(monkeypatch, ["--enable-metrics"])
    assert server_args.enable_metrics and server_args.tts_policy == "off"
    assert scheduler.sgl_tts_metrics is None
    assert getattr(scheduler.tree_cache, "sgl_tts_metrics", None) is None
    assert scheduler.policy.sgl_tts is None


def test_policy_alone_records_nothing(monkeypatch, clean_env):
    _, scheduler = start_scheduler(monkeypatch, ["--tts-policy", "prefix-aware"])
    assert scheduler.policy.sgl_tts is not None and scheduler.sgl_tts_metrics is None


def test_enable_metrics_with_flags_that_do_not_schedule_or_record_attaches_nothing(monkeypatch, clean_env):
    """--tts-seeded-sampling changes sampling, --tts-dedup-tokens only matters under prefix-aware:
    neither asks for scheduler metrics."""
    argv = ["--enable-metrics", "--tts-seeded-sampling", "--tts-dedup-tokens", "8", "--sampling-backend", "pytorch"]
    server_args, scheduler = start_scheduler(monkeypatch, argv)
    assert server_args.tts_seeded_sampling and scheduler.sgl_tts_metrics is None


@pytest.mark.parametrize("argv, to_file, prometheus", [
    (["--tts-metrics-file", "{tmp}/m"], True, False),
    (["--tts-metrics-file", "{tmp}/m", "--enable-metrics"], True, True),
    (["--tts-policy", "prefix-aware", "--enable-metrics"], False, True),
])
def test_an_explicit_tts_flag_switches_metrics_on(monkeypatch, clean_env, tmp_path, argv, to_file, prometheus):
    """The JSONL file needs --tts-metrics-file; the sgl_tts_* Prometheus counters need SGLang's
    --enable-metrics and the plugin's scheduling or recording on (--tts-policy prefix-aware or
    --tts-metrics-file)."""
    _, scheduler = start_scheduler(monkeypatch, [a.format(tmp=tmp_path) for a in argv])
    metrics = scheduler.sgl_tts_metrics
    assert metrics is not None and scheduler.tree_cache.sgl_tts_metrics is metrics
    assert (metrics.path == tmp_path / f"m.{os.getpid()}") if to_file else metrics.path is None
    assert (metrics._prom is not None) == prometheus
    if to_file:
        assert '"event": "start"' in metrics.path.read_text()
