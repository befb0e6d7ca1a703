"""The sgl-tts SGLang scheduler plugin on SGLang 0.5.15's own objects (CPU): registration, flags,
the prefix-aware order of ``SchedulePolicy.calc_priority``, deferral through ``PrefillAdder``,
request classes, and stock behaviour when the plugin is not enabled."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
import json
import os
import random
import subprocess
import sys
import types
from array import array
from importlib.metadata import entry_points

import pytest
import torch
from sglang.srt.plugins import load_plugins

load_plugins()  # as launch_server and every scheduler process do: the plugin's hooks are applied

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import InsertParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, prepare_server_args, set_global_server_args_for_scheduler  # noqa: E402,E501

from sgl_tts.plugin.scheduling import policy as tts_policy  # noqa: E402
from sgl_tts.plugin.settings import TTSSettings  # noqa: E402
from sgl_tts.protocol import SearchTag  # noqa: E402

# page_size and attention_backend as a CPU scheduler would resolve them ("dummy" skips that step)
SERVER_ARGS = ServerArgs(model_path="dummy", page_size=1, attention_backend="torch_native")
set_global_server_args_for_scheduler(SERVER_ARGS)


# ------------------------------------------------------------------------------------- fixtures
class Cache:
    """SGLang's RadixCache with real CPU pools (what a scheduler's tree cache is)."""

    def __init__(self, size=200_000, page_size=1):
        self.allocator = TokenToKVPoolAllocator(size=size, dtype=torch.float16, device="cpu",
                                                kvcache=None, need_sort=False)
        self.pool = pool = ReqToTokenPool(size=64, max_context_len=4096, device="cpu", enable_memory_saver=False)
        self.tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=pool,
                                               token_to_kv_pool_allocator=self.allocator, page_size=page_size))

    def insert(self, tokens):
        ids = array("q", tokens)
        kv = self.allocator.alloc(len(ids))
        res = self.tree.insert(InsertParams(key=RadixKey(ids), value=kv))
        if res.prefix_len:
            self.allocator.free(kv[:res.prefix_len])


def make_req(rid, tokens, tag: SearchTag | None = None, output=(), max_new=8):
    req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", tokens),
              sampling_params=SamplingParams(max_new_tokens=max_new,
                                             custom_params=tag.custom_params() if tag else None),
              vocab_size=284)  # the tiny models' vocabulary (SGLang checks sampled ids against it)
    req.output_ids.extend(output)
    return req


def policy_for(cache, name="lpm", settings=TTSSettings("prefix-aware", 32)):
    pol = SchedulePolicy(name, cache.tree, False, False, False)
    tts_policy.enable(pol, settings)
    return pol


def lcp(a, b):
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


def seq(req):
    return list(req.origin_input_ids) + list(req.output_ids)


# ---------------------------------------------------------------------------------- registration
def test_the_plugin_is_an_sglang_entry_point_and_its_hooks_are_applied():
    from sgl_tts.plugin import missing_hooks

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("sgl-tts") == "sgl_tts.plugin:register"
    assert missing_hooks() == []   # every target (tests/test_plugin_scheduling.py checks the list)


def _launch(*args, env=None):
    return subprocess.run([sys.executable, "-m", "sglang.launch_server", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_launch_server_help_lists_and_validates_the_flags(capsys):
    from sgl_tts.bench.command import STOCK_ENV

    # two launches at once (each spends ~10 s importing sglang on one core): the real command lists
    # the flags (the plugin came in through its entry point), and observe-only (the benchmark's stock
    # sides) adds the observer's hooks and no sgl-tts flag
    with cf.ThreadPoolExecutor(2) as pool:
        out, other = pool.map(lambda env: _launch("--help", env=env), [None, STOCK_ENV])
    assert out.returncode == 0
    assert "test-time scaling (sgl-tts)" in out.stdout and "--tts-policy {off,prefix-aware,locality}" in out.stdout
    assert "--tts-dedup-tokens" in out.stdout and "--tts-metrics-file PATH" in out.stdout
    assert other.returncode == 0 and "--tts-policy" not in other.stdout and "--mem-fraction-static" in other.stdout
    # the flags' checks: launch_server parses its command line with prepare_server_args, here with
    # the plugin loaded as in that process (load_plugins above)
    for args, message in ((("--tts-policy", "lpm"), "argument --tts-policy: invalid choice: 'lpm'"),
                          (("--tts-dedup-tokens", "0"), "argument --tts-dedup-tokens: expected a positive integer, got 0")):
        with pytest.raises(SystemExit) as exit_:
            prepare_server_args(["--model-path", "x", *args])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_flag_values_reach_server_args_and_the_environment(monkeypatch):
    # prepare_server_args writes these into os.environ itself: registered with monkeypatch first (set,
    # then removed) so that they are gone again after the test; a later live server in the same
    # session would otherwise inherit --tts-dedup-tokens 8
    for var in ("SGLANG_TTS_POLICY", "SGLANG_TTS_METRICS_FILE", "SGLANG_TTS_DEDUP_TOKENS"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    sa = prepare_server_args(["--model-path", "dummy", "--tts-policy", "prefix-aware", "--tts-dedup-tokens", "8",
                              "--tts-metrics-file", "/tmp/tts-metrics"])
    assert (sa.tts_policy, sa.tts_dedup_tokens, sa.tts_metrics_file) == ("prefix-aware", 8, "/tmp/tts-metrics")
    assert os.environ["SGLANG_TTS_METRICS_FILE"] == "/tmp/tts-metrics"
    assert os.environ["SGLANG_TTS_POLICY"] == "prefix-aware" and os.environ["SGLANG_TTS_DEDUP_TOKENS"] == "8"
    assert TTSSettings.of(sa) == TTSSettings("prefix-aware", 8, "/tmp/tts-metrics")
    assert TTSSettings.of(ServerArgs(model_path="dummy")) == TTSSettings("prefix-aware", 8, "/tmp/tts-metrics")
    with pytest.raises(ValueError, match="needs the radix cache: drop --disable-radix-cache"):
        prepare_server_args(["--model-path", "dummy", "--tts-policy", "prefix-aware", "--disable-radix-cache"])
    sa = prepare_server_args(["--model-path", "dummy"])
    assert sa.tts_policy == "prefix-aware"  # the environment default (an in-process Engine's way in)
    monkeypatch.setenv("SGLANG_TTS_POLICY", "off")
    monkeypatch.setenv("SGLANG_TTS_METRICS_FILE", "")
    assert prepare_server_args(["--model-path", "dummy"]).tts_policy == "off"


# ------------------------------------------------------------------------ stock behaviour kept
@pytest.mark.parametrize("name", ["lpm", "fcfs", "dfs-weight", "lof"])
def test_without_the_flag_sglang_orders_exactly_as_stock(name):
    """The hooks are applied, but a policy the plugin is not enabled on gives the unhooked
    function's order (and prefix matches) on the same queue."""
    rng = random.Random(3)
    for trial in range(5):
        cache = Cache()
        base = [rng.randrange(50) for _ in range(40)]
        cache.insert(base + [1, 2, 3])
        specs = [(f"r{i}", base[:rng.randrange(0, 40)] + [rng.randrange(50) for _ in range(rng.randrange(1, 50))],
                  rng.randrange(1, 64)) for i in range(rng.choice([5, 40, 130]))]
        hooked = [make_req(r, t, max_new=m) for r, t, m in specs]
        plain = [make_req(r, t, max_new=m) for r, t, m in specs]
        pol = SchedulePolicy(name, cache.tree, False, False, False)
        tts_policy.enable(pol, TTSSettings("off"))
        pol.calc_priority(hooked)
        SchedulePolicy.calc_priority.__wrapped__(SchedulePolicy(name, cache.tree, False, False, False), plain)
        assert [r.rid for r in hooked] == [r.rid for r in plain]
        assert [len(r.prefix_indices) for r in hooked] == [len(r.prefix_indices) for r in plain]


