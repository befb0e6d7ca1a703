"""The plugin inside SGLang 0.5.15's own scheduling code (CPU, no model run): ``Scheduler.
get_new_batch_prefill`` (SGLang's admission loop with the plugin's hooks) on real pools, radix
cache and decode batches; ``Req.update_finish_state``; ``ScheduleBatch.retract_decode``; the
load inquirer behind ``/v1/loads``. Issue 16's problems, each with the case that showed it
(``scheduler_for``: see tests/test_scheduler_plugin.py)."""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import random
import subprocess
import sys

import pytest
from test_scheduler_plugin import (SERVER_ARGS, Cache, Req, SamplingParams, ScheduleBatch, SchedulePolicy,
                                   SearchTag, TTSSettings, decode_state, lcp, make_req, policy_for, scheduler_for,
                                   seq, tts_policy)

from sgl_tts.plugin.scheduling import preemption, reclass

def tokens(seed, n):
    return [(seed * 31 + 7 * i) % 270 + 1 for i in range(n)]


def spec_req(rid, seed, n=12, max_new=60):
    return make_req(rid, tokens(seed, n), SearchTag("g", 0, -1, seed, "speculative"), max_new=max_new)


def rids(reqs):
    return [r.rid for r in reqs]


# ------------------------------------------------------------- 6: stop speculative work only when refused
def test_speculative_work_is_stopped_only_when_normal_work_is_refused_room():
    # room: a normal request, an untagged one (a /health_generate probe is one) and a deferred
    # sibling all wait; none is refused for room, so the running speculative request goes on
    running, tree, allocator = decode_state(400, [([spec_req("spec", 1)], 3)], fill=False)
    prompt = tokens(40, 60)
    waiting = [make_req("n", tokens(9, 20), SearchTag("h", 0, -1, 0)), make_req("probe", [5, 6, 7]),
               make_req("s0", prompt + [1], SearchTag("k", 0, -1, 0)), make_req("s1", prompt + [2], SearchTag("k", 0, -1, 1))]
    s = scheduler_for(running, tree, allocator, waiting)
    batch = s.get_new_batch_prefill()
    assert rids(batch.reqs) == ["n", "probe", "s0"] and rids(s.waiting_queue) == ["s1"]   # s1 deferred
    assert not preemption.stopping(running.reqs[0])
    # no room: the decode batch fills the pool, a normal request gets no KV tokens -> stop
    running, tree, allocator = decode_state(60, [([spec_req("spec", 1), make_req("norm", tokens(2, 12),
                                                   SearchTag("g", 0, -1, 2), max_new=60)], 6)])
    s = scheduler_for(running, tree, allocator, [make_req("late", tokens(3, 30), SearchTag("h", 0, -1, 0))])
    assert s.get_new_batch_prefill() is None and running.batch_is_full
    assert [preemption.stopping(r) for r in running.reqs] == [True, False]   # the normal one runs on
    # a waiting speculative request refused room stops nothing
    running, tree, allocator = decode_state(60, [([spec_req("spec", 1)], 6)])
    s = scheduler_for(running, tree, allocator, [spec_req("spec2", 5, 30)])
    assert s.get_new_batch_prefill() is None and not preemption.stopping(running.reqs[0])


# ------------------------------------------------------------- 2: a stop never hides a natural finish
def stopped_req(**sampling):
    from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

    from sgl_tts.models import shipped_model

    tok = get_tokenizer(str(shipped_model("generator")))   # as the scheduler loads it
    req = Req(rid="spec", origin_input_text="", origin_input_ids=tok.encode("a step:", add_special_tokens=False),
              sampling_params=SamplingParams(max_new_tokens=50, **sampling), vocab_size=284)
    req.tokenizer = tok
    req.sampling_params.normalize(tok)
    for t in tok.encode("ab", add_special_tokens=False):   # two tokens already generated
        req.output_ids.append(t)
        req.update_finish_state()
    assert not req.finished()
    setattr(req, preemption.STOP, True)   # what the plugin marks when normal work is refused
    return req, tok


