"""CPU accounting for benchmarks: a process's CPU over a block, the part its engine threads or
engine processes took, the CPU of servers it started (with their children), and its peak thread count."""

from __future__ import annotations

import resource
import threading
from typing import Iterable, Sequence


def thread_cpu(native_ids: Iterable[int]) -> tuple[float, float]:
    """User and system CPU seconds of this process's threads with these native ids."""
    import psutil

    wanted = set(native_ids)
    if not wanted:
        return 0.0, 0.0
    user = system = 0.0
    for t in psutil.Process().threads():
        if t.id in wanted:
            user += t.user_time
            system += t.system_time
    return user, system


def process_tree_cpu(pids: Iterable[int]) -> tuple[float, float]:
    """User and system CPU seconds of these processes and all their live descendants."""
    import psutil

    user = system = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            user += t.user
            system += t.system
    return user, system


class CPUMeter:
    """This process's CPU over a ``with`` block, the part of it the given threads took, and the CPU
    of the given server processes (with their descendants) over the same block."""

    def __init__(self, engine_threads: Sequence[int] = (), server_pids: Sequence[int] = (),
                 engine_pids: Sequence[int] = ()):
        self.engine_threads = tuple(engine_threads)
        self.server_pids = tuple(server_pids)
        self.engine_pids = tuple(engine_pids)
        self.user = self.system = self.engine_user = self.engine_system = 0.0
        self.server_user = self.server_system = 0.0

    def __enter__(self) -> "CPUMeter":
        self._r0 = resource.getrusage(resource.RUSAGE_SELF)
        self._e0 = thread_cpu(self.engine_threads)
        self._p0 = process_tree_cpu(self.engine_pids)
        self._s0 = process_tree_cpu(self.server_pids)
        return self

    def __exit__(self, *exc) -> None:
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        e1 = thread_cpu(self.engine_threads)
        p1 = process_tree_cpu(self.engine_pids)
        s1 = process_tree_cpu(self.server_pids)
        pu, ps = p1[0] - self._p0[0], p1[1] - self._p0[1]
        self.user = r1.ru_utime - self._r0.ru_utime + pu
        self.system = r1.ru_stime - self._r0.ru_stime + ps
        self.engine_user, self.engine_system = e1[0] - self._e0[0] + pu, e1[1] - self._e0[1] + ps
        self.server_user, self.server_system = s1[0] - self._s0[0], s1[1] - self._s0[1]


class PeakThreads:
    """The most threads alive during a ``with`` block (``threading.active_count()``, the sampler's own
    thread included), sampled every ``interval`` seconds by a thread that waits on an event."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sgl-tts-thread-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, threading.active_count())
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "PeakThreads":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, threading.active_count())


__all__ = ["CPUMeter", "PeakThreads", "process_tree_cpu", "thread_cpu"]
