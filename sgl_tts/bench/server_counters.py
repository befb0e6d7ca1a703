"""SGLang's own counters of a server's memory pressure, read the same way for every side of
``sgl-tts bench`` (stock or sgl-tts: no plugin needed): tokens evicted from the radix cache and
requests retracted for lack of KV memory, with the prompt tokens they held (recomputed when they
come back). A server started with ``--enable-metrics`` serves them at ``/metrics`` (Prometheus text);
a side's work is the difference between a reading before its searches and one after."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Iterable, Mapping

#: what is read (the report's name -> SGLang 0.5.15's counter, summed over its labels)
COUNTERS = {
    "evicted_tokens": "sglang:evicted_tokens_total",
    "retracted_requests": "sglang:num_retracted_requests_total",
    "retracted_prompt_tokens": "sglang:num_retracted_input_tokens_total",
}
METRICS_FLAG = "--enable-metrics"


def parse_counters(text: str) -> dict[str, float]:
    """The :data:`COUNTERS` in a Prometheus text answer (a counter with several label sets is summed;
    one the server never set reads 0)."""
    out = {name: 0.0 for name in COUNTERS}
    metric_of = {metric: name for name, metric in COUNTERS.items()}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = metric_of.get(head.split("{", 1)[0])
        if name is not None:
            out[name] += float(value)
    return out


def server_counters(base_url: str, timeout: float = 30.0) -> dict[str, float]:
    """The server's counters now (``GET /metrics``); a server without ``--enable-metrics`` answers
    404, which raises naming the flag."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as res:
            return parse_counters(res.read().decode("utf-8", errors="replace"))
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{base_url}/metrics answered HTTP {exc.code}: start the server with "
                           f"{METRICS_FLAG}") from None


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What happened between two readings of the same server."""
    return {name: after[name] - before[name] for name in COUNTERS}


def per_side(records: Iterable[dict]) -> dict[str, dict[str, float]]:
    """Each side's counters over the run, summed over its ``kind: counters`` records (a side resumed
    after a crash has one record per part that ran)."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        if r.get("kind") == "counters":
            side = out.setdefault(r["side"], {name: 0.0 for name in COUNTERS})
            for name in COUNTERS:
                side[name] += float(r.get(name, 0.0))
    return out


def format_counters(counters: Mapping[str, Mapping[str, float]], order: Iterable[str]) -> str:
    """A Markdown table, one row per side in ``order`` that has counters."""
    lines = ["| side | generator tokens evicted | requests retracted | their prompt tokens |",
             "|---|---|---|---|"]
    for side in order:
        c = counters.get(side)
        if c is not None:
            lines.append(f"| {side} | {c['evicted_tokens']:.0f} | {c['retracted_requests']:.0f} | "
                         f"{c['retracted_prompt_tokens']:.0f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


__all__ = ["COUNTERS", "METRICS_FLAG", "delta", "format_counters", "parse_counters", "per_side", "server_counters"]
