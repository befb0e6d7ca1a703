"""Benchmark: one layer's attention, SGLang's ``torch_native`` against the plugin's ragged backend.

The shapes of the tiny generator under a tree search (4 query heads, 2 KV heads, head dim 64, float32;
``--rows`` sequences with contexts drawn from [60, 160) at scattered pool slots), timed in this
process on SGLang's real ``TorchNativeAttnBackend`` and on ``sgl_tts.plugin.attention.cpu_attention``:

- the key gather: 2-D advanced indexing (``k_cache[index]``) against ``cpu_attention.gather``;
- a decode step (one query per row);
- a one-token extend of every row (a beam step: the prompt cached but its last token).

Each figure is the median of ``--repeats`` timings of one call. Prints a Markdown table and writes it
with the machine and date to ``--out`` (JSON) when given.

    ./dev.sh run python benchmarks/cpu_attention.py --out docs/benchmarks/cpu_attention.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import sys
import time

import torch

from sgl_tts.machine import describe
from sgl_tts.plugin.attention.cpu_attention import backend_class, gather

HEADS, KV_HEADS, DIM, POOL = 4, 2, 64, 80_000


def timed(fn, repeats: int) -> float:
    """Median milliseconds of one call (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def batch(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(POOL, KV_HEADS, DIM, generator=g)
    v = torch.randn(POOL, KV_HEADS, DIM, generator=g)
    lengths = torch.randint(60, 160, (rows,), generator=g)
    slots = torch.randperm(POOL, generator=g)
    table = torch.zeros(rows, 512, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lengths.tolist()):
        table[i, :n] = slots[used:used + n]
        used += n
    return k, v, table, torch.arange(rows), lengths


def measure(rows: int, repeats: int) -> dict:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    native = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)   # the sdpa loops use no runner state
    ragged_cls = backend_class()
    k, v, table, pool_rows, lengths = batch(rows)
    q = torch.randn(rows, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    out = torch.empty_like(q)
    index = table[:, :int(lengths.max())]
    one = torch.ones(rows, dtype=torch.int64)

    def ragged():   # a fresh backend per call: its plan is made every time, as at a forward's first layer
        return ragged_cls.__new__(ragged_cls)

    return {
        "rows": rows,
        "gather_indexing_ms": timed(lambda: k[index], repeats),
        "gather_index_select_ms": timed(lambda: gather(k, index), repeats),
        "decode_native_ms": timed(lambda: native._run_sdpa_forward_decode(
            q, out, k, v, table, pool_rows, lengths, enable_gqa=True), repeats),
        "decode_ragged_ms": timed(lambda: ragged()._run_sdpa_forward_decode(
            q, out, k, v, table, pool_rows, lengths, enable_gqa=True), repeats),
        "extend1_native_ms": timed(lambda: native._run_sdpa_forward_extend(
            q, out, k, v, table, pool_rows, lengths, lengths - one, one, enable_gqa=True, causal=True), repeats),
        "extend1_ragged_ms": timed(lambda: ragged()._run_sdpa_forward_extend(
            q, out, k, v, table, pool_rows, lengths, lengths - one, one, enable_gqa=True, causal=True), repeats),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="32,100,250", help="batch sizes, comma-separated")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)   # as the CPU servers run (OMP_NUM_THREADS=1, sgl_tts.launch.cpu_serving)
    results = [measure(int(r), args.repeats) for r in args.rows.split(",")]
    print("| rows | gather: indexing / index_select (ms) | decode: native / ragged (ms) | one-token extend: native / ragged (ms) |")
    print("| ---: | --- | --- | --- |")
    for r in results:
        print(f"| {r['rows']} | {r['gather_indexing_ms']:.2f} / {r['gather_index_select_ms']:.2f} | "
              f"{r['decode_native_ms']:.2f} / {r['decode_ragged_ms']:.2f} | "
              f"{r['extend1_native_ms']:.2f} / {r['extend1_ragged_ms']:.2f} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"machine": describe(), "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                       "command": "python benchmarks/cpu_attention.py " + shlex.join(argv),
                       "torch_threads": 1, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
