"""``sgl-tts bench``: stock SGLang against SGLang with sgl-tts, the same TTS programs side by side.

Each *side* is a generator + PRM server pair started by :mod:`sgl_tts.launch.serve` on one GPU:

- ``stock``: SGLang's own scheduling (scheduling plugin-free, observed by the same observer as the
  sgl-tts side: the plugin loaded observe-only, :mod:`sgl_tts.plugin.observer`), a static split of the memory
  budget (``--stock-split``, the generator's share; 0.5 by default), SGLang's own batch limits;
- ``stock-lpm``, ``stock-dfs-weight``: the same stock servers under SGLang's own prefix-aware
  scheduling policies (``--schedule-policy lpm`` / ``dfs-weight``), what a user would try first;
- ``sgl-tts``: the plugin on (``--tts-policy prefix-aware``) and the memory planner's split and batch.

The report's ``vs best stock`` compares each side with the best stock side that ran. Each side's
servers also report SGLang's own counters (``--enable-metrics``): tokens evicted from the radix
cache and requests retracted (and their prompt tokens), and the sgl-tts observer's, the same code on
every side: prompt tokens recomputed that had been computed before (thrashing, block-granular), prompt
tokens prefilled, and the scheduler's time per round; from the generator's ``/metrics`` before and
after the side's searches (:mod:`sgl_tts.bench.server_counters`).

On the CPU (``sgl-tts bench --device cpu``) both sides get the same split and SGLang's own batch
limits (no planning there), so they differ only in the plugin's scheduling.

On each side beam search and DVTS run for every n on the same synthetic problems, one problem at a
time. Models are real architectures with random weights, so the *trace* (:mod:`sgl_tts.bench.trace`)
fixes what a real model would decide: every step's length (the request asks for exactly that many
tokens with ``ignore_eos``), whether it ends the solution, and its PRM score. The PRM server still
reads every step (a step-tag PRM request per new step, as in a real run: that is the verifier's work
and time), but its random output is replaced by the trace's score. Selections are therefore the same
on both sides by construction, and the benchmark checks it: the kept beams of every search (each
named by its path of beam indices) must match, or the report says where they differ.

Reported per (algorithm, n) and side: precise goodput (seed 000 §6.1: mean tokens of a kept
trajectory over its mean completion time), completion latency split into generator and verifier
time, tokens generated and kept, the prefix-cache hit rate of each server (SGLang's ``cached_tokens``
over ``prompt_tokens``), and the generator-bound limit: the same generated tokens decoded at the
planned batch with no stragglers and no PRM waits (a measured decode throughput at that batch),
depth by depth, so a trajectory that ends at depth d is done once every step up to d is decoded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from sgl_tts.backends.endpoint import SGLangEndpoint
from sgl_tts.bench.sides import (ALL_SIDES, SERVER_POLICIES, SIDE_OPTIONS, SIDES, STOCK_POLICIES,  # noqa: F401
                                 is_stock, run_config, side_curve, side_slowdown)
from sgl_tts.bench.trace import StepTrace
from sgl_tts.frontend import end_stream_executors
from sgl_tts.records import KeyMismatch, RecordStore, StoreError
from sgl_tts.search import STEP_DELIMITER, SearchTag

logger = logging.getLogger(__name__)

ALGORITHMS = ("beam_search", "dvts")
DEFAULT_N = (8, 16, 32, 64, 128, 256, 512)
# What the lent GPU machines can run with the wheelhouse (docs/GPU_BRINGUP.md): triton attention,
# torch sampling, no grammar backend (FA3 kernels, flashinfer cubins and xgrammar do not travel).
DEFAULT_SERVER_ARGS = ("--attention-backend triton --sampling-backend pytorch --grammar-backend none "
                       "--cuda-graph-backend-prefill disabled")
CONTEXT_MARGIN = 64   # tokens a path leaves free under the context length (PRM tags, padding)


class BenchError(RuntimeError):
    """The benchmark cannot go on; the message says why and what to do."""


# ----------------------------------------------------------------------------------- the trace
class StepRegistry:
    """Where every generated step of one search sits in its tree, and the tokens along each path.

    A request's place is its parent's path plus its ordinal among the parent's children (its beam
    index where the tag has no ordinal); the parent is found from the
    request's prefix (the text of its last step), because the same search on another side writes
    different random text. Paths, not texts, key the trace, so both sides draw the same lengths and
    scores. Thread-safe (forked states generate on their own threads).
    """

    def __init__(self, delimiter: str = STEP_DELIMITER):
        self.delimiter = delimiter
        self._nodes: dict[str, tuple[str, tuple[int, ...], int]] = {}   # text -> (group, path, path tokens)
        self.prompt_tokens: dict[str, int] = {}                          # group -> its prompt's tokens
        self.depth_tokens: dict[int, int] = {}                           # depth -> tokens generated there
        self._lock = threading.Lock()

    def place(self, prefix: str, tag: SearchTag) -> tuple[tuple[int, ...], int]:
        """The path of the step a request with ``prefix`` and ``tag`` is about to generate, and the
        tokens the path holds before it."""
        # a step's place among its parent's children (its ordinal): a speculative request and the
        # child that takes it over are the same node
        place = tag.beam if tag.ordinal is None else tag.ordinal
        if tag.depth == 0:
            return (place,), 0
        segments = [x.strip() for x in prefix.split(self.delimiter)]
        last = next((x for x in reversed(segments) if x), "")
        with self._lock:
            node = self._nodes.get(last)
        if node is None:
            raise BenchError(f"a depth-{tag.depth} request of search {tag.group!r} does not continue a step "
                             f"this benchmark generated (prefix ends {prefix[-60:]!r})")
        return node[1] + (place,), node[2]

    def add(self, text: str, group: str, path: tuple[int, ...], path_tokens: int, tokens: int) -> None:
        """A generated step: its text, place, the path's tokens through it, and its own tokens."""
        key = text.strip()
        with self._lock:
            old = self._nodes.get(key)
            if old is not None and old[:2] != (group, path):
                raise BenchError(f"two steps ({old[:2]} and {(group, path)}) generated the same text "
                                 f"{key[:60]!r}; the benchmark cannot tell them apart")
            self._nodes[key] = (group, path, path_tokens)
            depth = len(path) - 1
            self.depth_tokens[depth] = self.depth_tokens.get(depth, 0) + tokens

    def node(self, text: str) -> tuple[str, tuple[int, ...]]:
        """``(search group, path)`` of a generated step's text."""
        with self._lock:
            got = self._nodes.get(text.strip())
        if got is None:
            raise BenchError(f"the PRM was asked about a step this benchmark did not generate: {text[:60]!r}")
        return got[0], got[1]

    def clear(self) -> None:
        with self._lock:
            self._nodes.clear()
            self.prompt_tokens.clear()
            self.depth_tokens.clear()


