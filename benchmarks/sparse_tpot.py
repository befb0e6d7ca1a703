"""Benchmark: time per output token of live CPU SGLang servers at long contexts, dense against sparse
decode attention (issue 36, seed 003).

The shipped tiny generator's architecture with its context raised (``--max-context``) and random
weights (``--load-format dummy``): what the server computes per token, not what it answers. Per side
one server, all up at once (an idle scheduler sleeps); per (rows, context): ``rows`` different
prompts of ``context`` tokens are prefilled once on each (one generated token), then generated again
from the cached prompts for ``--short`` and ``--long`` tokens (``ignore_eos``), all rows at once, the
sides taking turns (forwards, then backwards: the host's drift falls on every side alike; the
minimum of ``--repeats`` kept); the time per output token is the difference of the two wall times
over the difference of the tokens, the prefill and the request overheads cancelling out.
Sides: ``dense`` (the plugin's ragged attention, what a server without the sparse flag runs),
``async`` (the choice in the cache rank process, the default), ``async-auto`` (the same with the
stand-down on, as a server with the defaults runs), ``async-thread`` (in a thread of the
scheduler), ``sync`` (token level, the current query) and ``quest`` (16-token pages, the current
query) with the default two dense layers (every side but ``async-auto`` with the stand-down off),
and ``async-all`` / ``sync-all`` / ``quest-all`` with every layer sparse (the tiny model has only
4 layers, so two dense ones are half its attention; ``--layers`` deepens the architecture, as the
seed's 36-64-layer models, to see two dense layers at a small share). The ``-all`` sides time what
sparse attention costs, not a setting to serve with: with its first layers sparse the tiny generator
answers 0-1% of the tiny task against dense's 97% (``docs/benchmarks/LOG.md``, "Sparse decoding"). Each cell's late share is the async worker's late selections over the cell's sparse
rows, and ``dense_layer_ms`` / ``sparse_layer_ms`` a dense and a sparse layer's attention per row as
the sparse server timed its own steps (its counters read before and after the cell; the dense layers
are the first ones of the sparse sides, so both come from the same steps of the same server).

    ./dev.sh run python benchmarks/sparse_tpot.py --out docs/benchmarks/sparse_tpot.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# the sparse sides attend sparsely wherever they can (no stand-down): what sparse attention costs;
# async-auto is what a server with the defaults does (it stands down where sparse measured slower)
SPARSE = ("--tts-sparse-budget", "0.5", "--tts-sparse-dense-below", "1024", "--tts-sparse-stand-down", "off")
SIDES = {
    "dense": (),
    "async": ("--tts-sparse-attention", "async") + SPARSE,
    "async-auto": ("--tts-sparse-attention", "async", "--tts-sparse-budget", "0.5"),
    "async-thread": ("--tts-sparse-attention", "async", "--tts-sparse-worker", "thread") + SPARSE,
    "sync": ("--tts-sparse-attention", "sync") + SPARSE,
    "quest": ("--tts-sparse-attention", "quest") + SPARSE,
    "async-all": ("--tts-sparse-attention", "async", "--tts-sparse-dense-layers", "0") + SPARSE,
    "sync-all": ("--tts-sparse-attention", "sync", "--tts-sparse-dense-layers", "0") + SPARSE,
    "quest-all": ("--tts-sparse-attention", "quest", "--tts-sparse-dense-layers", "0") + SPARSE,
}


def long_model(max_context: int, workdir: Path, layers: int | None = None) -> Path:
    """The shipped generator's folder with its context raised to ``max_context`` (and ``layers``
    layers, its weights random anyway under ``--load-format dummy``)."""
    from sgl_tts.models import shipped_model

    src = Path(shipped_model("generator"))
    dst = workdir / "generator-long"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["max_position_embeddings"] = max_context
    if layers:
        cfg["num_hidden_layers"] = layers
        cfg["layer_types"] = ["full_attention"] * layers
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return dst


def generate(url: str, prompts: list[str], tokens: int) -> float:
    import httpx

    def one(p: str):
        r = httpx.post(url + "/generate", json={"text": p, "sampling_params": {
            "max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}}, timeout=3600)
        r.raise_for_status()
        return r.json()["meta_info"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(one, prompts))
    if any(n != tokens for n in done):
        raise RuntimeError(f"asked for {tokens} tokens, got {done}")
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="4096,16384")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--short", type=int, default=4)
    p.add_argument("--long", type=int, default=36)
    p.add_argument("--max-context", type=int, default=17000)
    p.add_argument("--layers", type=int, default=None, help="layers of the served architecture (default: the tiny 4)")
    p.add_argument("--repeats", type=int, default=1, help="each timing this many times, its minimum taken")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from tqdm import tqdm

    from sgl_tts.launch.live_servers import LiveServer, LiveServers
    from sgl_tts.machine import describe

    contexts = [int(x) for x in args.contexts.split(",")]
    rows_list = [int(x) for x in args.rows.split(",")]
    sides = args.sides.split(",")
    unknown = [s for s in sides if s not in SIDES]
    if unknown or args.max_context < max(contexts) + args.long + 2:
        raise SystemExit(f"unknown sides {unknown} (known: {', '.join(SIDES)})" if unknown else
                         f"--max-context {args.max_context} is under the longest context {max(contexts)} "
                         f"plus --long {args.long}")
    work = Path(tempfile.mkdtemp(prefix="sgl-tts-sparse-tpot-"))
    model = long_model(args.max_context, work, args.layers)
    layers = args.layers or 4
    kv_tokens = max(rows_list) * (max(contexts) + args.long + 64) + args.max_context
    kv_bytes = kv_tokens * layers * 2 * 2 * 64 * 4          # layers x (K, V) x kv heads x head dim x float32
    rng = random.Random(0)
    records = []
    specs = {s: LiveServer(str(model), policy="off", metrics=True, kv_bytes=kv_bytes,
                           cpu_attention="ragged" if s == "dense" else "native",
                           extra=("--load-format", "dummy") + SIDES[s]) for s in sides}
    # one server at a time (started by its first url()), so that no idle server shares the cores
    cells = [(rows, context) for rows in rows_list for context in contexts]
    with LiveServers(specs, work / "servers") as servers:
        urls = {side: servers.url(side) for side in sides}    # every side up at once (idle ones sleep)
        for rows, context in tqdm(cells, desc="sparse tpot", unit="cell"):
            # digits and spaces: one token per character with the byte-level tokenizer
            prompts = ["".join(rng.choice("0123456789 ") for _ in range(context)) for _ in range(rows)]
            for side in sides:
                generate(urls[side], prompts, 1)                 # prefill, cached from here on
            before = settled_counters(work / "servers", sides)
            # the sides take turns, forwards then backwards, so the host's drift falls on all of them alike
            times = {side: {"short": [], "long": []} for side in sides}
            for rep in range(args.repeats):
                for side in (sides if rep % 2 == 0 else sides[::-1]):
                    times[side]["short"].append(generate(urls[side], prompts, args.short))
                    times[side]["long"].append(generate(urls[side], prompts, args.long))
            settled = settled_counters(work / "servers", sides)
            for side in sides:
                after = settled[side]
                short, long = min(times[side]["short"]), min(times[side]["long"])
                rec = {"side": side, "rows": rows, "context": context,
                       "tpot_ms": round(1000 * (long - short) / (args.long - args.short), 2)}
                b = before[side]
                if after.get("sparse_rows", 0) > b.get("sparse_rows", 0):
                    rec["late_share"] = round((after["late"] - b.get("late", 0))
                                              / (after["sparse_rows"] - b.get("sparse_rows", 0)), 3)
                    rec["attended_share"] = round((after["attended_tokens"] - b.get("attended_tokens", 0))
                                                  / (after["context_tokens"] - b.get("context_tokens", 0)), 3)
                for kind in ("dense", "sparse"):   # the server's own attention seconds, per layer and row
                    secs = sum(after.get(f"{kind}_seconds", {}).values()) - sum(b.get(f"{kind}_seconds", {}).values())
                    toks = sum(after.get(f"{kind}_tokens", {}).values()) - sum(b.get(f"{kind}_tokens", {}).values())
                    if toks > 0:
                        rec[f"{kind}_layer_ms"] = round(1000 * secs / toks * context, 3)
                records.append(rec)
                tqdm.write(json.dumps(rec))
    meta = {"machine": describe(), "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python " + " ".join(sys.argv),
            "revision": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(), "max_context": args.max_context,
            "layers": layers, "repeats": args.repeats}
    print(table(records))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)


def settled_counters(folder: Path, sides: list[str]) -> dict[str, dict]:
    """Every side's counters once its server has written its last steps' (at most every 0.2 s:
    :class:`sgl_tts.plugin.attention.sparse_counters.StatsFile`)."""
    time.sleep(0.5)
    return {side: counters(folder, side) for side in sides}


def counters(folder: Path, side: str) -> dict:
    """The sparse backend's counters of ``side``'s server now (empty before its first decode step)."""
    files = sorted(folder.glob(f"{side}.metrics.jsonl.sparse.*"), key=lambda f: f.stat().st_mtime)
    return json.loads(files[-1].read_text()) if files else {}


def table(records: list[dict]) -> str:
    sides = list(dict.fromkeys(r["side"] for r in records))
    lines = ["| rows | context | " + " | ".join(f"{s} ms/token" for s in sides) + " |",
             "| --- | --- | " + " | ".join("---" for _ in sides) + " |"]
    for rows, context in dict.fromkeys((r["rows"], r["context"]) for r in records):
        by = {r["side"]: r for r in records if (r["rows"], r["context"]) == (rows, context)}
        lines.append(f"| {rows} | {context} | " + " | ".join(f"{by[s]['tpot_ms']:.1f}" if s in by else "-"
                                                            for s in sides) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
