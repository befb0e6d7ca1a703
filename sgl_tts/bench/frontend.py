"""``sgl-tts bench-frontend``: do many searches at once slow each other down?

For each backend (``cpu``: the tiny generator and PRM in this process on :class:`sgl_tts.LocalBackend`;
``server``: live CPU SGLang servers, the generator with the sgl-tts plugin), each program
(``beam_search``, ``best_of_n`` with the PRM, ``mcts``) and each K, it runs max(K, ``--min-searches``)
problems of the arithmetic task's test split with K in flight through the project's own runner
(:func:`sgl_tts.search.runner.run_continuously`, the path ``sgl-tts run`` takes, with ``sgl-tts run``'s
program arguments and a fixed seed), both prefix caches flushed first, and records per block:

- searches, wall seconds, searches/s, generated tokens (the programs' own ``tokens_generated``) and
  tokens/s, accuracy;
- this process's CPU (``getrusage(RUSAGE_SELF)`` user and system seconds over the block) per 1,000
  generated tokens. On the ``cpu`` backend the models run here too, on the generator's and the PRM's
  :class:`~sgl_tts.backends.engine.BatchEngine` threads: their CPU (read per native thread with
  psutil) is reported apart, and the *client* share is the process's CPU minus theirs. On ``server``
  the process is the client, and the servers this command started (their processes and children,
  read with psutil) are the rest of the run's CPU. Reported: the share of system CPU in the run's
  CPU, the client's system CPU as a share of the run's CPU (the goal) and of the client's own;
- the peak thread count (``threading.active_count()``, sampled every 0.2 s);
- the limit: the generator's own decode throughput at the running batch the searches had. That
  batch B is what the generator itself reports over the block: the mean rows per decode iteration
  (``cpu``: the engine's counters; ``server``: the plugin's per-iteration ``batch`` records, which
  need the plugin's metrics file, so a server started by this command). The limit is B concurrent
  plain generations of 64 tokens with ``ignore_eos`` (``cpu``: straight to the engine; ``server``:
  one batched ``POST /generate``); the searches' tokens/s as a fraction of it. The same is recorded
  at the nominal batch, min(K x requests a search keeps in flight, the generator's max running
  requests), which a search reaches only when none of its requests waits on the PRM or on its
  siblings; servers given by URL have no records to read, so there the nominal batch is the limit's;
- on ``server``, from the plugin's records too: the decoded rows' mean context (tokens of sequence
  per row: a row's attention cost grows with it), the seconds the generator spent in decode and in
  extend (prefill) iterations and how many extends it ran, and the limit again at that context: B
  plain generations on prompts cut from the searches' own texts to the block's mean context. The
  goal is judged on this one (the bare-question limit decodes shorter contexts, faster).

Each finished block is appended to ``--out`` (JSONL) at once, naming the machine, the command and the
date; a rerun with the same settings skips the blocks already there. At the end it prints a table and
the goals (PASS/FAIL per line) and writes PREFIX.md and a plot PREFIX.png next to ``--out``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from sgl_tts.bench.cpu_meter import CPUMeter, PeakThreads, process_tree_cpu, thread_cpu  # noqa: F401
from sgl_tts.bench.frontend_report import (  # noqa: F401 - re-exported: their home before the split
    median_runs,
    goals,
    format_report,
    plot_report,
)
from sgl_tts.bench.frontend_settings import (  # noqa: F401
    BACKENDS,
    PROGRAMS,
    LIMIT_NEW_TOKENS,
    GEN_KV_BYTES,
    PRM_KV_BYTES,
    METRICS_FLUSH_WAIT_S,
    _positive_ints,
    _names,
    FrontendSettings,
    cpu_engine_for,
    program_options,
)
from sgl_tts.bench.load import record_store
from sgl_tts.launch.server_api import flush_cache, running_request_cap, server_info
from sgl_tts.launch.serve import sigterm_stops_servers

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------- targets
@dataclasses.dataclass
class Target:
    """What a block runs on.

    Attributes:
        name: ``cpu`` or ``server``.
        generator: the SGLang backend the programs generate on.
        new_prm: a fresh PRM scorer (its score cache empty) per block.
        flush: empties the generator's and the PRM's prefix caches.
        engine_threads: native ids of the threads that run models in this process (``cpu``), whose
            CPU is not the client's.
        max_running: the generator's most running requests.
        decode_limit: ``(batch, prompts) -> tokens/s`` of ``batch`` plain generations.
        close: releases what the target opened.
        decode_meter: called as a block starts; returns the call that, as it ends, gives the
            generator's decode iterations and rows decoded in between (``None``: it cannot tell).
        server_pids: the server processes whose CPU is the run's too (with their children): those
            this command started; none for servers given by URL or the ``cpu`` backend.
        tokenizer: the generator's tokenizer (``server``), for the limit at the searches' context.
        engine_pids: the engine processes of ``cpu`` with ``cpu_engine="process"``: their CPU is
            the engines' (and counted in the process's).
    """

    name: str
    generator: Any
    new_prm: Callable[[], Any]
    flush: Callable[[], None]
    engine_threads: tuple[int, ...]
    max_running: int
    decode_limit: Callable[[int, Sequence[str]], float]
    close: Callable[[], None]
    decode_meter: Callable[[], Callable[[], "DecodeCounts | None"]] = lambda: (lambda: None)
    server_pids: Callable[[], Sequence[int]] = lambda: ()
    tokenizer: Callable[[], Any] | None = None
    engine_pids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class DecodeCounts:
    """The generator's work over a block: ``iterations`` decode forward passes, ``rows`` tokens they
    decoded; from the plugin's records also ``context_tokens`` (the decoded rows' sequence lengths
    summed), and the seconds from each decode or extend (prefill) iteration to the next one
    (``decode_s``, ``extend_s``) with the number of extend iterations (``None``: not known)."""

    iterations: int
    rows: int
    context_tokens: int | None = None
    decode_s: float | None = None
    extend_s: float | None = None
    extend_iterations: int | None = None

    @property
    def mean_context(self) -> float | None:
        """Tokens of context per decoded row (what a decode row's attention reads)."""
        return self.context_tokens / self.rows if self.rows and self.context_tokens is not None else None

    @property
    def mean_batch(self) -> float | None:
        """Rows per decode iteration: the running batch the searches gave the generator."""
        return self.rows / self.iterations if self.iterations else None


def engine_decode_meter(engine) -> Callable[[], DecodeCounts]:
    """Decode iterations and rows of a :class:`~sgl_tts.backends.engine.BatchEngine` from now on."""
    it0, rows0 = engine.stats.decode_forwards, engine.stats.decode_tokens
    return lambda: DecodeCounts(engine.stats.decode_forwards - it0, engine.stats.decode_tokens - rows0)


def metrics_file_records(prefix: str) -> list[dict]:
    """What the sgl-tts plugin of a server started with ``--tts-metrics-file PREFIX`` wrote."""
    from sgl_tts.plugin.scheduling.metrics import read_records, scheduler_files

    files = scheduler_files(prefix)
    if not files:
        raise FileNotFoundError(f"--generator-metrics: no file {prefix}.<pid>; give the generator's "
                                f"--tts-metrics-file (its scheduler writes PREFIX.<pid>)")
    return read_records(files)


def records_decode_counts(records: Iterable[dict], t0: float, t1: float) -> DecodeCounts:
    """Decode iterations and rows in the sgl-tts plugin's scheduler records (``event: batch``, SGLang's
    forward mode ``DECODE``) whose time lies in ``[t0, t1]`` (``time.time()`` seconds), their context
    tokens (``seq_tokens``; ``None`` when a record lacks them) and the time split: each iteration
    counts until the next record (the last one until ``t1``)."""
    batches = sorted((r for r in records if r.get("event") == "batch" and t0 <= r["time"] <= t1),
                     key=lambda r: r["time"])
    decode = [r for r in batches if r.get("mode") == "DECODE"]
    context = [r.get("seq_tokens") for r in decode]
    seconds = {"DECODE": 0.0, "EXTEND": 0.0}
    for r, nxt in zip(batches, [*(b["time"] for b in batches[1:]), t1]):
        if r.get("mode") in seconds:
            seconds[r["mode"]] += max(0.0, nxt - r["time"])
    return DecodeCounts(len(decode), sum(r["batch_size"] for r in decode),
                        None if any(c is None for c in context) else sum(context),
                        round(seconds["DECODE"], 3), round(seconds["EXTEND"], 3),
                        sum(r.get("mode") == "EXTEND" for r in batches))


def context_prompts(tokenizer, texts: Sequence[str], tokens: int, count: int) -> list[str]:
    """``count`` prompts of ``tokens`` tokens each, cut from ``texts`` (each repeated until it is long
    enough), in turn: plain generations on them decode at the context a block's searches had."""
    out = []
    for i in range(count):
        text = texts[i % len(texts)]
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError(f"context_prompts: text {i % len(texts)} has no tokens")
        ids = (ids * (tokens // len(ids) + 1))[:tokens]
        out.append(tokenizer.decode(ids))
    return out


def search_texts(problems: Sequence[Any], results: Sequence[Any]) -> list[str]:
    """Per search: its prompt followed by its trajectories' steps (what its requests decoded on)."""
    from sgl_tts.search import STEP_DELIMITER

    return [p.question + STEP_DELIMITER + STEP_DELIMITER.join(st for t in r.trajectories for st in t.steps)
            for p, r in zip(problems, results)]


def cpu_decode_limit(backend, batch: int, prompts: Sequence[str], temperature: float, seed: int,
                     new_tokens: int = LIMIT_NEW_TOKENS) -> float:
    """Tokens/s of ``batch`` concurrent plain generations of ``new_tokens`` each (``ignore_eos``),
    submitted straight to a :class:`~sgl_tts.LocalBackend`'s engine."""
    from sgl_tts.backends.engine import SamplingSpec

    ids = [backend.encode(p) for p in prompts]
    t0 = time.perf_counter()
    futs = [backend.engine.submit(ids[i % len(ids)], SamplingSpec(max_new_tokens=new_tokens, ignore_eos=True,
                                                                  temperature=temperature, seed=seed + i))
            for i in range(batch)]
    generated = sum(len(f.result().output_ids) for f in futs)
    return generated / (time.perf_counter() - t0)


def _http_json(url: str, body: dict | None = None, timeout: float = 900.0) -> Any:
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as res:
        return json.loads(res.read())


def server_decode_limit(url: str, batch: int, prompts: Sequence[str], temperature: float,
                        new_tokens: int = LIMIT_NEW_TOKENS) -> float:
    """Tokens/s of ``batch`` concurrent plain generations on an SGLang server: one ``POST /generate``
    with ``batch`` prompts and ``sampling_params: {max_new_tokens, ignore_eos: true}`` (the server
    admits them together, as many requests would be)."""
    body = {"text": [prompts[i % len(prompts)] for i in range(batch)],
            "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": temperature}}
    t0 = time.perf_counter()
    out = _http_json(url.rstrip("/") + "/generate", body)
    wall = time.perf_counter() - t0
    outs = out if isinstance(out, list) else [out]
    return sum(int(o["meta_info"]["completion_tokens"]) for o in outs) / wall


def server_max_running(url: str) -> int:
    """The server's max running requests (its :func:`~sgl_tts.launch.server_api.server_info`: what the
    scheduler settled on)."""
    cap = running_request_cap(server_info(url))
    if cap is None:
        raise RuntimeError(f"{url}/server_info names no max running requests")
    return cap


def open_cpu(s: FrontendSettings, layout=None) -> Target:
    """The tiny generator and PRM on :class:`~sgl_tts.LocalBackend` engines laid out as ``layout``
    (a :class:`~sgl_tts.backends.local.EngineLayout`; default: threads of this process, 256 rows)."""
    from sgl_tts.backends.layout import DEFAULT_RUNNING_CAP, EngineLayout

    layout = layout or EngineLayout("thread", DEFAULT_RUNNING_CAP)
    from sgl_tts import LocalBackend
    from sgl_tts.models import shipped_model
    from sgl_tts.prm import StepTagPRM

    gen = LocalBackend(shipped_model("generator"), seed=s.seed, **layout.options())
    try:
        prm_backend = LocalBackend(shipped_model("prm"), seed=s.seed, **layout.prm_options())
    except BaseException:
        gen.shutdown()
        raise
    ids = tuple(i for i in (gen.engine.native_thread_id, prm_backend.engine.native_thread_id) if i is not None)
    pids = tuple(p for b in (gen, prm_backend)
                 for p in getattr(b.engine, "pids", (getattr(b.engine, "pid", None),)))

    def flush() -> None:
        gen.flush_cache()
        prm_backend.flush_cache()

    def close() -> None:
        gen.shutdown()
        prm_backend.shutdown()

    return Target("cpu", gen, lambda: StepTagPRM(prm_backend), flush, ids, gen.engine.max_running,
                  lambda b, prompts: cpu_decode_limit(gen, b, prompts, s.temperature, s.seed), close,
                  lambda: engine_decode_meter(gen.engine),
                  engine_pids=tuple(p for p in pids if p is not None))


def open_server(s: FrontendSettings, generator_url: str, prm_url: str,
                generator_records: Callable[[], list[dict]] | None = None,
                server_pids: Callable[[], Sequence[int]] = lambda: ()) -> Target:
    """The generator and PRM servers at these URLs; ``generator_records`` reads the generator's
    plugin metrics records (without them the generator's running batch is not known);
    ``server_pids`` names the server processes whose CPU to count (those started here)."""
    from sgl_tts.backends import SGLangEndpoint
    from sgl_tts.prm import StepTagPRM

    gen = SGLangEndpoint(generator_url)
    prm_backend = SGLangEndpoint(prm_url)

    def flush() -> None:
        for url in (generator_url, prm_url):
            flush_cache(url)

    def decode_meter() -> Callable[[], DecodeCounts | None]:
        t0 = time.time()

        def stop() -> DecodeCounts | None:
            if generator_records is None:
                return None
            t1 = time.time()
            # The plugin writes its records out every second (SchedulerMetrics.flush_seconds); a
            # block's last iterations are on disk after that. A benchmark driver's one wait.
            time.sleep(METRICS_FLUSH_WAIT_S)
            return records_decode_counts(generator_records(), t0, t1)
        return stop

    return Target("server", gen, lambda: StepTagPRM(prm_backend), flush, (), server_max_running(generator_url),
                  lambda b, prompts: server_decode_limit(generator_url, b, prompts, s.temperature), lambda: None,
                  decode_meter, server_pids, lambda: gen.tokenizer)


def start_servers(workdir: str | None = None, cpu_attention: str = "ragged"):
    """The tiny generator (plugin, prefix-aware, seeded sampling) and the tiny PRM as live CPU servers,
    both with the plugin's ``--tts-cpu-attention`` ``cpu_attention`` (the PRM: plugin policy off)."""
    from sgl_tts.launch.live_servers import NO_PLUGIN, LiveServer, LiveServers
    from sgl_tts.models import shipped_model

    return LiveServers({
        "generator": LiveServer(str(shipped_model("generator")), policy="prefix-aware", kv_bytes=GEN_KV_BYTES,
                                metrics=True, seeded_sampling=True, cpu_attention=cpu_attention),
        "prm": LiveServer(str(shipped_model("prm")), kv_bytes=PRM_KV_BYTES, cpu_attention=cpu_attention,
                          policy=NO_PLUGIN if cpu_attention == "native" else "off")},
        workdir or tempfile.mkdtemp(prefix="sgl-tts-bench-frontend-"))


# ------------------------------------------------------------------------------------- a block
def run_block(target: Target, program: str, k: int, problems: Sequence[Any], s: FrontendSettings, *,
              progress: bool = True) -> tuple[dict[str, Any], list[Any]]:
    """Run ``program`` over the first max(K, min_searches) problems with K in flight on ``target``.

    Returns the block's measurements (no limit or provenance fields yet) and the searches'
    :class:`~sgl_tts.search.SearchResult` in problem order. A failed search raises after the block.
    """
    from tqdm.auto import tqdm

    from sgl_tts.experiment import program_function
    from sgl_tts.search.runner import run_continuously

    cfg = s.run_config(program)
    fn = program_function(program)
    prm = target.new_prm()
    n = s.searches(k)
    if n > len(problems):
        raise ValueError(f"{n} searches need {n} problems, got {len(problems)}")
    args = [cfg.program_arguments(p.question, prm) for p in problems[:n]]
    results: list[Any] = [None] * n
    errors: list[str] = []
    bar = tqdm(total=n, desc=f"{target.name} {program} K={k}", unit="search", disable=not progress, leave=False)
    decode_counts = target.decode_meter()
    with PeakThreads() as threads, CPUMeter(target.engine_threads, target.server_pids(),
                                                   target.engine_pids) as cpu:
        started_at = time.time()
        t0 = time.perf_counter()
        for i, state in run_continuously(fn, args, backend=target.generator, in_flight=k, total=n):
            err = state if isinstance(state, BaseException) else state.error()
            if err is not None or state.ret_value is None:
                errors.append(f"search {i}: {err!r}" if err is not None else f"search {i} returned nothing")
            else:
                results[i] = state.ret_value
            bar.update(1)
        wall = time.perf_counter() - t0
        ended_at = time.time()
    bar.close()
    decoded = decode_counts()
    if errors:
        raise RuntimeError(f"{target.name} {program} K={k}: {len(errors)} of {n} searches failed; first: {errors[0]}")
    tokens = sum(r.tokens_generated for r in results)
    correct = sum(r.answer is not None and r.answer == str(p.answer) for r, p in zip(results, problems))
    # the run's CPU: this process's, and the servers' when they were started here
    run_cpu = cpu.user + cpu.system + cpu.server_user + cpu.server_system
    client_user, client_system = max(0.0, cpu.user - cpu.engine_user), max(0.0, cpu.system - cpu.engine_system)

    def per_1k(x: float) -> float | None:
        return round(1000 * x / tokens, 4) if tokens else None

    rec = {"backend": target.name, "program": program, "k": k, "searches": n, "wall_s": round(wall, 3),
           "started_at": round(started_at, 3), "ended_at": round(ended_at, 3),
           "searches_per_s": round(n / wall, 4), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
           "cpu_user_s": round(cpu.user, 3), "cpu_system_s": round(cpu.system, 3),
           "engine_threads": len(target.engine_threads), "engine_processes": len(target.engine_pids),
           "engine_user_s": round(cpu.engine_user, 3), "engine_system_s": round(cpu.engine_system, 3),
           "client_user_s": round(client_user, 3), "client_system_s": round(client_system, 3),
           "cpu_user_per_1k_tokens": per_1k(cpu.user), "cpu_system_per_1k_tokens": per_1k(cpu.system),
           "client_user_per_1k_tokens": per_1k(client_user), "client_system_per_1k_tokens": per_1k(client_system),
           "server_processes": len(target.server_pids()),
           "server_user_s": round(cpu.server_user, 3), "server_system_s": round(cpu.server_system, 3),
           "system_share": round((cpu.system + cpu.server_system) / run_cpu, 4) if run_cpu else None,
           "client_system_share": round(client_system / run_cpu, 4) if run_cpu else None,
           "client_own_system_share": round(client_system / (client_user + client_system), 4)
           if client_user + client_system else None,
           "peak_threads": threads.peak, "correct": correct, "accuracy": round(correct / n, 4),
           "decode_iterations": None if decoded is None else decoded.iterations,
           "decode_rows": None if decoded is None else decoded.rows,
           "decode_batch_mean": None if decoded is None or decoded.mean_batch is None
           else round(decoded.mean_batch, 2),
           "decode_context_mean": None if decoded is None or decoded.mean_context is None
           else round(decoded.mean_context, 1),
           "decode_s": None if decoded is None else decoded.decode_s,
           "extend_s": None if decoded is None else decoded.extend_s,
           "extend_iterations": None if decoded is None else decoded.extend_iterations}
    return rec, results


# ------------------------------------------------------------------------------------- the run
def settings_from_values(values: Mapping[str, Any], *, quick: bool = False) -> FrontendSettings:
    """The settings from command-line values by field name (None or absent: not given; ``backends``,
    ``programs`` and ``ks`` comma-separated): ``quick``'s presets first, given values over them. A bad
    value raises ``ValueError`` whose message starts with the flag."""
    out: dict[str, Any] = dict(FrontendSettings.QUICK) if quick else {}
    out["backends"] = _names(values["backends"], "--backends", BACKENDS)
    out["programs"] = _names(values["programs"], "--programs", PROGRAMS)
    if values.get("ks") is not None:
        out["ks"] = _positive_ints(values["ks"], "--ks")
    for f in dataclasses.fields(FrontendSettings):
        if f.name not in ("backends", "programs", "ks") and values.get(f.name) is not None:
            out[f.name] = values[f.name]
    return FrontendSettings(**out)


def pending_runs(s: FrontendSettings, records: Sequence[dict], repeats: int) -> tuple[list[tuple[str, str, int]], int]:
    """The (backend, program, K) runs still to do for ``repeats`` runs of each block, given the records
    already written, and how many are there already (skipped)."""
    done = collections.Counter((r["backend"], r["program"], r["k"]) for r in records)
    # run by run: each block's first run, then each one's second, ... (a cut-short run has them all
    # once); run_frontend takes them one backend at a time, in this order
    todo = [(b, p, k) for i in range(repeats) for b in s.backends for p in s.programs for k in sorted(s.ks)
            if done[(b, p, k)] <= i]
    return todo, len(s.backends) * len(s.programs) * len(s.ks) * repeats - len(todo)


def _server_pids(servers, names: Sequence[str]) -> list[int]:
    return [pid for pid in (servers.pid(n) for n in names) if pid is not None] if servers else []


class Targets:
    """What blocks run on, opened when a block first needs it: on ``cpu`` one target per engine
    placement (threads, processes), on ``server`` the servers given by URL or, for those not given,
    the tiny generator and PRM started here (stopped by :meth:`close`)."""

    def __init__(self, s: FrontendSettings, *, generator_url: str | None = None, prm_url: str | None = None,
                 generator_metrics: str | None = None):
        self.s = s
        self.generator_url, self.prm_url, self.generator_metrics = generator_url, prm_url, generator_metrics
        self.servers = None
        self.opened: dict[tuple[str, Any], Target] = {}

    def for_block(self, backend: str, program: str, k: int) -> Target:
        layout = cpu_engine_for(self.s, program, k) if backend == "cpu" else None
        if (backend, layout) not in self.opened:
            self.opened[(backend, layout)] = open_cpu(self.s, layout) if backend == "cpu" else self._open_server()
        return self.opened[(backend, layout)]

    def _open_server(self) -> Target:
        gen_url, prm_url, metrics = self.generator_url, self.prm_url, self.generator_metrics
        started: list[str] = []
        if gen_url is None or prm_url is None:
            self.servers = self.servers or start_servers(cpu_attention=self.s.server_attention)
            if gen_url is None:
                metrics = str(self.servers.metrics_prefix("generator"))
                started.append("generator")
            if prm_url is None:
                started.append("prm")
            gen_url = gen_url or self.servers.url("generator")
            prm_url = prm_url or self.servers.url("prm")
        records_of = None if metrics is None else functools.partial(metrics_file_records, metrics)
        pids_of = functools.partial(_server_pids, self.servers, tuple(started))
        return open_server(self.s, gen_url, prm_url, records_of, pids_of)

    def close(self, backend: str | None = None) -> None:
        """Close the targets of ``backend`` (all when None; then stop the servers started here)."""
        for key in [key for key in self.opened if backend in (None, key[0])]:
            self.opened.pop(key).close()
        if backend is None and self.servers is not None:
            self.servers.stop_all()


class Limits:
    """The generator's decode limits, each measured once per target name, batch and context; those in
    the records already written count as measured."""

    def __init__(self, records: Sequence[dict], prompts: Sequence[str], problems: Sequence[Any]):
        self.prompts, self.problems = prompts, problems
        self.known: dict[tuple, float] = {(r["backend"], r["limit_batch"]): r["limit_tokens_per_s"] for r in records}

    def at(self, target: Target, batch: int, length: int | None = None, results: Sequence[Any] = ()) -> float:
        """Tokens/s of ``batch`` plain generations: on the bare questions, or (``length``) on prompts of
        that many tokens cut from the block's own search texts."""
        key = (target.name, batch) if length is None else (target.name, batch, length)
        if key not in self.known:
            target.flush()
            prompts = self.prompts if length is None else context_prompts(
                target.tokenizer(), search_texts(self.problems, results), length, batch)
            self.known[key] = round(target.decode_limit(batch, prompts), 2)
            logger.info("%s decode limit at B=%d%s: %.0f tokens/s", target.name, batch,
                        "" if length is None else f", {length} prompt tokens", self.known[key])
        return self.known[key]

    def add_to(self, rec: dict, target: Target, nominal: int, results: Sequence[Any]) -> None:
        """The block's limit fields: at its observed running batch (``nominal`` when not known), at the
        nominal batch, and (when the generator reported its context) at the searches' context."""
        mean = rec["decode_batch_mean"]
        batch = nominal if mean is None else max(1, round(mean))
        limit, nominal_limit = self.at(target, batch), self.at(target, nominal)
        context = rec["decode_context_mean"]
        if context is not None and target.tokenizer is not None:
            # the same batch at the searches' context: plain generations whose prompts are cut from
            # the searches' own texts, so that their mean context over the LIMIT_NEW_TOKENS decoded
            # equals the block's
            length = max(1, round(context - (LIMIT_NEW_TOKENS + 1) / 2))
            context_limit = self.at(target, batch, length, results)
            rec.update(context_limit_prompt_tokens=length, context_limit_tokens_per_s=context_limit,
                       context_limit_fraction=round(rec["tokens_per_s"] / context_limit, 4))
        rec.update(limit_batch=batch, limit_batch_source="nominal" if mean is None else "observed",
                   limit_new_tokens=LIMIT_NEW_TOKENS,
                   limit_tokens_per_s=limit, limit_fraction=round(rec["tokens_per_s"] / limit, 4),
                   nominal_batch=nominal, nominal_limit_tokens_per_s=nominal_limit,
                   nominal_limit_fraction=round(rec["tokens_per_s"] / nominal_limit, 4))


def run_frontend(s: FrontendSettings, out: Path, records: list[dict], todo: Sequence[tuple[str, str, int]], *,
                 command: str, quick: bool = False, generator_url: str | None = None, prm_url: str | None = None,
                 generator_metrics: str | None = None, progress: bool = True) -> tuple[str, Path]:
    """Run the ``todo`` blocks (:func:`pending_runs`), appending each record to ``out`` (JSONL) and
    ``records`` as it finishes; the servers not given by URL are started here and stopped at the end,
    SIGTERM included. Writes the table of the settings' blocks to ``out``.md and the plot to ``out``.png;
    returns the table and the plot's path."""
    from sgl_tts.tiny import task
    from sgl_tts.machine import describe

    key = s.key()
    store = record_store(out, key)
    problems = task.test_split()[:s.searches(max(s.ks))]
    limits = Limits(records, [p.question + "\n\n" for p in problems], problems)
    provenance = {"machine": describe(), "command": command}
    targets = Targets(s, generator_url=generator_url, prm_url=prm_url, generator_metrics=generator_metrics)
    settings = {k_: v for k_, v in dataclasses.asdict(s).items() if k_ not in FrontendSettings.NOT_IN_KEY}
    # SIGTERM (a job runner, timeout) ends the run as Ctrl-C does: the servers started here stop too
    with sigterm_stops_servers():
        try:
            for backend in s.backends:
                for program, k in [(p, k) for b, p, k in todo if b == backend]:
                    target = targets.for_block(backend, program, k)
                    target.flush()   # every block samples the same texts: no block starts on a warm cache
                    rec, results = run_block(target, program, k, problems, s, progress=progress)
                    limits.add_to(rec, target, s.limit_batch(program, k, target.max_running), results)
                    layout = cpu_engine_for(s, program, k) if backend == "cpu" else None
                    started_here = backend == "server" and generator_url is None
                    rec.update(key=key, cpu_engine=layout and layout.engine_in,
                               server_attention=s.server_attention if started_here else None,
                               cpu_running_cap=layout and layout.running_cap,
                               cpu_replicas=layout and layout.replicas,
                               max_running=target.max_running, options=program_options(s, program),
                               settings=settings, **provenance,
                               date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
                    store.append(rec)
                    records.append(rec)
                    logger.info("%s %s K=%d: %.3f searches/s, %.0f tokens/s (%.0f%% of the limit)", backend,
                                program, k, rec["searches_per_s"], rec["tokens_per_s"], 100 * rec["limit_fraction"])
                targets.close(backend)
        finally:
            targets.close()
    shown = [r for r in records if r["backend"] in s.backends and r["program"] in s.programs and r["k"] in s.ks]
    report = format_report(shown)
    out.with_suffix(".md").write_text(report + "\n")
    plot = plot_report(shown, out.with_suffix(".png"),
                       f"{'--quick: ' if quick else ''}searches in flight on {provenance['machine']}")
    return report, plot


__all__ = ["BACKENDS", "CPUMeter", "DecodeCounts", "FrontendSettings", "Limits", "PROGRAMS", "PeakThreads", "Target",
           "Targets", "cpu_decode_limit",
           "engine_decode_meter", "format_report", "median_runs", "process_tree_cpu", "goals", "open_cpu", "open_server", "plot_report", "program_options",
           "records_decode_counts", "run_block", "server_decode_limit", "server_max_running", "pending_runs", "run_frontend", "settings_from_values", "start_servers",
           "thread_cpu"]