# ----------------------------------------------------------------------------- prefix-aware order
def simulate_beam_search(rng, n_parents, width, depth_count, retract_rate=0.2):
    """Queues of a beam search as a scheduler sees them, iteration by iteration: each kept parent's
    children (shuffled arrival), plus retracted requests of the iteration before (with output)."""
    prompt = [rng.randrange(1000) for _ in range(50)]
    # first-generation parents differ from their first token on
    parents = [(i, prompt + [2000 + i] + [rng.randrange(1000) for _ in range(9)]) for i in range(n_parents)]
    for depth in range(depth_count):
        queue = []
        for beam, (p_idx, p_tokens) in enumerate((p for p in parents for _ in range(width))):
            tokens = p_tokens + [rng.randrange(1000) for _ in range(rng.randrange(5, 30))]
            queue.append((SearchTag("g", depth, p_idx, beam), tokens))
        yield depth, queue
        kept = rng.sample(range(len(queue)), n_parents)
        parents = [(queue[k][0].beam, queue[k][1]) for k in sorted(kept)]


def check_order(order, by_rid):
    """Siblings contiguous, and each pick is the request sharing the longest prefix with the one
    before, ties to the smallest (group, depth, parent, beam): the stable parent order."""
    parents = [by_rid[r.rid].parent for r in order]
    runs = [p for p, _ in itertools.groupby(parents)]
    assert len(runs) == len(set(runs)), "siblings split"
    key = lambda r: (by_rid[r.rid].depth, by_rid[r.rid].parent, by_rid[r.rid].beam)  # noqa: E731
    rest = list(order)
    prev = None
    for r in order:
        best = max(lcp(seq(prev), seq(x)) for x in rest) if prev is not None else 0
        tied = [x for x in rest if prev is None or lcp(seq(prev), seq(x)) == best]
        assert r is min(tied, key=key), "not the greedy pick with the stable tie-break"
        rest.remove(r)
        prev = r
    return runs


