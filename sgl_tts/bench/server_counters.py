"""Counters of a server's memory pressure and scheduling work, read the same way for every side of
``sgl-tts bench`` (stock or sgl-tts) from the generator's ``/metrics`` (Prometheus text, served with
``--enable-metrics``); a side's work is the difference between a reading before its searches and one
after.

- SGLang's own counters (:data:`COUNTERS`): tokens evicted from the radix cache, requests retracted
  for lack of KV memory and the prompt tokens they held (recomputed when they come back).
- The sgl-tts plugin's observer counters (:data:`OBSERVER_COUNTERS`, :mod:`sgl_tts.plugin.scheduling.observer`),
  which SGLang does not count: prompt tokens recomputed that an earlier request had computed
  (thrashing: evicted, then needed again), prompt tokens prefilled, and the scheduler's own rounds
  and the seconds it spent forming their batches, prefill and decode. Every side runs the same
  observer: the sgl-tts side as part of the plugin, the stock sides with the plugin observe-only
  (``SGLANG_TTS_OBSERVE_ONLY=1``: no scheduling hook). Recomputed prompt tokens are block-granular:
  the observer counts whole 16-token blocks (:data:`BLOCK_TOKENS`, seed 001 Alg. 1), times 16 here.
  A server without the observer has none of these series: they read ``None`` (the report's ``-``),
  as do records written before they were read.
"""

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
#: the observer's counters (the report's name -> (series as Prometheus' multiprocess collector names
#: it on SGLang's /metrics, the labels it must carry)); ``None`` when the server has no such series
OBSERVER_COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "recomputed_blocks": ("sgl_tts_recomputed_blocks_total", {}),
    "prefill_computed_tokens": ("sgl_tts_prefill_computed_tokens_total", {}),
    "prefill_rounds": ("sgl_tts_scheduler_rounds_total", {"mode": "prefill"}),
    "decode_rounds": ("sgl_tts_scheduler_rounds_total", {"mode": "decode"}),
    "prefill_round_seconds": ("sgl_tts_scheduler_round_seconds_total", {"mode": "prefill"}),
    "decode_round_seconds": ("sgl_tts_scheduler_round_seconds_total", {"mode": "decode"}),
}
ALL_COUNTERS = (*COUNTERS, *OBSERVER_COUNTERS)
BLOCK_TOKENS = 16   # the observer's block (SchedulerMetrics' default block_tokens)
METRICS_FLAG = "--enable-metrics"


def _labels(head: str) -> tuple[str, dict[str, str]]:
    """A sample's name and labels (``name{a="x",b="y"}``; label values without commas or quotes)."""
    name, _, rest = head.partition("{")
    labels = {}
    for item in rest.rstrip("}").split(","):
        key, sep, value = item.partition("=")
        if sep:
            labels[key.strip()] = value.strip().strip('"')
    return name, labels


def parse_counters(text: str) -> dict[str, float | None]:
    """The :data:`COUNTERS` and :data:`OBSERVER_COUNTERS` in a Prometheus text answer (a counter with
    several label sets is summed; one of SGLang's the server never set reads 0, an observer series
    the server does not have reads ``None``)."""
    out: dict[str, float | None] = {name: 0.0 for name in COUNTERS}
    out.update({name: None for name in OBSERVER_COUNTERS})
    metric_of = {metric: name for name, metric in COUNTERS.items()}
    observed = {metric for metric, _ in OBSERVER_COUNTERS.values()}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric = head.split("{", 1)[0]
        if metric in metric_of:
            out[metric_of[metric]] += float(value)
        elif metric in observed:
            _, labels = _labels(head)
            for name, (want, need) in OBSERVER_COUNTERS.items():
                if want == metric and all(labels.get(k) == v for k, v in need.items()):
                    out[name] = (out[name] or 0.0) + float(value)
    return out


def server_counters(base_url: str, timeout: float = 30.0) -> dict[str, float | None]:
    """The server's counters now (``GET /metrics``); a server without ``--enable-metrics`` answers
    404, which raises naming the flag."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as res:
            return parse_counters(res.read().decode("utf-8", errors="replace"))
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{base_url}/metrics answered HTTP {exc.code}: start the server with "
                           f"{METRICS_FLAG}") from None


def metric_sum(text: str, metric: str) -> float | None:
    """``metric`` in a Prometheus text answer, summed over its label sets (``None``: absent)."""
    total = None
    for line in text.splitlines():
        if line and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if head.split("{", 1)[0] == metric:
                total = (total or 0.0) + float(value)
    return total


def gauge(base_url: str, metric: str, timeout: float = 5.0) -> float | None:
    """``metric`` on the server's ``/metrics`` now, summed over its labels; ``None`` when the server did
    not answer in time or has no such series (a sampler skips the reading)."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as res:
            return metric_sum(res.read().decode("utf-8", errors="replace"), metric)
    except (OSError, ValueError):
        return None