@dataclasses.dataclass
class Meter:
    """What a server reported for the requests sent to it (SGLang's ``meta_info``)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, meta: Mapping[str, Any]) -> None:
        self.requests += 1
        self.prompt_tokens += int(meta.get("prompt_tokens", 0) or 0)
        self.cached_tokens += int(meta.get("cached_tokens", 0) or 0)
        self.completion_tokens += int(meta.get("completion_tokens", 0) or 0)


class MeteredEndpoint(SGLangEndpoint):
    """An :class:`~sgl_tts.backends.SGLangEndpoint` that tallies every answer's ``meta_info``."""

    def __init__(self, *args, **kwargs):
        self.meter = Meter()
        self._meter_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def post(self, path: str, payload: dict[str, Any]) -> Any:
        obj = super().post(path, payload)
        with self._meter_lock:
            for res in obj if isinstance(obj, list) else [obj]:
                if isinstance(res, dict) and isinstance(res.get("meta_info"), dict):
                    self.meter.add(res["meta_info"])
        return obj

    def take_meter(self) -> Meter:
        with self._meter_lock:
            got, self.meter = self.meter, Meter()
        return got


class TraceEndpoint(MeteredEndpoint):
    """A generator endpoint that makes every step as long as the trace says.

    Each ``/generate`` of a tagged step request asks for exactly the trace's length
    (``max_new_tokens``, ``ignore_eos``, no stop strings), and the answer's ``finish_reason`` is
    rewritten to what a real model would have reported: the step delimiter, or EOS where the trace
    ends the solution (also where the path would run past ``context_tokens`` less a margin and the
    PRM's tags: a real run ends there too). A server that generates fewer tokens than asked (its
    request limit or pool cut the step) stops the benchmark.
    """

    def __init__(self, base_url: str, trace: StepTrace, registry: StepRegistry, *,
                 context_tokens: int | None = None, tokenizer_path: str | None = None,
                 banned_token_ids: Sequence[int] = ()):
        self.trace, self.registry, self.context_tokens = trace, registry, context_tokens
        # never sampled: far below any logit (SGLang adds logit_bias to the logits before sampling)
        self.logit_bias = {str(int(t)): -1e4 for t in banned_token_ids} or None
        super().__init__(base_url, tokenizer_path=tokenizer_path)

    def prepare_request(self, s, data, fields):
        """The step's length from the trace: exactly that many tokens, no stop strings, no EOS."""
        tag = SearchTag.from_custom_params(fields.custom_params)
        if tag is None:
            raise BenchError("the benchmark generator only serves tagged step requests "
                             "(gen_step(..., tags=...)); a program sent an untagged one")
        path, before = self.registry.place(s.text_, tag)
        if tag.depth == 0:   # the prompt, tokenized once per search (the same on every side)
            self.registry.prompt_tokens.setdefault(tag.group, len(self.encode(s.text_)))
        tokens = self.trace.step_tokens(tag.group, path, tag.depth)
        ends = self.trace.ends(tag.group, path, tag.depth)
        if self.context_tokens:
            # counted from the trace, not the text: the same on both sides; the PRM's input adds a
            # tag per step and a pad token
            used = self.registry.prompt_tokens[tag.group] + before + self.trace.max_depth + 2
            room = self.context_tokens - CONTEXT_MARGIN - used
            if room < 1:
                raise BenchError(f"search {tag.group!r}: a path left no room under the context "
                                 f"length {self.context_tokens}")
            if tokens >= room - self.trace.min_tokens:   # the next step would not fit: end here
                tokens, ends = min(tokens, room), True
        data["sampling_params"].update(max_new_tokens=tokens, ignore_eos=True, stop=[])
        if self.logit_bias:
            data["sampling_params"]["logit_bias"] = self.logit_bias
        return tag, path, before, tokens, ends

    def finish_answer(self, s, data, prepared, text, meta):
        """The finish reason a real model would have given: the step delimiter, or EOS where the trace
        ends the solution; a step cut short stops the benchmark (unless speculative)."""
        tag, path, before, tokens, ends = prepared
        meta = dict(meta)
        got = int(meta.get("completion_tokens", -1))
        if got < tokens and tag.cls == "speculative":
            # stopped by the scheduler (two-phase scheduling) or aborted after selection: the program
            # sees SGLang's own finish reason (length or abort) and never takes the piece as a step
            return text, meta
        if got != tokens:
            raise BenchError(f"search {tag.group!r}: the server generated {got} of the {tokens} tokens "
                             f"asked (cut by its request length limit or KV pool?): the sides would "
                             f"no longer do the same work")
        meta["finish_reason"] = ({"type": "stop", "matched": 0} if ends   # EOS (an int: a token id)
                                 else {"type": "stop", "matched": self.registry.delimiter})
        meta["trace_path"] = list(path)
        self.registry.add(text, tag.group, path, before + tokens, tokens)
        return text, meta


