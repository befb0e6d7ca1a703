"""Searches served one per request: what ``sgl-tts serve-search`` runs behind its HTTP routes.

:class:`SearchService` holds the generator and PRM servers' URLs and runs a
:class:`~sgl_tts.serving.api.SearchRequest`'s program on them, at most ``max_concurrent`` at a time
(the others wait their turn in arrival order, as ``sgl-tts run``'s continuous problem batching keeps
a fixed number of problems in flight). Each search gets its own group id and its own
:class:`SearchEndpoint` onto the generator, which

- reports progress (generations finished, tokens, deepest step) to a callback, and
- once the search is cancelled (its client went away), refuses every new generation and aborts the
  search's requests on the server by group prefix (the sgl-tts plugin's group abort). A request that
  was already on its way when the search was cancelled may reach the server after that abort (the
  abort then finds nothing and the request would run to its end), so the abort is repeated every
  ``ABORT_EVERY_S`` while such a request is still outstanding, and no longer: when
  :meth:`SearchService.run` returns nothing of the search is left on the generator.

Nothing here polls: a search waiting for its slot or for its program sleeps on a condition that the
other side signals (a slot freed, the program returned, a request answered, the cancel set: see
:class:`CancelEvent`), so it uses no CPU and wakes at once.

The result is a :class:`SearchOutcome`: the program's :class:`~sgl_tts.search.SearchResult` plus the
choices ranked for the response, the prompt's token count and the timings.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import logging
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator

from sgl_tts.backends import SGLangEndpoint
from sgl_tts.search import SearchResult, Trajectory
from sgl_tts.serving.api import SearchRequest
from sgl_tts.protocol import new_group, rid_depth

if TYPE_CHECKING:
    from sgl_tts.experiment import RunConfig

logger = logging.getLogger(__name__)

# SGLang's interpreter warns with a whole traceback for every stream a cancel stops: expected, not news
warnings.filterwarnings("ignore", message=r"(?s)Error in stream_executor:.*SearchCancelled", category=UserWarning)

ABORT_EVERY_S = 0.05   # how often a cancelled search's abort is repeated while a request sent before it is out


class SearchCancelled(RuntimeError):
    """The search was cancelled (its client disconnected); raised by its endpoint's next generation."""


_CALLBACKS = threading.Lock()   # guards every CancelEvent's callback list (held for a list operation only)


