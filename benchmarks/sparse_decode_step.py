"""Benchmark: one layer's decode attention at long contexts, dense against sparse (issue 36, seed 003).

In this process, on the plugin's own code with SGLang's tensor layout (a KV pool, ``req_to_token``,
pool indices, lengths; each row's context at scattered slots), the tiny generator's attention shapes
(4 query heads, 2 KV heads, head dim 64, float32): ``--rows`` rows at each ``--contexts`` length, one
layer, a budget of ``--budget`` of the context. Sides:

- ``dense``: the ragged backend's decode (``cpu_attention.decode_rows``), what a server without the
  sparse flag runs;
- ``dense-heads``: the same attention with the keys and values gathered per head
  (``sparse_decoding.gather_heads``, the layout the sparse sides read), to tell the layout's share of
  a difference from the sparsity's;
- ``sync``: token-level top-k from the current query, chosen inside the step;
- ``quest``: Quest's 16-token pages from the current query, inside the step (its page bounds computed
  from the keys each step: Quest keeps them incrementally, so this side's time is an upper bound);
- ``async``: the step attends to the selection the worker thread made beside the previous step and
  hands it the next one; the step never waits for it.

Each step grows every row by one token, as decoding does. Reported per side: the step's median
milliseconds on the calling thread (what the forward pass waits for), and for ``async`` the share of
steps whose selection was late and the worker's seconds per selection job. This is the attention of
one layer, not a whole forward pass: the served time per output token (parameters and every layer
included) at these contexts is still to be measured on a server.

    ./dev.sh run python benchmarks/sparse_decode_step.py --out docs/benchmarks/sparse_decode_step.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEADS, KV, DIM = 4, 2, 64


def run_side(side: str, context: int, rows: int, budget: float, steps: int, seed: int = 0) -> dict:
    import torch

    from sgl_tts.plugin.attention import cpu_attention
    from sgl_tts.plugin.settings import SparseSettings
    from sgl_tts.plugin.attention.sparse_attention import SparseDecoder

    torch.manual_seed(seed)
    width = context + steps + 4
    capacity = rows * width
    k = torch.randn(capacity, KV, DIM)
    v = torch.randn(capacity, KV, DIM)
    req_to_token = torch.randperm(capacity).view(rows, width)   # scattered, as a pool after churn
    slots = torch.arange(rows)
    lengths = torch.full((rows,), context)
    scale = DIM ** -0.5
    decoder = None
    if side not in ("dense", "dense-heads"):
        decoder = SparseDecoder(SparseSettings(side, budget=budget, dense_below=1, dense_layers=0)).bind(rows)
        # the prompt's last queries, as a prefill records them
        decoder.record_extend(0, torch.randn(rows * 17, HEADS, DIM), slots, lengths, torch.full((rows,), 17))
    times = []
    with torch.no_grad():
        for step in range(steps + 3):
            lengths = lengths + 1
            query = torch.randn(rows, HEADS, DIM)
            out = torch.empty(rows, HEADS, DIM)

            def dense(idx):
                part = out.new_empty((len(idx),) + tuple(out.shape[1:]))
                cpu_attention.decode_rows(query[idx], part, k, v, req_to_token, slots[idx], lengths[idx],
                                          scale=scale, enable_gqa=True)
                out[idx] = part

            t0 = time.perf_counter()
            if side == "dense-heads":
                from sgl_tts.plugin.attention.sparse_decoding import gather_heads

                index = req_to_token[slots, :int(lengths.max())]     # every row as long: no mask
                out = torch.nn.functional.scaled_dot_product_attention(
                    query.view(rows, KV, HEADS // KV, DIM), gather_heads(k, index), gather_heads(v, index),
                    scale=scale).view(rows, HEADS, DIM)
            elif decoder is None:
                dense(slots)
            else:
                decoder.decode(0, query, out, k, v, req_to_token, slots, lengths, scale, dense)
            if step >= 3:           # the first steps: caches warm, async's first selections made
                times.append(time.perf_counter() - t0)
            if side == "async" and step < 2:
                decoder.wait_idle(60)
    rec = {"side": side, "context": context, "rows": rows, "budget": budget, "steps": steps,
           "step_ms": round(1000 * statistics.median(times), 3)}
    if decoder is not None:
        c = decoder.counters
        rec["attended_share"] = round(c.attended_tokens / max(1, c.context_tokens), 3)
        if side == "async":
            decoder.wait_idle(60)
            rec["late_share"] = round(c.late / max(1, c.sparse_rows), 3)
            rec["missing"] = c.missing
            rec["worker_ms_per_job"] = round(1000 * c.selection_seconds / max(1, c.selections // rows), 3)
        decoder.close()
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="2048,4096,8192,16384,32768")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sides", default="dense,dense-heads,sync,quest,async")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    from sgl_tts.machine import describe

    torch.set_num_threads(1)        # the scheduler's thread; async's worker is the second core
    records = []
    for rows in [int(x) for x in args.rows.split(",")]:
        for context in [int(x) for x in args.contexts.split(",")]:
            for side in args.sides.split(","):
                rec = run_side(side, context, rows, args.budget, args.steps)
                records.append(rec)
                print(json.dumps(rec), flush=True)
    meta = {"machine": describe(), "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python " + " ".join(sys.argv),
            "revision": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(), "torch_threads": 1}
    print(table(records))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")


def table(records: list[dict]) -> str:
    sides = list(dict.fromkeys(r["side"] for r in records))
    lines = ["| rows | context | " + " | ".join(f"{s} ms" for s in sides) + " | dense / async | async late | worker ms per job |",
             "| --- | --- | " + " | ".join("---" for _ in sides) + " | --- | --- | --- |"]
    keys = list(dict.fromkeys((r["rows"], r["context"]) for r in records))
    for rows, context in keys:
        by = {r["side"]: r for r in records if (r["rows"], r["context"]) == (rows, context)}
        ratio = (f"{by['dense']['step_ms'] / by['async']['step_ms']:.2f}x"
                 if "dense" in by and "async" in by else "-")
        late = f"{by['async']['late_share']:.0%}" if "async" in by else "-"
        worker = f"{by['async']['worker_ms_per_job']:.1f}" if "async" in by else "-"
        lines.append(f"| {rows} | {context} | " + " | ".join(f"{by[s]['step_ms']:.2f}" if s in by else "-" for s in sides)
                     + f" | {ratio} | {late} | {worker} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
