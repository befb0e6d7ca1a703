"""What waiting threads cost, measured per thread: CPU seconds and wake-ups (voluntary context
switches) over a stretch of wall time.

Per thread, not per process: the process also holds threads other tests left behind (look-alike
servers, executors) and the test's own, and a busy CI machine makes those cost more, while a thread
blocked on a lock or a condition neither runs nor wakes however loaded the machine is."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable


def _switches(thread: threading.Thread) -> int | None:
    try:
        with open(f"/proc/self/task/{thread.native_id}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:"))
    except FileNotFoundError:                         # the thread ended
        return None


def _cpu(clock: int) -> float | None:
    try:
        return time.clock_gettime(clock)
    except OSError:                                    # the thread ended
        return None


def asleep(threads: Iterable[threading.Thread], seconds: float = 1.0) -> tuple[float, int]:
    """CPU seconds the live ``threads`` used together and times they woke up over ``seconds``.

    A thread that ends during the stretch is left out (it is not waiting)."""
    start = []
    for thread in threads:
        if not thread.is_alive() or thread.native_id is None:
            continue
        try:
            clock = time.pthread_getcpuclockid(thread.ident)
        except OSError:                                # it ended meanwhile
            continue
        cpu, switches = _cpu(clock), _switches(thread)
        if cpu is not None and switches is not None:
            start.append((thread, clock, cpu, switches))
    time.sleep(seconds)
    cpu_used, wakeups = 0.0, 0
    for thread, clock, cpu0, switches0 in start:
        cpu, switches = _cpu(clock), _switches(thread)
        if cpu is None or switches is None:
            continue
        cpu_used += cpu - cpu0
        wakeups += switches - switches0
    return cpu_used, wakeups
