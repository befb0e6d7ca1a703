"""Benchmark: what sparse decode attention (issue 36, seed 003) keeps of dense attention's answers.

Serves the shipped tiny generator on live CPU SGLang servers, one per side: dense (the plugin's ragged
attention, the same attention as torch_native to float rounding), and ``--tts-sparse-attention``
``async`` (in the rotary frame and in the query frame), ``sync`` and ``quest``, each with
``--tts-sparse-measure``. Every side answers the first ``--problems`` test problems greedily
(``--max-tokens``); the report gives per side: accuracy (with its binomial standard error), how many
answers are the dense side's text exactly, the share of the context the sparse rows attended to, the
selection's overlap with the current query's token-level choice per layer (seed 003's Eq. 1, Fig. 5),
the cosine of the predicted query with the true one beside the previous step's query's (the value of
predicting over reusing the last query; on-time selections only), and the asynchronous side's late and
missing selections. Contexts on this task are 25-150 tokens, so
``--dense-below`` is low (rows from that length on are sparse).

    ./dev.sh run python benchmarks/sparse_quality.py --out docs/benchmarks/sparse_quality.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import subprocess
import sys
import time
from pathlib import Path

SIDES = {
    "dense": (),
    "async": ("--tts-sparse-attention", "async"),
    "async-query-frame": ("--tts-sparse-attention", "async", "--tts-sparse-frame", "query"),
    "sync": ("--tts-sparse-attention", "sync"),
    "quest": ("--tts-sparse-attention", "quest"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problems", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--budget", default="0.5")
    p.add_argument("--dense-below", type=int, default=24)
    p.add_argument("--dense-layers", type=int, default=2)
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    p.add_argument("--workdir", default="/tmp/sgl-tts-sparse-quality")
    p.add_argument("--out", default=None, help="write the records (JSON) here")
    args = p.parse_args()

    import httpx

    from sgl_tts.launch.live_servers import LiveServer, LiveServers
    from sgl_tts.machine import describe
    from sgl_tts.models import shipped_model
    from sgl_tts.tiny import task

    problems = task.test_split()[:args.problems]
    prompts = [q.question + "\n\n" for q in problems]
    gen = str(shipped_model("generator"))
    common = ("--tts-sparse-budget", args.budget, "--tts-sparse-dense-below", str(args.dense_below),
              "--tts-sparse-dense-layers", str(args.dense_layers), "--tts-sparse-measure",
              "--tts-sparse-stand-down", "off")   # every row sparse: what its choice keeps, at every length
    specs = {name: LiveServer(gen, policy="off", metrics=True, kv_bytes=64 << 20,
                              cpu_attention="ragged" if name == "dense" else "native",
                              extra=(flags + common) if flags else ())
             for name, flags in SIDES.items() if name in args.sides or name == "dense"}
    body = {"text": prompts, "sampling_params": {"max_new_tokens": args.max_tokens, "temperature": 0.0}}
    records, texts = [], {}
    with LiveServers(specs, args.workdir) as servers:
        for name in ["dense"] + [s for s in args.sides if s != "dense"]:
            url = servers.url(name)
            t0 = time.perf_counter()
            answers = httpx.post(url + "/generate", json=body, timeout=3600).json()
            seconds = time.perf_counter() - t0
            texts[name] = [a["text"] for a in answers]
            right = sum(task.grade(q, t).answer_ok for q, t in zip(problems, texts[name]))
            acc = right / len(problems)
            rec = {"side": name, "problems": len(problems), "accuracy": acc,
                   "stderr": math.sqrt(acc * (1 - acc) / len(problems)),
                   "same_as_dense": sum(a == b for a, b in zip(texts[name], texts["dense"])),
                   "seconds": round(seconds, 2)}
            time.sleep(0.5)   # the server writes its counters at most every 0.2 s (StatsFile)
            stats = sorted(Path(args.workdir).glob(f"{name}.metrics.jsonl.sparse.*"))
            if stats:
                c = json.loads(stats[-1].read_text())
                rec.update({k: c[k] for k in ("sparse_rows", "dense_rows", "late", "missing", "selections")})
                rec["attended_share"] = c["attended_tokens"] / max(1, c["context_tokens"])
                for field, key in (("overlap_by_layer", "overlap"), ("cosine_by_layer", "cosine"),
                                   ("previous_cosine_by_layer", "previous_cosine"),
                                   ("previous_overlap_by_layer", "previous_overlap")):
                    sums, counts = c.get(f"{key}_sum", {}), c.get(f"{key}_count", {})
                    rec[field] = {k: sums[k] / counts[k] for k in sorted(sums, key=int) if counts.get(k)}
            records.append(rec)
            servers.stop(name)
            print(json.dumps(rec), flush=True)
    meta = {"machine": describe(), "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": "python " + " ".join(sys.argv),
            "revision": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                       text=True).stdout.strip(),
            "budget": args.budget, "dense_below": args.dense_below, "dense_layers": args.dense_layers,
            "max_tokens": args.max_tokens}
    print(table(records))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")


def pairs(side: dict, previous: dict) -> str:
    """``layer: side / previous`` for each layer the side has a figure for ("-" if none)."""
    return ", ".join(f"{k}: {v:.2f} / {previous[k]:.2f}" if k in previous else f"{k}: {v:.2f}"
                     for k, v in side.items()) or "-"


def table(records: list[dict]) -> str:
    lines = ["| side | accuracy | same text as dense | attended | overlap with the current query's choice: "
             "the side's / the previous query's, by layer | cosine with the current query: predicted / "
             "previous, by layer | late / missing |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        overlap = pairs(r.get("overlap_by_layer", {}), r.get("previous_overlap_by_layer", {}))
        cosine = pairs(r.get("cosine_by_layer", {}), r.get("previous_cosine_by_layer", {}))
        attended = f"{r['attended_share']:.0%}" if "attended_share" in r else "100%"
        late = f"{r['late']} / {r['missing']} of {r['sparse_rows'] + r['missing']}" if "late" in r else "-"
        lines.append(f"| {r['side']} | {r['accuracy']:.1%} ± {r['stderr']:.1%} | {r['same_as_dense']}/{r['problems']} "
                     f"| {attended} | {overlap} | {cosine} | {late} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
