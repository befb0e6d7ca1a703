"""The PRM's slowdown beside generation, measured on the live pair of servers (issue 33).

Where the generator and the PRM share a device (always on a CPU; on a GPU when both are served from
one card) a speculative branch still decoding while the PRM verifies takes from the verification the
search is waiting for. How much is the hardware's: on two CPU cores every decoding row competes for
the same cores; on a GPU a memory-bound decode beside a compute-bound prefill may cost the PRM little.
So it is measured where the search runs, the same way on either device:
:func:`measure_verifier_slowdown` times one fixed batch of PRM scoring requests (``prm_batch`` fresh
prompts of ``context`` token ids, prefilled for one token: a verification is a prefill) alone, then
with ``B`` generator requests decoding beside it (``rows``), each several times, keeping the minimum
(other load only adds time). The generator's requests stream, so the PRM batch starts only once every
one of them has produced a token (it is decoding, not queued); they are aborted by their rids right
after. The result is a :class:`~sgl_tts.server_costs.VerifierSlowdown`, whose ``per_row``
is what the controller's barrier rule uses.

:func:`slowdown_for_servers` caches it as JSON beside the decode curves, keyed by what both servers
report of themselves and this machine: a search on the same pair measures once.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import logging
import os
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Sequence

from sgl_tts.launch.cpu_profile import (ProfileError, _post, _Timer, machine_identity, read_cached,
                                        write_json_atomically)
from sgl_tts.launch.decode_curve import _vocab, curve_dir, model_config_int, read_server_info, server_identity
from sgl_tts.launch.server_api import running_request_cap
from sgl_tts.server_costs import VerifierSlowdown

log = logging.getLogger(__name__)

FORMAT = 1
DEFAULT_ROWS = (0, 4, 16)
DEFAULT_PRM_BATCH = 8
DEFAULT_CONTEXT = 256


@dataclasses.dataclass(frozen=True)
class MeasuredSlowdown:
    """A verifier slowdown with where and when it was measured."""

    slowdown: VerifierSlowdown
    generator: dict
    prm: dict
    machine: dict
    prm_batch: int
    context: int
    date: str
    path: str | None = None

    def to_json(self) -> dict:
        return {"format": FORMAT, "points": [list(p) for p in self.slowdown.points],
                "per_row": round(self.slowdown.per_row, 6), "generator": self.generator, "prm": self.prm,
                "machine": self.machine, "prm_batch": self.prm_batch, "context": self.context, "date": self.date}

    @classmethod
    def from_json(cls, data: dict, path: str | None = None) -> "MeasuredSlowdown":
        if data.get("format") != FORMAT:
            raise ProfileError(f"a verifier slowdown of format {data.get('format')!r}, not {FORMAT}")
        return cls(VerifierSlowdown.of([tuple(p) for p in data["points"]]), data["generator"], data["prm"],
                   data["machine"], int(data["prm_batch"]), int(data["context"]), data["date"], path)


class _Decoding:
    """``rows`` generator requests decoding (streamed, ``ignore_eos``) until :meth:`stop` aborts them."""

    def __init__(self, url: str, prompts: list[list[int]], max_tokens: int):
        self.url, self.rids = url, [f"sgl-tts-slowdown/{uuid.uuid4().hex}" for _ in prompts]
        self._started = threading.Semaphore(0)
        self._errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._run, args=(rid, ids, max_tokens), daemon=True,
                                          name="slowdown-decode") for rid, ids in zip(self.rids, prompts)]
        for t in self._threads:
            t.start()

    def _run(self, rid: str, ids: list[int], max_tokens: int) -> None:
        body = {"rid": rid, "input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
        req = urllib.request.Request(self.url + "/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        signalled = False
        try:
            with urllib.request.urlopen(req, timeout=600) as res:
                for line in res:   # "data: {...}" per chunk; the first means it is decoding
                    if not signalled and line.startswith(b"data:") and b"[DONE]" not in line:
                        signalled = True
                        self._started.release()
        except BaseException as exc:   # noqa: BLE001 - reported by wait_started
            self._errors.append(exc)
        finally:
            if not signalled:
                self._started.release()

    def wait_started(self, timeout: float) -> None:
        """Block (no polling) until every request produced a token; raises if one failed or ended early."""
        deadline = time.monotonic() + timeout
        for _ in self.rids:
            if not self._started.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise ProfileError(f"{self.url}: generator requests did not start decoding within {timeout:.0f} s")
        if self._errors:
            raise ProfileError(f"{self.url}: a generator request failed: {self._errors[0]}")
        if any(not t.is_alive() for t in self._threads):
            raise ProfileError(f"{self.url}: a generator request ended before the PRM batch was timed "
                               "(it ran out of context, or waited behind the server's running-request limit)")

    def stop(self) -> None:
        for rid in self.rids:
            try:
                _post(self.url + "/abort_request", {"rid": rid})
            except (OSError, ValueError) as exc:   # an ended request: nothing to abort
                log.debug("abort %s: %s", rid, exc)
        for t in self._threads:
            t.join(timeout=60)


def rows_within_cap(rows: Sequence[int], cap: int | None) -> tuple[int, ...]:
    """``rows`` with the counts above ``cap`` replaced by ``cap`` itself: a row beyond the server's
    running-request limit queues instead of decoding, so it would wait for the others to end (the
    H200, 2026-11-27: 16 rows asked of a generator capped at 8 made the measurement fail)."""
    rows = tuple(rows)
    if cap is None or rows[-1] <= cap:
        return rows
    kept = tuple(b for b in rows if b < cap) + (cap,)
    log.info("the generator decodes at most %d requests at once: slowdown rows %s instead of %s", cap,
             list(kept), list(rows))
    return kept


def measure_verifier_slowdown(generator_url: str, prm_url: str, *, rows: Sequence[int] = DEFAULT_ROWS,
                              prm_batch: int = DEFAULT_PRM_BATCH, context: int = DEFAULT_CONTEXT,
                              repeats: int = 3, generator_context: int = 64) -> VerifierSlowdown:
    """Seconds the PRM at ``prm_url`` takes to prefill ``prm_batch`` fresh prompts of ``context`` ids,
    with each of ``rows`` generator requests decoding beside it on ``generator_url`` (module
    docstring; counts above the generator's running-request limit are measured at the limit). Raises
    :class:`~sgl_tts.launch.cpu_profile.ProfileError` when a server answers other than asked."""
    rows = tuple(int(b) for b in rows)
    if not rows or rows[0] != 0 or any(a >= b for a, b in zip(rows, rows[1:])):
        raise ValueError(f"rows must start at 0 (the PRM alone) and increase, got {list(rows)}")
    if len(rows) < 2 or prm_batch < 1 or repeats < 1 or context < 2:
        raise ValueError(f"need two row counts or more, prm_batch >= 1, repeats >= 1 and context >= 2; got "
                         f"{list(rows)}, {prm_batch}, {repeats}, {context}")
    gen_url, prm_url = generator_url.rstrip("/"), prm_url.rstrip("/")
    gen_info = read_server_info(gen_url)
    gen = _Timer(gen_url, _vocab(gen_info.get("model_path")))
    prm = _Timer(prm_url, _vocab(read_server_info(prm_url).get("model_path")))
    # decode as long as the generator's context allows (SGLang refuses a request beyond it): its
    # --context-length, else the model's
    context_len = gen_info.get("context_length") or model_config_int(gen_info.get("model_path"), "max_position_embeddings")
    room = int(context_len or 4096) - generator_context - 2
    if room < 64:
        raise ProfileError(f"{gen_url}: a context of {room + generator_context + 2} tokens leaves too little "
                           "room to keep requests decoding")
    rows = rows_within_cap(rows, running_request_cap(gen_info))
    try:
        prm.wall(prm.prompts(2, 32, "slowdown-warm-up"), 1)
        points = []
        for b in rows:
            times = []
            for r in range(repeats):
                prompts = prm.prompts(prm_batch, int(context), f"slowdown/{b}/{r}")   # fresh: a cold prefill
                decoding = _Decoding(gen_url, gen.prompts(b, generator_context, f"slowdown/{b}/{r}"), room) if b else None
                try:
                    if decoding is not None:
                        decoding.wait_started(timeout=300)
                    times.append(prm.wall(prompts, 1))
                finally:
                    if decoding is not None:
                        decoding.stop()
            points.append((b, min(times)))
    finally:
        gen.close()
        prm.close()
    return VerifierSlowdown.of(points)


def slowdown_key(generator: dict, prm: dict, rows: Sequence[int], prm_batch: int, context: int) -> str:
    blob = json.dumps({"generator": generator, "prm": prm, "machine": machine_identity(), "rows": list(rows),
                       "prm_batch": prm_batch, "context": context, "format": FORMAT}, sort_keys=True)
    name = Path(str(prm.get("model_path") or "prm")).name or "prm"
    return f"slowdown-{name}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def slowdown_for_servers(generator_url: str, prm_url: str, *, rows: Sequence[int] = DEFAULT_ROWS,
                         prm_batch: int = DEFAULT_PRM_BATCH, context: int = DEFAULT_CONTEXT,
                         cache_dir: str | os.PathLike | None = None, remeasure: bool = False) -> MeasuredSlowdown:
    """The PRM's slowdown beside generation on this pair of servers: from the cache when the pair
    (as each reports itself) was measured on this machine before, else measured now and saved. A
    corrupt cached file raises :class:`~sgl_tts.launch.cpu_profile.ProfileError` (``remeasure``
    replaces it)."""
    gen_id, prm_id = server_identity(generator_url), server_identity(prm_url)
    path = Path(cache_dir or curve_dir()).expanduser() / f"{slowdown_key(gen_id, prm_id, rows, prm_batch, context)}.json"
    if path.exists() and not remeasure:
        got = read_cached(path, MeasuredSlowdown.from_json, "verifier slowdown")
        log.info("verifier slowdown of %s beside %s from %s (measured %s)", prm_url, generator_url, path, got.date)
        return got
    log.info("measuring the slowdown of %s beside %s at %s generator rows", prm_url, generator_url, list(rows))
    slowdown = measure_verifier_slowdown(generator_url, prm_url, rows=rows, prm_batch=prm_batch, context=context)
    got = MeasuredSlowdown(slowdown, gen_id, prm_id, machine_identity(), prm_batch, int(context),
                           datetime.date.today().isoformat(), str(path))
    write_json_atomically(path, got.to_json())
    log.info("verifier slowdown saved to %s: %s (%.3f per generator row)", path,
             ", ".join(f"{b} rows: {t:.3f} s" for b, t in slowdown.points), slowdown.per_row)
    return got


__all__ = ["MeasuredSlowdown", "measure_verifier_slowdown", "rows_within_cap",
           "slowdown_for_servers", "slowdown_key"]
