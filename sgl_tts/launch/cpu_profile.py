"""A model's measured cost on a live SGLang CPU server: the memory planner's cost model on the CPU.

On a GPU the planner prices a batch with a roofline (:class:`sgl_tts.launch.memory.Roofline`: peak
FLOP/s and bandwidth from a datasheet). A CPU server has no such ceilings worth quoting (one OpenMP
thread per server, Python scheduling between steps, SGLang's ``torch_native`` attention looping over
sequences), so here the costs are measured: :func:`measure_profile` starts the model on a real
``sglang.launch_server`` (the flags :mod:`sgl_tts.launch.cpu_serving` gives every CPU server, one at a
time, through :class:`sgl_tts.launch.live_servers.LiveServers`) and times ``/generate`` over a grid of
batch sizes x context lengths. At each point (B, C) it sends B distinct prompts of ``C - D/2`` token ids
at once (client wall time until the last answer):

1. ``max_new_tokens`` 1, cold cache: the prefill of B x (C - D/2) tokens (with the HTTP round trip and
   the scheduler's per-batch work, a real part of a PRM's cost) -> ``prefill(B, C - D/2)``;
2. the same prompts again, ``max_new_tokens`` 1: every prompt is in the radix cache, one token each
   is extended -> the fixed part;
3. the same prompts, ``max_new_tokens`` 1 + D (``ignore_eos``): the fixed part and D decode steps whose
   context runs from C - D/2 to C + D/2 -> ``decode_step(B, C) = (t3 - t2) / D``.

The radix cache is flushed before each timing of a point (``/flush_cache``); the repeats take turns
over the whole grid, and each time is the minimum over the repeats (other load on the cores only adds
time, and a burst of it falls on one repeat of several points, not on every repeat of one). :class:`CpuProfile` holds the two tables and
interpolates them with the interface of :class:`~sgl_tts.launch.memory.Roofline` (``prefill(batch,
tokens)``, ``decode_step(batch, cached)``), so :func:`sgl_tts.launch.memory.solve` takes either.
Profiles are cached as JSON under ``~/.cache/sgl-tts/profiles/`` keyed by the model's config, the
machine, SGLang's version and the serving settings (:func:`profile_key`); :func:`load_or_measure`
measures only what is missing (or everything, with ``remeasure``).
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import random
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

from sgl_tts.launch.server_api import flush_cache

log = logging.getLogger(__name__)

PROFILE_DIR = Path.home() / ".cache" / "sgl-tts" / "profiles"
FORMAT = 1   # bumped when the file's meaning changes: older files are measured again


class ProfileError(ValueError):
    """A cached profile cannot be read (corrupt or of another format), or a measurement failed."""


def write_json_atomically(path: str | os.PathLike, data: dict) -> Path:
    """Write ``data`` as JSON to ``path`` through a temporary file beside it: a crash or a reader
    never sees half a file under the name (every cached measurement is saved this way)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path


def read_cached(path: str | os.PathLike, parse, what: str):
    """``parse(data, path)`` of the cached JSON measurement at ``path``; one that does not parse (corrupt,
    or of another format) raises :class:`ProfileError` naming the file (it is never silently replaced:
    remeasuring does that)."""
    try:
        return parse(json.loads(Path(path).read_text()), str(path))
    except (ValueError, KeyError, TypeError) as exc:
        raise ProfileError(f"{path}: not a {what} ({exc}); remeasure to replace it") from exc


