"""The ``locality`` policy (issue 32, :mod:`sgl_tts.plugin.scheduling.residency`) on SGLang's own radix cache,
allocator and policy objects: under KV pressure, eviction goes by next use in the waiting order
(unneeded nodes first, then the one needed last), resident families are admitted first; without
pressure the order is ``prefix-aware``'s exactly."""

from __future__ import annotations

import os
import random
from array import array

import pytest
from test_scheduler_plugin import Cache, RadixKey, make_req, policy_for, scheduler_for

from sglang.srt.managers.schedule_batch import ScheduleBatch  # noqa: E402 (after the plugin is loaded)
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from sgl_tts.plugin.scheduling import residency
from sgl_tts.plugin.settings import TTSSettings
from sgl_tts.protocol import SearchTag

LOCALITY = TTSSettings("locality", 32)
PREFIX_AWARE = TTSSettings("prefix-aware", 32)
EVICTION_ONLY = TTSSettings("locality", 32, locality_rules="eviction")   # the ablation's two halves
ORDER_ONLY = TTSSettings("locality", 32, locality_rules="order")
SHARED = list(range(1, 101))                   # a 100-token prompt every path starts with


def path(tag: int) -> list[int]:
    """A beam's cached path: the prompt, then 100 tokens of its own."""
    return SHARED + [1000 * tag + k for k in range(100)]


def cached(cache: Cache, tokens: list[int]) -> int:
    """Tokens of ``tokens`` in the radix cache now (a read that touches nothing it did not find)."""
    return len(cache.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).device_indices)


def insert(cache: Cache, tokens: list[int]) -> None:
    """Cache ``tokens`` as a finished request does: only what is not cached yet takes new KV slots."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams

    key = RadixKey(array("q", tokens))
    have = cache.tree.match_prefix(MatchPrefixParams(key=key)).device_indices
    kv = torch.cat([have, cache.allocator.alloc(len(tokens) - len(have))])
    cache.tree.insert(InsertParams(key=key, value=kv))


def children(parent_beam: int, tokens: list[int], count: int = 2) -> list:
    """A family of a beam-search step: ``count`` children of one parent, whose input is its path."""
    return [make_req(f"p{parent_beam}c{i}", tokens, SearchTag("g", 1, parent_beam, 4 * parent_beam + i))
            for i in range(count)]


def evicted_paths(settings: TTSSettings, evict_tokens: int) -> dict[str, int]:
    """Families A (parent 0) and B (parent 1) wait, their parents' paths cached; G, a pruned beam's
    path, was cached before the round and G2, a finished request's, after it. The pool (520 tokens)
    is then 96% full (77% when the round is ordered). Returns each path's cached tokens after evicting ``evict_tokens``."""
    cache = Cache(size=520)
    a, b, g, g2 = path(1), path(2), path(3), path(4)
    for p in (a, b, g):
        insert(cache, p)
    pol = policy_for(cache, "fcfs", settings)
    queue = children(1, b) + children(0, a)      # B's children arrived first
    pol.calc_priority(queue)
    assert [r.rid for r in queue][:1] == ["p0c0"]   # family A (parent 0) is placed first
    insert(cache, g2)
    assert cache.allocator.available_size() == 520 - 500
    cache.tree.evict(EvictParams(num_tokens=evict_tokens))
    return {"A": cached(cache, a), "B": cached(cache, b), "G": cached(cache, g), "G2": cached(cache, g2)}


def test_under_pressure_eviction_keeps_what_the_queue_needs_and_drops_the_one_needed_last_first():
    # by the definition: nodes no waiting request needs go first (G, G2: 100 own tokens each), then the
    # path needed last in the waiting order (B's, its family is placed after A's)
    assert evicted_paths(LOCALITY, 200) == {"A": 200, "B": 200, "G": 100, "G2": 100}
    assert evicted_paths(LOCALITY, 300) == {"A": 200, "B": 100, "G": 100, "G2": 100}
    # SGLang's LRU (under prefix-aware, whose deferral check touched A's and B's paths before G2 was
    # cached) throws away G and then A's path, needed first, and keeps G2, needed by nobody
    assert evicted_paths(PREFIX_AWARE, 200) == {"A": 100, "B": 200, "G": 100, "G2": 200}