def test_siblings_together_parents_stable_greedy_over_iterations_with_retractions():
    rng = random.Random(11)
    cache = Cache()
    pol = policy_for(cache)
    for depth, queue in simulate_beam_search(rng, n_parents=6, width=4, depth_count=5):
        reqs = [make_req(f"tts/g/{t.depth}/{t.beam}", tok, t) for t, tok in queue]
        by_rid = {r.rid: t for r, (t, _) in zip(reqs, queue)}
        rng.shuffle(reqs)                                     # arrival order is random
        pol.calc_priority(reqs)
        runs = check_order(reqs, by_rid)
        if depth == 0:
            assert runs == list(range(6))  # parents with distinct tokens: exactly their order
        # a retraction puts some requests back with output tokens: they return to their place
        back = rng.sample(reqs, 5)
        for r in back:
            r.output_ids.extend([7, 7, 7])
        again = back + [r for r in reqs if r not in back]
        pol.calc_priority(again)
        assert [r.rid for r in again] == [r.rid for r in reqs]


def test_a_queue_of_2000_requests_is_ordered_not_dropped_to_fcfs():
    rng = random.Random(5)
    cache = Cache()
    pol = policy_for(cache)
    _, queue = next(simulate_beam_search(rng, n_parents=125, width=16, depth_count=1))
    reqs = [make_req(f"r{t.beam}", tok, t) for t, tok in queue]
    by_rid = {r.rid: t for r, (t, _) in zip(reqs, queue)}
    rng.shuffle(reqs)
    pol.calc_priority(reqs)
    assert len(reqs) == 2000
    parents = [by_rid[r.rid].parent for r in reqs]
    runs = [p for p, _ in itertools.groupby(parents)]
    assert runs == list(range(125))          # siblings together, parents in order (lpm: FCFS here)
    for _, run in itertools.groupby(reqs, key=lambda r: by_rid[r.rid].parent):
        run = list(run)
        check_order(run, by_rid)             # greedy within each family
    # the shared uncached prompt: one request prefills it, the other 1999 wait a round
    assert sum(getattr(r, tts_policy.DEFERRED) for r in reqs) == 1999


