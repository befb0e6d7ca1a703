"""One child interpreter that imports the CPU engine once and forks an engine process per request.

A fresh engine process spends ~7 s of CPU importing torch and transformers before it loads its
model (2-core AMD EPYC, 2026-11-28). With a generator in two processes and a PRM in a third, those
imports ran side by side on two cores and held up the first search for ~15-20 s. The zygote (the
Android name for a process that is forked from, never run) pays for them once: it imports the
engine's modules, runs no torch operation (so no OpenMP pool exists that a fork could break), and
forks a child for each engine, which loads only its model. The caller's own main module is never
imported by a child (unlike ``multiprocessing``'s forkserver, which imports it), so a script or
notebook that builds a backend at top level is not run again.

Protocol (one datagram per message, ``SOCK_SEQPACKET``): the caller sends ``spawn`` with the
engine's socket end attached (``SCM_RIGHTS``); the zygote forks, gives the child the next serial
(1, 2, ...) and answers ``pid SERIAL PID`` with a pidfd of the child attached, in the order of the
requests; when a child ends it reaps it and sends ``exit SERIAL CODE`` (``CODE`` as
:attr:`subprocess.Popen.returncode`: minus the signal number for a killed child). Exits are keyed by
the serial, never by the pid: the kernel reuses a pid once its process is reaped, so a pid names an
engine only until then. Both sides keep only the children still running (the zygote drops a child
when it reaps it, the caller when it reads its exit), so their tables stay as small as the set of
live engines. The pidfd, opened by the parent before it can reap the child, names that process for
good: a kill through it reaches the engine or, once it is reaped, nothing (never a process that
took its pid), and the caller can still wait on it if the zygote dies. Nothing polls: the zygote
blocks in ``select`` on its socket and a signal wake-up pipe, the caller's reader thread blocks on
the socket.

This module imports only the standard library, so :func:`start` can run before the caller's own
heavy imports and overlap with them.
"""

from __future__ import annotations

import collections
import itertools
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
from typing import Callable, Iterator, NoReturn, Sequence

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
    :class:`~sgl_tts.backends.engine_process.EngineProcess` uses (``pid``, ``returncode``, ``wait``,
    ``poll``, ``kill``)."""

    def __init__(self, zygote: "Zygote"):
        self._zygote = zygote
        self._pid: int | None = None
        self._pidfd: int | None = None     # this child's pidfd from the zygote, until its exit is known
        self.returncode: int | None = None  # as the zygote reported it

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
            if not z._cond.wait_for(lambda: self.returncode is not None or not z._alive, timeout):
                raise subprocess.TimeoutExpired("engine process", timeout)
            if self.returncode is not None or self._pidfd is None:
                return self.returncode
            pidfd = self._pidfd   # the zygote is gone (nothing closes it now): the end, without its code
        if not select.select([pidfd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired("engine process", timeout)
        return None

    def poll(self) -> int | None:
        """The exit code if the child has ended (as the zygote reported it), else ``None``."""
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the child: nothing if its exit is known or it was never forked, nor once it is
        reaped (the pidfd names this process, never one that took its pid)."""
        with self._zygote._cond:    # the reader closes the pidfd under this lock
            if self._pidfd is not None:
                try:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _ended(self, code: int) -> None:
        """Record the exit the zygote reported (under the zygote's lock)."""
        self.returncode = code
        self._close_pidfd()

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self):   # a handle dropped after its zygote died still holds its pidfd
        try:
            self._close_pidfd()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _check_pidfds() -> None:
    """Raise RuntimeError unless this kernel and Python have pidfds (Linux 5.3+, Python 3.9+), which
    the zygote's children are killed and waited on through."""
    if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        raise RuntimeError("the engine zygote needs pidfds (os.pidfd_open), which this Python lacks")
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError as exc:
        raise RuntimeError(f"the engine zygote needs pidfds (Linux 5.3+): {exc}") from None


class Zygote:
    """The caller's side of the zygote: start it, ask it for engine processes."""

    def __init__(self):
        _check_pidfds()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._process = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE_COMMAND, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=child_environment())
        theirs.close()
        self.owner = os.getpid()
        self._sock = ours
        self._cond = threading.Condition()
        self._alive = True
        self._running: dict[int, ForkedChild] = {}   # by serial: the children whose exit is not in yet
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
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(self._sock, 256, 1, socket.MSG_CMSG_CLOEXEC)
            except OSError:
                msg, fds = b"", []
            if not msg:
                break
            word, *values = msg.split()
            with self._cond:
                if word == b"pid" and self._unanswered:
                    child = self._unanswered.popleft()
                    child._pidfd = fds.pop() if fds else None
                    child._pid = int(values[1])
                    self._running[int(values[0])] = child
                elif word == b"exit" and (child := self._running.pop(int(values[0]), None)) is not None:
                    child._ended(int(values[1]))
                self._cond.notify_all()
            for fd in fds:
                os.close(fd)
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
    # What every engine imports, once (no torch operation runs here). transformers loads
    # ``modeling_utils`` only at the first ``from_pretrained``: 1.4 s of every forked engine's start on
    # the 2-core Xeon, paid here once instead.
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    from sgl_tts.backends import engine_process
    from sgl_tts.backends.engine import BatchEngine  # noqa: F401

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # a handler, so that the wake-up byte is written
    sel = selectors.DefaultSelector()
    sel.register(ctrl, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    running: dict[int, int] = {}    # pid -> serial of each child not reaped yet (no other can have its pid)
    serials = itertools.count(1)

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
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    _run_engine(engine_process.main, fds[0])
                os.close(fds[0])
                running[pid] = serial = next(serials)
                if not _answer(ctrl, serial, pid):
                    return
            else:
                os.read(wake_r, 4096)
                for pid, code in _reaped():
                    serial = running.pop(pid, None)
                    if serial is not None and not _tell(ctrl, f"exit {serial} {code}"):
                        return


def _tell(ctrl: socket.socket, text: str, fds: Sequence[int] = ()) -> bool:
    """Send the caller one message (False: it has gone)."""
    try:
        if fds:
            socket.send_fds(ctrl, [text.encode()], fds)
        else:
            ctrl.send(text.encode())
        return True
    except OSError:
        return False


def _answer(ctrl: socket.socket, serial: int, pid: int) -> bool:
    """Tell the caller the new child's serial and pid, with a pidfd of it. The pidfd is opened
    before the child can be reaped (only the zygote's one thread reaps), so it names this child; if
    it cannot be opened, the child is killed (the caller could not kill it safely) and its exit
    follows."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        print(f"sgl-tts engine zygote: no pidfd for engine {pid} ({exc}); ending it", file=sys.stderr)
        os.kill(pid, signal.SIGKILL)   # not reaped yet: still this process's child
        return _tell(ctrl, f"pid {serial} {pid}")
    try:
        return _tell(ctrl, f"pid {serial} {pid}", [pidfd])
    finally:
        os.close(pidfd)


def _reaped() -> Iterator[tuple[int, int]]:
    """(pid, exit code) of each child that has ended, reaping it."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _run_engine(engine_main: Callable[[list[str]], None], fd: int) -> NoReturn:
    """The forked child: serve the engine on socket ``fd``, then end without running the zygote's
    exit handlers."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    code = 0
    try:
        engine_main([str(fd)])
    except BaseException:  # noqa: BLE001 - reported, then the child ends
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


__all__ = ["ForkedChild", "Zygote", "child_environment", "start"]