@dataclasses.dataclass(frozen=True)
class ProfileGrid:
    """Where a profile is measured: every batch size x every context length, ``decode_tokens`` decode
    steps per point (the difference of two generation lengths), ``repeats`` times (the minimum kept)."""

    batches: tuple[int, ...] = (1, 4, 16, 64)
    contexts: tuple[int, ...] = (128, 512, 1024)
    decode_tokens: int = 16
    repeats: int = 2

    def __post_init__(self):
        for name in ("batches", "contexts"):
            values = tuple(int(v) for v in getattr(self, name))
            if not values or list(values) != sorted(set(values)) or values[0] < 1:
                raise ValueError(f"{name} must be distinct increasing positive integers, got {list(values)}")
            object.__setattr__(self, name, values)
        if self.decode_tokens < 2 or self.repeats < 1:
            raise ValueError("decode_tokens must be >= 2 and repeats >= 1")
        if self.contexts[0] <= self.decode_tokens:
            raise ValueError(f"the shortest context ({self.contexts[0]}) must exceed decode_tokens "
                             f"({self.decode_tokens}): its prompts are C - decode_tokens / 2 long")

    @property
    def points(self) -> int:
        return len(self.batches) * len(self.contexts)

    def within(self, context: int) -> "ProfileGrid":
        """This grid for a model of ``context`` tokens (0: unknown, the grid as is): a point's longest
        request is a prompt of ``C - decode_tokens // 2`` tokens asking for ``decode_tokens + 1`` more.
        SGLang 0.5.15 refuses a prompt past the model's context (400 Bad Request) and cuts the new
        tokens at ``context - 1 - prompt - 1``, so longer contexts give way to the longest that fits
        (the shipped tiny models have 512 positions: (128, 512, 1024) becomes (128, 501))."""
        if context <= 0:
            return self
        longest = context - (self.decode_tokens - self.decode_tokens // 2) - 3
        if longest <= self.decode_tokens:
            raise ValueError(f"a model of {context} tokens of context has no room for a profile's requests "
                             f"({self.decode_tokens} decode tokens)")
        contexts = tuple(sorted({min(c, longest) for c in self.contexts}))
        return self if contexts == self.contexts else dataclasses.replace(self, contexts=contexts)


DEFAULT_GRID = ProfileGrid()


def _axis(values: Sequence[int], x: float) -> tuple[int, int, float]:
    """Neighbours ``i, j`` and weight ``w`` of ``x`` on an increasing axis: held at the first value
    below it (a smaller batch or context costs no less than the fixed part measured at the first
    point), linear between points, extended linearly past the last (cost grows linearly in batch and
    context beyond the grid: the weights' and the KV's passes)."""
    if len(values) == 1 or x <= values[0]:
        return 0, 0, 0.0
    k = min(bisect.bisect_right(values, x), len(values) - 1)
    i, j = k - 1, k
    return i, j, (x - values[i]) / (values[j] - values[i])


def _bilinear(batches: Sequence[int], contexts: Sequence[int],
              table: Sequence[Sequence[float]], batch: float, tokens: float) -> float:
    bi, bj, bw = _axis(batches, batch)
    ci, cj, cw = _axis(contexts, tokens)
    low = table[bi][ci] * (1 - cw) + table[bi][cj] * cw
    high = table[bj][ci] * (1 - cw) + table[bj][cj] * cw
    value = low * (1 - bw) + high * bw
    return max(value, min(min(r) for r in table))   # extrapolating a noisy slope never goes below the least measured


@dataclasses.dataclass(frozen=True)
class CpuProfile:
    """A model's measured seconds per batch on this machine's CPU (see the module docstring).

    Attributes:
        model: the model's name (its folder's). key: :func:`profile_key` of what was measured.
        machine: :func:`sgl_tts.machine.describe`; cpu, cores: the CPU model and the cores this process may use.
        sglang: SGLang's version. date: ISO date of the measurement. settings: the server settings
            measured (dtype, attention, OpenMP threads per server).
        batches, contexts: the grid's axes. prefill_seconds[i][j]: prefill of ``batches[i]`` requests of
            ``contexts[j] - decode_tokens / 2`` tokens. decode_seconds[i][j]: one decode step of
            ``batches[i]`` requests over ``contexts[j]`` cached tokens each.
    """

    model: str
    key: str
    machine: str
    cpu: str
    cores: int
    sglang: str
    date: str
    settings: dict
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    decode_tokens: int
    prefill_seconds: tuple[tuple[float, ...], ...]
    decode_seconds: tuple[tuple[float, ...], ...]

    def __post_init__(self):
        for name in ("prefill_seconds", "decode_seconds"):
            table = tuple(tuple(float(v) for v in row) for row in getattr(self, name))
            if len(table) != len(self.batches) or any(len(r) != len(self.contexts) for r in table):
                raise ValueError(f"{name} must be {len(self.batches)} x {len(self.contexts)} (batches x contexts)")
            if any(v <= 0 for r in table for v in r):
                raise ValueError(f"{name} must be positive")
            object.__setattr__(self, name, table)
        object.__setattr__(self, "batches", tuple(int(b) for b in self.batches))
        object.__setattr__(self, "contexts", tuple(int(c) for c in self.contexts))

    def prefill(self, batch: int, tokens: int) -> float:
        """Seconds to prefill ``batch`` requests of ``tokens`` tokens (interpolated, see :func:`_axis`)."""
        prompts = [c - self.decode_tokens // 2 for c in self.contexts]
        return _bilinear(self.batches, prompts, self.prefill_seconds, batch, tokens)

    def decode_step(self, batch: int, cached: float) -> float:
        """Seconds of one decode step of ``batch`` requests over ``cached`` tokens each."""
        return _bilinear(self.batches, self.contexts, self.decode_seconds, batch, cached)

    def to_json(self) -> dict:
        return {"format": FORMAT, **json.loads(json.dumps(dataclasses.asdict(self)))}

    @classmethod
    def from_json(cls, data: dict) -> "CpuProfile":
        if data.get("format") != FORMAT:
            raise ValueError(f"profile format {data.get('format')!r}, this version reads {FORMAT}")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items() if k in fields})

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile as JSON (atomically: a reader never sees half a file)."""
        return write_json_atomically(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CpuProfile":
        """Read a profile; :class:`ProfileError` names the file when it is not one."""
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ProfileError(f"the cached CPU profile {path} is corrupt or from another version ({exc}); "
                               f"delete it or measure again with --remeasure") from None

    def summary(self) -> str:
        """The two tables as Markdown (milliseconds)."""
        lines = [f"{self.model} on {self.machine}, SGLang {self.sglang}, {self.date}, {self.settings}", "",
                 "| batch | " + " | ".join(f"prefill {c - self.decode_tokens // 2} tok (ms)" for c in self.contexts)
                 + " | " + " | ".join(f"decode step @{c} (ms)" for c in self.contexts) + " |",
                 "|---:|" + "---:|" * (2 * len(self.contexts))]
        for b, pre, dec in zip(self.batches, self.prefill_seconds, self.decode_seconds):
            lines.append(f"| {b} | " + " | ".join(f"{1e3 * v:.1f}" for v in pre) + " | "
                         + " | ".join(f"{1e3 * v:.2f}" for v in dec) + " |")
        return "\n".join(lines)


def _config_digest(model: str | os.PathLike) -> str:
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    cfg = json.loads(path.read_text())
    return json.dumps(cfg, sort_keys=True)


def machine_identity() -> dict:
    """What a profile is valid for besides the model: CPU model, usable cores, SGLang's version."""
    from importlib.metadata import version

    from sgl_tts.machine import cpu_model, usable_cores

    return {"cpu": cpu_model(), "cores": usable_cores(), "sglang": version("sglang")}