class TraceScores:
    """A PRM that does the real PRM's work, then answers with the trace's scores.

    ``inner`` (e.g. a :class:`~sgl_tts.prm.StepTagPRM` on the PRM server) is called on every batch,
    so the verifier reads every step as it would in a real run; ``seconds`` adds up its time.
    """

    def __init__(self, inner, registry: StepRegistry, trace: StepTrace):
        self.inner, self.registry, self.trace = inner, registry, trace
        self.seconds = 0.0   # summed over calls (overlapped calls each count: see the program's own split)
        self._lock = threading.Lock()

    def score(self, question: str, steps_batch: Sequence[Sequence[str]]) -> list[list[float]]:
        t0 = time.perf_counter()
        self.inner.score(question, steps_batch)
        with self._lock:
            self.seconds += time.perf_counter() - t0
        out = []
        for steps in steps_batch:
            row = []
            for step in steps:
                group, path = self.registry.node(step)
                row.append(self.trace.score(group, path, len(path) - 1))
            out.append(row)
        return out


# ------------------------------------------------------------------------------------ settings
@dataclasses.dataclass
class BenchSettings:
    """What one benchmark run measures (written as the output's first line; a resumed run must match).

    Attributes:
        algorithms, n: the programs and beam counts; problems: synthetic problems per (algorithm, n).
        beam_width: M of beam search and DVTS. seed: problems' and trace's seed.
        prompt_tokens: words per synthetic problem. temperature: sampling temperature.
        trace: the step-length / end / score trace's parameters (:class:`StepTrace` fields).
        context_tokens: the generator's context length (paths end before it); None: unlimited.
        planned_batch: the generator's planned batch (the generator-bound limit's batch).
        limit_tokens: tokens per request when the decode throughput for the limit is measured.
        banned_token_ids: ids the generator never samples (SGLang ``logit_bias``): a word
            tokenizer's specials, where a small vocabulary would write them into many steps.
        placement: how a step's trace path is keyed (``ordinal``: its place among its parent's
            children, as beam search's seeds since issue 18); records of another scheme do not resume.
    """

    algorithms: tuple[str, ...] = ALGORITHMS
    n: tuple[int, ...] = DEFAULT_N
    problems: int = 2
    beam_width: int = 4
    seed: int = 0
    prompt_tokens: int = 200
    temperature: float = 0.8
    trace: dict = dataclasses.field(default_factory=dict)
    context_tokens: int | None = None
    planned_batch: int = 256
    limit_tokens: int = 256
    banned_token_ids: tuple[int, ...] = ()
    placement: str = "ordinal"

    def __post_init__(self):
        self.algorithms, self.n = tuple(self.algorithms), tuple(int(x) for x in self.n)
        self.banned_token_ids = tuple(int(x) for x in self.banned_token_ids)
        bad = [a for a in self.algorithms if a not in ALGORITHMS]
        if bad or not self.algorithms:
            raise ValueError(f"unknown algorithm {bad[0] if bad else None!r}; choose from {', '.join(ALGORITHMS)}")
        if not self.n or any(x < 1 for x in self.n):
            raise ValueError(f"every n must be >= 1, got {list(self.n)}")
        if self.beam_width < 1 or self.problems < 1 or self.prompt_tokens < 1:
            raise ValueError("beam_width, problems and prompt_tokens must be >= 1")
        if "dvts" in self.algorithms and min(self.n) < self.beam_width:
            raise ValueError(f"DVTS needs n >= beam_width ({self.beam_width}); got n = {min(self.n)}")
        if self.planned_batch < 1 or self.limit_tokens < 1:
            raise ValueError("planned_batch and limit_tokens must be >= 1")
        self.step_trace()   # bad trace parameters fail here

    def step_trace(self) -> StepTrace:
        return StepTrace(seed=self.seed, **self.trace)

    def question(self, problem: int, vocab: int) -> str:
        """Synthetic problem ``problem``: ``prompt_tokens`` words of the benchmark word tokenizer."""
        rng = random.Random(f"bench-question/{self.seed}/{problem}")
        return " ".join(f"t{rng.randrange(vocab)}" for _ in range(self.prompt_tokens))

    def to_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


