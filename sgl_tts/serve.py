"""``sgl-tts serve``: the generator and the PRM as two SGLang servers, on one GPU (planned) or on the
CPU (``--device cpu``, :mod:`sgl_tts.cpu_serving`), supervised.

The memory planner (:mod:`sgl_tts.memory`) gives both servers' flags in start-up order; the servers
start one after the other (the second sizes its pools from the memory the first left), each must
answer ``/health`` before the next starts, and their logs stream with a ``[generator]`` / ``[prm]``
prefix. Ctrl-C, or either server dying, stops both: every child runs in its own process group, which
gets SIGTERM, then SIGKILL after a grace period, so nothing is left running. A server that dies or
never becomes healthy ends ``serve`` with a non-zero exit and that server's last log lines.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Sequence


@dataclasses.dataclass
class ServerSpec:
    """One server to start: its name (log prefix), command line, health URL and extra environment."""

    name: str
    command: list[str]
    health_url: str
    env: dict[str, str] | None = None


class ServerFailed(RuntimeError):
    """A server exited or never became healthy; the message names it and quotes its last lines."""


class ManagedServer:
    """A child process in its own process group, its output streamed with a prefix and its last
    lines kept for error messages."""

    def __init__(self, spec: ServerSpec, *, out=None, tail_lines: int = 30, env: dict | None = None):
        self.spec = spec
        self.out = out or sys.stdout
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.proc = subprocess.Popen(spec.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        self._reader = threading.Thread(target=self._pump, name=f"log-{spec.name}", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            print(f"[{self.spec.name}] {line}", file=self.out, flush=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.spec.health_url, timeout=2) as res:
                return res.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def failure(self, what: str) -> ServerFailed:
        self._reader.join(timeout=1)
        last = "\n".join(f"  {line}" for line in self.tail) or "  (no output)"
        return ServerFailed(f"the {self.spec.name} server {what}; its last log lines:\n{last}")

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM to the whole process group, SIGKILL after ``grace`` seconds. The group is
        signalled even when the server itself has exited: a crashed server's children (SGLang's
        scheduler and detokenizer processes) must not outlive it."""
        _signal_group(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + grace
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._reader.join(timeout=2)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True    # an error status is still an answer
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process is left in the group (Linux /proc; elsewhere killpg 0)."""
    proc = "/proc"
    if not os.path.isdir(proc):
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":   # state, ppid, pgrp
            return True
    return False


def run_servers(specs: Sequence[ServerSpec], *, health_timeout: float = 600.0, poll: float = 0.5,
                on_ready: Callable[[list[ManagedServer]], None] | None = None,
                stop_event: threading.Event | None = None, out=None, grace: float = 10.0) -> None:
    """Start ``specs`` in order, each healthy before the next; call ``on_ready``; supervise until
    ``stop_event`` is set (Ctrl-C sets nothing: it raises KeyboardInterrupt, which also stops both)
    or a server exits (:class:`ServerFailed`). Every started server is stopped on the way out."""
    started: list[ManagedServer] = []
    try:
        for spec in specs:
            if _answers(spec.health_url):   # e.g. a server left running by a killed earlier run
                raise ServerFailed(f"something already answers at {spec.health_url}; stop it (or pick another "
                                   f"port) before starting the {spec.name} server")
            with signals_held():   # a server that was started is always in ``started``, so stopped
                server = ManagedServer(spec, out=out, env=spec.env)
                started.append(server)
            deadline = time.monotonic() + health_timeout
            while not server.healthy():
                if not server.alive():
                    raise server.failure(f"exited with code {server.proc.returncode} before it was healthy")
                if time.monotonic() > deadline:
                    raise server.failure(f"did not answer {spec.health_url} within {health_timeout:.0f} s")
                time.sleep(poll)
        if on_ready is not None:
            on_ready(started)
        while stop_event is None or not stop_event.is_set():
            for server in started:
                if not server.alive():
                    raise server.failure(f"exited with code {server.proc.returncode}")
            time.sleep(poll)
    finally:
        for server in reversed(started):
            server.stop(grace)


@contextlib.contextmanager
def signals_held(signums: Sequence[int] = (signal.SIGINT, signal.SIGTERM)):
    """Within it, Ctrl-C and SIGTERM wait: they are delivered on the way out, to the handlers in place
    before, so a step such as "start a server, then register it for clean-up" is never cut in two (a
    server started but not registered would outlive the command: it runs in its own process group).
    Blocking the signals instead would be inherited by the children. Main thread only; elsewhere a
    no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in signums}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for signum in dict.fromkeys(got):
            signal.raise_signal(signum)


