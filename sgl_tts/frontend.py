"""What sgl-tts adds to SGLang's frontend interpreter: waiting without polling, finding leftover
stream executors, and a guard against a CPython deadlock that the interpreter's threads can hit.

SGLang's frontend runs every program state (``s``, each ``fork``) on a :class:`StreamExecutor` with a
worker thread of its own; a generation's end is a ``threading.Event`` per variable
(``StreamExecutor.variable_event[name]``). A search that waits for the *first* of many generations
has no call for that, so it used to look at every event every 2 ms: with dozens of searches in flight
(each with a fork per beam) the looking and the thread switches took the cores the engine needed.

- :class:`Waiter`: a state :meth:`Waiter.watch`-ed before its generation is submitted gets events
  that wake the waiter when they are set. :meth:`Waiter.wait` sleeps (no CPU) until one of them is
  set after the waiter last looked. Nothing in SGLang is patched: the executor's own table of events
  is replaced by a ``dict`` whose new events signal; SGLang sets, waits on and reads them as before.
- :func:`live_stream_executors` / :func:`end_stream_executors`: executors whose worker threads still
  run, found through those threads (not by scanning every object in the process).
- :func:`fewer_young_collections`: while many searches run, Python's cyclic collector would pass
  over the young generation every 700 net allocations, each pass holding the GIL that the model
  engine threads and every search need (measured: 4.9 s of a 60 s block at K = 128, 1,641 passes).
- :func:`guard_thread_bootstrap` (installed when ``sgl_tts`` is imported, Python < 3.13): CPython's
  ``threading`` keeps a set of the non-daemon threads' locks and prunes it under a plain lock at every
  thread start and stop. The list the pruning builds can start the cyclic garbage collector, which
  runs finalizers in that thread; ``StreamExecutor.__del__`` calls ``end()`` → ``worker.is_alive()``,
  which, for a worker that has exited and not been looked at since, takes the same lock again: the
  thread deadlocks holding it, and every later ``Thread.start()`` waits for ever (the CI hang of stop
  28: two searches stuck in ``fork`` → ``Thread.start``). The guard runs the pruning with the
  collector paused; ``tests/test_frontend.py`` shows the deadlock without it.
"""

from __future__ import annotations

import gc
import sys
import threading
from typing import Any, Callable, Iterable

# ------------------------------------------------------------------------------------ waiting


class _SignallingEvent(threading.Event):
    """A generation's end event that also wakes its table's waiter."""

    def __init__(self, table: "_SignallingEvents"):
        super().__init__()
        self._table = table

    def set(self) -> None:
        super().set()
        waiter = self._table.waiter
        if waiter is not None:
            waiter.wake()


class _SignallingEvents(dict):
    """A ``StreamExecutor.variable_event`` table whose new events wake ``waiter`` when set (SGLang's
    ``submit`` stores a fresh ``threading.Event`` per generation here, before its worker can see it)."""

    def __init__(self, waiter: "Waiter", existing: dict):
        super().__init__(existing)
        self.waiter: Waiter | None = waiter

    def __setitem__(self, name: str, event: Any) -> None:
        if type(event) is threading.Event and not event.is_set():
            event = _SignallingEvent(self)
        super().__setitem__(name, event)


class Waiter:
    """Wakes a search when any generation it watches ends, or when someone calls :meth:`wake`.

    Usage (the loop of a search with many generations in flight)::

        waiter = Waiter()
        waiter.watch(state)                 # before the state's gen is submitted
        state += sgl_tts.gen("step", ...)
        while pending:
            seen = waiter.seen()            # before looking: a signal after this is not lost
            ...handle what ended...
            if nothing_ended:
                waiter.wait(seen)           # sleeps until a watched generation ends

    A state is watched by one waiter at a time (the last to watch it).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._signals = 0

    def watch(self, state: Any) -> Any:
        """Make ``state``'s generations submitted from now on wake this waiter; returns ``state``."""
        ex = state.stream_executor
        table = ex.variable_event
        if isinstance(table, _SignallingEvents):
            table.waiter = self
        else:
            ex.variable_event = _SignallingEvents(self, table)
        return state

    def wake(self) -> None:
        """Wake every thread waiting on this waiter (a watched generation ended, or the caller's own
        reason: a control changed what the search may run)."""
        with self._cond:
            self._signals += 1
            self._cond.notify_all()

    def seen(self) -> int:
        """How many signals there have been: take it before looking at what ended."""
        return self._signals

    def wait(self, seen: int, timeout: float | None = None) -> bool:
        """Sleep until there has been a signal since :meth:`seen` returned ``seen`` (at once if there
        was one), or ``timeout`` seconds; ``True`` when signalled."""
        with self._cond:
            return self._cond.wait_for(lambda: self._signals != seen, timeout)


