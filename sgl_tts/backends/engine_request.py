"""What the CPU engine keeps per request (:class:`_Request`) and counts (:class:`EngineStats`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import numpy as np
import torch

from sgl_tts.backends.semantics import LogprobSpec, SamplingSpec


@dataclasses.dataclass
class EngineStats:
    """Counters for tests and benchmarks (read them; the engine only adds)."""

    requests: int = 0
    prefill_forwards: int = 0
    decode_forwards: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cached_tokens: int = 0
    max_running: int = 0
    joined_running: int = 0   # requests admitted while others were mid-decode
    kv_reallocations: int = 0  # joins that copied the running batch's KV into new buffers


class _Request:
    """Engine-internal state of one request."""

    __slots__ = (
        "rid", "input_ids", "sampling", "logprobs", "score_positions", "future", "created",
        "generator", "output_ids", "cached_tokens", "finish_reason", "out_lp", "out_top",
        "out_ids_lp", "in_lp", "in_top", "in_ids_lp", "scores", "stop_window", "priority",
        "processor", "custom_params", "eos_token_ids",
    )

    def __init__(self, rid, input_ids, sampling, logprobs, score_positions, priority=0):
        self.rid: str = rid
        self.processor: str | None = None           # a custom logit processor (SGLang's serialized form)
        self.custom_params: dict | None = None      # its per-request parameters, with ``__req__``: this
        self.eos_token_ids: frozenset[int] = frozenset()
        self.priority: int = priority
        self.input_ids: list[int] = input_ids
        self.sampling: SamplingSpec = sampling
        self.logprobs: LogprobSpec = logprobs
        self.score_positions: tuple[tuple[int, ...], tuple[int, ...]] | None = score_positions
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.created = time.perf_counter()
        self.generator: torch.Generator | None = None
        if sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(int(sampling.seed))
        self.output_ids: list[int] = []
        self.cached_tokens = 0
        self.finish_reason: dict | None = None
        self.out_lp: list[float] = []
        self.out_top: list[tuple[tuple[float, ...], tuple[int, ...]]] = []   # per token: top values, their ids
        self.out_ids_lp: list[list[float]] = []
        self.in_lp: list[float | None] = []
        self.in_top: list[list[tuple[float, int]] | None] = []
        self.in_ids_lp: list[list[float] | None] = []
        self.scores: np.ndarray | None = None
        self.stop_window = 0

    @property
    def origin_input_ids(self) -> list[int]:
        """The prompt, by the name SGLang's ``Req`` gives it (what custom logit processors read)."""
        return self.input_ids

    # Rows of the prompt whose next-token distribution this request needs (besides the last one).
    def needed_rows(self) -> list[int]:
        rows: list[int] = []
        lp = self.logprobs
        if lp.return_logprob:
            start = self.input_start()
            # Entry j (j >= 1) is token start+j, predicted by row start+j-1; entry 0 is None.
            rows.extend(range(start, len(self.input_ids) - 1))
        if self.score_positions is not None:
            rows.extend(self.score_positions[0])
        return rows

    def input_start(self) -> int:
        start = self.logprobs.logprob_start_len
        return len(self.input_ids) if start is None or start < 0 else start

    def reuse_limit(self) -> int:
        """Longest prompt prefix whose KV may come from a cache (its rows need no logits)."""
        limit = len(self.input_ids) - 1
        rows = self.needed_rows()
        if rows:
            limit = min(limit, min(rows))
        return max(limit, 0)