@pytest.mark.parametrize("case", ["eos", "stop token", "stop string", "max_new_tokens", "plain"])
def test_a_stopped_request_reports_its_natural_finish_when_its_next_token_ends_it(case):
    """The next step's token, appended and checked as SGLang's decode does: a stop token, EOS, a
    stop string or the length limit is reported as such (trimmed as SGLang trims it); only a token
    that ends nothing gives the plugin's ``length`` stop, with every generated token."""
    sampling = {"stop": ["\n\n"]} if case == "stop string" else {"stop_token_ids": [99]} if case == "stop token" else {}
    req, tok = stopped_req(**sampling)
    if case == "max_new_tokens":
        req.sampling_params.max_new_tokens = 3
    nxt = {"eos": tok.eos_token_id, "stop token": 99, "stop string": tok.encode("\n\n", add_special_tokens=False)[0],
           "max_new_tokens": 100, "plain": 100}[case]
    req.output_ids.append(nxt)
    req.update_finish_state()
    got = req.finished_reason.to_json()
    expected = {"eos": {"type": "stop", "matched": tok.eos_token_id},
                "stop token": {"type": "stop", "matched": 99},
                "stop string": {"type": "stop", "matched": "\n\n"},
                "max_new_tokens": {"type": "length", "length": 3},
                "plain": {"type": "length", "length": 3}}[case]
    assert got == expected
    assert req.finished_len == 3 and list(req.output_ids) == tok.encode("ab", add_special_tokens=False) + [nxt]


# --------------------------------------------------------- 3: a request being stopped is never retracted
def test_retraction_never_takes_a_request_being_stopped():
    def req(rid, seed, n, cls):
        return make_req(rid, tokens(seed, n), SearchTag("g", 0, -1, seed, cls), max_new=60)

    stopped, other = req("stopped", 1, 12, "speculative"), req("spec2", 4, 12, "speculative")
    first, late = req("norm", 2, 12, "normal"), req("late", 3, 10, "normal")
    running, tree, allocator = decode_state(70, [([stopped, other, first], 5), ([late], 0)])
    s = scheduler_for(running, tree, allocator, [])   # attaches the policy to this tree
    setattr(stopped, preemption.STOP, True)
    retracted, _, aborted = running.retract_decode(SERVER_ARGS)
    assert "stopped" not in rids(retracted) and "stopped" in rids(running.reqs)
    assert rids(retracted)[0] == "spec2" and aborted == []   # the other speculative request first
    assert running.check_decode_mem() and s.policy.sgl_tts is not None


# ------------------------------------------------------------ 1: dedup across overlapped prefill rounds
def test_siblings_arriving_after_their_first_are_deferred_while_its_prefill_is_in_flight():
    """SGLang's overlap loop forms round t+1 before round t's prefill enters the radix cache: the
    siblings that arrive then share 60 uncached tokens with the request admitted in round t and
    must wait for it, not prefill the prefix again (they are the first of their class this round)."""
    running, tree, allocator = decode_state(600, [([make_req("other", tokens(90, 10), SearchTag("x", 0, -1, 0))], 1)],
                                            fill=False)
    prompt = tokens(50, 60)
    s = scheduler_for(running, tree, allocator, [make_req("s0", prompt + [1], SearchTag("k", 0, -1, 0))])
    first = s.get_new_batch_prefill()
    assert rids(first.reqs) == ["s0"]
    s.waiting_queue.extend(make_req(f"s{i}", prompt + [i + 1], SearchTag("k", 0, -1, i)) for i in (1, 2, 3))
    assert s.get_new_batch_prefill() is None          # round t+1: s0's prefill not processed yet
    assert rids(s.waiting_queue) == ["s1", "s2", "s3"] and s.policy.sgl_tts.last_deferred == 3
    from sglang.srt.mem_cache.common import maybe_cache_unfinished_req

    for r in first.reqs:                              # round t's result: s0's prompt enters the cache
        r.output_ids.append(100)
        maybe_cache_unfinished_req(r, tree)
    second = s.get_new_batch_prefill()
    assert rids(second.reqs) == ["s1", "s2", "s3"]
    assert [len(r.prefix_indices) for r in second.reqs] == [60, 60, 60]


def test_a_prefill_batch_defers_its_siblings_for_one_round_only():
    """If the first request's prefix is not in the cache a round later (evicted, or it never
    finished), its siblings do not wait on it again: the next round admits one of them, which
    prefills the prefix, and defers the rest behind it."""
    running, tree, allocator = decode_state(600, [([make_req("other", tokens(90, 10), SearchTag("x", 0, -1, 0))], 1)],
                                            fill=False)
    prompt = tokens(51, 60)
    s = scheduler_for(running, tree, allocator, [make_req("s0", prompt + [1], SearchTag("k", 0, -1, 0))])
    assert rids(s.get_new_batch_prefill().reqs) == ["s0"]
    s.waiting_queue.extend(make_req(f"s{i}", prompt + [i + 1], SearchTag("k", 0, -1, i)) for i in (1, 2, 3))
    assert s.get_new_batch_prefill() is None            # s0's prefill may be in flight: wait
    third = s.get_new_batch_prefill()                   # s0's prefix never reached the cache
    assert rids(third.reqs) == ["s1"] and rids(s.waiting_queue) == ["s2", "s3"]


