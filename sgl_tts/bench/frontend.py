"""``sgl-tts bench-frontend``: do many searches at once slow each other down?

For each backend (``cpu``: the tiny generator and PRM in this process on :class:`sgl_tts.LocalBackend`;
``server``: live CPU SGLang servers, the generator with the sgl-tts plugin), each program
(``beam_search``, ``best_of_n`` with the PRM, ``mcts``) and each K, it runs max(K, ``--min-searches``)
problems of the arithmetic task's test split with K in flight through the project's own runner
(:func:`sgl_tts.runner.run_continuously`, the path ``sgl-tts run`` takes, with ``sgl-tts run``'s
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

import argparse
import collections
import dataclasses
import functools
import hashlib
import json
import logging
import resource
import shlex
import sys
import tempfile
import threading
import time
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from sgl_tts.bench.load import flush_cache, read_records
from sgl_tts.serve import sigterm_stops_servers

logger = logging.getLogger(__name__)

BACKENDS = ("cpu", "server")
PROGRAMS = ("beam_search", "best_of_n", "mcts")
LIMIT_NEW_TOKENS = 64          # tokens of each plain generation of the limit measurement
GEN_KV_BYTES = 1 << 30         # the generator server's KV pool when this command starts it
PRM_KV_BYTES = 512 << 20       # the PRM server's
RECORD_FORMAT = 2              # 2: the limit is taken at the generator's observed running batch
METRICS_FLUSH_WAIT_S = 1.5     # the plugin's records reach disk within a second (its flush timer)


def _positive_ints(text: str, flag: str) -> tuple[int, ...]:
    out = []
    for part in (x.strip() for x in text.split(",")):
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"{flag}: {part!r} is not a positive integer (give a comma-separated list, e.g. 1,8,32)")
        out.append(int(part))
    return tuple(out)


def _names(text: str, flag: str, choices: Sequence[str]) -> tuple[str, ...]:
    out = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in out if x not in choices]
    if bad or not out:
        raise ValueError(f"{flag}: unknown value {bad[0] if bad else text!r}; choose from {', '.join(choices)}")
    return out


# ------------------------------------------------------------------------------------- settings
@dataclasses.dataclass(frozen=True)
class FrontendSettings:
    """One run's settings.

    Attributes:
        backends, programs, ks: what to run (blocks: every backend x program x K).
        min_searches: searches per block are max(K, this).
        beams, beam_width: beam search's N and M.
        samples: best-of-N's N.
        rollouts, expansion_width, parallel: MCTS's rollout budget, children per expansion and
            rollouts in flight.
        max_depth, step_tokens: most steps of a tree search and a step's token limit.
        max_tokens: a best-of-N sample's token limit.
        temperature: sampling temperature.
        seed: the sampling seed (``sgl-tts run``'s: each sample's seed derives from it).
        cpu_engine: where the ``cpu`` backend's engines run: ``thread`` (in this process),
            ``process`` (a child process each, :class:`~sgl_tts.backends.engine_process.EngineProcess`)
            or ``auto`` (per block, as ``sgl-tts run`` decides: :func:`cpu_engine_for`).
    """

    backends: tuple[str, ...] = BACKENDS
    programs: tuple[str, ...] = PROGRAMS
    ks: tuple[int, ...] = (1, 8, 32, 128)
    min_searches: int = 8
    beams: int = 16
    beam_width: int = 4
    samples: int = 16
    rollouts: int = 16
    expansion_width: int = 4
    parallel: int = 4
    max_depth: int = 40
    step_tokens: int = 64
    max_tokens: int = 256
    temperature: float = 0.8
    seed: int = 0
    cpu_engine: str = "auto"

    # --quick: K in {1, 4}, 4 searches, small budgets (a CI check, not a measurement)
    QUICK: typing.ClassVar[dict[str, Any]] = dict(ks=(1, 4), min_searches=4, beams=4, beam_width=2, samples=4,
                                                  rollouts=4, expansion_width=2, parallel=2)
    # what may differ between runs whose records are shared (which blocks to run)
    NOT_IN_KEY: typing.ClassVar[tuple[str, ...]] = ("backends", "programs", "ks")

    def __post_init__(self):
        _names(",".join(self.backends), "--backends", BACKENDS)
        _names(",".join(self.programs), "--programs", PROGRAMS)
        if self.cpu_engine not in ("auto", "thread", "process"):
            raise ValueError(f"--cpu-engine must be auto, thread or process, got {self.cpu_engine!r}")
        if not self.ks or any(k < 1 for k in self.ks):
            raise ValueError(f"--ks: every K must be a positive integer, got {self.ks}")
        for name in ("min_searches", "beams", "beam_width", "samples", "rollouts", "expansion_width", "parallel",
                     "max_depth", "step_tokens", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"--temperature: must be >= 0, got {self.temperature}")
        from sgl_tts.task import TEST_SIZE
        if self.searches(max(self.ks)) > TEST_SIZE:
            raise ValueError(f"--ks: {max(self.ks)} searches exceed the {TEST_SIZE} test problems")

    def key(self) -> str:
        """What a record must match to be reused (every setting that changes a block's result)."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in self.NOT_IN_KEY}
        if fields["cpu_engine"] == "thread":  # how runs went before the setting existed: their records match
            del fields["cpu_engine"]
        fields["record_format"] = RECORD_FORMAT
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]

    def searches(self, k: int) -> int:
        """Searches of a block with K in flight."""
        return max(k, self.min_searches)

    def run_config(self, program: str):
        """``sgl-tts run``'s :class:`~sgl_tts.experiment.RunConfig` for ``program`` at these budgets."""
        from sgl_tts.experiment import RunConfig

        common = dict(program=program, max_depth=self.max_depth, step_tokens=[self.step_tokens],
                      max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed, progress=False)
        if program == "beam_search":
            cfg = RunConfig(n=self.beams, beam_width=self.beam_width, **common)
        elif program == "best_of_n":
            cfg = RunConfig(n=self.samples, **common)
        else:   # MCTS scores trajectories by their weakest step (the program's default)
            cfg = RunConfig(n=self.rollouts, beam_width=self.expansion_width, parallel=self.parallel,
                            aggregation="min", **common)
        cfg.validate()
        return cfg

    def requests_per_search(self, program: str) -> int:
        """Generation requests one search keeps in flight."""
        if program == "beam_search":
            return self.beams
        if program == "best_of_n":
            return self.samples
        return self.parallel * self.expansion_width

    def limit_batch(self, program: str, k: int, max_running: int) -> int:
        """B: the running batch K searches give the generator (at most its max running requests)."""
        return max(1, min(k * self.requests_per_search(program), max_running))


