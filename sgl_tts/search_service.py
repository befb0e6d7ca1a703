"""Searches served one per request: what ``sgl-tts serve-search`` runs behind its HTTP routes.

:class:`SearchService` holds the generator and PRM servers' URLs and runs a
:class:`~sgl_tts.search_api.SearchRequest`'s program on them, at most ``max_concurrent`` at a time
(the others wait their turn in arrival order, as ``sgl-tts run``'s continuous problem batching keeps
a fixed number of problems in flight). Each search gets its own group id and its own
:class:`SearchEndpoint` onto the generator, which

- reports progress (generations finished, tokens, deepest step) to a callback, and
- once the search is cancelled (its client went away), refuses every new generation and aborts the
  search's requests on the server by group prefix (the sgl-tts plugin's group abort), again and again
  until the program has returned: a request sent just before the abort is caught by the next one, so
  when :meth:`SearchService.run` returns nothing of the search is left on the generator.

The result is a :class:`SearchOutcome`: the program's :class:`~sgl_tts.search.SearchResult` plus the
choices ranked for the response, the prompt's token count and the timings.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from typing import Any, Callable

from sgl_tts.backends import SGLangEndpoint
from sgl_tts.search import SearchResult, Trajectory
from sgl_tts.search_api import SearchRequest
from sgl_tts.tts_request import new_group

logger = logging.getLogger(__name__)

# SGLang's interpreter warns with a whole traceback for every stream a cancel stops: expected, not news
warnings.filterwarnings("ignore", message=r"(?s)Error in stream_executor:.*SearchCancelled", category=UserWarning)

ABORT_EVERY_S = 0.05   # how often a cancelled search's requests are aborted until its program returns


class SearchCancelled(RuntimeError):
    """The search was cancelled (its client disconnected); raised by its endpoint's next generation."""


@dataclasses.dataclass
class Progress:
    """How far a running search has got (what a streaming client sees as progress events).

    Attributes:
        generations: generation requests finished (steps or samples).
        tokens: tokens those requests generated.
        depth: the deepest step generated so far (0-based; 0 for best-of-N).
        elapsed: seconds since the search started (queueing excluded).
    """

    generations: int = 0
    tokens: int = 0
    depth: int = 0
    elapsed: float = 0.0


class SearchEndpoint(SGLangEndpoint):
    """One search's connection to the generator: counts its generations and stops on cancel."""

    def __init__(self, base_url: str, group: str, on_generation: Callable[[int, int], None] | None = None,
                 **kwargs: Any):
        super().__init__(base_url, **kwargs)
        self.group = group
        self.cancelled = threading.Event()
        self._on_generation = on_generation

    def _generate_body(self, s, sampling_params, fields):   # every generation, streamed or not
        if self.cancelled.is_set():
            raise SearchCancelled(f"search {self.group} was cancelled")
        return super()._generate_body(s, sampling_params, fields)

    def generate(self, s, sampling_params):
        from sgl_tts.backends.request import take_request_fields

        data = self._generate_body(s, sampling_params, take_request_fields())
        obj = self.post("/generate", data)
        if self._on_generation is not None:
            self._on_generation(_depth_of(data.get("rid")), int(obj["meta_info"].get("completion_tokens", 0)))
        return obj["text"], obj["meta_info"]


def _depth_of(rid: Any) -> int:
    """The depth in a tagged request's rid (``tts/<group>/<depth>/...``), else 0."""
    if isinstance(rid, str) and rid.startswith("tts/"):
        parts = rid.split("/")
        if len(parts) > 2 and parts[2].isdigit():
            return int(parts[2])
    return 0


@dataclasses.dataclass
class Choice:
    """One answer in the response: a trajectory's text and what the search knew of it."""

    text: str
    answer: str | None
    score: float
    finished: bool


@dataclasses.dataclass
class SearchOutcome:
    """A finished search, ready to become a response.

    Attributes:
        request: what was asked.
        group: the search's group id (its requests' rid prefix ``tts/<group>/``).
        result: the program's result.
        choices: up to ``request.choices`` answers, the program's pick first (see :func:`rank_choices`).
        prompt_tokens: tokens of the prompt the program sends (question + delimiter).
        queued: seconds the search waited for a free slot.
        latency: seconds from its start to its result (queueing excluded).
    """

    request: SearchRequest
    group: str
    result: SearchResult
    choices: list[Choice]
    prompt_tokens: int
    queued: float
    latency: float

    def report(self) -> dict[str, Any]:
        """The response's ``sgl_tts`` field: what the search did."""
        cfg, r = self.request.config, self.result
        return {"program": cfg.program, "budget": cfg.n, "beam_width": cfg.beam_width, "seed": cfg.seed,
                "temperature": cfg.temperature, "search_group": self.group, "answer": r.answer,
                "answers": dict(r.answers), "tokens_generated": r.tokens_generated, "tokens_kept": r.tokens_kept,
                "trajectories": len(r.trajectories), "scores": [round(c.score, 6) for c in self.choices],
                "exit_reason": r.exit_reason, "requests_aborted": r.requests_aborted,
                "latency_s": round(self.latency, 4), "queued_s": round(self.queued, 4)}