#: requests the server received (SGLang's tokenizer manager counts each when it finishes)
REQUESTS_COUNTER = "sglang:num_requests_total"


def request_count(base_url: str, timeout: float = 30.0) -> float | None:
    """The requests the server has counted so far (:data:`REQUESTS_COUNTER`; ``None``: not served)."""
    return gauge(base_url, REQUESTS_COUNTER, timeout)


def delta(before: Mapping[str, float | None], after: Mapping[str, float | None]) -> dict[str, float | None]:
    """What happened between two readings of the same server (``None`` where either has none)."""
    out: dict[str, float | None] = {}
    for name in ALL_COUNTERS:
        a, b = before.get(name), after.get(name)
        out[name] = None if a is None or b is None else b - a
    return out


def per_side(records: Iterable[dict]) -> dict[str, dict[str, float | None]]:
    """Each side's counters over the run, summed over its ``kind: counters`` records (a side resumed
    after a crash has one record per part that ran). An observer counter is ``None`` for a side when
    any of its records lacks it (written before it was read, or by a server without the observer)."""
    out: dict[str, dict[str, float | None]] = {}
    for r in records:
        if r.get("kind") == "counters":
            side = out.setdefault(r["side"], {name: 0.0 for name in ALL_COUNTERS})
            for name in COUNTERS:
                side[name] += float(r.get(name, 0.0))
            for name in OBSERVER_COUNTERS:
                value, total = r.get(name), side[name]
                side[name] = None if value is None or total is None else total + float(value)
    return out


def recomputed_prompt_tokens(counters: Mapping[str, float | None]) -> float | None:
    """Prompt tokens computed again that an earlier request had computed (thrashing), from the
    observer's recomputed blocks: whole :data:`BLOCK_TOKENS`-token blocks, so block-granular."""
    blocks = counters.get("recomputed_blocks")
    return None if blocks is None else blocks * BLOCK_TOKENS


def ms_per_round(counters: Mapping[str, float | None], modes: Iterable[str] = ("prefill", "decode")) -> float | None:
    """The scheduler's milliseconds per round over ``modes`` (``None``: not observed, or no round)."""
    modes = tuple(modes)
    rounds = [counters.get(f"{m}_rounds") for m in modes]
    seconds = [counters.get(f"{m}_round_seconds") for m in modes]
    if any(v is None for v in rounds + seconds) or not sum(rounds):
        return None
    return 1000.0 * sum(seconds) / sum(rounds)


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_counters(counters: Mapping[str, Mapping[str, float | None]], order: Iterable[str]) -> str:
    """A Markdown table, one row per side in ``order`` that has counters (``-``: not observed)."""
    lines = ["| side | generator tokens evicted | requests retracted | their prompt tokens "
             "| recomputed prompt tokens | prefill tokens computed | scheduler ms per prefill round "
             "| scheduler ms per round |",
             "|---|---|---|---|---|---|---|---|"]
    for side in order:
        c = counters.get(side)
        if c is not None:
            lines.append(f"| {side} | {c['evicted_tokens']:.0f} | {c['retracted_requests']:.0f} | "
                         f"{c['retracted_prompt_tokens']:.0f} | {_cell(recomputed_prompt_tokens(c), '.0f')} | "
                         f"{_cell(c.get('prefill_computed_tokens'), '.0f')} | "
                         f"{_cell(ms_per_round(c, ('prefill',)), '.3f')} | {_cell(ms_per_round(c), '.3f')} |")
    return "\n".join(lines) if len(lines) > 2 else ""


__all__ = ["ALL_COUNTERS", "BLOCK_TOKENS", "COUNTERS", "METRICS_FLAG", "OBSERVER_COUNTERS", "delta",
           "REQUESTS_COUNTER", "format_counters", "gauge", "metric_sum", "ms_per_round", "parse_counters", "per_side", "recomputed_prompt_tokens",
           "request_count", "server_counters"]
