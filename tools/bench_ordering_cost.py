"""Cost per scheduling round of the prefix-aware order (``SchedulePolicy.calc_priority`` with the
plugin's hook) against SGLang's real ``RadixCache`` on CPU pools, vs the waiting-queue size.

    ./dev.sh run python tools/bench_ordering_cost.py [--sizes 100 500 1000 2000 5000] [--tokens 1500]

Workload: a beam-search depth as the scheduler sees it: parents with 16 children each, every
request ``--tokens`` long (a 300-token prompt, the parent's path, 100 tokens of its own step); the
parents' paths are in the radix cache (they were generated), the children's steps are not; one
running request anchors the order. Per queue size, milliseconds per round:

- **first**: the first order of the queue;
- **unchanged**: a round on the same queue (nothing admitted, nothing arrived: what happens every
  decode step while siblings wait), median of 7;
- **arrival**: a round after one new request arrived;
- **admitted**: a round after the first 16 requests were admitted and their prefill cached;
- **mixed**: a round after a few admissions (2, their prefill cached) and a few arrivals (2 more
  children of the same depth), median of 7 such rounds: a busy server's common changed round.

Uses only APIs the plugin has had from the start (``policy.enable``, ``calc_priority``), so the same
script measures an older checkout: ``PYTHONPATH=<old checkout> ./dev.sh run python tools/...``.
Results: docs/benchmarks/plugin_costs.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from array import array


def build(n: int, tokens: int, seed: int = 0):
    import torch
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sgl_tts.protocol import SearchTag

    rng = random.Random(seed)
    allocator = TokenToKVPoolAllocator(size=n * 200 + 4 * tokens * max(1, n // 16) + 100_000, dtype=torch.float16,
                                       device="cpu", kvcache=None, need_sort=False)
    pool = ReqToTokenPool(size=64, max_context_len=tokens + 16, device="cpu", enable_memory_saver=False)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator,
                                      page_size=1))

    def insert(ids):
        ids = array("q", ids)
        kv = allocator.alloc(len(ids))
        res = tree.insert(InsertParams(key=RadixKey(ids), value=kv))
        if res.prefix_len:
            allocator.free(kv[:res.prefix_len])

    def req(rid, ids, tag):
        return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", ids),
                   sampling_params=SamplingParams(max_new_tokens=64, custom_params=tag.custom_params()),
                   vocab_size=300)

    prompt = [rng.randrange(280) for _ in range(300)]
    reqs = []
    for p in range(max(1, n // 16)):
        path = prompt + [rng.randrange(280) for _ in range(tokens - 400)]
        insert(path)
        for c in range(16):
            reqs.append(req(f"tts/g{p % 8}/3/{p * 16 + c}", path + [rng.randrange(280) for _ in range(100)],
                            SearchTag(f"g{p % 8}", 3, p, p * 16 + c)))
    rng.shuffle(reqs)
    running = ScheduleBatch(reqs=[reqs.pop()])
    extra = req("tts/new/0/0", prompt + [rng.randrange(280) for _ in range(tokens - 300)], SearchTag("new"))
    return tree, reqs[:n], running, extra, insert


def measure(n: int, tokens: int) -> dict:
    from sglang.srt.managers.schedule_policy import SchedulePolicy
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from sgl_tts.plugin.scheduling import policy as tts_policy
    from sgl_tts.plugin.settings import TTSSettings

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=1, attention_backend="torch_native"))
    tree, queue, running, extra, insert = build(n + 32, tokens)
    later = queue[n:]            # arrivals of the mixed rounds: more children of the same depth
    del queue[n:]
    pol = SchedulePolicy("fcfs", tree, False, False, False)
    tts_policy.enable(pol, TTSSettings("prefix-aware", 32))

    def timed():
        t = time.perf_counter()
        pol.calc_priority(queue, running)
        return (time.perf_counter() - t) * 1e3

    first = timed()
    unchanged = statistics.median(timed() for _ in range(7))
    queue.append(extra)
    arrival = timed()
    for r in queue[:16]:     # admitted: their prefill enters the cache, they leave the queue
        insert(list(r.origin_input_ids))
    del queue[:16]
    admitted = timed()
    mixed = []
    for _ in range(7):
        for r in queue[:2]:
            insert(list(r.origin_input_ids))
        del queue[:2]
        queue += [later.pop(), later.pop()]
        mixed.append(timed())
    return {"waiting": n, "tokens": tokens, "first_ms": first, "unchanged_ms": unchanged,
            "arrival_ms": arrival, "admitted_ms": admitted, "mixed_ms": statistics.median(mixed)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 500, 1000, 2000, 5000])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--json", action="store_true", help="print one JSON object per size")
    args = parser.parse_args(argv)
    from sglang.srt.managers.schedule_policy import SchedulePolicy
    from sglang.srt.plugins import load_plugins

    load_plugins()   # as every scheduler process does: the plugin's hooks are applied
    if not hasattr(SchedulePolicy.calc_priority, "__wrapped__"):
        parser.error("the sgl-tts plugin's hook on SchedulePolicy.calc_priority is not in place")
    import sgl_tts

    print(f"# sgl_tts from {sgl_tts.__file__}")
    if not args.json:
        print(f"{'waiting':>8} {'first':>9} {'unchanged':>10} {'arrival':>9} {'admitted':>9} {'mixed':>9}  (ms per round)")
    for n in args.sizes:
        row = measure(n, args.tokens)
        if args.json:
            print(json.dumps(row))
        else:
            print(f"{n:>8} {row['first_ms']:>9.1f} {row['unchanged_ms']:>10.2f} {row['arrival_ms']:>9.1f} "
                  f"{row['admitted_ms']:>9.1f} {row['mixed_ms']:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
