"""One child interpreter that imports the CPU engine once and forks an engine process per request.

A fresh engine process spends ~7 s of CPU importing torch and transformers before it loads its
model (2-core AMD EPYC, 2026-11-28). With a generator in two processes and a PRM in a third, those
imports ran side by side on two cores and held up the first search for ~15-20 s. The zygote (the
Android name for a process that is forked from, never run) pays for them once: it imports the
engine's modules, runs no torch operation (so no OpenMP pool exists that a fork could break), and
forks a child for each engine, which loads only its model. The caller's own main module is never
imported by a child (unlike ``multiprocessing``'s forkserver, which imports it), so a script or
notebook that builds a backend at top level is not run again.

Protocol: the caller sends one byte string ``spawn`` with the engine's socket end attached
(``SCM_RIGHTS``); the zygote answers ``pid N`` after forking, in the order of the requests, and
``exit N CODE`` when a child it forked ends (``CODE`` as :attr:`subprocess.Popen.returncode`: minus
the signal number for a killed child). Nothing polls: the zygote blocks in ``select`` on its socket
and a signal wake-up pipe, the caller's reader thread blocks on the socket.

This module imports only the standard library, so :func:`start` can run before the caller's own
heavy imports and overlap with them.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Sequence

logger = logging.getLogger(__name__)

ZYGOTE_COMMAND = "import sys; from sgl_tts.backends.engine_zygote import main; main(sys.argv[1:])"


def child_environment() -> dict[str, str]:
    """The environment of an engine interpreter: this one's, with this checkout first on the path (a
    checkout need not be installed)."""
    env = dict(os.environ)
    home = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (home, env.get("PYTHONPATH")) if p)
    return env


class ForkedChild:
    """An engine process forked by the zygote, with the part of :class:`subprocess.Popen` that
    :class:`~sgl_tts.backends.engine_process.EngineProcess` uses (``pid``, ``wait``, ``poll``,
    ``kill``)."""

    def __init__(self, zygote: "Zygote"):
        self._zygote = zygote
        self._pid: int | None = None

    @property
    def pid(self) -> int:
        """The child's process id (waits for the zygote's answer)."""
        z = self._zygote
        with z._cond:
            z._cond.wait_for(lambda: self._pid is not None or not z._alive)
            if self._pid is None:
                raise RuntimeError("the engine zygote exited before it forked this engine")
            return self._pid

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code once the child has ended (``None``: unknown, the zygote ended first);
        :class:`subprocess.TimeoutExpired` after ``timeout`` seconds."""
        z = self._zygote
        with z._cond:
            ended = z._cond.wait_for(lambda: not z._alive or (self._pid is not None and self._pid in z._exits),
                                     timeout)
            if not ended:
                raise subprocess.TimeoutExpired("engine process", timeout)
            if self._pid is None:
                return None
            if self._pid in z._exits:
                return z._exits[self._pid]
            pid = self._pid
        _wait_for_end(pid, timeout)   # the zygote is gone: the child's end, without its code
        return None

    def poll(self) -> int | None:
        """The exit code if the child has ended (as the zygote reported it), else ``None``."""
        z = self._zygote
        with z._cond:
            return z._exits.get(self._pid) if self._pid is not None else None

    def kill(self) -> None:
        """SIGKILL the child (nothing if it has ended or was never forked)."""
        z = self._zygote
        with z._cond:
            pid = self._pid
            if pid is None or pid in z._exits:
                return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_for_end(pid: int, timeout: float | None) -> None:
    """Block until a process that is not this one's child ends (a pidfd becomes readable)."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return
    try:
        if not select.select([fd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("engine process", timeout)
    finally:
        os.close(fd)


class Zygote:
    """The caller's side of the zygote: start it, ask it for engine processes."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE_COMMAND, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=child_environment())
        theirs.close()
        self.owner = os.getpid()
        self._sock = ours
        self._cond = threading.Condition()
        self._alive = True
        self._exits: dict[int, int] = {}
        self._unanswered: collections.deque[ForkedChild] = collections.deque()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="sgl-tts-zygote-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._alive

    def spawn(self, fd: int) -> ForkedChild:
        """Fork an engine process serving the connected socket ``fd`` (the caller may close its
        copy afterwards). Returns at once; the child runs once the zygote has its imports."""
        child = ForkedChild(self)
        with self._send_lock:
            with self._cond:
                if not self._alive:
                    raise RuntimeError("the engine zygote has exited")
                self._unanswered.append(child)
            try:
                socket.send_fds(self._sock, [b"spawn"], [fd])
            except OSError as exc:
                with self._cond:
                    self._unanswered.remove(child)
                raise RuntimeError(f"the engine zygote is gone ({exc})") from None
        return child

    def _read(self) -> None:
        with self._sock.makefile("rb") as lines:
            for line in lines:
                word, *values = line.split()
                with self._cond:
                    if word == b"pid" and self._unanswered:
                        self._unanswered.popleft()._pid = int(values[0])
                    elif word == b"exit":
                        self._exits[int(values[0])] = int(values[1])
                    self._cond.notify_all()
        with self._cond:
            self._alive = False
            self._cond.notify_all()
        if self._unanswered:
            logger.warning("the engine zygote exited (code %s) before forking %d engine(s)",
                           self._process.wait(), len(self._unanswered))


_lock = threading.Lock()
_zygote: Zygote | None = None


def start() -> Zygote:
    """This process's zygote, started if it is not running (call early: it imports while the
    caller does other work)."""
    global _zygote
    with _lock:
        if _zygote is None or not _zygote.alive or _zygote.owner != os.getpid():
            _zygote = Zygote()
        return _zygote


# ------------------------------------------------------------------------------ the zygote itself
def main(argv: Sequence[str] | None = None) -> None:
    """The zygote's entry point (:data:`ZYGOTE_COMMAND`, argument FD: its socket to the caller)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or not args[0].isdigit():
        raise SystemExit("usage: main([FD]) (started by sgl_tts, not by hand)")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the caller's to handle, as for engines
    ctrl = socket.socket(fileno=int(args[0]))
    # What every engine imports, once (no torch operation runs here).
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    from sgl_tts.backends import engine_process
    from sgl_tts.backends.engine import BatchEngine  # noqa: F401

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # a handler, so that the wake-up byte is written
    sel = selectors.DefaultSelector()
    sel.register(ctrl, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)

    def tell(text: str) -> bool:
        try:
            ctrl.sendall(text.encode() + b"\n")
            return True
        except OSError:
            return False

    while True:
        for key, _ in sel.select():
            if key.fileobj is ctrl:
                try:
                    msg, fds, _flags, _addr = socket.recv_fds(ctrl, 64, 1)
                except OSError:
                    msg, fds = b"", []
                if not msg:          # the caller has gone: so does the zygote
                    return
                if not fds:
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    ctrl.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    code = 0
                    try:
                        engine_process.main([str(fds[0])])
                    except BaseException:  # noqa: BLE001 - reported, then the child ends
                        import traceback

                        traceback.print_exc()
                        code = 1
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(code)
                os.close(fds[0])
                if not tell(f"pid {pid}"):
                    return
            else:
                os.read(wake_r, 4096)
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    if not tell(f"exit {pid} {os.waitstatus_to_exitcode(status)}"):
                        return


__all__ = ["ForkedChild", "Zygote", "child_environment", "start"]