def cpu_engine_for(s: FrontendSettings, program: str, k: int) -> str:
    """Where the ``cpu`` backend's engines run for a block: ``s.cpu_engine``, with ``auto`` resolved
    as ``sgl-tts run`` resolves it (:func:`sgl_tts.backends.local.choose_engine_in`)."""
    from sgl_tts import registry
    from sgl_tts.backends.local import choose_engine_in

    return choose_engine_in(s.cpu_engine, tree_search=registry.program(program).budget != "samples", in_flight=k)


def program_options(s: FrontendSettings, program: str) -> dict[str, Any]:
    """The program's keyword arguments other than the question and the PRM (recorded with a block)."""
    args = s.run_config(program).program_arguments("", None)
    return {k: v for k, v in args.items() if k not in ("question", "prm")}


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
    from sgl_tts.plugin.metrics import read_records, scheduler_files

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
    """The server's max running requests (``/server_info``: what the scheduler settled on)."""
    info = _http_json(url.rstrip("/") + "/server_info")
    for state in info.get("internal_states") or []:
        if state.get("effective_max_running_requests_per_dp"):
            return int(state["effective_max_running_requests_per_dp"])
    if info.get("max_running_requests"):
        return int(info["max_running_requests"])
    raise RuntimeError(f"{url}/server_info names no max running requests")


