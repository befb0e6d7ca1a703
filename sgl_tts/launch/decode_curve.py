"""The generator's decode curve, measured on its own live server: what ``speculative="auto"`` decides on.

A speculative branch pays only if the decode step it joins grows by less than the time it saves
(:mod:`sgl_tts.search.speculation_cost`). How much a step grows with the batch is the server's, not
the algorithm's: flat on a GPU at small batches, steep on a CPU. So the curve is measured where the
search runs, the same way on either device: :func:`measure_decode_curve` sends ``B`` distinct prompts
of ``context`` token ids to ``/generate`` at once, each batch size three times as
:mod:`sgl_tts.launch.cpu_profile` does (a cold prefill, the same prompts again for one token, then for
``1 + D`` tokens with ``ignore_eos``); ``(t3 - t2) / D`` is the decode step at ``B``, the minimum over
the repeats (other load only adds time). Each repeat uses fresh prompts, so the server's radix cache
is never flushed (a shared server keeps its cache).

:func:`curve_for_server` caches curves as JSON under :func:`curve_dir`, keyed by what the
server reports of itself (``/server_info``: model, dtype, attention backend, pool, batch limits,
device, SGLang's version) and this machine: a search on the same server measures once.
:func:`server_curve` keeps what it read per server for the process (``SGLangEndpoint.decode_curve``:
``speculative="auto"`` from Python and ``sgl-tts serve-search``).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Sequence

from sgl_tts.launch.cpu_profile import (ProfileError, ProfileGrid, _Timer, machine_identity, read_cached,
                                        write_json_atomically)
from sgl_tts.launch.server_api import server_info
from sgl_tts.server_costs import DecodeCurve

log = logging.getLogger(__name__)



def curve_dir() -> Path:
    """Where curves are cached: ``curves/`` under ``$SGLANG_TTS_CACHE`` (dev.sh's cache root), by
    default ``~/.cache/sgl-tts``."""
    return Path(os.environ.get("SGLANG_TTS_CACHE") or Path.home() / ".cache" / "sgl-tts").expanduser() / "curves"

FORMAT = 1
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_CONTEXT = 256      # tokens per request: a tiny-task question and a few steps
#: what of ``/server_info`` a decode step's time depends on
IDENTITY_FIELDS = ("model_path", "dtype", "kv_cache_dtype", "attention_backend", "device", "tp_size",
                   "max_running_requests", "max_total_tokens", "schedule_policy", "chunked_prefill_size",
                   "load_format", "version")


@dataclasses.dataclass(frozen=True)
class MeasuredCurve:
    """A decode curve with where and when it was measured."""

    curve: DecodeCurve
    server: dict
    machine: dict
    context: int
    decode_tokens: int
    date: str
    path: str | None = None   # the cache file it was read from or saved to

    def to_json(self) -> dict:
        return {"format": FORMAT, "points": [list(p) for p in self.curve.points], "server": self.server,
                "machine": self.machine, "context": self.context, "decode_tokens": self.decode_tokens,
                "date": self.date}

    @classmethod
    def from_json(cls, data: dict, path: str | None = None) -> "MeasuredCurve":
        if data.get("format") != FORMAT:
            raise ProfileError(f"a decode curve of format {data.get('format')!r}, not {FORMAT}")
        return cls(DecodeCurve.of([tuple(p) for p in data["points"]]), data["server"], data["machine"],
                   int(data["context"]), int(data["decode_tokens"]), data["date"], path)


def read_server_info(url: str) -> dict:
    """What the server at ``url`` reports of itself (:func:`sgl_tts.launch.server_api.server_info`);
    :class:`ProfileError` when it cannot be read, for then its measurements cannot be keyed."""
    try:
        return server_info(url)
    except (OSError, ValueError) as exc:
        raise ProfileError(f"{url}: cannot read /server_info to key its measurements: {exc}") from exc


def server_identity(url: str) -> dict:
    """What the server at ``url`` reports of itself that its decode speed depends on."""
    info = read_server_info(url)
    return {k: info.get(k) for k in IDENTITY_FIELDS}


def model_config_int(model_path: str | None, key: str) -> int | None:
    """An integer of the served model's ``config.json`` (or of its ``text_config``) where this machine
    can read it; ``None`` where it cannot."""
    try:
        cfg = json.loads((Path(str(model_path)) / "config.json").read_text())
        return int(cfg.get(key) or cfg["text_config"][key])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def _vocab(model_path: str | None) -> int:
    """The served model's vocabulary size from its ``config.json`` where this machine can read it;
    else 256 (ids below any real vocabulary's size)."""
    return model_config_int(model_path, "vocab_size") or 256


def measure_decode_curve(url: str, *, batches: Sequence[int] = DEFAULT_BATCHES, context: int = DEFAULT_CONTEXT,
                         decode_tokens: int = 16, repeats: int = 2, vocab: int | None = None) -> DecodeCurve:
    """Seconds per decode step at each of ``batches`` on the live server at ``url`` (module docstring).
    Raises :class:`~sgl_tts.launch.cpu_profile.ProfileError` when the server generates other than
    asked (a request limit, a full pool)."""
    if decode_tokens < 2 or repeats < 1 or context <= decode_tokens:
        raise ValueError(f"need decode_tokens >= 2, repeats >= 1 and context > decode_tokens; got "
                         f"{decode_tokens}, {repeats}, {context}")
    batches = ProfileGrid(batches=tuple(batches), contexts=(int(context),), decode_tokens=decode_tokens).batches
    d = decode_tokens
    timer = _Timer(url.rstrip("/"), vocab or _vocab(server_identity(url).get("model_path")))
    try:
        timer.wall(timer.prompts(2, 32, "curve-warm-up"), 4)
        points = []
        for b in batches:
            base, long = [], []
            for r in range(repeats):   # fresh prompts each repeat: nothing is flushed from the cache
                prompts = timer.prompts(b, int(context) - d // 2, f"curve/{r}")
                timer.wall(prompts, 1)                  # the cold prefill, not timed here
                base.append(timer.wall(prompts, 1))     # cached: the fixed part
                long.append(timer.wall(prompts, 1 + d))  # the fixed part and d decode steps
            step = (min(long) - min(base)) / d
            if step <= 0:
                log.warning("decode step at batch %d measured %.2g s (noise): kept at 1 us", b, step)
                step = 1e-6
            points.append((b, step))
    finally:
        timer.close()
    return DecodeCurve.of(points)


def curve_key(identity: dict, batches: Sequence[int], context: int, decode_tokens: int) -> str:
    blob = json.dumps({"server": identity, "machine": machine_identity(), "batches": list(batches),
                       "context": context, "decode_tokens": decode_tokens, "format": FORMAT}, sort_keys=True)
    name = Path(str(identity.get("model_path") or "server")).name or "server"
    return f"{name}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def curve_for_server(url: str, *, batches: Sequence[int] = DEFAULT_BATCHES, context: int = DEFAULT_CONTEXT,
                     decode_tokens: int = 16, cache_dir: str | os.PathLike | None = None,
                     remeasure: bool = False) -> MeasuredCurve:
    """The decode curve of the server at ``url``: from the cache when this server (as it reports
    itself) was measured on this machine before, else measured now and saved. A corrupt cached file
    raises :class:`~sgl_tts.launch.cpu_profile.ProfileError` (``remeasure`` replaces it)."""
    identity = server_identity(url)
    path = Path(cache_dir or curve_dir()).expanduser() / f"{curve_key(identity, batches, context, decode_tokens)}.json"
    if path.exists() and not remeasure:
        got = read_cached(path, MeasuredCurve.from_json, "decode curve")
        log.info("decode curve of %s from %s (measured %s)", url, path, got.date)
        return got
    log.info("measuring the decode curve of %s at batches %s (%d-token context)", url, list(batches), context)
    curve = measure_decode_curve(url, batches=batches, context=context, decode_tokens=decode_tokens,
                                 vocab=_vocab(identity.get("model_path")))
    got = MeasuredCurve(curve, identity, machine_identity(), int(context), decode_tokens,
                        datetime.date.today().isoformat(), str(path))
    write_json_atomically(path, got.to_json())
    log.info("decode curve of %s saved to %s: %s", url, path,
             ", ".join(f"{b}: {1e3 * s:.1f} ms" for b, s in curve.points))
    return got


_SERVER_CURVES: dict[tuple[str, str], MeasuredCurve] = {}
_SERVER_CURVES_LOCK = threading.Lock()


def server_curve(url: str) -> MeasuredCurve:
    """:func:`curve_for_server` at its defaults, once per server (its URL) and cache folder in this
    process: a search asks each time it starts, and only the first asks the server (a second that asks
    meanwhile waits for the first's curve rather than measure beside it)."""
    key = (url.rstrip("/"), os.fspath(curve_dir()))
    with _SERVER_CURVES_LOCK:
        if key not in _SERVER_CURVES:
            _SERVER_CURVES[key] = curve_for_server(url)
        return _SERVER_CURVES[key]