def search_group(algorithm: str, n: int, problem: int) -> str:
    """The search's id: the same on both sides (it keys the trace)."""
    return f"{algorithm}-n{n}-p{problem}"


# --------------------------------------------------------------------------------- the searches
def run_side(side: str, generator_url: str, prm_url: str, settings: BenchSettings, *,
             prm_tokenizer: str | None = None, generator_tokenizer: str | None = None,
             vocab: int = 32000, done: Iterable[tuple] = (), write: Callable[[dict], None],
             progress: bool = True, deadline: float | None = None) -> int:
    """Run every (algorithm, n, problem) not in ``done`` on one side's servers; ``write`` gets one
    record per finished search (so nothing finished is lost if a later one fails). No search starts
    after ``deadline`` (``time.monotonic()``); returns how many were left for a later run."""
    from tqdm.auto import tqdm

    from sgl_tts.bench.dummy_models import WORD_TAG
    from sgl_tts.experiment import RunError, program_function
    from sgl_tts.prm import StepTagPRM

    trace = settings.step_trace()
    try:    # every program's settings checked before the first search
        configs = {(a, n): run_config(side, a, n, settings, trace) for a in settings.algorithms for n in settings.n}
    except RunError as exc:
        raise BenchError(f"side {side}: {exc}") from None
    if SIDE_OPTIONS[side].get("speculative") == "auto":   # its decode curve, before the first search
        measured = side_curve(side, generator_url, settings, trace)
        write({"kind": "curve", "side": side, "points": [list(p) for p in measured.curve.points],
               "context": measured.context, "date": measured.date, "path": measured.path})
        slowdown = side_slowdown(side, generator_url, prm_url)
        write({"kind": "slowdown", "side": side, "points": [list(p) for p in slowdown.slowdown.points],
               "per_row": round(slowdown.slowdown.per_row, 6), "date": slowdown.date, "path": slowdown.path})
        configs = {k: dataclasses.replace(c, speculation_curve=measured.path, verifier_slowdown=slowdown.path)
                   for k, c in configs.items()}
    registry = StepRegistry()
    gen = TraceEndpoint(generator_url, trace, registry, context_tokens=settings.context_tokens,
                        tokenizer_path=generator_tokenizer, banned_token_ids=settings.banned_token_ids)
    prm_backend = MeteredEndpoint(prm_url, tokenizer_path=prm_tokenizer)
    gen.tokenizer, prm_backend.tokenizer   # loaded now, not inside the first timed search
    done = set(done)
    todo = [(a, n, p) for a in settings.algorithms for n in settings.n for p in range(settings.problems)
            if (side, a, n, p) not in done]
    for k, (algorithm, n, problem) in enumerate(tqdm(todo, desc=f"{side} searches", disable=not progress)):
        if deadline is not None and time.monotonic() >= deadline:
            logger.warning("%s: time is up; %d searches left for the next run", side, len(todo) - k)
            return len(todo) - k
        group = search_group(algorithm, n, problem)
        registry.clear()
        gen.take_meter(), prm_backend.take_meter()
        verifier = TraceScores(StepTagPRM(prm_backend, good="+", bad="-", tag=WORD_TAG), registry, trace)
        t0 = time.perf_counter()
        try:
            state = program_function(algorithm).run(
                **configs[algorithm, n].program_arguments(settings.question(problem, vocab), verifier),
                search_group=group, backend=gen)
            error = state.error()
        except Exception as exc:  # noqa: BLE001 - reported with the search that failed
            error = exc
        seconds = time.perf_counter() - t0
        if error is not None:
            # a fork's own error (an HTTP error, a BenchError) only reaches the program as a missing
            # variable: report the fork's
            cause = next(iter(end_stream_executors()), None) or error
            raise BenchError(f"search {group} failed: {cause!r}") from (cause if isinstance(cause, BaseException) else None)
        result = state.ret_value
        kept = sorted([list(registry.node(t.steps[-1])[1]) if t.steps else [], bool(t.finished), int(t.tokens),
                       round(float(t.score), 9)] for t in result.trajectories)
        g, v = gen.take_meter(), prm_backend.take_meter()
        write({"kind": "search", "side": side, "algorithm": algorithm, "n": n, "problem": problem,
               "seconds": seconds, "verifier_seconds": verifier.seconds,
               "generator_seconds": max(0.0, seconds - verifier.seconds),
               # the program's own split (what it waited for: overlapped PRM time is not counted twice)
               "waited_generating": result.seconds_generating, "waited_verifying": result.seconds_verifying,
               "tokens_generated": int(result.tokens_generated), "tokens_kept": int(result.tokens_kept),
               "tokens_speculative": int(result.tokens_speculative), "tokens_reused": int(result.tokens_reused),
               "branches": {"started": result.branches_started, "declined": result.branches_declined,
                            "stopped": result.branches_stopped, "stood_down": dict(result.stood_down)},
               "prm_requests": int(result.prm_requests),
               "trajectories": len(result.trajectories),
               "trajectory_tokens": sum(t.tokens for t in result.trajectories),
               "trajectory_seconds": sum(t.seconds for t in result.trajectories),
               "depth_tokens": [registry.depth_tokens.get(d, 0) for d in range(max(registry.depth_tokens) + 1)],
               "generator": dataclasses.asdict(g), "prm": dataclasses.asdict(v), "kept": kept})
    return 0


