"""The load mode of ``sgl-tts bench`` (``--arrivals R1,R2,...``): many searches share one pair of servers.

At each offered rate, the ``problems`` of every (algorithm, n) arrive as a Poisson process
(:func:`sgl_tts.bench.arrivals.scaled_poisson_arrivals`: the same times on every side, the same
pattern at every rate) and each search starts
at its arrival, however many are still running: an open loop, as a service sees them. Every side serves
the same problems with the same trace (:mod:`sgl_tts.bench.goodput_trace`), so the same kept beams.

One *block* is one (side, algorithm, n, rate). Each (side, algorithm, n) first runs an *unloaded* block
(rate key 0): its first ``unloaded_problems`` problems one after another, one in flight, whose median
latency is the side's unloaded latency (:mod:`sgl_tts.bench.arrivals`' rule). Before every block both
radix caches are flushed (every block starts cold). It writes one ``load_search`` record per search (arrival, answer, latency from arrival to
answer, tokens, kept beams) and then one ``load_block`` record: the block's span (first arrival to
last answer), each server's counters over it (SGLang's evictions and retractions, the observer's
recomputed prompt tokens: :mod:`sgl_tts.bench.server_counters`), each server's waiting queue
(:class:`QueueSampler`), the requests the client sent and had answered, the requests each server
counted, and this process's CPU. A block is whole or absent: a rerun redoes a block that has no
``load_block`` record (its searches' records carry the attempt they belong to, and only a finished
attempt's count).
"""

from __future__ import annotations

import logging
import resource
import threading
import time
import uuid
from typing import Callable, Iterable

from sgl_tts.bench import server_counters
from sgl_tts.bench.arrivals import scaled_poisson_arrivals
from sgl_tts.bench.errors import BenchError
from sgl_tts.bench.goodput import kept_beams, run_search, side_configs, trace_verifier
from sgl_tts.bench.goodput_settings import BenchSettings, search_group
from sgl_tts.bench.goodput_trace import MeteredEndpoint, StepRegistry, TraceEndpoint
from sgl_tts.experiment import quantile
from sgl_tts.frontend import end_stream_executors

logger = logging.getLogger(__name__)

QUEUE_GAUGE = "sglang:num_queue_reqs"   # SGLang's waiting-queue length (--enable-metrics), every server
QUEUE_PERIOD = 0.25                     # seconds between two readings of it


def block_key(record: dict) -> tuple:
    """``(side, algorithm, n, rate)`` of a load record."""
    return record["side"], record["algorithm"], int(record["n"]), float(record["rate"])


UNLOADED = 0.0   # the rate key of the unloaded block: its problems one after another, one in flight


def block_rates(settings: BenchSettings) -> tuple[float, ...]:
    """The blocks of an (algorithm, n) in the order they run: the unloaded one, then the offered rates."""
    return (UNLOADED, *settings.arrivals)


def finished_blocks(records: Iterable[dict]) -> set[tuple]:
    """The blocks a ``load_block`` record closed."""
    return {block_key(r) for r in records if r.get("kind") == "load_block"}


class QueueSampler:
    """Each server's waiting queue (:data:`QUEUE_GAUGE` on its ``/metrics``), read every ``period``
    seconds on one thread while a block runs: the same reading on every side, stock or sgl-tts. The
    gauge is SGLang's own, set when the scheduler logs a prefill batch and every few decode batches;
    a reading that fails (a server busy past the timeout) is skipped and counted."""

    def __init__(self, urls: dict[str, str], period: float = QUEUE_PERIOD):
        self.urls, self.period = dict(urls), period
        self.samples: dict[str, list[float]] = {name: [] for name in urls}
        self.missed = {name: 0 for name in urls}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sgl-tts-queue-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            for name, url in self.urls.items():
                value = server_counters.gauge(url, QUEUE_GAUGE, timeout=max(1.0, self.period * 4))
                if value is None:
                    self.missed[name] += 1
                else:
                    self.samples[name].append(value)
            if self._stop.wait(self.period):   # a timed wait between readings, woken at once by stop()
                return

    def __enter__(self) -> "QueueSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def stats(self) -> dict[str, dict]:
        """Per server: p50 and max of the readings, how many, how many failed."""
        return {name: {"p50": quantile(sorted(v), 0.5) if v else None, "max": max(v) if v else None,
                       "samples": len(v), "missed": self.missed[name]} for name, v in self.samples.items()}