@contextlib.contextmanager
def sigterm_stops_servers():
    """Within it, SIGTERM (``timeout``, a job runner, ``kill``) raises KeyboardInterrupt as Ctrl-C does,
    so the servers are stopped on the way out: they run in their own process groups and would outlive
    this process otherwise. Main thread only; the previous handler comes back on exit."""
    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # a second one must not cut the clean-up short
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def build_specs(generator: str, prm: str, flags: dict, *, host: str, ports: dict[str, int],
                first: str, plugin_args: Sequence[str] = (), python: str = sys.executable,
                extra: dict[str, Sequence[str]] | None = None,
                env: dict[str, str] | None = None) -> list[ServerSpec]:
    """The two ``python -m sglang.launch_server`` command lines in start-up order (the plugin's
    ``--tts-*`` flags go to the generator, whose scheduler runs the search's requests); ``env`` is
    added to both servers' environment."""
    models = {"generator": generator, "prm": prm}
    order = [first, "prm" if first == "generator" else "generator"]
    specs = []
    for name in order:
        cmd = [python, "-m", "sglang.launch_server", "--model-path", models[name], "--host", host,
               "--port", str(ports[name]), *flags[name].args()]
        if name == "generator":
            cmd += list(plugin_args)
        cmd += list((extra or {}).get(name, ()))
        specs.append(ServerSpec(name, cmd, f"http://{host}:{ports[name]}/health", env))
    return specs


def main(argv: Sequence[str] | None = None) -> int:
    """``sgl-tts serve``."""
    import argparse
    import shlex

    from sgl_tts.cpu_serving import CPU_ENV, DEFAULT_KV_MEMORY, cpu_pair_flags
    from sgl_tts.memory import add_plan_arguments, plan_from_args

    ap = argparse.ArgumentParser(prog="sgl-tts serve", description=__doc__.splitlines()[0])
    add_plan_arguments(ap, models_required=False)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: the planned split on one GPU. cpu: both servers on this machine's CPU "
                         "(SGLANG_USE_CPU_ENGINE=1; default models: the shipped tiny generator and PRM; "
                         "pools from --kv-memory; the GPU planning flags are ignored)")
    ap.add_argument("--kv-memory", default=DEFAULT_KV_MEMORY,
                    help=f"with --device cpu: RAM the two KV pools may take together "
                         f"(default {DEFAULT_KV_MEMORY}; each server also needs ~3 GB for itself)")
    ap.add_argument("--generator-share", type=float, default=0.5,
                    help="with --device cpu: the generator's share of --kv-memory (default 0.5)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="with --device cpu: compute and KV dtype (default: the checkpoint's; float32 "
                         "computes exactly what sgl_tts.LocalBackend computes)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--generator-port", type=int, default=30000)
    ap.add_argument("--prm-port", type=int, default=30001)
    ap.add_argument("--tts-policy", default="prefix-aware", choices=["off", "prefix-aware"])
    ap.add_argument("--tts-metrics-file", default=None)
    ap.add_argument("--health-timeout", type=float, default=600.0)
    ap.add_argument("--dry-run", action="store_true", help="print the two commands and exit")
    args = ap.parse_args(argv)
    env = None
    try:
        if args.device == "cpu":
            from sgl_tts.models import shipped_model

            args.generator = args.generator or str(shipped_model("generator") or "")
            args.prm = args.prm or str(shipped_model("prm") or "")
            if not (args.generator and args.prm):
                raise ValueError("this install ships no tiny models: pass --generator and --prm")
            flags = cpu_pair_flags(args.generator, args.prm, args.kv_memory, args.generator_share, args.dtype)
            env = dict(CPU_ENV)
        else:
            if not (args.generator and args.prm):
                ap.error("--generator and --prm are required with --device cuda")
            flags = plan_from_args(args).flags
    except (FileNotFoundError, ValueError) as exc:
        print(f"sgl-tts serve: error: {exc}", file=sys.stderr)
        return 1
    plugin = ["--tts-policy", args.tts_policy]
    if args.device == "cpu":
        plugin.append("--tts-seeded-sampling")   # the pytorch sampler: the programs' seeds take effect
    if args.tts_metrics_file:
        plugin += ["--tts-metrics-file", args.tts_metrics_file]
    specs = build_specs(args.generator, args.prm, flags, host=args.host,
                        ports={"generator": args.generator_port, "prm": args.prm_port},
                        first=args.first, plugin_args=plugin, env=env)
    if args.dry_run:
        for spec in specs:
            print(f"# {spec.name}: healthy at {spec.health_url}")
            prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (spec.env or {}).items())
            print((prefix + " " if prefix else "") + shlex.join(spec.command))
        return 0

    def ready(servers):
        urls = {s.spec.name: s.spec.health_url.rsplit("/", 1)[0] for s in servers}
        print(f"sgl-tts serve: generator {urls['generator']}, PRM {urls['prm']} (Ctrl-C stops both)",
              flush=True)

    try:
        with sigterm_stops_servers():
            run_servers(specs, health_timeout=args.health_timeout, on_ready=ready)
    except ServerFailed as exc:
        print(f"sgl-tts serve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sgl-tts serve: stopped", file=sys.stderr)
        return 130
    return 0


__all__ = ["ManagedServer", "ServerFailed", "ServerSpec", "build_specs", "main", "run_servers",
           "sigterm_stops_servers"]