def measure_limit(generator_url: str, settings: BenchSettings, *, vocab: int = 32000,
                  write: Callable[[dict], None], done: Iterable[int] = ()) -> None:
    """Decode throughput at every batch the limit needs (``min(n, planned_batch)``): that many
    requests of ``limit_tokens`` tokens each (``ignore_eos``) sent at once, no PRM, no stragglers."""
    import requests

    done = set(done)
    for batch in sorted({min(n, settings.planned_batch) for n in settings.n} - done):
        texts = [settings.question(10_000 + i, vocab) for i in range(batch)]
        body = {"text": texts, "sampling_params": {"max_new_tokens": settings.limit_tokens,
                                                   "ignore_eos": True, "temperature": settings.temperature}}
        t0 = time.perf_counter()
        res = requests.post(generator_url.rstrip("/") + "/generate", json=body, timeout=3600)
        seconds = time.perf_counter() - t0
        if res.status_code != 200:
            raise BenchError(f"the limit measurement at batch {batch} failed: HTTP {res.status_code} {res.text[:200]}")
        out = res.json()
        tokens = sum(int(o["meta_info"]["completion_tokens"]) for o in (out if isinstance(out, list) else [out]))
        write({"kind": "limit", "batch": batch, "tokens": tokens, "seconds": seconds,
               "tokens_per_s": tokens / seconds if seconds > 0 else 0.0})