def open_cpu(s: FrontendSettings, engine_in: str = "thread") -> Target:
    """The tiny generator and PRM on :class:`~sgl_tts.LocalBackend` engines, on threads of this
    process or (``engine_in="process"``) in a child process each."""
    from sgl_tts import LocalBackend
    from sgl_tts.models import shipped_model
    from sgl_tts.prm import StepTagPRM

    gen = LocalBackend(shipped_model("generator"), seed=s.seed, engine_in=engine_in)
    try:
        prm_backend = LocalBackend(shipped_model("prm"), seed=s.seed, engine_in=engine_in)
    except BaseException:
        gen.shutdown()
        raise
    ids = tuple(i for i in (gen.engine.native_thread_id, prm_backend.engine.native_thread_id) if i is not None)
    pids = tuple(getattr(b.engine, "pid", None) for b in (gen, prm_backend))

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


def start_servers(workdir: str | None = None):
    """The tiny generator (plugin, prefix-aware, seeded sampling) and the tiny PRM as live CPU servers."""
    from sgl_tts.live_servers import LiveServer, LiveServers
    from sgl_tts.models import shipped_model

    return LiveServers({
        "generator": LiveServer(str(shipped_model("generator")), policy="prefix-aware", kv_bytes=GEN_KV_BYTES,
                                metrics=True, seeded_sampling=True),
        "prm": LiveServer(str(shipped_model("prm")), kv_bytes=PRM_KV_BYTES)},
        workdir or tempfile.mkdtemp(prefix="sgl-tts-bench-frontend-"))


# ------------------------------------------------------------------------------------- measuring
def thread_cpu(native_ids: Iterable[int]) -> tuple[float, float]:
    """User and system CPU seconds of this process's threads with these native ids."""
    import psutil

    wanted = set(native_ids)
    if not wanted:
        return 0.0, 0.0
    user = system = 0.0
    for t in psutil.Process().threads():
        if t.id in wanted:
            user += t.user_time
            system += t.system_time
    return user, system


def process_tree_cpu(pids: Iterable[int]) -> tuple[float, float]:
    """User and system CPU seconds of these processes and all their live descendants."""
    import psutil

    user = system = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            user += t.user
            system += t.system
    return user, system


class CPUMeter:
    """This process's CPU over a ``with`` block, the part of it the given threads took, and the CPU
    of the given server processes (with their descendants) over the same block."""

    def __init__(self, engine_threads: Sequence[int] = (), server_pids: Sequence[int] = (),
                 engine_pids: Sequence[int] = ()):
        self.engine_threads = tuple(engine_threads)
        self.server_pids = tuple(server_pids)
        self.engine_pids = tuple(engine_pids)
        self.user = self.system = self.engine_user = self.engine_system = 0.0
        self.server_user = self.server_system = 0.0

    def __enter__(self) -> "CPUMeter":
        self._r0 = resource.getrusage(resource.RUSAGE_SELF)
        self._e0 = thread_cpu(self.engine_threads)
        self._p0 = process_tree_cpu(self.engine_pids)
        self._s0 = process_tree_cpu(self.server_pids)
        return self

    def __exit__(self, *exc) -> None:
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        e1 = thread_cpu(self.engine_threads)
        p1 = process_tree_cpu(self.engine_pids)
        s1 = process_tree_cpu(self.server_pids)
        pu, ps = p1[0] - self._p0[0], p1[1] - self._p0[1]
        self.user = r1.ru_utime - self._r0.ru_utime + pu
        self.system = r1.ru_stime - self._r0.ru_stime + ps
        self.engine_user, self.engine_system = e1[0] - self._e0[0] + pu, e1[1] - self._e0[1] + ps
        self.server_user, self.server_system = s1[0] - self._s0[0], s1[1] - self._s0[1]