# -------------------------------------------------------------------------- 4: cached ordering state
def test_the_last_rounds_requests_are_held_so_their_ids_cannot_be_reused():
    """Infos are looked up by id(): a request that left the queue must stay alive until the next
    round replaces the lookup, or a new request at its address would get its info. And forgetting a
    request (retraction, re-class) reaches every live policy state, not only the one that ordered it."""
    import gc
    import weakref

    cache = Cache()
    pol, other = policy_for(cache), policy_for(cache)
    queue = [make_req(f"h{i}", tokens(i, 12), SearchTag("h", 1, i, i)) for i in range(4)]
    pol.calc_priority(queue)
    other.calc_priority(list(queue))
    gone = weakref.ref(queue.pop())
    gc.collect()
    assert gone() is not None                   # held by both states' last rounds
    pol.calc_priority(queue)
    other.calc_priority(list(queue))
    gc.collect()
    assert gone() is None                       # the next rounds let it go
    back = queue[0]
    assert id(back) in pol.sgl_tts._known and id(back) in other.sgl_tts._known
    back.output_ids.extend([5])
    back.reset_for_retract()
    assert id(back) not in pol.sgl_tts._known and id(back) not in other.sgl_tts._known


def test_the_order_is_reused_while_the_queue_is_unchanged_and_redone_when_it_changes():
    rng = random.Random(1)
    cache = Cache()
    pol = policy_for(cache)
    state = pol.sgl_tts
    prompt = [rng.randrange(200) for _ in range(80)]
    reqs = [make_req(f"r{p}-{c}", prompt + [p] * 5 + [rng.randrange(200) for _ in range(10)], SearchTag("g", 1, p, p * 4 + c))
            for p in range(6) for c in range(4)]
    rng.shuffle(reqs)
    queue = list(reqs)
    pol.calc_priority(queue)
    first = rids(queue)
    assert state.sorts == 1
    for _ in range(3):
        pol.calc_priority(queue)
    assert rids(queue) == first and state.sorts == 1 and state.rounds == 4
    # the same requests in another order are another queue: sorted again, to the same order
    shuffled = list(reqs)
    rng.shuffle(shuffled)
    pol.calc_priority(shuffled)
    assert rids(shuffled) == first and state.sorts == 2
    # set_class changes a request's class: its cached info goes, the order follows
    from sglang.srt.managers.scheduler import Scheduler

    sched = object.__new__(Scheduler)
    sched.waiting_queue, sched.running_batch, sched.enable_priority_scheduling = shuffled, ScheduleBatch(reqs=[]), False
    last = shuffled[-1]
    assert reclass.set_class(sched, "g", "boosted", beams=[SearchTag.from_custom_params(
        last.sampling_params.custom_params).beam]) == 1
    pol.calc_priority(shuffled)
    assert shuffled[0] is last and state.sorts == 3
    # a retracted request comes back with output: SGLang's reset_for_retract (the plugin's hook)
    # drops its info, even where it stands in the queue as before; its bytes are recomputed
    back = shuffled[3]
    back.output_ids.extend([1, 2])
    back.reset_for_retract()
    assert not hasattr(back, tts_policy.INFO)
    pol.calc_priority(shuffled)
    assert state.sorts == 4 and getattr(back, tts_policy.INFO).seq == tts_policy.tokens_of(back)
    # a request that was away for a round comes back with more output: checked as a new one
    away = shuffled.pop(5)
    pol.calc_priority(shuffled)
    away.output_ids.extend([3])
    shuffled.append(away)
    pol.calc_priority(shuffled)
    assert state.sorts == 6 and getattr(away, tts_policy.INFO).seq == tts_policy.tokens_of(away)