# ------------------------------------------------------------------------------------- the report
@dataclasses.dataclass
class SideRow:
    """One side at one (algorithm, n), over its problems."""

    problems: int
    goodput: float              # precise goodput, tokens/s
    latency: float              # mean seconds per search
    generator_seconds: float    # of which waiting for the generator (mean)
    verifier_seconds: float     # of which waiting for the PRM (mean)
    tokens_generated: float     # mean per search
    tokens_kept: float
    generator_hit_rate: float   # cached / prompt tokens
    prm_hit_rate: float
    tokens_speculative: float = 0.0   # mean per search, of tokens_generated
    tokens_reused: float = 0.0        # of those, taken over by a kept child
    branches_started: float = 0.0     # speculative branches per search (a controlled side: started,
    branches_declined: float = 0.0    # and declined as costing more than they save)


@dataclasses.dataclass
class ReportRow:
    algorithm: str
    n: int
    sides: dict[str, SideRow]
    limit_goodput: float | None    # generator-bound limit (precise goodput), tokens/s
    limit_batch: int
    match: bool | None             # kept beams equal on every side (None: only one side ran)
    mismatched: list[int]          # problems whose kept beams differ


def _side_row(recs: list[dict]) -> SideRow:
    k = len(recs)
    mean = lambda f: sum(f(r) for r in recs) / k  # noqa: E731
    secs = sum(r["trajectory_seconds"] for r in recs)
    rate = lambda who: (sum(r[who]["cached_tokens"] for r in recs) /  # noqa: E731
                        max(1, sum(r[who]["prompt_tokens"] for r in recs)))
    # what the program waited for, where it records it (older records: the PRM calls' time)
    split = all("waited_verifying" in r for r in recs)
    gen_s = mean(lambda r: r["seconds"] - r["waited_verifying"]) if split else mean(lambda r: r["generator_seconds"])
    ver_s = mean(lambda r: r["waited_verifying"]) if split else mean(lambda r: r["verifier_seconds"])
    return SideRow(k, sum(r["trajectory_tokens"] for r in recs) / secs if secs > 0 else 0.0,
                   mean(lambda r: r["seconds"]), gen_s, ver_s, mean(lambda r: r["tokens_generated"]),
                   mean(lambda r: r["tokens_kept"]), rate("generator"), rate("prm"),
                   mean(lambda r: r.get("tokens_speculative", 0)), mean(lambda r: r.get("tokens_reused", 0)),
                   mean(lambda r: r.get("branches", {}).get("started", 0)),
                   mean(lambda r: r.get("branches", {}).get("declined", 0)))