def test_no_node_is_marked_and_eviction_is_lru_without_pressure():
    cache = Cache(size=5000)
    a, g = path(1), path(3)
    insert(cache, a)
    insert(cache, g)
    pol = policy_for(cache, "fcfs", LOCALITY)
    assert isinstance(cache.tree.eviction_strategy, residency.QueueAwareEviction)
    queue = children(0, a)
    pol.calc_priority(queue)
    assert pol.sgl_tts.local_rounds == 0 and cache.tree.eviction_strategy.epoch == 0
    cache.tree.evict(EvictParams(num_tokens=100))
    assert (cached(cache, a), cached(cache, g)) == (200, 100)   # g was older than a's touch


def pressured_pool(size: int) -> tuple[Cache, list[int], list[int]]:
    """A pool of ``size`` tokens holding A's path (parent 1's) but not B's (parent 0's), filled with
    four paths nobody waits for (600 tokens used). Returns the cache and both paths."""
    cache = Cache(size=size)
    a, b = path(1), path(2)
    insert(cache, a)
    for k in range(4):
        insert(cache, path(10 + k))
    return cache, a, b


def resident_case(settings: TTSSettings, size: int) -> list[str]:
    """Family B (parent 0: first in the prefix-aware walk) must recompute its parent's path (evicted);
    family A's (parent 1) is cached. Returns the order of the waiting queue."""
    cache, a, b = pressured_pool(size)
    pol = policy_for(cache, "fcfs", settings)
    queue = children(1, a) + children(0, b)
    pol.calc_priority(queue)
    return [r.rid for r in queue]


def test_under_pressure_a_resident_family_is_admitted_before_one_that_must_recompute():
    # 100 + 5 * 100 = 600 tokens used: 9% free of 660 (pressure), 88% free of 5000 (none)
    assert resident_case(LOCALITY, 660) == ["p1c0", "p1c1", "p0c0", "p0c1"]
    # without pressure, prefix-aware's order: B first (smaller key), its second child deferred (it
    # shares 100 uncached tokens with its sibling) behind A
    assert resident_case(LOCALITY, 5000) == resident_case(PREFIX_AWARE, 5000) == ["p0c0", "p1c0", "p1c1", "p0c1"]
    assert resident_case(PREFIX_AWARE, 660) == ["p0c0", "p1c0", "p1c1", "p0c1"]


def test_admission_under_pressure_takes_the_resident_family():
    """SGLang's own admission (``get_new_batch_prefill``) after the locality order: the resident family
    A is admitted, and B, which must recompute 100 tokens, waits while the pool is short."""
    cache, a, b = pressured_pool(660)
    pol = policy_for(cache, "fcfs", LOCALITY)
    queue = children(1, a) + children(0, b)
    s = scheduler_for(ScheduleBatch(reqs=[]), cache.tree, cache.allocator, list(queue), pool=cache.pool,
                      policy=pol, max_prefill_tokens=16384)
    batch = s.get_new_batch_prefill()
    assert [r.rid for r in batch.reqs][:2] == ["p1c0", "p1c1"]


