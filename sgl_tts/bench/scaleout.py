"""``sgl-tts scale-out``: generator replicas behind SGLang's router, measured on this machine's CPU.

Two parts, on two tiny-generator replicas (sgl-tts plugin, scheduler metrics, seeded sampling) and
the tiny PRM, with SGLang's router (sglang-router) in front of the replicas:

1. **Routing.** The same beam searches (``--problems``, N = ``--beams``, M = ``--beam-width``,
   ``--in-flight`` at once) through the router with ``cache_aware`` and with ``round_robin``
   routing, both replicas' prefix caches flushed first. From the replicas' own scheduler metrics:
   the prefix-cache hit rate (cached / (cached + computed) prompt tokens of the searches' requests),
   the prompt tokens computed, and the share of searches whose requests all landed on one replica.
2. **serve-search throughput.** ``--requests`` chat completions (``beam_search``, the same budget)
   from ``--clients`` concurrent OpenAI clients to serve-search over the router with 1 and with 2
   replicas: requests per second, p50/p99 latency.

Records go to PREFIX.jsonl (one line per part and setting), a table to PREFIX.md, a plot to PREFIX.png.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from sgl_tts.launch.server_api import flush_cache
from sgl_tts.experiment import quantile
from sgl_tts.protocol import rid_group

REPLICAS = ("rep0", "rep1")


@dataclasses.dataclass(frozen=True)
class ScaleOutSettings:
    problems: int = 12
    beams: int = 8
    beam_width: int = 2
    in_flight: int = 4
    clients: int = 8
    requests: int = 32
    seed: int = 0


def prefill_by_group(records: Sequence[dict]) -> dict[str, tuple[int, int]]:
    """search group -> (cached, computed) prompt tokens over the prefill records given."""
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for rec in records:
        if rec.get("event") != "prefill":
            continue
        for req in rec.get("requests", []):
            group = rid_group(req.get("rid"))
            if group is not None:
                out[group][0] += int(req["cached"])
                out[group][1] += int(req["computed"])
    return {g: (c, p) for g, (c, p) in out.items()}


def routing_row(servers, router: str, policy: str, prm, s: ScaleOutSettings) -> dict:
    from sgl_tts.backends import SGLangEndpoint
    from sgl_tts.experiment import RunConfig, program_function
    from sgl_tts.search.runner import run_continuously
    from sgl_tts.tiny import task

    problems = task.test_split()[:s.problems]
    before = {n: len(servers.metrics_records(n)) for n in REPLICAS}
    tag = f"{policy.replace('_', '')}{int(time.time())}x"
    cfg = RunConfig(program="beam_search", n=s.beams, beam_width=s.beam_width, max_depth=12, step_tokens=[48])
    args = [dict(dataclasses.replace(cfg, seed=s.seed + i).program_arguments(p.question, prm), search_group=f"{tag}{i}")
            for i, p in enumerate(problems)]
    beam_search = program_function(cfg.program)
    t0 = time.monotonic()
    results = {}
    for i, state in run_continuously(beam_search, args, backend=SGLangEndpoint(router), in_flight=s.in_flight,
                                     total=len(args), progress=True):
        if isinstance(state, BaseException) or state.error() is not None:
            raise RuntimeError(f"search {i} failed: {state if isinstance(state, BaseException) else state.error()}")
        results[i] = state.ret_value
    wall = time.monotonic() - t0
    time.sleep(2.5)   # the plugin flushes its metrics at least every second
    per_replica = {n: prefill_by_group(servers.metrics_records(n)[before[n]:]) for n in REPLICAS}
    groups = [f"{tag}{i}" for i in range(len(problems))]
    cached = sum(per_replica[n].get(g, (0, 0))[0] for n in REPLICAS for g in groups)
    computed = sum(per_replica[n].get(g, (0, 0))[1] for n in REPLICAS for g in groups)
    on_one = sum(1 for g in groups if sum(g in per_replica[n] for n in REPLICAS) == 1)
    used = sorted(n for n in REPLICAS if any(g in per_replica[n] for g in groups))
    correct = sum(results[i].answer == str(p.answer) for i, p in enumerate(problems))
    return {"part": "routing", "policy": policy, "searches": len(problems), "wall_s": round(wall, 2),
            "searches_per_s": round(len(problems) / wall, 4), "cached_tokens": cached, "computed_tokens": computed,
            "hit_rate": round(cached / max(1, cached + computed), 4), "on_one_replica": on_one,
            "replicas_used": used, "accuracy": round(correct / len(problems), 4),
            "tokens_generated": sum(r.tokens_generated for r in results.values())}


def serve_search_row(router: str, prm_url: str, replicas: int, s: ScaleOutSettings) -> dict:
    from sgl_tts.tiny import task
    from sgl_tts.serving.server import BackgroundSearchServer
    from sgl_tts.serving.service import SearchService

    problems = task.test_split()[:s.requests]
    with BackgroundSearchServer(SearchService(router, prm_url, max_concurrent=s.clients)) as server:
        client = server.client()

        def one(i: int) -> tuple[float, int]:
            t = time.monotonic()
            r = client.chat.completions.create(model=f"beam_search:{s.beams}x{s.beam_width}", seed=s.seed + i,
                                               messages=[{"role": "user", "content": problems[i % len(problems)].question}],
                                               extra_body={"max_depth": 12, "step_tokens": 48})
            return time.monotonic() - t, r.usage.completion_tokens

        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(s.clients) as pool:
            got = list(pool.map(one, range(s.requests)))
        wall = time.monotonic() - t0
    lat = [g[0] for g in got]
    return {"part": "serve-search", "replicas": replicas, "clients": s.clients, "requests": s.requests,
            "wall_s": round(wall, 2), "requests_per_s": round(s.requests / wall, 4),
            "tokens_per_s": round(sum(g[1] for g in got) / wall, 1), "p50_s": round(quantile(lat, 0.5), 3),
            "p99_s": round(quantile(lat, 0.99), 3)}


def format_report(rows: Sequence[dict]) -> str:
    lines = ["| routing | searches | hit rate | prompt tokens computed | searches on one replica | replicas used | "
             "searches/s | accuracy |", "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        if r["part"] == "routing":
            lines.append(f"| {r['policy']} | {r['searches']} | {100 * r['hit_rate']:.1f}% | {r['computed_tokens']} | "
                         f"{r['on_one_replica']}/{r['searches']} | {', '.join(r['replicas_used'])} | "
                         f"{r['searches_per_s']:.3f} | {100 * r['accuracy']:.0f}% |")
    lines += ["", "| serve-search replicas | clients | requests | requests/s | tokens/s | p50 (s) | p99 (s) |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if r["part"] == "serve-search":
            lines.append(f"| {r['replicas']} | {r['clients']} | {r['requests']} | {r['requests_per_s']:.3f} | "
                         f"{r['tokens_per_s']:.0f} | {r['p50_s']:.2f} | {r['p99_s']:.2f} |")
    return "\n".join(lines)


def plot_report(rows: Sequence[dict], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routing = [r for r in rows if r["part"] == "routing"]
    serving = [r for r in rows if r["part"] == "serve-search"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.bar([r["policy"] for r in routing], [r["computed_tokens"] for r in routing], color=["C0", "C1"][:len(routing)])
    a.set_ylabel("prompt tokens computed (prefill)")
    a.set_title("beam search through the router")
    for i, r in enumerate(routing):
        a.annotate(f"hit {100 * r['hit_rate']:.1f}%", (i, r["computed_tokens"]), ha="center", va="bottom", fontsize=8)
    b.bar([f"{r['replicas']} replica(s)" for r in serving], [r["requests_per_s"] for r in serving], color="C2")
    b.set_ylabel("requests / s")
    b.set_title("serve-search, concurrent clients")
    fig.suptitle("scale-out on the 2-core CPU (tiny models)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_scale_out(s: ScaleOutSettings, output: str | Path,
                  on_row: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """Both parts on two tiny-generator replicas and the tiny PRM started here: each row is appended to
    ``output``.jsonl as it is measured (and given to ``on_row``); the table goes to ``output``.md and the
    plot to ``output``.png. Returns the rows."""
    from sgl_tts.backends import SGLangEndpoint
    from sgl_tts.launch.live_servers import LiveServer, LiveServers
    from sgl_tts.models import shipped_model
    from sgl_tts.prm import StepTagPRM

    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    jsonl = out.with_suffix(".jsonl")
    gen = LiveServer(str(shipped_model("generator")), policy="prefix-aware", metrics=True, kv_bytes=128 << 20,
                     seeded_sampling=True)
    rows: list[dict] = []
    with LiveServers({**{n: gen for n in REPLICAS}, "prm": LiveServer(str(shipped_model("prm")), kv_bytes=128 << 20)},
                     tempfile.mkdtemp(prefix="sgl-tts-scale-out-")) as servers:
        prm_url = servers.url("prm")
        prm = StepTagPRM(SGLangEndpoint(prm_url), cache=False)

        def record(row: dict) -> None:
            rows.append(row)
            with jsonl.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            on_row(row)

        for policy in ("cache_aware", "round_robin"):
            router = servers.start_router("router", REPLICAS, policy)
            for n in (*REPLICAS, "prm"):
                flush_cache(servers.url(n))
            record(routing_row(servers, router, policy, prm, s))
        for k in (1, 2):
            router = servers.start_router("router", REPLICAS[:k], "cache_aware")
            for n in (*REPLICAS, "prm"):
                flush_cache(servers.url(n))
            record(serve_search_row(router, prm_url, k, s))
    out.with_suffix(".md").write_text(format_report(rows) + "\n")
    plot_report(rows, out.with_suffix(".png"))
    return rows


__all__ = ["ScaleOutSettings", "format_report", "plot_report", "prefill_by_group", "run_scale_out"]