def summarize(records: Sequence[dict], settings: BenchSettings) -> list[ReportRow]:
    """The report's rows, in (algorithm, n) order, from the run's records."""
    searches = [r for r in records if r.get("kind") == "search"]
    limits = {r["batch"]: r["tokens_per_s"] for r in records if r.get("kind") == "limit"}
    rows = []
    for algorithm in settings.algorithms:
        for n in settings.n:
            mine = [r for r in searches if r["algorithm"] == algorithm and r["n"] == n]
            if not mine:
                continue
            by_side = {s: sorted((r for r in mine if r["side"] == s), key=lambda r: r["problem"]) for s in ALL_SIDES}
            sides = {s: _side_row(rs) for s, rs in by_side.items() if rs}
            batch = min(n, settings.planned_batch)
            limit = None
            tps = limits.get(batch)
            # a side without speculation: its depth tokens are the search's own work
            ref = by_side["sgl-tts"] or by_side["stock"] or next((rs for rs in by_side.values() if rs), [])
            if tps:
                # depth by depth at ``tps``: a trajectory that ends at depth d is done when every
                # step of depths <= d is decoded
                tokens = secs = 0.0
                for r in ref:
                    through = [sum(r["depth_tokens"][:d + 1]) for d in range(len(r["depth_tokens"]))]
                    for path, _, kept_tokens, _ in r["kept"]:
                        tokens += kept_tokens
                        secs += through[len(path) - 1] / tps
                limit = tokens / secs if secs > 0 else None
            match, bad = None, []
            present = [s for s in ALL_SIDES if by_side[s]]
            if len(present) > 1:   # every side against the first (stock when it ran)
                a = {r["problem"]: r["kept"] for r in by_side[present[0]]}
                for other in present[1:]:
                    b = {r["problem"]: r["kept"] for r in by_side[other]}
                    bad += [p for p in set(a) & set(b) if a[p] != b[p]]
                bad = sorted(set(bad))
                match = not bad
            rows.append(ReportRow(algorithm, n, sides, limit, batch, match, bad))
    return rows


def _rate(tokens_per_s: float, decimals: int) -> str:
    """A goodput for the table: ``decimals`` places from 10 tok/s up, two below, so that the slow
    rows of a pressured CPU run (0.4 against 0.7 tok/s) keep their ratio readable."""
    return f"{tokens_per_s:.{decimals if tokens_per_s >= 10 else 2}f}"