def ended(state: Any, name: str) -> bool:
    """Whether ``state``'s generation ``name`` has ended (answered, failed or aborted)."""
    event = state.stream_executor.variable_event.get(name)
    return event is not None and event.is_set()


# ------------------------------------------------------------------------ leftover executors

def _executor_of(thread: threading.Thread) -> Any | None:
    """The ``StreamExecutor`` a worker thread runs for, or ``None`` for any other thread. SGLang starts
    each worker as ``Thread(target=copy_context().run, args=(_run_worker_in_context,))``, a closure
    over the executor; ``Thread.run`` drops both once the worker returns."""
    args = getattr(thread, "_args", None)
    fn = args[0] if isinstance(args, tuple) and args else None
    if getattr(fn, "__qualname__", "") != "StreamExecutor.__init__.<locals>._run_worker_in_context":
        return None
    from sglang.lang.interpreter import StreamExecutor

    for cell in fn.__closure__ or ():
        obj = cell.cell_contents
        if isinstance(obj, StreamExecutor):
            return obj
    return None


def live_stream_executors() -> list[Any]:
    """Every SGLang ``StreamExecutor`` whose worker thread is still running."""
    out = []
    for th in threading.enumerate():
        ex = _executor_of(th)
        if ex is not None:
            out.append(ex)
    return out


def end_stream_executors(executors: Iterable[Any] | None = None) -> list[BaseException]:
    """Let the worker thread of every live SGLang stream executor exit once its queued work is done;
    return the errors the executors recorded (a fork's failure).

    A program that raises never reaches its joins, so its forks' workers wait for work forever, and
    being non-daemon threads they keep the process from exiting. Only for a process that runs its
    programs to the end (the benchmark, ``sgl-tts run`` once it stops): it stops every program's forks.
    """
    errors = []
    for ex in live_stream_executors() if executors is None else executors:
        if getattr(ex, "error_", None) is not None:
            errors.append(ex.error_)
        ex.queue.put(None)
    return errors


# ------------------------------------------------------------------ the thread-bootstrap guard

def guard_thread_bootstrap() -> bool:
    """Run ``threading``'s pruning of its shutdown locks with the cyclic garbage collector paused (see
    the module doc); idempotent. Returns whether the guard is in place (Python < 3.13 only: 3.13
    rewrote thread bookkeeping without that lock)."""
    maintain: Callable[[], None] | None = getattr(threading, "_maintain_shutdown_locks", None)
    if maintain is None or sys.version_info >= (3, 13):
        return False
    if getattr(maintain, "_sgl_tts_guard", False):
        return True

    def _maintain_shutdown_locks() -> None:
        paused = gc.isenabled()
        if paused:
            gc.disable()
        try:
            maintain()
        finally:
            if paused:
                gc.enable()

    _maintain_shutdown_locks._sgl_tts_guard = True   # type: ignore[attr-defined]
    _maintain_shutdown_locks.__doc__ = maintain.__doc__
    threading._maintain_shutdown_locks = _maintain_shutdown_locks   # type: ignore[attr-defined]
    return True


# ------------------------------------------------------------------------- garbage collection

YOUNG_GC_ALLOCATIONS = 20_000   # CPython's default is 700
_gc_lock = threading.Lock()
_gc_users = 0
_gc_saved: tuple[int, ...] | None = None


class fewer_young_collections:
    """A context in which CPython's cyclic collector passes over its youngest generation only every
    ``allocations`` net allocations (unless it already waits longer); the older generations keep
    their ratios, so a full pass stays as rare relative to young ones as before. The threshold is
    process-wide: nested and concurrent contexts share one change, undone when the last one exits.
    Reference counting frees almost everything a search allocates; the collector only finds cycles,
    and finds them later here (bounded: at most ``allocations`` more objects wait for it)."""

    def __init__(self, allocations: int = YOUNG_GC_ALLOCATIONS):
        if allocations < 1:
            raise ValueError(f"allocations must be at least 1, got {allocations}")
        self.allocations = allocations

    def __enter__(self) -> "fewer_young_collections":
        global _gc_users, _gc_saved
        with _gc_lock:
            if _gc_users == 0:
                _gc_saved = gc.get_threshold()
                if 0 < _gc_saved[0] < self.allocations:   # 0: the collector is off; leave it so
                    gc.set_threshold(self.allocations, *_gc_saved[1:])
            _gc_users += 1
        return self

    def __exit__(self, *exc) -> None:
        global _gc_users, _gc_saved
        with _gc_lock:
            _gc_users -= 1
            if _gc_users == 0 and _gc_saved is not None:
                gc.set_threshold(*_gc_saved)
                _gc_saved = None


__all__ = ["Waiter", "end_stream_executors", "fewer_young_collections", "ended", "guard_thread_bootstrap", "live_stream_executors"]