def test_greedy_order_is_swap_optimal_on_random_trees():
    """Seed 000 Appendix A: on random prefix trees no single swap of two requests increases the sum
    of prefixes shared by consecutive requests, and each pick shares the longest prefix available
    (every request its own family here: families are kept together, see the mixed-depth test)."""
    rng = random.Random(2)
    for trial in range(40):
        paths = [[1, 2, 3]]
        for _ in range(rng.randrange(2, 10)):
            paths.append(rng.choice(paths) + [rng.randrange(3) for _ in range(rng.randrange(0, 4))])
        reqs = [make_req(f"x{i}", p, SearchTag("g", rng.randrange(3), i, i)) for i, p in enumerate(paths[1:])]
        pol = policy_for(Cache())
        pol.calc_priority(reqs)
        score = lambda o: sum(lcp(seq(a), seq(b)) for a, b in zip(o, o[1:]))  # noqa: E731
        base = score(reqs)
        for i, j in itertools.combinations(range(len(reqs)), 2):
            swapped = list(reqs)
            swapped[i], swapped[j] = swapped[j], swapped[i]
            assert score(swapped) <= base
        rest, prev = list(reqs), None
        for r in reqs:
            if prev is not None:
                assert lcp(seq(prev), seq(r)) == max(lcp(seq(prev), seq(x)) for x in rest)
            rest.remove(r)
            prev = r


def test_the_first_pick_continues_the_latest_admission():
    cache = Cache()
    pol = policy_for(cache)
    a = make_req("a", [1] * 40 + [2] * 10, SearchTag("g", 1, 0, 0))
    b = make_req("b", [5] * 40 + [6] * 10, SearchTag("g", 1, 1, 1))
    running = ScheduleBatch(reqs=[make_req("run", [5] * 40 + [6] * 5)])
    cache.insert([5] * 40 + [6] * 5)   # a running request's prefill is in the radix cache
    queue = [a, b]
    pol.calc_priority(queue, running)
    assert [r.rid for r in queue] == ["b", "a"]  # shares 45 tokens with the running request
    queue = [b, a]
    pol.calc_priority(queue)
    assert [r.rid for r in queue] == ["a", "b"]  # no anchor: parent order


