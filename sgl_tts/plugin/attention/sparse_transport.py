"""How the sparse decoder's ``async`` jobs reach the cache-rank worker (``--tts-sparse-worker``).

:class:`~sgl_tts.plugin.attention.sparse_attention.SparseDecoder` plans each step and makes one job of its
sparse layers (:class:`~sgl_tts.plugin.attention.sparse_async.Job`); :class:`WorkerTransport` hands it over in one
of three ways and hands each answer back to the decoder's ``store``:

- **the cache-rank process** (``process``, the default; :class:`~sgl_tts.plugin.attention.sparse_worker.CacheRank`
  once :meth:`WorkerTransport.start_cache_rank` is called): jobs go over a pipe, answers are read
  without waiting at a sparse layer's decode; no job is handed while the process is behind (counted
  ``dropped_jobs``). A process that fails to start or dies is replaced by the thread, logged: the
  server goes on serving.
- **a thread of the scheduler** (``thread``): a queue; the thread takes every job waiting and runs
  only the newest per set of layers (the older ones counted ``dropped_jobs``).
- **inline** (no thread: ``threaded=False``, tests): the job runs in the step that made it.

The thread and inline transports choose in this process, on their own copy of the keys
(:class:`~sgl_tts.plugin.attention.sparse_decoding.KeyMirror`); the process keeps its own.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Callable, Optional

from sgl_tts.plugin.attention.sparse_async import Answer, Job, choose

if TYPE_CHECKING:
    import torch

    from sgl_tts.plugin.settings import SparseSettings
    from sgl_tts.plugin.attention.sparse_counters import SparseCounters

logger = logging.getLogger("sgl_tts.plugin.attention.sparse_attention")   # the sparse path's log, one name for all of it


class WorkerTransport:
    """The way one decoder's jobs reach its worker (see the module docstring).

    Args:
        settings: the sparse settings (``mode``, ``worker`` and what a choice needs).
        counters: where ``dropped_jobs`` is counted (the decoder's).
        store: takes each finished choice (called on the worker thread for the thread transport).
        threaded: ``False``: no thread, a job runs when it is handed (until a cache rank starts).
    """

    def __init__(self, settings: "SparseSettings", counters: "SparseCounters", store: Callable[[Answer], None], *,
                 threaded: bool = True):
        self.s = settings
        self.counters = counters
        self._store = store
        self._jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._done = threading.Condition()
        self.given = self.finished = 0      # jobs handed to the thread, jobs it has finished or dropped
        self.thread: Optional[threading.Thread] = None
        self.rank = None          # the cache rank process (--tts-sparse-worker process): start_cache_rank
        self._mirror = None       # the thread's (or inline) copy of the keys: the process keeps its own
        if settings.mode == "async" and threaded and settings.worker == "thread":
            self.start_thread()

    def start_cache_rank(self, k_caches: dict, req_to_token: "torch.Tensor") -> None:
        """``async`` with ``worker="process"``: start the cache rank process over ``k_caches`` (layer id
        -> that layer's key pool, in shared memory: :func:`~sgl_tts.plugin.attention.sparse_worker.share_key_pools`)
        and the server's ``req_to_token`` (moved into shared memory in place, if it is not there yet: the
        process reads the rows' contexts from it); until then (and with any other setting) jobs run as
        ``threaded`` said. A process that cannot start leaves the thread to choose (logged)."""
        from sgl_tts.plugin.attention.sparse_worker import CacheRank

        if self.s.mode == "async" and self.s.worker == "process" and self.rank is None:
            try:
                self.rank = CacheRank(self.s, k_caches, req_to_token)
            except RuntimeError as exc:
                logger.error("sgl-tts sparse attention: %s; choosing in a thread of the scheduler", exc)
                self.start_thread()
                return
            logger.info("sgl-tts sparse attention: the cache rank is process %d (layers %s, key pools and the "
                        "request table in shared memory), ready in %.1f s", self.rank.process.pid,
                        sorted(k_caches), self.rank.ready_seconds)

    def start_thread(self) -> None:
        """Choose in a thread of the scheduler from now on (idempotent)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="sgl-tts-cache-rank", daemon=True)
            self.thread.start()

    def hand(self, job: Job) -> None:
        """Give ``job`` to the worker: to the cache rank (dropped while it is behind; a rank whose pipe
        closed is replaced by the thread, which then takes the job), to the thread, or run it now."""
        if self.rank is not None:
            if self.rank.behind:       # it answers the older jobs first; this one would come later still
                self.counters.dropped_jobs += 1
                return
            try:
                self.rank.submit(job)
                return
            except OSError as exc:      # its end of the pipe closed: it died
                self._rank_failed(exc)
        if self.thread is None:
            self.run(job)
        else:
            with self._done:
                self.given += 1
            self._jobs.put(job)

    def collect(self) -> None:
        """At a sparse layer's decode: store the cache rank's answers that have arrived (no wait)."""
        if self.rank is not None and self.rank.owes:
            self._collect(wait=False)

    # ------------------------------------------------------------------ the choice in this process
    def run(self, job: Job) -> None:
        """The job's choice (:func:`~sgl_tts.plugin.attention.sparse_async.choose`), stored for the next step."""
        from sgl_tts.plugin.attention import sparse_decoding as sd

        if self._mirror is None:
            self._mirror = sd.KeyMirror()
        self._store(choose(self.s, job.layers, job.slots, job.epochs, job.lengths, job.ring, job.available,
                           job.scale, job.k_caches, job.req_to_token, job.rotary, self._mirror))

    def _work(self) -> None:
        import torch

        torch.set_grad_enabled(False)
        torch.set_num_threads(1)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            batch = [job]
            while True:         # take everything waiting; a newer job of a layer supersedes an older one
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    return
                batch.append(more)
            newest: dict[tuple, Job] = {}
            for j in batch:
                if tuple(j.layers) in newest:
                    self.counters.dropped_jobs += 1
                newest[tuple(j.layers)] = j
            for j in newest.values():
                try:
                    self.run(j)
                except Exception:  # noqa: BLE001 - a failed selection leaves rows dense, never the server down
                    logger.exception("sgl-tts sparse attention: a selection failed")
            with self._done:
                self.finished += len(batch)
                self._done.notify_all()

    # ------------------------------------------------------------------ the cache rank process
    def _collect(self, wait: bool) -> None:
        """The cache rank's answers that have arrived (``wait``: every one still owed), stored. A cache rank
        that died is replaced by the worker thread (logged): the server goes on serving."""
        try:
            self._take_answers(wait)
        except RuntimeError as exc:
            self._rank_failed(exc)

    def _rank_failed(self, exc: BaseException) -> None:
        logger.error("sgl-tts sparse attention: the cache rank process is gone (%s); choosing in a thread of "
                     "the scheduler from now on", exc)
        self.rank.close()
        self.rank = None
        self.start_thread()

    def _take_answers(self, wait: bool) -> None:
        from sgl_tts.plugin.attention.sparse_worker import answer_of

        for a in self.rank.answers(wait=wait):
            self.counters.dropped_jobs += a["superseded"]
            if a["error"] is not None:
                logger.error("sgl-tts sparse attention: a selection failed in the cache rank: %s", a["error"])
                continue
            self._store(answer_of(a))

    # ------------------------------------------------------------------ end
    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Tests and benchmarks: until the worker has finished (or dropped as superseded) every job given
        so far; false if ``timeout`` passed first."""
        if self.rank is not None:
            if self.rank.finished >= self.rank.given:
                return True
            if not self.rank.answers_in.poll(timeout):
                return False
            self._collect(wait=True)
            return True
        with self._done:
            return self._done.wait_for(lambda: self.finished >= self.given, timeout)

    def close(self) -> None:
        if self.rank is not None:
            self.rank.close()
        if self.thread is not None:
            self._jobs.put(None)
            self.thread.join(timeout=10)


__all__ = ["WorkerTransport"]
