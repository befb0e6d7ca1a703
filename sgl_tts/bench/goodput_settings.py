"""What one ``sgl-tts bench`` run measures (:class:`BenchSettings`, the records' first line), the
search ids that key its trace (:func:`search_group`), and the benchmark's defaults: the algorithms,
the beam counts and the GPU servers' flags."""

from __future__ import annotations

import dataclasses
import json
import random

from sgl_tts.bench.arrivals import DEFAULT_LATENCY_BOUND
from sgl_tts.bench.trace import StepTrace

ALGORITHMS = ("beam_search", "dvts")
DEFAULT_N = (8, 16, 32, 64, 128, 256, 512)
# What the lent GPU machines can run with the wheelhouse (docs/GPU_BRINGUP.md): triton attention,
# torch sampling, no grammar backend (FA3 kernels, flashinfer cubins and xgrammar do not travel).
DEFAULT_SERVER_ARGS = ("--attention-backend triton --sampling-backend pytorch --grammar-backend none "
                       "--cuda-graph-backend-prefill disabled")


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
        arrivals: the load mode's offered rates, problems per second (``--arrivals``; empty: the
            searches run one at a time). At each rate the ``problems`` of every (algorithm, n) arrive as
            a Poisson process (:mod:`sgl_tts.bench.arrivals`) and run at once (:mod:`sgl_tts.bench.goodput_load`).
        latency_bound: the load mode's maximum-sustainable-rate rule: p99 within this many times the
            side's unloaded latency.
        unloaded_problems: the load mode's unloaded block: this many problems (None: every one) run one
            after another, alone: each one's latency alone, over which its latencies under load are read
            as a stretch (:mod:`sgl_tts.bench.load_report`).
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
    arrivals: tuple[float, ...] = ()
    latency_bound: float = DEFAULT_LATENCY_BOUND
    unloaded_problems: int | None = None

    def __post_init__(self):
        self.algorithms, self.n = tuple(self.algorithms), tuple(int(x) for x in self.n)
        self.arrivals = tuple(float(x) for x in self.arrivals)
        if any(r <= 0 for r in self.arrivals) or len(set(self.arrivals)) != len(self.arrivals):
            raise ValueError(f"every arrival rate must be > 0 and given once, got {list(self.arrivals)}")
        if self.unloaded_problems is None:
            self.unloaded_problems = self.problems
        if self.load and not 1 <= self.unloaded_problems <= self.problems:
            raise ValueError(f"unloaded_problems must be 1 to problems ({self.problems}), got {self.unloaded_problems}")
        if self.latency_bound <= 1:
            raise ValueError(f"the latency bound must be > 1 (times the unloaded latency), got {self.latency_bound}")
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

    @property
    def load(self) -> bool:
        """The load mode: searches arrive at the offered rates and run at once."""
        return bool(self.arrivals)

    def to_json(self) -> dict:
        out = json.loads(json.dumps(dataclasses.asdict(self)))
        if not self.arrivals:   # one search at a time: the records' header as before the load mode
            del out["arrivals"], out["latency_bound"], out["unloaded_problems"]
        return out


def search_group(algorithm: str, n: int, problem: int) -> str:
    """The search's id: the same on both sides (it keys the trace)."""
    return f"{algorithm}-n{n}-p{problem}"


__all__ = ["ALGORITHMS", "DEFAULT_N", "DEFAULT_SERVER_ARGS", "BenchSettings", "search_group"]
