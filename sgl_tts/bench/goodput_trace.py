"""The trace on the servers (:mod:`sgl_tts.bench.trace` fixes what a real model would decide): where each
generated step sits in its search's tree (:class:`StepRegistry`), a generator endpoint that makes every
step as long as the trace says (:class:`TraceEndpoint`), a PRM that does the real PRM's work and
answers with the trace's scores (:class:`TraceScores`), and what each server reported for the requests
sent to it (:class:`Meter`, :class:`MeteredEndpoint`)."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Mapping, Sequence

from sgl_tts.backends.endpoint import SGLangEndpoint
from sgl_tts.bench.errors import BenchError
from sgl_tts.bench.trace import StepTrace
from sgl_tts.search import STEP_DELIMITER, SearchTag

CONTEXT_MARGIN = 64   # tokens a path leaves free under the context length (PRM tags, padding)


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
    cached_reported: int = 0   # answers that said their cached tokens (SGLang's /classify does not)

    def add(self, meta: Mapping[str, Any]) -> None:
        self.requests += 1
        self.prompt_tokens += int(meta.get("prompt_tokens", 0) or 0)
        self.cached_tokens += int(meta.get("cached_tokens", 0) or 0)
        self.cached_reported += "cached_tokens" in meta
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
        self._sent = 0   # step requests prepared for sending (streamed or not)
        super().__init__(base_url, tokenizer_path=tokenizer_path)

    def take_sent(self) -> int:
        """The step requests sent since the last call (every generation, streamed ones too)."""
        with self._meter_lock:
            got, self._sent = self._sent, 0
        return got

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
        with self._meter_lock:
            self._sent += 1
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


@dataclasses.dataclass(frozen=True)
class WordStepPooledFormat:
    """A step-pooled PRM's input over the benchmark's word tokenizer (a real config served with random
    weights, its tokenizer apart): the question, then each step's words closed by the id the
    architecture's class pools at without its own tokenizer
    (:data:`sgl_tts.protocol.STEP_POOLED_DEFAULT_IDS`). The work is the real PRM's (every step's
    tokens, one input per trajectory, the head at each step's end); the scores are the trace's
    (:class:`TraceScores`). Duck-types :class:`sgl_tts.prm.formats.StepPooledFormat`."""

    architecture: str

    @property
    def name(self) -> str:
        return f"{self.architecture} (word tokenizer)"

    def step_token_id(self, tokenizer) -> int:
        from sgl_tts.protocol import STEP_POOLED_DEFAULT_IDS

        return STEP_POOLED_DEFAULT_IDS[self.architecture]

    def encode(self, tokenizer, question: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        step_id = self.step_token_id(tokenizer)
        ids = list(tokenizer.encode(question, add_special_tokens=False))
        ends = []
        for step in steps:
            ids += list(tokenizer.encode(step, add_special_tokens=False)) + [step_id]
            ends.append(len(ids) - 1)
        return ids, ends

    def score(self, row: Sequence[float]) -> float:
        from sgl_tts.prm.scorers import head_score

        return head_score(row, 1)


__all__ = ["CONTEXT_MARGIN", "Meter", "MeteredEndpoint", "StepRegistry", "TraceEndpoint", "TraceScores",
           "WordStepPooledFormat"]