class CancelEvent(threading.Event):
    """A ``threading.Event`` that also calls its callbacks when it is set, so that a thread can wait for
    "cancelled *or* something else" on one condition (no polling). :meth:`SearchService.run` turns a
    plain ``threading.Event`` it is given into one (in place; it stays an ordinary ``Event``)."""

    def set(self) -> None:
        super().set()
        with _CALLBACKS:
            callbacks = list(self.__dict__.get("_callbacks", ()))
        for fn in callbacks:
            fn()

    def add_callback(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn()`` (on the setting thread) when the event is set, at once when it already is;
        returns a function that removes it. ``fn`` must be quick and must not block."""
        with _CALLBACKS:
            if not self.is_set():
                self.__dict__.setdefault("_callbacks", []).append(fn)
                return lambda: self._remove_callback(fn)
        fn()
        return lambda: None

    def _remove_callback(self, fn: Callable[[], None]) -> None:
        with _CALLBACKS:
            callbacks = self.__dict__.get("_callbacks", [])
            if fn in callbacks:
                callbacks.remove(fn)


def as_cancel_event(event: threading.Event | None) -> CancelEvent:
    """``event`` as a :class:`CancelEvent`: a new one for ``None``; a plain ``threading.Event`` has its
    class changed in place (same object, same state, same behaviour, plus callbacks)."""
    if event is None:
        return CancelEvent()
    if isinstance(event, CancelEvent):
        return event
    if type(event) is threading.Event:
        event.__class__ = CancelEvent
        return event   # type: ignore[return-value]
    raise TypeError(f"cancel must be a threading.Event or a CancelEvent, got {type(event).__name__}")


def _notifier(cond: threading.Condition) -> Callable[[], None]:
    def notify() -> None:
        with cond:
            cond.notify_all()
    return notify


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
    """One search's connection to the generator: counts its generations and stops on cancel.

    Attributes:
        cancelled: once set (with ``changed``'s lock held), every generation raises
            :class:`SearchCancelled` before it is sent.
        in_flight: generations let through and not answered yet (once ``cancelled`` is set it only falls).
        changed: its lock guards ``in_flight``; notified whenever ``in_flight`` falls after the cancel.
    """

    def __init__(self, base_url: str, group: str, on_generation: Callable[[int, int], None] | None = None,
                 **kwargs: Any):
        super().__init__(base_url, **kwargs)
        self.group = group
        self.cancelled = threading.Event()
        self.changed = threading.Condition(threading.Lock())
        self.in_flight = 0
        self._on_generation = on_generation

    def prepare_request(self, s, data, fields):   # every generation, streamed or not
        if self.cancelled.is_set():
            raise SearchCancelled(f"search {self.group} was cancelled")

    @contextlib.contextmanager
    def sending(self, data) -> Iterator[None]:
        with self.changed:   # the lock the cancel is set under: a generation is either refused or counted
            if self.cancelled.is_set():
                raise SearchCancelled(f"search {self.group} was cancelled")
            self.in_flight += 1
        try:
            yield
        finally:
            with self.changed:
                self.in_flight -= 1
                if self.cancelled.is_set():   # someone may be waiting for the last of them
                    self.changed.notify_all()

    def finish_answer(self, s, data, prepared, text, meta):
        if self._on_generation is not None:
            self._on_generation(rid_depth(data.get("rid")) or 0, int(meta.get("completion_tokens", 0)))
        return text, meta


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
                 prm_kind: str = "auto", prm_tokenizer: str | None = None, prm_good: str = "+",
                 prm_bad: str = "-", prm_tag: str | None = None):
        from sgl_tts.experiment import RunConfig, open_prm

        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {max_concurrent}")
        self.generator_url = generator_url.rstrip("/")
        self.generator = SGLangEndpoint(self.generator_url)   # checks it answers; tokenizer; group aborts
        self.max_concurrent = max_concurrent
        self.prm = None
        self.prm_url = prm_url.rstrip("/") if prm_url is not None else None
        self._auto_lock = threading.Lock()
        self._auto_settings: dict[str, Any] | None = None   # speculative: auto on these servers, once resolved
        if prm_url is not None:
            cfg = RunConfig(prm=prm_url.rstrip("/"), prm_kind=prm_kind, prm_tokenizer=prm_tokenizer,
                            prm_good=prm_good, prm_bad=prm_bad, **({"prm_tag": prm_tag} if prm_tag else {}))
            self.prm, _ = open_prm(cfg)
        # slots: ``_free`` of ``max_concurrent``, taken in arrival order (``_queue``); ``_lock`` guards
        # them and the counters and is notified when a slot is freed or a waiting search is cancelled
        self._lock = threading.Condition(threading.Lock())
        self._free = max_concurrent
        self._queue: collections.deque[object] = collections.deque()
        self.running: dict[str, SearchEndpoint] = {}
        self.waiting = 0
        self.served = 0

    def run(self, req: SearchRequest, *, group: str | None = None, cancel: threading.Event | None = None,
            on_progress: Callable[[Progress], None] | None = None,
            on_start: Callable[[str], None] | None = None) -> SearchOutcome:
        """Run one search and return its outcome; raises :class:`SearchCancelled` when ``cancel`` is
        set before it ends (its requests then aborted on the generator, none left when this returns),
        or the program's own error. Setting ``cancel`` wakes the waiting call at once, whether it waits
        for a slot or for the program (a plain ``threading.Event`` becomes a :class:`CancelEvent` for
        that, see :func:`as_cancel_event`)."""
        from sgl_tts.experiment import program_function

        cfg = req.config
        if cfg.uses_prm and self.prm is None:
            raise ValueError(f"{cfg.program} needs a PRM and this server has none (start it with --prm-url)")
        group = group or new_group()
        cancel = as_cancel_event(cancel)
        t_arrive = time.monotonic()
        if cancel.is_set():
            raise SearchCancelled(f"search {group} was cancelled before it started")
        self._take_slot(group, cancel)
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
            if cfg.speculative == "auto":
                cfg = self._on_these_servers(cfg)
            args = cfg.program_arguments(req.question, self.prm)
            args["search_group"] = group
            result = self._run_program(program_function(cfg.program), args, group, endpoint, cancel)
            latency = time.monotonic() - t0
            prompt_tokens = len(self.generator.encode(req.question + cfg.delimiter))
            with self._lock:
                self.served += 1
            return SearchOutcome(req, group, result, rank_choices(result, req.choices), prompt_tokens,
                                 t0 - t_arrive, latency)
        finally:
            with self._lock:
                self.running.pop(group, None)
                self._free += 1
                self._lock.notify_all()

    def _on_these_servers(self, cfg: "RunConfig") -> "RunConfig":
        """``speculative: auto`` on this service's servers, resolved as ``sgl-tts run`` resolves it: the
        generator's decode curve and, where the PRM shares its host, the PRM's slowdown beside it, each
        read from the disk cache or measured (:mod:`sgl_tts.launch.decode_curve`), once: at the first
        such request (a second waits for it); a failure is the request's error and the next one tries
        again."""
        with self._auto_lock:
            if self._auto_settings is None:
                from sgl_tts.experiment.driver import with_decode_curve, with_verifier_slowdown

                said = io.StringIO()
                on = dataclasses.replace(cfg, generator=self.generator_url, prm=self.prm_url)
                on = with_verifier_slowdown(with_decode_curve(on, said), said)
                logger.info("speculative: auto: %s", said.getvalue().strip().replace("\n", "; "))
                self._auto_settings = {k: getattr(on, k) for k in
                                       ("generator", "prm", "speculation_curve", "verifier_slowdown")}
        return dataclasses.replace(cfg, **self._auto_settings)

    def _run_program(self, program, args: dict[str, Any], group: str, endpoint: "SearchEndpoint",
                     cancel: CancelEvent) -> Any:
        """The program's return value: it runs on a thread of its own while this one sleeps until the
        program ends or ``cancel`` is set (then its requests are aborted and it is waited out);
        raises :class:`SearchCancelled` or the program's error."""
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["state"] = program.run(backend=endpoint, **args)
            except BaseException as exc:   # handed to the caller below
                box["error"] = exc
            finally:
                with endpoint.changed:
                    box["done"] = True
                    endpoint.changed.notify_all()

        worker = threading.Thread(target=work, name=f"sgl-tts-search-{group}", daemon=True)
        remove = cancel.add_callback(_notifier(endpoint.changed))
        try:
            worker.start()
            self._await_program(group, endpoint, cancel, box)
        finally:
            remove()
        worker.join()   # it has returned already (box["done"]); only the thread's exit is left
        if cancel.is_set():
            raise SearchCancelled(f"search {group} was cancelled")
        if "error" in box:
            raise box["error"]
        state = box["state"]
        err = state.error()
        if err is not None:
            raise err if isinstance(err, BaseException) else RuntimeError(str(err))
        return state.ret_value

    def _take_slot(self, group: str, cancel: CancelEvent) -> None:
        """Wait (asleep) for a slot, in arrival order; raises :class:`SearchCancelled` as soon as
        ``cancel`` is set while waiting."""
        ticket = object()
        with self._lock:
            self.waiting += 1
            self._queue.append(ticket)
        remove = cancel.add_callback(_notifier(self._lock))
        try:
            with self._lock:
                self._lock.wait_for(lambda: cancel.is_set() or (self._free > 0 and self._queue[0] is ticket))
                self._queue.remove(ticket)
                self.waiting -= 1
                if not cancel.is_set():
                    self._free -= 1
                if self._free > 0 and self._queue:
                    self._lock.notify_all()   # the next in line may take a slot too
                if cancel.is_set():
                    raise SearchCancelled(f"search {group} was cancelled while waiting for a slot")
        finally:
            remove()

    def _await_program(self, group: str, endpoint: SearchEndpoint, cancel: CancelEvent,
                       box: dict[str, Any]) -> None:
        """Wait (asleep) until the program has returned (``box["done"]``); once ``cancel`` is set,
        refuse the search's new generations and abort its requests on the generator.

        One abort is not always enough: a generation let through just before the cancel may reach the
        server after the abort (which then finds nothing; a request still being tokenized there escapes
        it too, see :mod:`sgl_tts.plugin.scheduling.abort`) and would run to its end. Neither the cancelled check
        nor the generator's :class:`~sgl_tts.backends.request.AbortLedger` can catch it, as both are
        looked at before the request is sent. So while such a request is out (``endpoint.in_flight``)
        the abort is repeated every ``ABORT_EVERY_S``; once none is, nothing of the search can reach
        the generator any more and this only waits for the program to unwind."""
        cond = endpoint.changed
        aborted = False
        with cond:
            while not box.get("done"):
                if not cancel.is_set():
                    cond.wait()   # woken by the program's return or by the cancel (its callback)
                    continue
                endpoint.cancelled.set()   # under ``cond``: from here ``in_flight`` only falls
                if aborted and endpoint.in_flight == 0:
                    cond.wait()   # nothing left to abort: wait for the program to return
                    continue
                cond.release()
                try:
                    self._abort(group)
                finally:
                    cond.acquire()
                aborted = True
                if endpoint.in_flight and not box.get("done"):
                    # woken at once when the last of them is answered or the program returns
                    cond.wait(ABORT_EVERY_S)

    def _abort(self, group: str) -> None:
        try:
            self.generator.abort_group(group)
        except Exception as exc:   # repeated while a request is out; the search is stopping anyway
            logger.warning("aborting search %s on %s failed: %s", group, self.generator_url, exc)

__all__ = ["CancelEvent", "Choice", "Progress", "SearchCancelled", "SearchEndpoint", "SearchOutcome", "SearchService",
           "as_cancel_event", "rank_choices"]
