"""Cost of the plugin's recomputed-block accounting per prefill batch: the old per-prefix hashing
(quadratic in a request's length, kept here for comparison) vs the chained block ids of
:class:`sgl_tts.plugin.scheduling.metrics.SchedulerMetrics` (linear).

    ./dev.sh run python tools/bench_metrics_hash.py [--requests 64] [--tokens 4000] [--repeats 7]

Prints one line per prompt length: milliseconds per prefill batch (the minimum over repeats, a
fresh metrics object each time), both ways, and checks that both count the same recomputed blocks.
Results: docs/benchmarks/plugin_costs.md.
"""

from __future__ import annotations

import argparse
import random
import time
from array import array
from collections import OrderedDict
from types import SimpleNamespace

from sgl_tts.plugin.scheduling.metrics import MAX_SEEN, SchedulerMetrics, prefix_bytes
from sgl_tts.plugin.scheduling.ordering import as_bytes


class OldBlocks:
    """``SchedulerMetrics._blocks`` and its caller's token handling before the chained ids."""

    def __init__(self, block_tokens: int = 16):
        self.block_tokens = block_tokens
        self._seen: OrderedDict[int, None] = OrderedDict()

    def request(self, req, cached: int, computed: int) -> int:
        tokens = list(req.origin_input_ids) + list(req.output_ids)
        return self._blocks(tokens[:cached + computed], cached)

    def _blocks(self, tokens: list[int], cached: int) -> int:
        data = as_bytes(tokens)
        b = self.block_tokens * 8
        recomputed = 0
        for end in range(b, len(data) + 1, b):
            h = hash(data[:end])
            if end // 8 > cached and h in self._seen:
                recomputed += 1
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)
        return recomputed


def batch(n_requests: int, n_tokens: int, seed: int = 0):
    """Siblings of a tree search: one shared prompt of ``n_tokens - 200`` tokens, then 200 tokens of
    their own (output so far); nothing cached, so every block is hashed and looked up."""
    rng = random.Random(seed)
    shared = [rng.randrange(150_000) for _ in range(n_tokens - 200)]
    reqs = []
    for i in range(n_requests):
        own = [rng.randrange(150_000) for _ in range(200)]
        reqs.append(SimpleNamespace(rid=f"r{i}", origin_input_ids=array("q", shared),
                                    output_ids=array("q", own), prefix_indices=[],
                                    extend_range=SimpleNamespace(start=0, end=n_tokens)))
    return reqs


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print(f"{'tokens':>7} {'old ms/batch':>13} {'new ms/batch':>13} {'new on_prefill ms':>18} {'speed-up':>9}")
    for n in args.tokens:
        reqs = batch(args.requests, n)

        def old():
            o = OldBlocks()
            return sum(o.request(r, 0, n) for r in reqs)

        def new():
            m = SchedulerMetrics()
            return sum(m._blocks(prefix_bytes(r, n), 0) for r in reqs)

        def whole():
            return SchedulerMetrics().on_prefill(reqs, waiting=0, running=0)["recomputed_blocks"]

        assert old() == new() == whole(), "the two ways count different recomputed blocks"
        t_old, t_new, t_whole = best_ms(old, args.repeats), best_ms(new, args.repeats), best_ms(whole, args.repeats)
        print(f"{n:>7} {t_old:>13.1f} {t_new:>13.1f} {t_whole:>18.1f} {t_old / t_new:>8.1f}x")


if __name__ == "__main__":
    main()
