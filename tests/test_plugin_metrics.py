"""The plugin's scheduler metrics: recomputed-block counting with chained block hashes (linear in a
request's length) against the definition, and which flags switch metrics on."""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

from sgl_tts.plugin.metrics import SchedulerMetrics


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