def test_without_pressure_the_order_equals_prefix_aware_over_random_rounds():
    rng = random.Random(7)
    for trial in range(20):
        cache = Cache(size=100_000)
        parents = [SHARED + [rng.randrange(200) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
        for p in parents[:4]:
            cache.insert(p)
        specs = []
        for f, p in enumerate(parents):
            for i in range(rng.randrange(1, 5)):
                specs.append((f"f{f}c{i}", p + [rng.randrange(200)] * rng.randrange(0, 2),
                              SearchTag(f"g{f % 2}", 1, f, 4 * f + i)))
        rng.shuffle(specs)
        orders = []
        for settings in (LOCALITY, PREFIX_AWARE):
            pol = policy_for(cache, "fcfs", settings)
            queue = [make_req(r, t, tag) for r, t, tag in specs]
            pol.calc_priority(queue)
            orders.append([r.rid for r in queue])
        assert orders[0] == orders[1]


def test_resident_first_keeps_families_whole_and_each_part_in_walk_order():
    fams = ["x", "x", "y", "z", "z", "w"]
    uncached = [0, 5, 40, 0, 31, 100]
    # x (0 and 5 < 32) and z (0, 31) are resident; y and w are not
    assert residency.resident_first(fams, uncached, 32) == [0, 1, 3, 4, 2, 5]
    assert residency.resident_first([], [], 32) == []


# ------------------------------------------------------------------ the rules one at a time (ablation)
def test_eviction_alone_evicts_by_next_use_in_the_prefix_aware_order():
    # eviction as under both rules (here both families are resident, so the orders agree) ...
    assert evicted_paths(EVICTION_ONLY, 200) == {"A": 200, "B": 200, "G": 100, "G2": 100}
    assert evicted_paths(EVICTION_ONLY, 300) == {"A": 200, "B": 100, "G": 100, "G2": 100}
    # ... but no reordering: the family that must recompute keeps its prefix-aware place
    assert resident_case(EVICTION_ONLY, 660) == resident_case(PREFIX_AWARE, 660) == ["p0c0", "p1c0", "p1c1", "p0c1"]


def test_eviction_alone_marks_the_needed_nodes_in_walk_order():
    """Under pressure with resident families first off, the marks follow the prefix-aware walk:
    family B (parent 0, first in the walk, its path evicted) ranks before A; the cached path that
    no waiting request needs is not marked."""
    cache, a, b = pressured_pool(660)
    pol = policy_for(cache, "fcfs", EVICTION_ONLY)
    queue = children(1, a) + children(0, b)
    pol.calc_priority(queue)
    strategy = cache.tree.eviction_strategy
    assert isinstance(strategy, residency.QueueAwareEviction) and strategy.epoch == 1
    node = cache.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", a)))).last_device_node
    # the prefix-aware walk is p0c0 p0c1 p1c0 p1c1 (p0c1's deferral comes after the marks): A's own
    # node is needed first by p1c0, at walk position 2
    assert getattr(node, residency.NEED) == (1, 2)
    shared = node.parent
    assert getattr(shared, residency.NEED) == (1, 0)   # the prompt, needed first by p0c0
    other = cache.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", path(10))))).last_device_node
    assert getattr(other, residency.NEED, None) is None


def test_order_alone_puts_resident_families_first_and_leaves_eviction_to_sglang():
    assert resident_case(ORDER_ONLY, 660) == resident_case(LOCALITY, 660) == ["p1c0", "p1c1", "p0c0", "p0c1"]
    assert resident_case(ORDER_ONLY, 5000) == resident_case(PREFIX_AWARE, 5000)
    # SGLang's LRU, as under prefix-aware: A's path (needed first) goes, G2 (needed by nobody) stays
    assert evicted_paths(ORDER_ONLY, 200) == evicted_paths(PREFIX_AWARE, 200) == {"A": 100, "B": 200, "G": 100, "G2": 200}
    cache = Cache(size=660)
    policy_for(cache, "fcfs", ORDER_ONLY)
    assert not isinstance(cache.tree.eviction_strategy, residency.QueueAwareEviction)


def test_locality_rules_setting_is_checked_and_reaches_the_server(monkeypatch):
    with pytest.raises(ValueError, match="--tts-locality-rules must be one of both, eviction, order, families, got 'lru'"):
        TTSSettings("locality", locality_rules="lru")
    with pytest.raises(ValueError, match="--tts-locality-rules order acts only with --tts-policy locality "
                                         r"\(the server runs --tts-policy prefix-aware\)"):
        TTSSettings("prefix-aware", locality_rules="order")
    assert (EVICTION_ONLY.evicts_by_next_use, EVICTION_ONLY.resident_first) == (True, False)
    assert (ORDER_ONLY.evicts_by_next_use, ORDER_ONLY.resident_first) == (False, True)
    assert (LOCALITY.evicts_by_next_use, LOCALITY.resident_first) == (True, True)
    assert (PREFIX_AWARE.evicts_by_next_use, PREFIX_AWARE.resident_first) == (False, False)
    assert ORDER_ONLY.args() == ["--tts-policy", "locality", "--tts-locality-rules", "order"]
    assert "--tts-locality-rules" not in LOCALITY.args()
    assert TTSSettings.from_env(ORDER_ONLY.env()) == ORDER_ONLY
    # launch_server's own parser: the flag lands on ServerArgs and in the children's environment
    for var in ("SGLANG_TTS_POLICY", "SGLANG_TTS_LOCALITY_RULES", "SGLANG_TTS_DEDUP_TOKENS", "SGLANG_TTS_MAX_WAIT",
                "SGLANG_TTS_CPU_ATTENTION", "SGLANG_TTS_METRICS_FILE", "SGLANG_TTS_SEEDED_SAMPLING"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    sa = prepare_server_args(["--model-path", "dummy", "--tts-policy", "locality", "--tts-locality-rules", "eviction"])
    assert TTSSettings.of(sa) == EVICTION_ONLY and os.environ["SGLANG_TTS_LOCALITY_RULES"] == "eviction"
    with pytest.raises(ValueError, match="acts only with --tts-policy locality"):
        prepare_server_args(["--model-path", "dummy", "--tts-policy", "prefix-aware", "--tts-locality-rules", "order"])


# ------------------------------------------------------------------ rule 3: whole families (families)
FAMILIES = TTSSettings("locality", 32, locality_rules="families")


def whole_family_case(settings: TTSSettings, max_new: int, running: bool = True, count: int = 2):
    """Family A (``count`` children of parent 0, its path cached) waits before family B (two children
    of parent 1, its path cached too); 550 KV tokens are held by running requests, so the 1,000-token
    pool has 150 free and 300 cached (pressure). Returns SGLang's admission from its own scheduler
    (the rids of the batch, or None), the scheduler and the cache."""
    import torch  # noqa: F401 (the allocator's tensors)

    cache = Cache(size=1000)
    a, b = path(1), path(2)
    insert(cache, a)
    insert(cache, b)
    held = cache.allocator.alloc(550)   # the running requests' KV (not in the tree)
    assert held is not None and cache.allocator.available_size() == 150
    pol = policy_for(cache, "fcfs", settings)
    queue = children(0, a, count) + children(1, b)
    for r in queue:
        r.sampling_params.max_new_tokens = max_new
    batch = ScheduleBatch(reqs=[make_req("run", [7] * 20, max_new=8)] if running else [])
    s = scheduler_for(batch, cache.tree, cache.allocator, list(queue), pool=cache.pool, policy=pol)
    formed = s.get_new_batch_prefill()
    return (None if formed is None else [r.rid for r in formed.reqs]), s, cache


def test_a_family_waits_while_it_would_need_the_next_familys_prefix():
    """By the rule's definition: the budget is free + evictable - what the running request may still
    write (all of its 8 new tokens: SGLang's own budget counts 8 x its 0.5 ratio) = 150 + 300 - 8 =
    442. The tokens cached for A (its path: the 100-token prompt and its own 100) and for B after it
    (B's own 100) are protected: 300. A's family needs, per child, SGLang's estimate: 1 token to
    prefill (the rest of its input is cached) + max_new + a page (1); so it fits only while
    2 * (max_new + 2) < 442 - 300 = 142."""
    got, s, cache = whole_family_case(FAMILIES, 68)       # 140 < 142: admitted
    # then B's first child (70) against 150 free - 8 - 140 reserved, B's own path protected: held
    # (SGLang would refuse it too once it locked B's path)
    assert got == ["p0c0", "p0c1"] and s.policy.sgl_tts.holds == 1 and s.running_batch.batch_is_full
    got, s, cache = whole_family_case(FAMILIES, 69)       # 142: the whole family waits
    assert got is None and s.running_batch.batch_is_full and s.policy.sgl_tts.holds == 1
    assert cached(cache, path(2)) == 200 and [r.rid for r in s.waiting_queue][:2] == ["p0c0", "p0c1"]
    # with 90 new tokens each (184 >= 142) the family waits under the rule; without it SGLang admits
    # it (92 < 446, then 92 < 150 + 100 - 4 - 92 once A's path is locked), and its reservations
    # (184 against 146 free) then evict B's path as it decodes
    got, s, _ = whole_family_case(FAMILIES, 90)
    assert got is None and s.policy.sgl_tts.holds == 1
    got, s, _ = whole_family_case(LOCALITY, 90)
    assert got == ["p0c0", "p0c1"] and s.policy.sgl_tts.holds == 0


def test_with_nothing_running_a_family_goes_to_sglang_and_its_later_members_are_checked_alone():
    """Nothing runs: A's first child is SGLang's to admit (nothing would ever free KV for it). Its
    sibling is then checked alone: 73 tokens against 150 free + 100 evictable (B's own path) - 73
    reserved - 100 protected (B's) = 77: admitted. B's first child (73) against 4: held, and with
    only this round's admissions to wait for, the round ends without marking the batch full."""
    got, s, _ = whole_family_case(FAMILIES, 71, running=False)
    assert got == ["p0c0", "p0c1"] and s.policy.sgl_tts.holds == 1 and not s.running_batch.batch_is_full
    got, s, _ = whole_family_case(FAMILIES, 75, running=False)   # 77 >= 150 + 100 - 77 - 100 = 73
    assert got == ["p0c0"] and s.policy.sgl_tts.holds == 1


def test_a_family_larger_than_the_pool_can_hold_is_checked_member_by_member():
    """Six children: with 60 new tokens each the family needs 6 * 62 = 372, which the pool less the
    protected tokens (1,000 - 300 = 700) could hold, so it waits as one (372 >= 142). With 130 each
    (6 * 132 = 792 >= 700) it could never be admitted whole: its first child alone is checked
    (132 < 142, admitted), and the second against 150 + 100 - 8 - 132 - 100 (B's path) = 10: held."""
    got, s, _ = whole_family_case(FAMILIES, 60, count=6)
    assert got is None and s.policy.sgl_tts.holds == 1
    got, s, _ = whole_family_case(FAMILIES, 130, count=6)
    assert got == ["p0c0"] and s.policy.sgl_tts.holds == 1


def test_family_rest_counts_what_each_later_member_adds():
    """By hand: family X (positions 0-2) of 200-token inputs, none cached, sharing 150 tokens with the
    member before: the second and third add 50 each (their shared 150 is the first's to prefill);
    family Y (3-4): 120 of 200 cached, the second shares all 200 with the first (its 80 uncached are
    the first's): 1, SGLang's last input token. Each adds its reservation (10)."""
    rest = residency.family_rest(["x", "x", "x", "y", "y"], [200] * 5, [200, 200, 200, 80, 80],
                                 [0, 150, 150, 0, 200], [10] * 5)
    assert rest == [2 * (50 + 10), 0, 0, 1 + 10, 0]


def test_without_pressure_the_whole_family_rule_has_no_table():
    cache = Cache(size=5000)
    insert(cache, path(1))
    pol = policy_for(cache, "fcfs", FAMILIES)
    queue = children(0, path(1))
    pol.calc_priority(queue)
    assert pol.sgl_tts.admission is None and pol.sgl_tts.local_rounds == 0


def test_with_whole_families_a_queue_that_will_fill_the_pool_is_pressure():
    """80% of the pool is free (no pressure for rules 1 and 2), but the two waiting children may write
    2 x (400 + 1) tokens: 800 - 802 < a quarter of 1,000. With ``families`` the rules act (the
    table is built, the nodes marked); with the two rules alone they wait for the pool to fill."""
    def rounds(settings: TTSSettings, max_new: int) -> tuple[int, bool]:
        cache = Cache(size=1000)
        insert(cache, path(1))
        pol = policy_for(cache, "fcfs", settings)
        queue = children(0, path(1))
        for r in queue:
            r.sampling_params.max_new_tokens = max_new
        pol.calc_priority(queue)
        return pol.sgl_tts.local_rounds, pol.sgl_tts.admission is not None

    assert rounds(FAMILIES, 400) == (1, True)
    assert rounds(LOCALITY, 400) == (0, False)
    assert rounds(FAMILIES, 150) == (0, False)   # 800 - 302 >= 250