def rank_choices(result: SearchResult, k: int) -> list[Choice]:
    """Up to ``k`` distinct trajectories as choices: first the best-scored one whose answer is the
    program's pick (its pick may be a vote, not the best trajectory), then the others by score, highest
    first (ties: the program's order); trajectories with the same text count once."""
    def as_choice(t: Trajectory) -> Choice:
        return Choice(t.text, t.answer, float(t.score), t.finished)

    order = sorted(range(len(result.trajectories)), key=lambda i: -result.trajectories[i].score)
    trajs = [result.trajectories[i] for i in order]
    picked = next((t for t in trajs if t.answer is not None and t.answer == result.answer), None)
    out: list[Choice] = []
    seen: set[str] = set()
    for t in ([picked] if picked is not None else []) + trajs:
        if t.text in seen:
            continue
        seen.add(t.text)
        out.append(as_choice(t))
        if len(out) == k:
            break
    return out


class SearchService:
    """Runs searches against a generator and a PRM server.

    Args:
        generator_url: the generator server (or the router in front of several).
        prm_url: the PRM server; ``None`` serves only ``self_consistency``.
        max_concurrent: searches running at once; later ones wait their turn.
        prm_kind, prm_tokenizer, prm_good, prm_bad, prm_tag: as ``sgl-tts run``'s settings.
    """

    def __init__(self, generator_url: str, prm_url: str | None, *, max_concurrent: int = 8,
                 prm_kind: str = "step_tag", prm_tokenizer: str | None = None, prm_good: str = "+",
                 prm_bad: str = "-", prm_tag: str | None = None):
        from sgl_tts.experiment import RunConfig, open_prm

        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {max_concurrent}")
        self.generator_url = generator_url.rstrip("/")
        self.generator = SGLangEndpoint(self.generator_url)   # checks it answers; tokenizer; group aborts
        self.max_concurrent = max_concurrent
        self.prm = None
        if prm_url is not None:
            cfg = RunConfig(prm=prm_url.rstrip("/"), prm_kind=prm_kind, prm_tokenizer=prm_tokenizer,
                            prm_good=prm_good, prm_bad=prm_bad, **({"prm_tag": prm_tag} if prm_tag else {}))
            self.prm, _ = open_prm(cfg)
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self._lock = threading.Lock()
        self.running: dict[str, SearchEndpoint] = {}
        self.waiting = 0
        self.served = 0

    def run(self, req: SearchRequest, *, group: str | None = None, cancel: threading.Event | None = None,
            on_progress: Callable[[Progress], None] | None = None,
            on_start: Callable[[str], None] | None = None) -> SearchOutcome:
        """Run one search and return its outcome; raises :class:`SearchCancelled` when ``cancel`` is
        set before it ends (its requests then aborted on the generator, none left when this returns),
        or the program's own error."""
        from sgl_tts.experiment import program_function

        cfg = req.config
        if cfg.uses_prm and self.prm is None:
            raise ValueError(f"{cfg.program} needs a PRM and this server has none (start it with --prm-url)")
        group = group or new_group()
        cancel = cancel or threading.Event()
        t_arrive = time.monotonic()
        with self._lock:
            self.waiting += 1
        try:
            if cancel.is_set():
                raise SearchCancelled(f"search {group} was cancelled before it started")
            while not self._slots.acquire(timeout=0.05):
                if cancel.is_set():
                    raise SearchCancelled(f"search {group} was cancelled while waiting for a slot")
        finally:
            with self._lock:
                self.waiting -= 1
        try:
            t0 = time.monotonic()
            progress = Progress()
            plock = threading.Lock()

            def counted(depth: int, tokens: int) -> None:
                with plock:
                    progress.generations += 1
                    progress.tokens += tokens
                    progress.depth = max(progress.depth, depth)
                    progress.elapsed = time.monotonic() - t0
                    snap = dataclasses.replace(progress)
                if on_progress is not None:
                    on_progress(snap)

            endpoint = SearchEndpoint(self.generator_url, group, counted)
            with self._lock:
                self.running[group] = endpoint
            if on_start is not None:
                on_start(group)
            args = cfg.program_arguments(req.question, self.prm)
            args["search_group"] = group
            program = program_function(cfg.program)
            box: dict[str, Any] = {}

            def work() -> None:
                try:
                    box["state"] = program.run(backend=endpoint, **args)
                except BaseException as exc:   # handed to the caller below
                    box["error"] = exc

            worker = threading.Thread(target=work, name=f"sgl-tts-search-{group}", daemon=True)
            worker.start()
            while worker.is_alive():
                worker.join(ABORT_EVERY_S)
                if cancel.is_set():
                    endpoint.cancelled.set()
                    if worker.is_alive():
                        self._abort(group)
            latency = time.monotonic() - t0
            if cancel.is_set():
                raise SearchCancelled(f"search {group} was cancelled")
            if "error" in box:
                raise box["error"]
            state = box["state"]
            err = state.error()
            if err is not None:
                raise err if isinstance(err, BaseException) else RuntimeError(str(err))
            result = state.ret_value
            prompt_tokens = len(self.generator.encode(req.question + cfg.delimiter))
            with self._lock:
                self.served += 1
            return SearchOutcome(req, group, result, rank_choices(result, req.choices), prompt_tokens,
                                 t0 - t_arrive, latency)
        finally:
            with self._lock:
                self.running.pop(group, None)
            self._slots.release()

    def _abort(self, group: str) -> None:
        try:
            self.generator.abort_group(group)
        except Exception as exc:   # the next round tries again; the search is stopping anyway
            logger.warning("aborting search %s on %s failed: %s", group, self.generator_url, exc)

__all__ = ["Choice", "Progress", "SearchCancelled", "SearchEndpoint", "SearchOutcome", "SearchService",
           "rank_choices"]