def profile_key(model: str | os.PathLike, settings: dict, grid: ProfileGrid = DEFAULT_GRID) -> str:
    """The cache key: the model's folder name and a hash of its ``config.json`` (sorted), the machine
    (:func:`machine_identity`), the server settings and the grid."""
    blob = json.dumps({"config": _config_digest(model), "machine": machine_identity(), "settings": settings,
                       "grid": dataclasses.asdict(grid), "format": FORMAT}, sort_keys=True)
    name = Path(model).name if Path(model).is_dir() else Path(model).parent.name
    return f"{name}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def server_settings(dtype: str | None = None, attention: str = "native") -> dict:
    """The serving settings a profile depends on (and is keyed by)."""
    from sgl_tts.launch.cpu_serving import CPU_ENV

    return {"dtype": dtype, "attention": attention, "omp_threads": CPU_ENV["OMP_NUM_THREADS"]}


# ------------------------------------------------------------------------------------ measurement
def _post(url: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as res:
        return json.loads(res.read() or b"{}")


class _Timer:
    """Sends a batch of prompts (token ids) to ``/generate`` at once and times the batch."""

    def __init__(self, url: str, vocab: int):
        self.url, self.vocab = url, vocab
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="profile")

    def prompts(self, batch: int, length: int, salt: str) -> list[list[int]]:
        """``batch`` distinct prompts (no shared prefix: the first id differs) of ``length`` ids."""
        rng = random.Random(f"cpu-profile/{salt}/{batch}/{length}")
        low, high = 8, max(16, self.vocab - 16)   # clear of the specials at either end of a vocabulary
        return [[low + (i % (high - low))] + [rng.randrange(low, high) for _ in range(length - 1)]
                for i in range(batch)]

    def wall(self, prompts: list[list[int]], new_tokens: int) -> float:
        body = lambda ids: {"input_ids": ids, "sampling_params": {  # noqa: E731
            "max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}
        start = time.perf_counter()
        results = list(self.pool.map(lambda ids: _post(self.url + "/generate", body(ids)), prompts))
        seconds = time.perf_counter() - start
        got = {r.get("meta_info", {}).get("completion_tokens") for r in results}
        if got != {new_tokens}:
            raise ProfileError(f"asked for {new_tokens} new tokens per request, the server generated {got}")
        return seconds

    def flush(self) -> None:
        """Empty the radix cache (:func:`sgl_tts.launch.server_api.flush_cache`; a refusal raises)."""
        flush_cache(self.url, timeout=30)

    def close(self) -> None:
        self.pool.shutdown()


def _sample_point(timer: _Timer, batch: int, context: int, grid: ProfileGrid) -> tuple[float, float, float]:
    """One timing of one grid point: (prefill, 1 decode token, 1 + decode_tokens) seconds."""
    prompts = timer.prompts(batch, context - grid.decode_tokens // 2, "grid")
    timer.flush()
    return (timer.wall(prompts, 1), timer.wall(prompts, 1), timer.wall(prompts, 1 + grid.decode_tokens))


def _point_from_samples(samples: Sequence[tuple[float, float, float]], batch: int, context: int,
                        grid: ProfileGrid) -> tuple[float, float]:
    """(prefill seconds, decode step seconds) at one grid point, each from the minimum over its samples."""
    prefill, base, long = (min(column) for column in zip(*samples))
    step = (long - base) / grid.decode_tokens
    if step <= 0:
        log.warning("decode step at batch %d, context %d measured %.2g s (noise): kept at 1 us", batch, context, step)
        step = 1e-6
    return prefill, step


def measure_profile(model: str | os.PathLike, *, dtype: str | None = None, attention: str = "native",
                    extra: Sequence[str] = (), grid: ProfileGrid = DEFAULT_GRID, progress: bool = True,
                    health_timeout: float = 600.0) -> CpuProfile:
    """Start ``model`` alone on a CPU SGLang server (``extra``: more ``launch_server`` flags, e.g.
    ``--load-format dummy``) and measure its :class:`CpuProfile` over ``grid`` (see the module
    docstring). Raises :class:`sgl_tts.launch.serve.ServerFailed` if the server does not come up."""
    from tqdm.auto import tqdm

    from sgl_tts.launch.live_servers import NO_PLUGIN, LiveServer, LiveServers
    from sgl_tts.launch.memory import ModelShape, context_tokens
    from sgl_tts.machine import describe

    settings = server_settings(dtype, attention)
    grid = grid.within(context_tokens(model))
    shape = ModelShape.from_config(model, kv_dtype=dtype)
    cfg = json.loads(((Path(model) / "config.json") if Path(model).is_dir() else Path(model)).read_text())
    # room for the whole point twice over: nothing measured is ever evicted and prefilled again
    tokens = 2 * max(grid.batches) * (max(grid.contexts) + grid.decode_tokens)
    tokens = max(tokens, context_tokens(model))   # SGLang refuses a pool shorter than the context
    spec = LiveServer(str(model), policy=NO_PLUGIN if attention == "native" else "off",
                      kv_bytes=tokens * shape.kv_bytes_per_token, dtype=dtype, cpu_attention=attention,
                      extra=tuple(extra))
    ident = machine_identity()
    with tempfile.TemporaryDirectory(prefix="sgl-tts-profile-") as tmp, \
            LiveServers({"profile": spec}, tmp, health_timeout=health_timeout) as servers:
        log.info("measuring the CPU profile of %s (%d grid points; starting its server)", shape.name, grid.points)
        timer = _Timer(servers.url("profile"), int(cfg.get("vocab_size") or cfg.get("text_config", {})["vocab_size"]))
        try:
            timer.wall(timer.prompts(2, 32, "warm-up"), 4)
            # The repeats take turns over the whole grid (not one point's repeats in a row): a burst of
            # other load on the cores then inflates one sample of several points, and each point's
            # minimum still reads a quiet sample (batch 1 timed at twice batch 8 beside a test run).
            samples: dict[tuple[int, int], list[tuple[float, float, float]]] = {}
            with tqdm(total=grid.points * grid.repeats, desc=f"profile {shape.name}", disable=not progress) as bar:
                for _ in range(grid.repeats):
                    for b in grid.batches:
                        for c in grid.contexts:
                            samples.setdefault((b, c), []).append(_sample_point(timer, b, c, grid))
                            bar.update(1)
            points = [[_point_from_samples(samples[b, c], b, c, grid) for c in grid.contexts] for b in grid.batches]
            prefill = [[p for p, _ in row] for row in points]
            decode = [[d for _, d in row] for row in points]
        finally:
            timer.close()
    return CpuProfile(shape.name, profile_key(model, settings, grid), describe(), ident["cpu"], ident["cores"],
                      ident["sglang"], datetime.date.today().isoformat(), settings, grid.batches, grid.contexts,
                      grid.decode_tokens, prefill, decode)


def load_or_measure(model: str | os.PathLike, *, dtype: str | None = None, attention: str = "native",
                    extra: Sequence[str] = (), grid: ProfileGrid = DEFAULT_GRID, remeasure: bool = False,
                    cache_dir: str | os.PathLike | None = None, progress: bool = True) -> CpuProfile:
    """``model``'s profile from the cache (``cache_dir``, default :data:`PROFILE_DIR`), measured and
    saved when it is missing or ``remeasure`` is set. A corrupt cached file raises
    :class:`ProfileError` (it is not silently replaced: ``remeasure`` does that)."""
    from sgl_tts.launch.memory import context_tokens

    settings = server_settings(dtype, attention)
    grid = grid.within(context_tokens(model))
    path = Path(cache_dir or PROFILE_DIR).expanduser() / f"{profile_key(model, settings, grid)}.json"
    if path.exists() and not remeasure:
        profile = CpuProfile.load(path)
        log.info("CPU profile of %s from %s (measured %s)", profile.model, path, profile.date)
        return profile
    profile = measure_profile(model, dtype=dtype, attention=attention, extra=extra, grid=grid, progress=progress)
    profile.save(path)
    log.info("CPU profile of %s saved to %s", profile.model, path)
    return profile


def pair_costs(generator: str | os.PathLike, prm: str | os.PathLike, *, dtype: str | None = None,
               attention: str = "native", extra: dict[str, Sequence[str]] | None = None, remeasure: bool = False,
               cache_dir: str | os.PathLike | None = None, progress: bool = True):
    """Both models' profiles (:func:`load_or_measure`) as the planner's
    :class:`~sgl_tts.launch.memory.StageCosts`; ``extra``: each model's further server flags by role."""
    from sgl_tts.launch.memory import StageCosts

    extra = extra or {}
    common = dict(dtype=dtype, attention=attention, remeasure=remeasure, cache_dir=cache_dir, progress=progress)
    return StageCosts(load_or_measure(generator, extra=extra.get("generator", ()), **common),
                      load_or_measure(prm, extra=extra.get("prm", ()), **common))


def cpu_plan_from_args(args, *, extra: dict[str, Sequence[str]] | None = None, attention: str | None = None):
    """The planned CPU split the planning options ask for (``sgl-tts plan`` / ``serve`` / ``bench``
    ``--device cpu``): the workload from ``--beams --prompt-tokens --step-tokens --verify-tokens``,
    the budget ``--kv-memory``, profiles from the cache or measured (``--remeasure``, ``--profile-dir``).
    Returns a :class:`sgl_tts.launch.cpu_serving.CpuPairPlan`."""
    from sgl_tts.launch.cpu_serving import plan_cpu_pair
    from sgl_tts.launch.memory import workload_from_args

    dtype = getattr(args, "dtype", None)
    attention = attention or getattr(args, "cpu_attention", None) or "native"
    costs = pair_costs(args.generator, args.prm, dtype=dtype, attention=attention, extra=extra,
                       remeasure=getattr(args, "remeasure", False), cache_dir=getattr(args, "profile_dir", None),
                       progress=not getattr(args, "no_progress", False))
    work = workload_from_args(args)
    return plan_cpu_pair(args.generator, args.prm, args.kv_memory, work, costs, dtype=dtype)


__all__ = ["DEFAULT_GRID", "PROFILE_DIR", "CpuProfile", "ProfileError", "ProfileGrid", "cpu_plan_from_args", "load_or_measure",
           "machine_identity", "measure_profile", "pair_costs", "profile_key", "server_settings"]