class PeakThreads:
    """The most threads alive during a ``with`` block (``threading.active_count()``, the sampler's own
    thread included), sampled every ``interval`` seconds by a thread that waits on an event."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sgl-tts-thread-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, threading.active_count())
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "PeakThreads":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, threading.active_count())


def run_block(target: Target, program: str, k: int, problems: Sequence[Any], s: FrontendSettings, *,
              progress: bool = True) -> tuple[dict[str, Any], list[Any]]:
    """Run ``program`` over the first max(K, min_searches) problems with K in flight on ``target``.

    Returns the block's measurements (no limit or provenance fields yet) and the searches'
    :class:`~sgl_tts.search.SearchResult` in problem order. A failed search raises after the block.
    """
    from tqdm.auto import tqdm

    from sgl_tts.experiment import program_function
    from sgl_tts.runner import run_continuously

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


# ------------------------------------------------------------------------------------- report
def median_runs(records: Sequence[dict]) -> list[dict]:
    """One record per block (backend, program, K): with several runs of a block (``--repeats``), the
    run with the median searches/s (the lower of the middle two for an even count), copied with
    ``runs`` (how many) and ``searches_per_s_min`` and ``_max`` (their spread)."""
    runs: dict[tuple[str, str, int], list[dict]] = {}
    for r in records:
        runs.setdefault((r["backend"], r["program"], r["k"]), []).append(r)
    out = []
    for recs in runs.values():
        ordered = sorted(recs, key=lambda r: r["searches_per_s"])
        out.append(ordered[(len(ordered) - 1) // 2] | {
            "runs": len(recs), "searches_per_s_min": ordered[0]["searches_per_s"],
            "searches_per_s_max": ordered[-1]["searches_per_s"]})
    return out


def _blocks(records: Sequence[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for r in sorted(records, key=lambda r: (BACKENDS.index(r["backend"]), PROGRAMS.index(r["program"]), r["k"])):
        out.setdefault((r["backend"], r["program"]), []).append(r)
    return out


def goals(records: Sequence[dict]) -> list[tuple[str, str]]:
    """The goals, one ``(PASS | FAIL | SKIP, text)`` per line, on each block's median run."""
    records = median_runs(records)
    lines: list[tuple[str, str]] = []
    blocks = _blocks(records)
    for (backend, program), recs in blocks.items():
        best: tuple[float, int] | None = None
        fell = []
        for r in recs:
            if best is not None and r["searches_per_s"] < 0.9 * best[0]:
                fell.append(f"K={r['k']} {r['searches_per_s']:.3f} < 90% of {best[0]:.3f} (K={best[1]})")
            if best is None or r["searches_per_s"] > best[0]:
                best = (r["searches_per_s"], r["k"])
        seen = ", ".join(f"{r['searches_per_s']:.3f} (K={r['k']})" for r in recs)
        lines.append(("FAIL" if fell else "PASS", f"throughput never falls as K grows, {backend} {program}: "
                      + ("; ".join(fell) if fell else f"searches/s {seen}")))
    for (backend, program), recs in blocks.items():
        r = next((x for x in recs if x["k"] == 128), recs[-1])
        where = "K=128" if r["k"] == 128 else f"K={r['k']} (largest run; the goal names K=128)"
        share = r.get("client_system_share")
        lines.append(("SKIP" if share is None else "PASS" if share < 0.10 else "FAIL",
                      f"client system CPU under 10% of the run's CPU (client, and servers started here) at {where}, "
                      f"{backend} {program}: "
                      + ("no CPU measured" if share is None else f"{100 * share:.1f}%")))
    r = next((x for x in records if x["backend"] == "server" and x["program"] == "beam_search" and x["k"] == 32), None)
    if r is None:
        lines.append(("SKIP", "on the server at K=32 beam search reaches >= 85% of the decode limit: not run"))
    else:
        f = r["limit_fraction"]
        at = ("the running batch it had" if r.get("limit_batch_source") == "observed"
              else "the nominal batch (the generator's running batch was not measured)")
        bare = (f"{100 * f:.0f}% ({r['tokens_per_s']:.0f} of {r['limit_tokens_per_s']:.0f} tokens/s at "
                f"B={r['limit_batch']})")
        ctx = r.get("context_limit_fraction")
        if ctx is None:
            lines.append(("PASS" if f >= 0.85 else "FAIL",
                          f"on the server at K=32 beam search reaches >= 85% of the decode limit at {at}: {bare}"))
        else:
            # a decode row's cost grows with its context: the limit that names the searches' own
            # context decides; the one on bare questions is shown beside it
            lines.append(("PASS" if ctx >= 0.85 else "FAIL",
                          f"on the server at K=32 beam search reaches >= 85% of the decode limit at {at} and the "
                          f"context it had: {100 * ctx:.0f}% ({r['tokens_per_s']:.0f} of "
                          f"{r['context_limit_tokens_per_s']:.0f} tokens/s at B={r['limit_batch']}, "
                          f"{r['decode_context_mean']:.0f} tokens of context per row); on bare questions: {bare}"))
    return lines


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    """A fraction as a whole percentage; ``-`` when not measured."""
    return "-" if x is None else f"{100 * x:.0f}%"