def format_report(rows: Sequence[ReportRow]) -> str:
    """Markdown tables: one row per (algorithm, n, side)."""
    head = ("| algorithm | n | side | problems | goodput (tok/s) | vs best stock | latency (s) | generator (s) | "
            "verifier (s) | tokens generated | speculative (reused) | tokens kept | gen cache hit | PRM cache hit | "
            "limit (tok/s) | vs limit | kept beams |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for row in rows:
        # against the best stock side that ran (fcfs, lpm, dfs-weight): what a user would pick instead
        stock = max((r for side, r in row.sides.items() if is_stock(side)), key=lambda r: r.goodput, default=None)
        for side in ALL_SIDES:
            r = row.sides.get(side)
            if r is None:
                continue
            vs = f"{r.goodput / stock.goodput:.2f}x" if stock and stock.goodput > 0 else "-"
            limit = f"{_rate(row.limit_goodput, 0)} (b={row.limit_batch})" if row.limit_goodput else "-"
            of_limit = f"{r.goodput / row.limit_goodput:.0%}" if row.limit_goodput else "-"
            spec = (f"{r.tokens_speculative:.0f} ({r.tokens_reused:.0f})"
                    if r.tokens_speculative or r.branches_declined else "-")
            if r.branches_declined:   # a controlled side: the branches it did not start
                spec += f"; {r.branches_declined:.0f} declined"
            kept = ("-" if row.match is None else "match" if row.match
                    else "DIFFER: problems " + ", ".join(map(str, row.mismatched)))
            lines.append(f"| {row.algorithm} | {row.n} | {side} | {r.problems} | {_rate(r.goodput, 1)} | {vs} | "
                         f"{r.latency:.2f} | {r.generator_seconds:.2f} | {r.verifier_seconds:.2f} | "
                         f"{r.tokens_generated:.0f} | {spec} | {r.tokens_kept:.0f} | {r.generator_hit_rate:.1%} | "
                         f"{r.prm_hit_rate:.1%} | {limit} | {of_limit} | {kept} |")
    return "\n".join(lines)


def plot_report(rows: Sequence[ReportRow], path: str | Path, title: str = "") -> Path:
    """Goodput vs n per algorithm (each side and the generator-bound limit) and the latency split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algorithms = list(dict.fromkeys(r.algorithm for r in rows))
    fig, axes = plt.subplots(2, max(1, len(algorithms)), figsize=(6 * max(1, len(algorithms)), 8),
                             squeeze=False)
    for col, algorithm in enumerate(algorithms):
        mine = [r for r in rows if r.algorithm == algorithm]
        ax = axes[0][col]
        # every side that ran, in ALL_SIDES's order (a marker each, cycling): a fixed list of styles
        # zipped with ALL_SIDES once dropped every side after the fifth from this panel
        shown = [side for side in ALL_SIDES if any(side in r.sides for r in mine)]
        for i, side in enumerate(shown):
            pts = [(r.n, r.sides[side].goodput) for r in mine if side in r.sides]
            ax.plot(*zip(*pts), "osv^dP*Xh<>p"[i % 12] + "-", color=f"C{i % 10}", label=side)
        lim = [(r.n, r.limit_goodput) for r in mine if r.limit_goodput]
        if lim:
            # a marker too: a run of one n is a single point, which a bare dashed line never draws
            ax.plot(*zip(*lim), "k_--", markersize=16, label="generator-bound limit")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("n (beams)")
        ax.set_ylabel("precise goodput (tokens/s)")
        ax.set_title(f"{algorithm}: goodput")
        ax.legend(fontsize=8)
        ax = axes[1][col]
        labels, gen, ver = [], [], []
        for r in mine:
            for side in ALL_SIDES:
                if side in r.sides:
                    labels.append(f"{r.n}\n{side.replace('sgl-tts', 'tts').replace('+lookahead', '+la')}")
                    gen.append(r.sides[side].generator_seconds)
                    ver.append(r.sides[side].verifier_seconds)
        xs = range(len(labels))
        ax.bar(xs, gen, label="generator")
        ax.bar(xs, ver, bottom=gen, label="verifier (PRM)")
        ax.set_xticks(list(xs), labels, fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("seconds per search (mean)")
        ax.set_title(f"{algorithm}: completion latency")
        ax.legend()
    if title:   # wrapped to the figure's width: long headers (the CPU run) would be cut
        fig.suptitle(textwrap.fill(title, int(15 * fig.get_figwidth())), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------- the records
def _record_store(path: Path, settings: BenchSettings) -> RecordStore:
    """The run's output as a :class:`~sgl_tts.records.RecordStore`: the settings in its header line."""
    return RecordStore(path, settings.to_json(), what="a benchmark output")


def read_records(path: Path, settings: BenchSettings) -> list[dict]:
    """The records of an earlier run of the same settings (a torn last line is dropped); an output of
    other settings is refused rather than mixed."""
    try:
        return _record_store(path, settings).read()
    except KeyMismatch as exc:
        command = next((r["command"] for r in exc.records if r.get("kind") == "run" and r.get("command")), None)
        again = f"; it was written by `{command}`: give that command's flags again" if command else ""
        raise BenchError(f"{path} holds a run of other settings ({exc.differences()}){again} (--report-only "
                         "rebuilds its report with them), or pick another --output") from None
    except StoreError as exc:
        raise BenchError(f"{exc}; move the file away or pick another --output") from None


class RecordWriter:
    """Appends to the run's output (the settings line first in a new file; a torn last line cut off
    first) one flushed and fsynced line per new record; ``records``: those already in it
    (:func:`read_records`), which :attr:`records` goes on from."""

    def __init__(self, path: Path, settings: BenchSettings, records: Sequence[dict] = ()):
        self.store = _record_store(path, settings)
        self.store.open()
        self.path = path
        self.records: list[dict] = list(records)

    def __call__(self, record: dict) -> None:
        self.store.append(record)
        self.records.append(record)


__all__ = ["ALGORITHMS", "BenchError", "BenchSettings", "Meter", "MeteredEndpoint", "RecordWriter",
           "ReportRow", "SIDES", "ALL_SIDES", "SERVER_POLICIES", "SIDE_OPTIONS", "STOCK_POLICIES", "is_stock", "run_config", "SideRow", "StepRegistry", "TraceEndpoint", "TraceScores",
           "format_report", "measure_limit", "plot_report", "read_records",
           "run_side", "search_group", "summarize"]