# ----------------------------------------------------------------------------- dedup and classes
def scheduler_for(running, tree, allocator, waiting, settings=TTSSettings("prefix-aware", 32), *,
                  priority=False, low_first=False, pool=None, policy=None, max_prefill_tokens=16384):
    """A real ``Scheduler`` object (SGLang's class and methods) with the state its admission path
    (``get_new_batch_prefill``) reads, on real pools and radix cache; the model-facing parts that path
    does not reach with these settings (grammar manager, TP worker, load inquirer) are inert
    stand-ins, because building them loads a model. ``policy``: an existing (hooked) policy to use."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sglang.srt.server_args import set_global_server_args_for_scheduler

    from sgl_tts.models import shipped_model

    SERVER_ARGS.pp_max_micro_batch_size = SERVER_ARGS.pp_max_micro_batch_size or 64
    set_global_server_args_for_scheduler(SERVER_ARGS)   # what the scheduler process holds
    s = object.__new__(Scheduler)
    s.server_args = SERVER_ARGS
    if policy is None:
        policy = SchedulePolicy("fcfs", tree, False, priority, low_first)
        tts_policy.enable(policy, settings)
    s.policy = policy
    s.tree_cache, s.token_to_kv_pool_allocator = tree, allocator
    s.req_to_token_pool = pool if pool is not None else running.req_to_token_pool
    s.running_batch, s.waiting_queue = running, waiting
    s.enable_priority_scheduling = priority
    s.enable_hierarchical_cache = s.enable_priority_preemption = s.is_hybrid_swa = False
    s.chunked_req = s.min_free_slots_delayer = s.prefill_delayer = s.chunked_prefill_size = None
    s.enable_dynamic_chunking = s.is_mixed_chunk = s.enable_lora = s.enable_hicache_storage = False
    s.enable_overlap = False
    s.page_size = 1
    s.new_token_ratio_tracker = NewTokenRatioTracker.__new__(NewTokenRatioTracker)
    s.new_token_ratio_tracker.current = 0.5
    s.max_prefill_tokens = max_prefill_tokens
    s.priority_scheduling_preemption_threshold = 10
    s.max_prefill_bs = 0
    s.max_running_requests = 64
    s.dllm_config = None
    s.disaggregation_mode = DisaggregationMode.NULL
    s.truncation_align_size = None
    s.model_config = ModelConfig(model_path=str(shipped_model("generator")))
    s.spec_algorithm = SpeculativeAlgorithm.NONE
    # not reached by admission with the settings above, or model-bound
    s.grammar_manager = types.SimpleNamespace(has_waiting_grammars=lambda: False)
    s.tp_worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(prefill_aware_swa=False))
    s.load_inquirer = types.SimpleNamespace(_get_num_pending_tokens=lambda chunk_deduct=0: 0)
    return s


def adder_for(cache, running=None, rem=100_000):
    return PrefillAdder(page_size=1, tree_cache=cache.tree, token_to_kv_pool_allocator=cache.allocator,
                        running_batch=running or ScheduleBatch(reqs=[]), new_token_ratio=0.5,
                        rem_input_tokens=rem, rem_chunk_tokens=None)


def admit(cache, pol, queue, rem=100_000):
    """What SGLang's ``Scheduler.get_new_batch_prefill`` admits from ``queue`` (its own order call,
    admission loop and batch), with an empty running batch and ``rem`` prefill tokens."""
    s = scheduler_for(ScheduleBatch(reqs=[]), cache.tree, cache.allocator, list(queue), pool=cache.pool,
                      policy=pol, max_prefill_tokens=rem)
    batch = s.get_new_batch_prefill()
    return [r.rid for r in batch.reqs] if batch is not None else []


def test_one_sibling_prefills_an_uncached_shared_prefix_the_others_wait_one_round():
    cache = Cache()
    pol = policy_for(cache)
    prompt = list(range(100, 160))            # 60 uncached tokens shared by 4 siblings
    sibs = [make_req(f"s{i}", prompt + [i], SearchTag("g", 0, -1, i)) for i in range(4)]
    other = make_req("o", list(range(500, 520)), SearchTag("h", 0, -1, 0))
    queue = sibs[::-1] + [other]
    pol.calc_priority(queue)
    assert [r.rid for r in queue] == ["s0", "o", "s1", "s2", "s3"]   # deferred ones last
    assert admit(cache, pol, queue) == ["s0", "o"]
    cache.insert(prompt + [0])                # s0's prefill put the prompt into the radix cache
    rest = [r for r in queue if r.rid not in ("s0", "o")]
    pol.calc_priority(rest)
    assert admit(cache, pol, rest) == ["s1", "s2", "s3"]
    # a short shared prefix (< dedup tokens) is not worth a round
    short = [make_req(f"t{i}", list(range(900, 910)) + [i], SearchTag("k", 0, -1, i)) for i in range(3)]
    pol.calc_priority(short)
    assert admit(cache, pol, short) == ["t0", "t1", "t2"]


def test_a_shared_prefix_shorter_than_a_page_defers_nobody():
    """With --page-size 64 the radix cache holds whole pages only: 60 shared tokens are never cached,
    so deferring the siblings for them would only make them wait (until aging) for nothing. Deferred
    siblings go behind other work: the order shows who was deferred."""
    cache = Cache(page_size=64)
    pol = policy_for(cache)
    prompt = list(range(100, 160))            # 60 shared tokens: more than dedup (32), less than a page
    sibs = [make_req(f"s{i}", prompt + [i], SearchTag("g", 0, -1, i)) for i in range(4)]
    queue = sibs[::-1] + [make_req("o", list(range(500, 520)), SearchTag("h", 0, -1, 0))]
    pol.calc_priority(queue)
    assert [r.rid for r in queue] == ["s0", "s1", "s2", "s3", "o"]
    # 130 shared tokens hold two whole pages: the siblings wait for the first one's prefill
    long_prompt = list(range(1000, 1130))
    sibs = [make_req(f"t{i}", long_prompt + [i], SearchTag("k", 0, -1, i)) for i in range(3)]
    queue = sibs[::-1] + [make_req("x", list(range(600, 620)), SearchTag("m", 0, -1, 0))]
    pol.calc_priority(queue)
    assert [r.rid for r in queue] == ["t0", "x", "t1", "t2"]


def test_boosted_first_speculative_only_into_free_slots():
    cache = Cache()
    pol = policy_for(cache)

    def req(rid, cls, beam, n=30):
        return make_req(rid, [beam * 1000 + k for k in range(n)], SearchTag("g", 0, -1, beam, cls))

    def queue():
        return [req("spec0", "speculative", 0), req("norm1", "normal", 1), req("boost2", "boosted", 2),
                req("norm3", "normal", 3), req("spec4", "speculative", 4)]

    q = queue()
    pol.calc_priority(q)
    assert [r.rid for r in q] == ["boost2", "norm1", "norm3", "spec0", "spec4"]
    assert admit(cache, pol, q) == ["boost2", "norm1", "norm3", "spec0", "spec4"]  # room for all
    # a budget for three requests: the speculative ones get nothing while normal work waits
    assert admit(Cache(), policy_for(Cache()), queue(), rem=3 * 30 + 1) == ["boost2", "norm1", "norm3"]


def test_untagged_requests_keep_arrival_order_between_searches():
    cache = Cache()
    pol = policy_for(cache)
    u1 = make_req("u1", [9] * 10)
    t = [make_req(f"t{i}", [1] * 10 + [i], SearchTag("g", 0, -1, i)) for i in range(2)]
    u2 = make_req("u2", [8] * 10)
    queue = [u1, t[1], u2, t[0]]
    pol.calc_priority(queue)
    assert [r.rid for r in queue] == ["u1", "t0", "t1", "u2"]


# ---------------------------------------------------------------------------------- observability
def test_metrics_count_hits_evictions_and_recomputed_blocks(tmp_path):
    """Seed 001 Alg. 1 on SGLang's radix cache: a prefix computed, evicted, then needed again is
    counted as recomputed blocks; cached prefixes count as hits; evictions come from the real
    RadixCache.evict through the plugin's hook."""
    from sgl_tts.plugin.scheduling.metrics import SchedulerMetrics, read_records, summarize
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache = Cache()
    metrics = SchedulerMetrics(tmp_path / "m.jsonl", block_tokens=16, flush_seconds=0)
    cache.tree.sgl_tts_metrics = metrics
    prompt = list(range(1000, 1064))                      # 64 tokens = 4 blocks

    def admit_and_record(reqs):
        adder = adder_for(cache)
        for r in reqs:
            r.init_next_round_input(cache.tree)
            assert adder.add_one_req(r, has_chunked_req=False, truncation_align_size=None) == AddReqResult.CONTINUE
        rec = metrics.on_prefill(adder.can_run_list, waiting=0, running=0)
        for r in adder.can_run_list:
            cache.tree.dec_lock_ref(r.last_node)
        return rec

    first = admit_and_record([make_req("a", prompt + [1])])
    assert (first["cached_tokens"], first["computed_tokens"], first["recomputed_blocks"]) == (0, 65, 0)
    cache.insert(prompt + [1])                            # its prefill is now in the cache
    hit = admit_and_record([make_req("b", prompt + [2])])
    assert (hit["cached_tokens"], hit["computed_tokens"], hit["recomputed_blocks"]) == (64, 1, 0)
    evicted = cache.tree.evict(EvictParams(num_tokens=10_000))
    assert evicted.num_tokens_evicted == 65 and metrics.totals["evicted_tokens"] == 65
    again = admit_and_record([make_req("c", prompt + [3])])
    assert (again["cached_tokens"], again["computed_tokens"], again["recomputed_blocks"]) == (0, 65, 4)
    metrics.on_batch("DECODE", 3, occupancy=0.25)
    metrics.flush()
    s = summarize(read_records([tmp_path / "m.jsonl"]))
    assert s["prefix_hit_rate"] == pytest.approx(64 / (64 + 131)) and s["recomputed_blocks"] == 4
    assert (s["evicted_tokens"], s["admitted"], s["batches"], s["batch_size"]["max"]) == (65, 3, 1, 3)
    assert s["kv_occupancy"]["max"] == 0.25