def format_report(records: Sequence[dict]) -> str:
    """A Markdown table of every block, then the goals."""
    records = median_runs(records)
    lines = ["| backend | program | K | runs | searches | wall (s) | searches/s | spread | tokens | tokens/s | "
             "running batch | "
             "limit tok/s | of limit | context | of its limit | extend share | nominal B | of its limit | "
             "CPU user/1k tok | sys/1k | client user/1k | "
             "client sys/1k | servers' CPU s | sys share | client sys share (of its own) | peak threads | accuracy |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
             "---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for recs in _blocks(records).values():
        for r in recs:
            nominal = r.get("nominal_limit_fraction")
            lines.append(
                f"| {r['backend']} | {r['program']} | {r['k']} | {r['runs']} | {r['searches']} | {r['wall_s']:.1f} | "
                f"{r['searches_per_s']:.3f} | "
                f"{'-' if r['runs'] == 1 else format(r['searches_per_s_min'], '.3f') + '-' + format(r['searches_per_s_max'], '.3f')} | "
                f"{r['tokens']} | {r['tokens_per_s']:.0f} | "
                f"{_f(r.get('decode_batch_mean'), '.1f')} | "
                f"{r['limit_tokens_per_s']:.0f} | {100 * r['limit_fraction']:.0f}% | "
                f"{_f(r.get('decode_context_mean'), '.0f')} | {_pct(r.get('context_limit_fraction'))} | "
                f"{_pct(None if r.get('extend_s') is None else r['extend_s'] / r['wall_s'])} | "
                f"{r.get('nominal_batch', r['limit_batch'])} | {_f(None if nominal is None else 100 * nominal, '.0f')}% | "
                f"{_f(r['cpu_user_per_1k_tokens'], '.3f')} | {_f(r['cpu_system_per_1k_tokens'], '.3f')} | "
                f"{_f(r['client_user_per_1k_tokens'], '.3f')} | {_f(r['client_system_per_1k_tokens'], '.3f')} | "
                f"{_f((r['server_user_s'] + r['server_system_s']) if r.get('server_processes') else None, '.1f')} | "
                f"{_f(None if r['system_share'] is None else 100 * r['system_share'], '.1f')}% | "
                f"{_f(None if r['client_system_share'] is None else 100 * r['client_system_share'], '.1f')}% "
                f"({_f(None if r.get('client_own_system_share') is None else 100 * r['client_own_system_share'], '.0f')}%) | "
                f"{r['peak_threads']} | {100 * r['accuracy']:.0f}% |")
    lines.append("")
    lines += [f"{verdict} {text}" for verdict, text in goals(records)]
    return "\n".join(lines)


def plot_report(records: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Per program: tokens/s against K, one solid line per backend and its decode limit dashed (top);
    the client's CPU seconds (user + system) per 1,000 generated tokens (bottom)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = median_runs(records)
    programs = [p for p in PROGRAMS if any(r["program"] == p for r in records)]
    fig, axes = plt.subplots(2, max(1, len(programs)), figsize=(4.2 * max(1, len(programs)), 6.4), squeeze=False)
    for col, program in enumerate(programs):
        top, bottom = axes[0][col], axes[1][col]
        for i, backend in enumerate(BACKENDS):
            recs = sorted((r for r in records if r["program"] == program and r["backend"] == backend),
                          key=lambda r: r["k"])
            if not recs:
                continue
            ks = [r["k"] for r in recs]
            color = f"C{i}"
            top.plot(ks, [r["tokens_per_s"] for r in recs], "-o", color=color, label=f"{backend} searches")
            top.plot(ks, [r["limit_tokens_per_s"] for r in recs], "--", color=color, alpha=0.7,
                     label=f"{backend} decode limit")
            cpu = [(r["client_user_per_1k_tokens"] or 0) + (r["client_system_per_1k_tokens"] or 0) for r in recs]
            bottom.plot(ks, cpu, "-o", color=color, label=f"{backend} client")
        ks_run = sorted({r["k"] for r in records if r["program"] == program})
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ks_run, [str(k) for k in ks_run])
            ax.set_xlabel("K (searches in flight)")
            ax.set_ylim(bottom=0)
        top.set_title(program)
        top.set_ylabel("generated tokens / s")
        bottom.set_ylabel("client CPU s / 1,000 tokens")
        top.legend(fontsize=7)
        bottom.legend(fontsize=7)
    fig.suptitle(title or "many searches at once", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# ------------------------------------------------------------------------------------- command
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sgl-tts bench-frontend", description=__doc__.split("\n\n")[0])
    d = FrontendSettings()
    p.add_argument("--backends", default=",".join(d.backends), help="comma-separated, from " + ", ".join(BACKENDS))
    p.add_argument("--programs", default=",".join(d.programs), help="comma-separated, from " + ", ".join(PROGRAMS))
    p.add_argument("--ks", default=None, help="searches in flight, comma-separated (default 1,8,32,128; --quick 1,4)")
    p.add_argument("--quick", action="store_true",
                   help="K in {1, 4}, 4 searches per block, budgets of 4 (a CI check, not a measurement)")
    for name in ("min_searches", "beams", "beam_width", "samples", "rollouts", "expansion_width", "parallel",
                 "max_depth", "step_tokens", "max_tokens", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"default {getattr(d, name)}" + (f" (--quick {d.QUICK[name]})" if name in d.QUICK else ""))
    p.add_argument("--temperature", type=float, default=None, help=f"default {d.temperature}")
    p.add_argument("--cpu-engine", choices=("auto", "thread", "process"), default=None,
                   help=f"where the cpu backend's model engines run: a thread of this process, a child "
                        f"process each, or auto: as sgl-tts run decides per program and K (default {d.cpu_engine})")
    p.add_argument("--generator-url", default=None, help="a running generator for the server backend (default: "
                   "start the tiny generator with the plugin on the CPU)")
    p.add_argument("--generator-metrics", default=None, metavar="PREFIX",
                   help="the --tts-metrics-file of the server at --generator-url, to read the running batch it "
                        "decoded (without it that server's decode limit is taken at the nominal batch)")
    p.add_argument("--prm-url", default=None, help="a running step-tag PRM server (default: start the tiny PRM)")
    p.add_argument("--out", default="docs/benchmarks/frontend.jsonl",
                   help="records (JSONL, appended); the table (.md) and plot (.png) go next to it")
    p.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="runs of each block (default 1); the table and the goals take each block's median "
                        "run and show the spread. Runs already in --out count: a rerun with a larger R adds runs")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="log each block")
    return p