def _random_rounds(parents, rounds, seed, *, count_evictions=True, dedup=32):
    """Admit some, add arrivals, retract some, evict some of the cache: each round, the order of the
    state carried across rounds and of a fresh state on the same queue and cache. Returns the carried
    policy's state and the rounds where the two orders differ."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    rng = random.Random(seed)
    cache = Cache()
    settings = TTSSettings("prefix-aware", dedup)
    pol = policy_for(cache, settings=settings)
    if not count_evictions:   # the eviction count stays 0 whatever is evicted
        del cache.tree.evict, cache.tree._delete_leaf
    prompt = [rng.randrange(200) for _ in range(40)]
    n = itertools.count()

    def arrivals(k):
        out = []
        for _ in range(k):
            p = rng.randrange(parents)
            i = next(n)
            out.append(make_req(f"q{i}", prompt + [p] * 8 + [rng.randrange(200) for _ in range(rng.randrange(1, 12))],
                                SearchTag(f"g{p % 2}", 1, p, i, rng.choice(["normal", "normal", "speculative"]))))
        return out

    queue = arrivals(20 if parents < 10 else 300)
    running = None
    differ = []
    for rnd in range(rounds):
        # the running batch's last request anchors the walk: now and then another one, which
        # continues a waiting request further than its siblings (the family's walk starts there)
        if queue and rng.random() < 0.3:
            near = seq(rng.choice(queue))
            running = ScheduleBatch(reqs=[make_req(f"run{rnd}", near[:-1] + [rng.randrange(200)])])
        pol.calc_priority(queue, running)
        # the requests the deferral checks, by its definition: every one after the aged, not
        # speculative, that shares at least dedup tokens with the one placed before it
        plan = pol.sgl_tts._plan
        if plan.cand_version == -1:
            assert plan.cand_pos == [p for p in range(plan.first_deferrable, len(plan.infos))
                                     if plan.infos[p].rank != tts_policy.SPECULATIVE and plan.shared_prev[p] >= dedup]
            assert plan.cand_keys == [(plan.infos[p].serial, plan.shared_prev[p]) for p in plan.cand_pos]
        fresh_pol = policy_for(cache, settings=settings)
        fresh_pol.sgl_tts._group_rank = dict(pol.sgl_tts._group_rank)
        fresh_pol.sgl_tts._counter = itertools.count(len(pol.sgl_tts._group_rank))
        copy = list(queue)
        fresh_pol.calc_priority(copy, running)
        if rids(copy) != rids(queue):
            differ.append(rnd)
        action = rng.random()
        if action < 0.25 and queue:
            admitted = queue[:rng.randrange(1, 4)]
            for r in admitted:
                cache.insert(seq(r))
            queue = queue[len(admitted):]
        elif action < 0.5:
            queue += arrivals(rng.randrange(1, 4))
        elif action < 0.65 and queue:   # retracted (SGLang's reset_for_retract) with more output
            back = queue[rng.randrange(len(queue))]
            back.output_ids.extend([rng.randrange(200)])
            back.reset_for_retract()
        elif action < 0.8:   # memory pressure: the least recently used leaves go, family prefixes too
            cache.tree.evict(EvictParams(num_tokens=rng.randrange(1, 120)))
        # else: an unchanged round
    return pol.sgl_tts, differ


@pytest.mark.parametrize("parents, rounds, seed, dedup", [(5, 25, 7, 32), (40, 60, 8, 32), (40, 60, 9, 32),
                                                          (40, 80, 10, 3)])
def test_the_cached_order_equals_a_fresh_order_over_random_rounds(parents, rounds, seed, dedup):
    """Every round the state carried across rounds (its cached plan, the buckets' families and their
    walks, the sorted sequences, the radix matches, kept across insertions while nothing was evicted)
    gives exactly what a fresh policy state gives on the same queue and cache (dedup 3: partial
    matches that grow past the threshold)."""
    state, differ = _random_rounds(parents, rounds, seed, dedup=dedup)
    assert differ == []
    assert state.sorts < state.rounds
    assert state.walks.hits > state.walks.misses > 0   # re-sorts reused most families' walks


def test_the_eviction_count_moves_on_every_removal_and_only_then():
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sgl_tts.plugin.scheduling import residency

    cache = Cache()
    policy_for(cache), policy_for(cache)             # two policies on one tree: wrapped once
    tree = cache.tree
    cache.insert(list(range(20)))
    cache.insert(list(range(10)) + [99] * 10)         # a split: content only grows
    assert getattr(tree, residency.EVICTIONS) == 0
    assert tree.evict(EvictParams(num_tokens=0)).num_tokens_evicted == 0
    assert getattr(tree, residency.EVICTIONS) == 0    # nothing freed, nothing counted
    tree.evict(EvictParams(num_tokens=5))             # one leaf of 10 tokens goes
    after_evict = getattr(tree, residency.EVICTIONS)
    assert after_evict > 0
    leaf = next(iter(tree.evictable_leaves))          # removed outside evict (as a session release does)
    cache.allocator.free(leaf.value)
    tree._delete_leaf(leaf)
    assert getattr(tree, residency.EVICTIONS) == after_evict + 1


def test_matches_kept_across_an_uncounted_eviction_would_order_wrongly():
    """The check above can fail: with evictions not counted, matches kept across them go stale and
    the carried order leaves the fresh one (a family whose prefix was evicted is not deferred)."""
    assert any(_random_rounds(40, 60, seed, count_evictions=False)[1] for seed in (8, 9))


# ------------------------------------------------------------------------------------- 7: priorities
@pytest.mark.parametrize("low_first", [False, True])
def test_priorities_order_work_inside_each_class(low_first):
    cache = Cache()
    pol = SchedulePolicy("fcfs", cache.tree, False, True, low_first)
    tts_policy.enable(pol, TTSSettings("prefix-aware", 10_000))   # no deferral here
    prompt = list(range(100, 140))

    def req(rid, prio, parent, cls="normal"):
        r = make_req(rid, prompt + [parent] * 3 + [hash(rid) % 50], SearchTag("g", 1, parent, int(rid[1:]), cls))
        r.priority = prio
        return r

    queue = [req("a0", 1, 0), req("a1", 1, 0), req("b2", 5, 1), req("b3", 5, 1), req("c4", 3, 2),
             req("s5", 9, 3, "speculative"), req("s6", 0, 3, "speculative"), req("x7", 5, 4, "boosted")]
    pol.calc_priority(queue)
    if low_first:
        assert rids(queue) == ["x7", "a0", "a1", "c4", "b2", "b3", "s6", "s5"]
    else:
        assert rids(queue) == ["x7", "b2", "b3", "c4", "a0", "a1", "s5", "s6"]


def test_num_matched_prefix_tokens_is_filled_for_v1_loads():
    """SGLang's load inquirer counts a waiting request's uncached tokens from its
    ``num_matched_prefix_tokens``; the plugin fills it before the read (stock lpm fills it at
    schedule time, the prefix-aware order does not need it)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler_components.load_inquirer import SchedulerLoadInquirer

    running, tree, allocator = decode_state(600, [([make_req("r", tokens(1, 10), SearchTag("x", 0, -1, 0))], 1)],
                                            fill=False)
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    prompt = tokens(60, 50)
    kv = allocator.alloc(50)
    tree.insert(InsertParams(key=RadixKey(array("q", prompt)), value=kv))
    waiting = [make_req(f"w{i}", prompt + [i, i], SearchTag("k", 0, -1, i)) for i in range(3)]
    s = scheduler_for(running, tree, allocator, waiting)
    fields = {f: None for f in SchedulerLoadInquirer.__dataclass_fields__}
    fields.update(disaggregation_mode=DisaggregationMode.NULL, get_waiting_queue=lambda: s.waiting_queue,
                  get_chunked_req=lambda: None)
    inquirer = SchedulerLoadInquirer(**fields)
    assert inquirer.get_num_waiting_uncached_tokens() == 3 * 52       # not known to this scheduler
    tts_policy.LOAD_INQUIRERS[id(inquirer)] = s
    try:
        assert inquirer.get_num_waiting_uncached_tokens() == 3 * 2    # 50 of each are cached
    finally:
        del tts_policy.LOAD_INQUIRERS[id(inquirer)]