def _readings(urls: dict[str, str]) -> dict[str, tuple]:
    """Each server's counters (:func:`server_counters.server_counters`) and requests counted so far."""
    return {name: (server_counters.server_counters(url), server_counters.request_count(url))
            for name, url in urls.items()}


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_load_side(side: str, urls: dict[str, str], settings: BenchSettings, *, prm_tokenizer: str | None = None,
                  generator_tokenizer: str | None = None, vocab: int = 32000, done: Iterable[tuple] = (),
                  write: Callable[[dict], None], flush: Callable[[], None], progress: bool = True,
                  deadline: float | None = None) -> int:
    """Run every block of ``side`` not in ``done`` (:func:`finished_blocks`) on its servers (``urls``:
    ``generator`` and ``prm``); ``flush`` empties both radix caches. No block starts after ``deadline``
    (``time.monotonic()``); returns how many blocks were left for a later run."""
    from tqdm.auto import tqdm

    trace = settings.step_trace()
    configs = side_configs(side, urls["generator"], urls["prm"], settings, trace, write)
    registry = StepRegistry()
    gen = TraceEndpoint(urls["generator"], trace, registry, context_tokens=settings.context_tokens,
                        tokenizer_path=generator_tokenizer, banned_token_ids=settings.banned_token_ids)
    prm_backend = MeteredEndpoint(urls["prm"], tokenizer_path=prm_tokenizer)
    gen.tokenizer, prm_backend.tokenizer   # loaded now, not inside the first timed search
    done = set(done)
    todo = [(a, n, r) for a in settings.algorithms for n in settings.n for r in block_rates(settings)
            if (side, a, n, r) not in done]
    for k, (algorithm, n, rate) in enumerate(todo):
        if deadline is not None and time.monotonic() >= deadline:
            logger.warning("%s: time is up; %d load blocks left for the next run", side, len(todo) - k)
            return len(todo) - k
        flush()
        _run_block(side, algorithm, n, rate, settings, configs[algorithm, n], gen, prm_backend, registry, trace,
                   urls, vocab, write, progress=progress, tqdm=tqdm)
    return 0


def _run_block(side, algorithm, n, rate, settings, config, gen, prm_backend, registry, trace, urls, vocab, write, *,
               progress, tqdm) -> None:
    """One block: the problems start at their arrival times, each on its own thread; then the block's
    record. A failed search stops the benchmark once every started search has ended."""
    attempt = uuid.uuid4().hex[:12]
    unloaded = rate == UNLOADED
    # unloaded: the first problems, each arriving as the one before is answered (their arrivals are
    # set when they start); else the problems at their Poisson arrival times
    arrivals = ([0.0] * settings.unloaded_problems if unloaded
                else scaled_poisson_arrivals(rate, settings.problems, settings.seed))
    registry.clear()
    gen.take_meter(), prm_backend.take_meter(), gen.take_sent()
    lock = threading.Lock()
    failures: list[tuple[str, BaseException]] = []
    bar = tqdm(total=len(arrivals), desc=f"{side} {algorithm} n={n} " + ("unloaded" if unloaded else f"at {rate:g}/s"),
               disable=not progress)
    before = _readings(urls)
    cpu0 = _cpu_seconds()
    t0 = time.perf_counter()

    def serve(problem: int) -> None:
        group = search_group(algorithm, n, problem)
        verifier = trace_verifier(prm_backend, registry, trace)
        arrival = t0 + arrivals[problem]   # when it arrived: a late start counts against the latency
        state, error = run_search(algorithm, config, settings.question(problem, vocab), verifier, group, gen)
        answered = time.perf_counter()
        if error is not None:
            with lock:
                failures.append((group, error if isinstance(error, BaseException) else BenchError(str(error))))
            return
        result = state.ret_value
        record = {"kind": "load_search", "side": side, "algorithm": algorithm, "n": n, "rate": rate,
                  "problem": problem, "attempt": attempt, "arrival": round(arrival - t0, 4),
                  "answered": round(answered - t0, 4), "latency": round(answered - arrival, 4),
                  "verifier_seconds": round(verifier.seconds, 4),
                  "tokens_generated": int(result.tokens_generated), "tokens_kept": int(result.tokens_kept),
                  "trajectory_tokens": sum(t.tokens for t in result.trajectories),
                  "prm_requests": int(result.prm_requests), "kept": kept_beams(registry, result)}
        with lock:
            write(record)
            bar.update(1)

    threads = []
    stop = threading.Event()   # never set: a timed wait until the next arrival, no polling
    with QueueSampler(urls) as sampler:
        for problem, at in enumerate(arrivals):
            if unloaded:
                if threads:
                    threads[-1].join()
                arrivals[problem] = time.perf_counter() - t0
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                stop.wait(delay)
            thread = threading.Thread(target=serve, args=(problem,), name=f"load-{problem}", daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
    span = time.perf_counter() - t0
    cpu = _cpu_seconds() - cpu0
    bar.close()
    if failures:
        group, error = failures[0]
        cause = next(iter(end_stream_executors()), None) or error
        raise BenchError(f"search {group} at {rate:g}/s failed: {cause!r} ({len(failures)} of "
                         f"{len(arrivals)} searches failed)") from (cause if isinstance(cause, BaseException) else None)
    after = _readings(urls)
    g, v = gen.take_meter(), prm_backend.take_meter()
    write({"kind": "load_block", "side": side, "algorithm": algorithm, "n": n, "rate": rate, "attempt": attempt,
           "problems": len(arrivals), "last_arrival": round(arrivals[-1], 4), "span": round(span, 4),
           "client_cpu_seconds": round(cpu, 4), "queue": sampler.stats(),
           "counters": {name: server_counters.delta(before[name][0], after[name][0]) for name in urls},
           "requests": {"generator_sent": gen.take_sent(), "generator_answered": g.requests,
                        "prm_answered": v.requests,
                        "server_counted": {name: None if before[name][1] is None or after[name][1] is None
                                           else after[name][1] - before[name][1] for name in urls}},
           "generator": {"prompt_tokens": g.prompt_tokens, "cached_tokens": g.cached_tokens,
                         "completion_tokens": g.completion_tokens},
           "prm": {"prompt_tokens": v.prompt_tokens, "cached_tokens": v.cached_tokens}})


__all__ = ["QUEUE_GAUGE", "UNLOADED", "QueueSampler", "block_key", "block_rates", "finished_blocks", "run_load_side"]
