"""Engine replicas: the prefix router against a re-derivation of its rule, and real engines in
processes that sample what one engine samples."""

from __future__ import annotations

import random

import pytest

from sgl_tts import LocalBackend
from sgl_tts.backends.engine import SamplingSpec
from sgl_tts.backends.replicas import PrefixRouter, block_keys
from sgl_tts.experiment import RunConfig
from sgl_tts.models import shipped_model
from sgl_tts.tiny import task
from search_outcomes import assert_same_outcomes, search_outcomes


def _common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class ReferenceRouter:
    """The rule as the module states it, computed from whole prompts (no hashing, no memory bound):
    an engine has seen a prefix in whole blocks of ``block`` tokens if a prompt sent to it before
    starts with it. Follow the engines with the longest such prefix if it is non-empty and covers at
    least ``share`` of the prompt, keeping those at most ``imbalance`` requests busier than the least
    busy engine; else (or if none is kept) all engines. Of those, the least busy, lowest index first."""

    def __init__(self, engines, block, share, imbalance):
        self.sent = [[] for _ in range(engines)]
        self.loads = [0] * engines
        self.block, self.share, self.imbalance = block, share, imbalance

    def choose(self, ids):
        seen = [max((_common(ids, p) // self.block * self.block for p in sent), default=0) for sent in self.sent]
        best, least = max(seen), min(self.loads)
        keep = [e for e, s in enumerate(seen) if s == best and self.loads[e] <= least + self.imbalance]
        if not (keep and best > 0 and best >= self.share * len(ids)):
            keep = list(range(len(self.loads)))
        engine = min(keep, key=lambda e: (self.loads[e], e))
        self.sent[engine].append(list(ids))
        self.loads[engine] += 1
        return engine


def test_block_keys_name_whole_block_prefixes():
    a = list(range(40))
    b = list(range(16)) + [99] + list(range(17, 40))
    assert len(block_keys(a, 16)) == 2 and len(block_keys(a[:15], 16)) == 0
    assert block_keys(a, 16)[0] == block_keys(b, 16)[0]       # the first 16 tokens agree
    assert block_keys(a, 16)[1] != block_keys(b, 16)[1]       # token 16 differs
    assert block_keys(a + [1, 2], 16) == block_keys(a, 16)    # a partial block adds no key
    # a block's key depends on every block before it
    c = [7] + list(range(1, 40))
    assert block_keys(c, 16)[1] != block_keys(a, 16)[1]


def test_a_fork_stays_together_and_problems_spread():
    r = PrefixRouter(2, block=4)
    p, q = [1] * 12, [2] * 12
    assert [r.choose(p) for _ in range(5)] == [0, 0, 0, 0, 0]   # siblings follow the first
    assert r.choose(q) == 1                                      # a new problem: the least busy
    assert r.choose(p + [3] * 4) == 0                            # a step extending p: where p ran
    assert r.choose(p[:4] + [5] * 12) == 1    # 4 of 16 tokens seen on engine 0: too little to follow
    assert (r.followed, r.balanced) == (5, 3)
    for _ in range(6):
        r.done(0)
    assert r.loads == [0, 2]


def test_a_shared_template_stops_deciding_once_the_loads_drift_apart():
    template = list(range(100, 124))                 # 24 tokens of 28: it alone passes the share rule
    r = PrefixRouter(2, block=4, max_imbalance=3)
    got = [r.choose(template + [k] * 4) for k in range(8)]
    # 0 takes the first four (a 3-request lead allowed), the fifth goes to 1 and brings the template
    # there, then the loads decide
    assert got == [0, 0, 0, 0, 1, 1, 1, 1]


def test_the_router_follows_its_rule_on_random_traffic():
    rng = random.Random(7)
    for trial in range(40):
        engines, block = rng.choice([2, 3]), rng.choice([2, 4])
        share, imbalance = rng.choice([0.0, 0.5, 0.9]), rng.choice([0, 2, 5])
        ours = PrefixRouter(engines, block=block, min_match_share=share, max_imbalance=imbalance)
        ref = ReferenceRouter(engines, block, share, imbalance)
        templates = [[rng.randrange(4) for _ in range(rng.randrange(0, 9))] for _ in range(3)]
        prompts: list[list[int]] = []
        in_flight: list[int] = []
        for step in range(60):
            if in_flight and rng.random() < 0.4:             # a request finishes
                e = in_flight.pop(rng.randrange(len(in_flight)))
                ours.done(e)
                ref.loads[e] -= 1
                continue
            if prompts and rng.random() < 0.6:               # a sibling or an extension of one before
                ids = rng.choice(prompts) + [rng.randrange(3) for _ in range(rng.choice([0, 1, 5, 12]))]
            else:                                            # a new problem, maybe after a template
                ids = rng.choice(templates) + [rng.randrange(4) for _ in range(rng.randrange(1, 14))]
            prompts.append(ids)
            want = ref.choose(ids)
            assert ours.choose(ids) == want, (trial, step, ids)
            in_flight.append(want)
        assert ours.loads == ref.loads


def test_the_router_forgets_the_least_recently_used_prefixes_first():
    r = PrefixRouter(2, block=2, max_blocks=2)
    a, b = [1, 1, 1, 1], [2, 2, 2, 2]
    assert r.choose(a) == 0 and r.choose(b) == 1
    r.done(0)
    r.done(1)
    assert r.choose(a) == 0                     # remembered
    assert r.choose([3, 3, 3, 3, 3, 3]) == 1    # engine 1's memory now holds [3, 3] blocks only
    r.done(0)
    r.done(1)
    assert r.matched_blocks(1, block_keys(b, 2)) == 0
    assert r.choose(b) == 0                     # b is no longer seen anywhere: least busy, lowest index
    # seeing a prefix again makes it the most recently used
    one = PrefixRouter(1, block=2, max_blocks=3)
    for ids in (a, [2, 2], a, [3, 3]):
        one.choose(ids)
    assert one.matched_blocks(0, block_keys(a, 2)) == 2
    assert one.matched_blocks(0, block_keys([2, 2], 2)) == 0


def test_bad_router_settings_are_refused():
    with pytest.raises(ValueError, match="at least one engine, got 0"):
        PrefixRouter(0)
    with pytest.raises(ValueError, match="min_match_share in"):
        PrefixRouter(2, min_match_share=1.5)
    with pytest.raises(ValueError, match="replicas=2 needs engine_in='process'"):
        LocalBackend(shipped_model("generator"), replicas=2)
    with pytest.raises(ValueError, match="replicas must be at least 1, got 0"):
        LocalBackend(shipped_model("generator"), replicas=0, engine_in="process")


def test_replicas_sample_what_one_engine_samples():
    """Two engine processes keep beam search's beams, scores and answers, and best-of-N's samples,
    equal to one thread engine's; the work is spread over both and the counters add up."""
    problems = task.test_split()[:4]
    outcomes, stats = {}, {}
    for replicas in (1, 2):
        gen = LocalBackend(shipped_model("generator"), seed=0, engine_in="thread" if replicas == 1 else "process",
                           replicas=replicas)
        prm_backend = LocalBackend(shipped_model("prm"), seed=0)
        try:
            for program in ("beam_search", "best_of_n"):
                cfg = RunConfig(program=program, n=4, beam_width=2, max_depth=6)
                outcomes[(replicas, program)] = search_outcomes(cfg, problems, gen, prm_backend, in_flight=4)
            if replicas == 2:
                router = gen.engine.router
                per_engine = [e.stats.requests for e in gen.engine.engines]
                stats = {"total": gen.engine.stats.requests, "per_engine": per_engine,
                         "routed": router.followed + router.balanced, "loads": list(router.loads)}
                again = gen.engine.generate(gen.encode(problems[0].question), SamplingSpec(max_new_tokens=3, seed=1))
                assert again.meta_info["completion_tokens"] == 3
        finally:
            gen.shutdown()
            prm_backend.shutdown()
    for program in ("beam_search", "best_of_n"):
        assert_same_outcomes(outcomes[(2, program)], outcomes[(1, program)], program)
        assert len(outcomes[(2, program)]) == 4
    assert stats["total"] == sum(stats["per_engine"]) == stats["routed"]
    assert min(stats["per_engine"]) > 0          # both engines worked
    assert stats["loads"] == [0, 0]              # every finished request was counted out