# ------------------------------------------------------------------------------------ 9: starvation
@pytest.mark.parametrize("max_wait", [None, 3.0])
def test_an_adversarial_flood_cannot_starve_another_search_past_max_wait(max_wait):
    """Search F keeps one admission slot busy with requests continuing the last admitted prefix
    (the anchor rule picks them first); search V's request waits. Without aging it never gets in;
    with ``max_wait`` it is admitted in the first round after it has waited that long."""
    now = [0.0]
    cache = Cache()
    pol = SchedulePolicy("fcfs", cache.tree, False, False, False)
    state = tts_policy.enable(pol, TTSSettings("prefix-aware", 1000, max_wait=max_wait))
    state.clock = lambda: now[0]
    flood = [7] * 30
    victim = make_req("victim", [3] * 30 + [1], SearchTag("v", 0, -1, 0))
    queue = [victim]
    admitted_at = None
    last = make_req("f-start", flood, SearchTag("f", 0, -1, 0))
    for rnd in range(20):
        queue.append(make_req(f"f{rnd}", flood + [rnd % 5] * (rnd + 1), SearchTag("f", rnd + 1, 0, rnd)))
        pol.calc_priority(queue, ScheduleBatch(reqs=[last]))
        last = queue.pop(0)                       # one slot per round (SGLang admits in queue order)
        if last is victim:
            admitted_at = now[0]
            break
        now[0] += 1.0
    if max_wait is None:
        assert admitted_at is None                # the hazard the aging rule removes
    else:
        assert admitted_at == 3.0 and state.last_aged == 1