def test_scheduler_stats_command_summarises_metric_files(tmp_path, capsys):
    from sgl_tts.cli import main
    from sgl_tts.plugin.scheduling.metrics import SchedulerMetrics

    m = SchedulerMetrics(tmp_path / "m.1", flush_seconds=0)
    m.on_batch("DECODE", 8, occupancy=0.5)
    m.on_evict(100)
    m.flush()
    (tmp_path / "m.1").open("a").write('{"event": "batch", "bat')   # torn by a killed server
    assert main(["scheduler-stats", str(tmp_path / "m.1"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batches"] == 1 and out["evicted_tokens"] == 100 and out["batch_size"]["mean"] == 8
    assert main(["scheduler-stats", str(tmp_path / "missing")]) == 1
    assert "no metrics file" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- group abort
# ------------------------------------------------------------------ speculative retraction/preemption
def extend_batch(reqs, pool, allocator, tree, config):
    """A prefill batch of ``reqs`` as Scheduler.get_new_batch_prefill forms it (admission: prefix
    match, lock, extend range; then prepare_for_extend), before any mixing."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    for r in reqs:
        r.sampling_params.normalize(None)
        r.init_next_round_input(tree)
        tree.inc_lock_ref(r.last_node)
        r.set_extend_range(len(r.prefix_indices), len(r.full_untruncated_fill_ids))
    batch = ScheduleBatch.init_new(reqs, pool, allocator, tree, config, enable_overlap=False,
                                   spec_algorithm=SpeculativeAlgorithm.NONE)
    batch.prepare_for_extend()
    return batch


def build_decode_state(kv_size, waves, fill=True):
    """A real decode-time ScheduleBatch on CPU pools, built the way the scheduler builds it:
    :func:`extend_batch`, one sampled token and cache_unfinished_req per request, merge into the
    running batch, decode steps. ``waves`` is a list of (requests, decode steps after the wave);
    ``fill``: then decode until the next step would not fit. Returns (running batch, tree,
    allocator, req-to-token pool, model config)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.mem_cache.common import maybe_cache_unfinished_req
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from sgl_tts.models import shipped_model

    config = ModelConfig(model_path=str(shipped_model("generator")))
    pool = ReqToTokenPool(size=8, max_context_len=128, device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(kv_size, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=pool,
                                      token_to_kv_pool_allocator=allocator, page_size=1))
    running = None
    step = 0

    def decode(batch):
        nonlocal step
        batch.prepare_for_decode()
        for r in batch.reqs:
            r.output_ids.append(150 + step % 100)
            r.update_finish_state()
        batch.input_ids = torch.tensor([r.output_ids[-1] for r in batch.reqs], dtype=torch.int64)
        step += 1

    for reqs, steps in waves:
        batch = extend_batch(reqs, pool, allocator, tree, config)
        for r in batch.reqs:
            r.output_ids.append(100)
            r.update_finish_state()
            maybe_cache_unfinished_req(r, tree)
        batch.input_ids = torch.tensor([100] * len(batch.reqs), dtype=torch.int64)
        batch.filter_batch()
        if running is None:
            running = batch
        else:
            running.merge_batch(batch)
        for _ in range(steps):
            decode(running)
    while fill and running.check_decode_mem():
        decode(running)
    running.spec_algorithm = SpeculativeAlgorithm.NONE
    return running, tree, allocator, pool, config


def decode_state(kv_size, waves, fill=True):
    """:func:`build_decode_state`'s running batch, tree and allocator."""
    return build_decode_state(kv_size, waves, fill)[:3]


def retraction_case(with_plugin):
    def req(rid, seed, n, cls):
        return make_req(rid, [(seed * 31 + 7 * i) % 270 + 1 for i in range(n)],
                        SearchTag("g", 0, -1, seed, cls), max_new=60)

    spec, first, late = req("spec", 1, 12, "speculative"), req("norm", 2, 12, "normal"), req("late", 3, 10, "normal")
    running, tree, allocator = decode_state(60, [([spec, first], 6), ([late], 0)])
    if with_plugin:
        policy_for(Cache())  # a policy elsewhere does not switch this tree on
        pol = SchedulePolicy("lpm", tree, False, False, False)
        tts_policy.enable(pol, TTSSettings("prefix-aware"))
    free = allocator.available_size()
    retracted, ratio, aborted = running.retract_decode(SERVER_ARGS)
    return [r.rid for r in retracted], [r.rid for r in running.reqs], allocator.available_size() - free, aborted


def test_speculative_requests_are_retracted_first():
    stock = retraction_case(False)
    ours = retraction_case(True)
    assert stock[0] == ["late"] and sorted(stock[1]) == ["norm", "spec"]   # stock: fewest outputs first
    assert ours[0] == ["spec"] and sorted(ours[1]) == ["late", "norm"]     # plugin: speculative first
    assert ours[2] > 0 and ours[3] == []                                   # its KV was freed


def test_one_call_changes_a_groups_class_and_the_next_order():
    """MCTS boosting: SGLang's Scheduler.set_internal_state with {"tts_set_class": ...} (what
    SGLangEndpoint.set_class posts to /set_internal_state) re-classes exactly that group's waiting
    and running requests; the next calc_priority puts the boosted ones first. Other states are
    SGLang's own."""
    from sglang.srt.managers.io_struct import SetInternalStateReq
    from sglang.srt.managers.scheduler import Scheduler

    cache = Cache()
    pol = policy_for(cache)
    waiting = [make_req(f"a{i}", [1, 2, i], SearchTag("a", 1, 0, i)) for i in range(3)] + \
              [make_req(f"b{i}", [7, 8, i], SearchTag("b", 1, 0, i)) for i in range(3)]
    scheduler = object.__new__(Scheduler)   # the real class; only the state this call reads
    scheduler.enable_priority_scheduling = False
    scheduler.waiting_queue = waiting
    scheduler.running_batch = ScheduleBatch(reqs=[make_req("b-run", [7, 8, 9], SearchTag("b", 0, -1, 0))])
    out = Scheduler.set_internal_state(scheduler, SetInternalStateReq(
        server_args={"tts_set_class": {"group": "b", "cls": "boosted", "beams": [1, 2]}}))
    assert out.updated and out.server_args == {"tts_set_class": {"requests": 2}}
    pol.calc_priority(waiting)
    # boosted first; the normal ones then continue from the last boosted prefix (b0 shares 7, 8)
    assert [r.rid for r in waiting] == ["b1", "b2", "b0", "a0", "a1", "a2"]
    refused = Scheduler.set_internal_state(scheduler, SetInternalStateReq(
        server_args={"tts_set_class": {"group": "b", "cls": "speculative", "depth": 0, "priority": 5}}))
    assert not refused.updated and "needs a server started with --enable-priority-scheduling" in \
        refused.server_args["tts_set_class"]["error"]
    scheduler.enable_priority_scheduling = True
    out = Scheduler.set_internal_state(scheduler, SetInternalStateReq(
        server_args={"tts_set_class": {"group": "b", "cls": "speculative", "depth": 0, "priority": 5}}))
    assert out.server_args == {"tts_set_class": {"requests": 1}}
    running = scheduler.running_batch.reqs[0]
    assert tts_policy.request_class(running) == "speculative" and running.priority == 5
    bad = Scheduler.set_internal_state(scheduler, SetInternalStateReq(
        server_args={"tts_set_class": {"group": "b", "cls": "urgent"}}))
    assert not bad.updated and "unknown request class 'urgent'" in bad.server_args["tts_set_class"]["error"]


def test_prometheus_collectors_are_made_once_per_process():
    from prometheus_client import REGISTRY

    from sgl_tts.plugin.scheduling.metrics import SchedulerMetrics

    a, b = SchedulerMetrics(prometheus=True), SchedulerMetrics(prometheus=True)  # no duplicate error
    before = REGISTRY.get_sample_value("sgl_tts_evicted_tokens_total") or 0.0
    a.on_evict(7)
    b.on_evict(5)
    assert REGISTRY.get_sample_value("sgl_tts_evicted_tokens_total") == before + 12