def settings_from_args(args: argparse.Namespace) -> FrontendSettings:
    """The settings the flags give (``--quick`` presets first, explicit flags over them); a bad value
    raises ``ValueError`` whose message starts with the flag."""
    values: dict[str, Any] = dict(FrontendSettings.QUICK) if args.quick else {}
    values["backends"] = _names(args.backends, "--backends", BACKENDS)
    values["programs"] = _names(args.programs, "--programs", PROGRAMS)
    if args.ks is not None:
        values["ks"] = _positive_ints(args.ks, "--ks")
    for f in dataclasses.fields(FrontendSettings):
        if f.name not in ("backends", "programs", "ks") and getattr(args, f.name, None) is not None:
            values[f.name] = getattr(args, f.name)
    return FrontendSettings(**values)


def _server_pids(servers, names: Sequence[str]) -> list[int]:
    return [pid for pid in (servers.pid(n) for n in names) if pid is not None] if servers else []


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.verbose:
        logger.setLevel(logging.INFO)
    else:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # per-shard "Loading weights" bars
    try:
        s = settings_from_args(args)
        if args.repeats < 1:
            raise ValueError(f"--repeats: must be at least 1, got {args.repeats}")
    except ValueError as exc:
        print(f"sgl-tts bench-frontend: error: {exc}", file=sys.stderr)
        return 2
    from sgl_tts import task
    from sgl_tts.machine import describe

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    key = s.key()
    records = read_records(out, key)
    done = collections.Counter((r["backend"], r["program"], r["k"]) for r in records)
    # run by run: each block's first run, then each one's second, ... (a cut-short run has them all
    # once); the loop below takes them one backend at a time, in this order
    todo = [(b, p, k) for i in range(args.repeats) for b in s.backends for p in s.programs for k in sorted(s.ks)
            if done[(b, p, k)] <= i]
    skipped = len(s.backends) * len(s.programs) * len(s.ks) * args.repeats - len(todo)
    if skipped:
        print(f"sgl-tts bench-frontend: {skipped} run(s) already in {out} under settings {key}: skipped")
    problems = task.test_split()[:s.searches(max(s.ks))]
    prompts = [p.question + "\n\n" for p in problems]
    limits: dict[tuple, float] = {(r["backend"], r["limit_batch"]): r["limit_tokens_per_s"] for r in records}
    provenance = {"machine": describe(), "command": "sgl-tts bench-frontend " + shlex.join(argv)}
    servers = None
    # SIGTERM (a job runner, timeout) ends the run as Ctrl-C does: the servers started here stop too
    with sigterm_stops_servers():
        try:
            for backend in s.backends:
                mine = [(p, k) for b, p, k in todo if b == backend]
                if not mine:
                    continue
                opened: dict[str, Target] = {}   # cpu: one target per engine placement, opened when needed

                def target_for(program: str, k: int) -> Target:
                    mode = cpu_engine_for(s, program, k) if backend == "cpu" else "server"
                    if mode not in opened:
                        opened[mode] = open_cpu(s, mode) if backend == "cpu" else open_server_target()
                    return opened[mode]

                def open_server_target() -> Target:
                    nonlocal servers
                    gen_url, prm_url = args.generator_url, args.prm_url
                    metrics = args.generator_metrics
                    started: list[str] = []
                    if gen_url is None or prm_url is None:
                        servers = servers or start_servers()
                        if gen_url is None:
                            metrics = str(servers.metrics_prefix("generator"))
                            started.append("generator")
                        if prm_url is None:
                            started.append("prm")
                        gen_url = gen_url or servers.url("generator")
                        prm_url = prm_url or servers.url("prm")
                    records_of = None if metrics is None else functools.partial(metrics_file_records, metrics)
                    pids_of = functools.partial(_server_pids, servers, tuple(started))
                    return open_server(s, gen_url, prm_url, records_of, pids_of)

                def limit_at(target: Target, batch: int) -> float:
                    if (target.name, batch) not in limits:
                        target.flush()
                        limits[(target.name, batch)] = round(target.decode_limit(batch, prompts), 2)
                        logger.info("%s decode limit at B=%d: %.0f tokens/s", target.name, batch,
                                    limits[(target.name, batch)])
                    return limits[(target.name, batch)]

                try:
                    for program, k in mine:
                        target = target_for(program, k)
                        nominal = s.limit_batch(program, k, target.max_running)
                        target.flush()   # every block samples the same texts: no block starts on a warm cache
                        rec, results = run_block(target, program, k, problems, s, progress=not args.no_progress)
                        mean = rec["decode_batch_mean"]
                        batch = nominal if mean is None else max(1, round(mean))
                        limit, nominal_limit = limit_at(target, batch), limit_at(target, nominal)
                        context = rec["decode_context_mean"]
                        if context is not None and target.tokenizer is not None:
                            # the same batch at the searches' context: plain generations whose
                            # prompts are cut from the searches' own texts, so that their mean
                            # context over the LIMIT_NEW_TOKENS decoded equals the block's
                            length = max(1, round(context - (LIMIT_NEW_TOKENS + 1) / 2))
                            if (target.name, batch, length) not in limits:
                                target.flush()
                                texts = context_prompts(target.tokenizer(), search_texts(problems, results),
                                                        length, batch)
                                limits[(target.name, batch, length)] = round(target.decode_limit(batch, texts), 2)
                            context_limit = limits[(target.name, batch, length)]
                            rec.update(context_limit_prompt_tokens=length, context_limit_tokens_per_s=context_limit,
                                       context_limit_fraction=round(rec["tokens_per_s"] / context_limit, 4))
                        rec.update(key=key, cpu_engine=cpu_engine_for(s, program, k) if backend == "cpu" else None,
                                   limit_batch=batch, limit_batch_source="nominal" if mean is None else "observed",
                                   limit_new_tokens=LIMIT_NEW_TOKENS,
                                   limit_tokens_per_s=limit, limit_fraction=round(rec["tokens_per_s"] / limit, 4),
                                   nominal_batch=nominal, nominal_limit_tokens_per_s=nominal_limit,
                                   nominal_limit_fraction=round(rec["tokens_per_s"] / nominal_limit, 4),
                                   max_running=target.max_running, options=program_options(s, program),
                                   settings={k_: v for k_, v in dataclasses.asdict(s).items()
                                             if k_ not in FrontendSettings.NOT_IN_KEY},
                                   **provenance, date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
                        with out.open("a") as fh:
                            fh.write(json.dumps(rec) + "\n")
                        records.append(rec)
                        logger.info("%s %s K=%d: %.3f searches/s, %.0f tokens/s (%.0f%% of the limit)", backend,
                                    program, k, rec["searches_per_s"], rec["tokens_per_s"], 100 * rec["limit_fraction"])
                finally:
                    for t in opened.values():
                        t.close()
        finally:
            if servers is not None:
                servers.stop_all()
    shown = [r for r in records if r["backend"] in s.backends and r["program"] in s.programs and r["k"] in s.ks]
    report = format_report(shown)
    out.with_suffix(".md").write_text(report + "\n")
    plot = plot_report(shown, out.with_suffix(".png"),
                       f"{'--quick: ' if args.quick else ''}searches in flight on {provenance['machine']}")
    print(report)
    print(f"records: {out}; table: {out.with_suffix('.md')}; plot: {plot}")
    return 0


__all__ = ["BACKENDS", "CPUMeter", "DecodeCounts", "FrontendSettings", "PROGRAMS", "PeakThreads", "Target", "cpu_decode_limit",
           "engine_decode_meter", "format_report", "median_runs", "process_tree_cpu", "goals", "main", "open_cpu", "open_server", "plot_report", "program_options",
           "records_decode_counts", "run_block", "server_decode_limit", "server_max_running", "settings_from_args", "start_servers",
           "thread_cpu"]