# ------------------------------------------------------------------ 10: the oldest search first
@pytest.mark.parametrize("admission", ["request", "search"])
def test_search_admission_puts_every_request_of_the_search_seen_first_before_a_later_one(admission):
    """Search O is seen first, then N. N's requests continue the running batch's last request, so the
    prefix walk (--tts-admission request) starts with them; with ``search`` all of O's go first, each
    search's families still together in key order. Aged requests (here N's waited longest): oldest
    first with ``request``, the oldest search's first with ``search``."""
    now = [0.0]
    cache = Cache()
    pol = SchedulePolicy("fcfs", cache.tree, False, False, False)
    state = tts_policy.enable(pol, TTSSettings("prefix-aware", 10_000, max_wait=5.0, admission=admission))
    state.clock = lambda: now[0]
    old, new = [3] * 30, [7] * 30
    pol.calc_priority([make_req("o-first", old + [5], SearchTag("o", 0, -1, 0))])   # O's rank: seen first
    n_reqs = [make_req(f"n{b}", new + [0, b], SearchTag("n", 1, 0, b)) for b in range(2)]
    pol.calc_priority(n_reqs[:])                                                     # N's, seen at 0
    now[0] = 1.0
    o_reqs = [make_req(f"o{b}", old + [b // 2, b], SearchTag("o", 1, b // 2, b)) for b in range(3)]
    anchor = ScheduleBatch(reqs=[make_req("n-run", new + [9])])
    queue = o_reqs[::-1] + n_reqs[::-1]
    pol.calc_priority(queue, anchor)
    fresh = ["n0", "n1", "o0", "o1", "o2"] if admission == "request" else ["o0", "o1", "o2", "n0", "n1"]
    assert rids(queue) == fresh and state.last_aged == 0
    now[0] = 5.5                                  # N's waited 5.5 s (aged), O's 4.5 s
    pol.calc_priority(queue, anchor)
    assert rids(queue) == ["n0", "n1", "o0", "o1", "o2"] and state.last_aged == 2
    now[0] = 6.5                                  # all aged: by age, or by search
    pol.calc_priority(queue, anchor)
    assert rids(queue) == (["n0", "n1", "o0", "o1", "o2"] if admission == "request" else fresh)
    assert state.last_aged == 5


def test_search_admission_is_a_flag_of_the_ordering_policies_only(monkeypatch):
    from sglang.srt.server_args import prepare_server_args

    settings = TTSSettings("locality", admission="search")
    assert settings.by_search and "--tts-admission search" in " ".join(settings.args())
    assert TTSSettings.from_env(settings.env()) == settings
    assert "--tts-admission" not in TTSSettings("prefix-aware").args()
    with pytest.raises(ValueError, match="--tts-admission search orders the waiting queue and needs --tts-policy "
                                         "prefix-aware or locality \\(the server runs --tts-policy off\\)"):
        TTSSettings(admission="search")
    with pytest.raises(ValueError, match="--tts-admission must be one of request, search, got 'family'"):
        TTSSettings("prefix-aware", admission="family")
    # launch_server's own parser: the flag lands on ServerArgs and in the children's environment
    for var in TTSSettings().env():
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    sa = prepare_server_args(["--model-path", "dummy", "--tts-policy", "prefix-aware", "--tts-admission", "search"])
    assert TTSSettings.of(sa) == TTSSettings("prefix-aware", admission="search")
    assert os.environ["SGLANG_TTS_ADMISSION"] == "search"
    monkeypatch.delenv("SGLANG_TTS_POLICY")           # (the first server's mirror would be the default)
    with pytest.raises(ValueError, match="--tts-admission search orders the waiting queue"):
        prepare_server_args(["--model-path", "dummy", "--tts-admission", "search"])


# ------------------------------------------------------------------------- 12: mixed-depth queues
def test_siblings_stay_together_when_a_deeper_request_shares_more_with_one_of_them():
    cache = Cache()
    pol = policy_for(cache, settings=TTSSettings("prefix-aware", 10_000))
    x = list(range(10, 40))
    a = make_req("a", x + [1, 2, 3, 4], SearchTag("t", 2, 5, 0))        # children of node 5 at depth 2
    b = make_req("b", x + [9, 9], SearchTag("t", 2, 5, 1))
    deep = make_req("deep", x + [1, 2, 3, 8, 8, 8], SearchTag("t", 3, 0, 7))   # goes through a's first tokens
    queue = [deep, b, a]
    pol.calc_priority(queue)
    # greedy alone gives a, deep, b (deep shares 33 tokens with a, b only 30)
    assert rids(queue) == ["a", "b", "deep"]


def test_families_are_contiguous_in_random_mcts_like_queues():
    rng = random.Random(4)
    for trial in range(60):
        nodes = {0: [1, 2, 3]}
        for node in range(1, 12):
            parent = rng.randrange(node)
            nodes[node] = nodes[parent] + [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
        queue, fam = [], {}
        for i in range(rng.randrange(2, 25)):
            parent = rng.randrange(12)
            depth = len(nodes[parent])
            r = make_req(f"q{i}", nodes[parent] + [rng.randrange(4) for _ in range(rng.randrange(1, 4))],
                         SearchTag("t", depth, parent, i))
            fam[r.rid] = parent
            queue.append(r)
        pol = policy_for(Cache(), settings=TTSSettings("prefix-aware", 10_000))
        anchor = rng.choice([None, ScheduleBatch(reqs=[make_req("run", nodes[rng.randrange(12)])])])
        pol.calc_priority(queue, anchor)
        runs = [p for p, _ in itertools.groupby(fam[r.rid] for r in queue)]
        assert len(runs) == len(set(runs)), f"siblings split in trial {trial}: {runs}"
        for _, members in itertools.groupby(queue, key=lambda r: fam[r.rid]):   # greedy inside a family
            members = list(members)
            rest = list(members)
            for prev, cur in zip(members, members[1:]):
                rest.remove(prev)
                assert lcp(seq(prev), seq(cur)) == max(lcp(seq(prev), seq(o)) for o in rest)


# ------------------------------------------------------------------ 10 and 13: hooks really in place
def test_every_hook_of_the_plugin_is_in_place_in_this_process():
    from sgl_tts.plugin import TARGETS, hook_table, missing_hooks

    assert missing_hooks() == []
    assert set(TARGETS.values()) <= {t for t, _, _ in hook_table()}   # every target, not 2 of them


BROKEN = """
import sys
import sgl_tts.plugin as plugin
plugin.TARGETS["calc_priority"] = "sglang.srt.managers.schedule_policy.SchedulePolicy.no_such_method"
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import prepare_server_args
prepare_server_args(["--model-path", "dummy"] + sys.argv[1:])
print("SERVED")
"""


def test_a_server_whose_hooks_did_not_attach_refuses_to_start_under_tts_flags():
    env = {k: v for k, v in os.environ.items() if "TTS_" not in k}
    run = lambda a: subprocess.run([sys.executable, "-c", BROKEN, *a], capture_output=True, text=True,  # noqa: E731
                                   timeout=300, env=env)
    # both processes at once: each spends its time importing sglang on one core
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bad, stock = pool.map(run, [("--tts-policy", "prefix-aware"), ()])
    assert bad.returncode != 0 and "SERVED" not in bad.stdout
    assert "hooks are not in place on sglang.srt.managers.schedule_policy.SchedulePolicy.no_such_method" in bad.stderr
    assert "Refusing to serve stock scheduling under sgl-tts flags" in bad.stderr
    # no --tts-* flag: stock SGLang, as the docs promise
    assert stock.returncode == 0 and "SERVED" in stock.stdout, stock.stderr[-2000:]


def test_a_malformed_tag_is_untagged_and_never_crashes_the_scheduler():
    """``{"tts_depth": Infinity}`` is valid JSON for a client (and a float for SGLang's
    custom_params): ``int(inf)`` raises OverflowError, which inside calc_priority would kill the
    scheduler process. Such a request is untagged; a set_class with such a beam is refused."""
    from sglang.srt.managers.io_struct import SetInternalStateReq
    from sglang.srt.managers.scheduler import Scheduler

    bad = make_req("bad", [1, 2, 3])
    bad.sampling_params.custom_params = {"tts_group": "g", "tts_depth": float("inf")}
    assert tts_policy.tag_of(bad) is None and tts_policy.request_class(bad) == "normal"
    queue = [bad, make_req("ok", [4, 5], SearchTag("g", 0, -1, 0))]
    policy_for(Cache()).calc_priority(queue)
    assert sorted(rids(queue)) == ["bad", "ok"]
    sched = object.__new__(Scheduler)
    sched.waiting_queue, sched.running_batch, sched.enable_priority_scheduling = queue, ScheduleBatch(reqs=[]), False
    out = Scheduler.set_internal_state(sched, SetInternalStateReq(
        server_args={"tts_set_class": {"group": "g", "cls": "boosted", "beams": [float("inf")]}}))
    assert not out.updated and "error" in out.server_args["tts_set_class"]


# ------------------------------------------------- the tag in the rid (requests through sglang-router)
def test_a_request_id_carries_its_whole_tag():
    plain = SearchTag("g1", 3, -1, 2)
    rid = plain.request_id()
    assert rid.startswith("tts/g1/3/2/") and rid.endswith("#tag=3,-1,2,normal") and len(rid) == len("tts/g1/3/2/") + 8 + 18
    assert plain.request_id() != rid                                     # unique per request
    assert SearchTag.from_rid(rid) == plain
    assert SearchTag("g1", 3, -1, 2).request_id("7").startswith("tts/g1/3/2/7/")
    spec = SearchTag("g1", 2, 1, 2_000_001, "speculative", ordinal=1)
    rid = spec.request_id(prefix="tts/g1/2/spec1/1/")
    assert rid.startswith("tts/g1/2/spec1/1/") and rid.endswith("#tag=2,1,2000001,speculative,1")
    assert SearchTag.from_rid(rid) == spec
    # anything else is untagged, never an error
    for other in (None, 17, "chatcmpl-1", "tts/g1/3/2/abc", "x/g1/0/0/a#tag=0,-1,0,normal", "tts/g1/0/0/a#tag=0,-1,0",
                  "tts/g1/0/0/a#tag=0,-1,x,normal", "tts/g1/0/0/a#tag=0,-1,0,gold", "tts//0/0/a#tag=0,-1,0,normal",
                  "tts/g1/0/0/a#tag=0,-1,0,normal,1,2"):
        assert SearchTag.from_rid(other) is None, other


def test_requests_that_lost_custom_params_are_ordered_and_reclassed_by_their_rid():
    """sglang-router 0.3.2 forwards the rid and drops ``custom_params``: the same requests with and
    without them get the same order, the same classes, and a class change finds them."""
    from sglang.srt.managers.scheduler import Scheduler

    rng = random.Random(3)
    prompt = tokens(5, 40)
    tags = [SearchTag("g", 1, p, p * 3 + c) for p in range(4) for c in range(3)] + \
           [SearchTag("g", 1, 0, 1_000_000 + j, "speculative", ordinal=j) for j in range(2)] + \
           [SearchTag("h", 0, -1, b) for b in range(3)]
    rid_of = {t: t.request_id() for t in tags}
    body = {t: prompt + [t.parent % 200 + 1] * 4 + tokens(t.beam % 97, 6) for t in tags}

    def queue(with_params: bool):
        reqs = [make_req(rid_of[t], body[t], t) for t in tags]
        if not with_params:
            for r in reqs:
                r.sampling_params.custom_params = None
        return reqs

    arrival = list(range(len(tags)))
    rng.shuffle(arrival)
    tagged, routed = queue(True), queue(False)
    tagged, routed = [tagged[i] for i in arrival], [routed[i] for i in arrival]
    policy_for(Cache()).calc_priority(tagged)
    policy_for(Cache()).calc_priority(routed)
    assert rids(routed) == rids(tagged)
    by_rid = {rid_of[t]: t for t in tags}
    # the order is the search's (speculative last, siblings together), not the arrival order
    assert [by_rid[r].cls for r in rids(routed)][-2:] == ["speculative", "speculative"]
    families = [k for k, _ in itertools.groupby((by_rid[r].group, by_rid[r].parent) for r in rids(routed)[:-2])]
    assert len(families) == len(set(families)) == 5
    assert [tts_policy.request_class(r) for r in routed] == [by_rid[r.rid].cls for r in routed]
    # a class change on requests tagged by their rid alone
    sched = object.__new__(Scheduler)
    sched.waiting_queue, sched.running_batch, sched.enable_priority_scheduling = routed, ScheduleBatch(reqs=[]), False
    assert reclass.set_class(sched, "h", "boosted", beams=[2]) == 1
    moved = next(r for r in routed if r.rid == rid_of[SearchTag("h", 0, -1, 2)])
    assert tts_policy.tag_of(moved) == SearchTag("h", 0, -1, 2, "boosted")
    assert moved.sampling_params.custom_params == SearchTag("h", 0, -1, 2, "boosted").custom_params()
    policy_for(Cache()).calc_priority(routed)
    assert routed[0] is moved
