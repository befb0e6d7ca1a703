"""``sgl-tts serve``: the generator and the PRM as two SGLang servers, on one GPU (planned) or on the
CPU (``--device cpu``, :mod:`sgl_tts.launch.cpu_serving`), supervised.

The memory planner (:mod:`sgl_tts.launch.memory`) gives both servers' flags in start-up order; on a GPU
the servers start one after the other (the second sizes its pools from the memory the first left),
each answering ``/health`` before the next starts; on the CPU, whose pools are explicit, they start at
once (:func:`start_waves`), and their logs stream with a ``[generator]`` / ``[prm]``
prefix. Ctrl-C, or either server dying, stops both: every child runs in its own process group, which
gets SIGTERM, then SIGKILL after a grace period, so nothing is left running. A server that dies or
never becomes healthy ends ``serve`` with a non-zero exit and that server's last log lines.

This module is the library under the command: the one builder of SGLang's command line
(:func:`launch_command`), the pair's and the replicas' server specs (:func:`build_specs`,
:func:`replicate`, :func:`router_spec`) and their supervision (:func:`run_servers`). Reading
``sgl-tts serve``'s flags into those specs (the memory plan, the CPU's split) is the command's own
(:mod:`sgl_tts.cli.serve`), so the launch layer's modules look at one another one way:
:mod:`~sgl_tts.launch.cpu_profile` starts servers through :mod:`~sgl_tts.launch.live_servers`, which
starts them through this module.

Nothing it starts runs code a request sends unless asked: SGLang's custom logit processors (serialized
code the server loads) are on only for ``--enable-deepconf-stop`` (online DeepConf's stop inside
generation) or when ``--server-args`` names them, ``serve`` says so when it starts, and on a
non-loopback ``--host`` they need ``--allow-remote-code-execution`` (:func:`check_remote_code`, applied by
:func:`launch_command` to every server sgl-tts starts).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import ipaddress
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Sequence

from sgl_tts.launch.cpu_serving import model_registry_env
from sgl_tts.plugin.settings import TTSSettings


@dataclasses.dataclass
class ServerSpec:
    """One server to start: its name (log prefix), command line, health URL and extra environment."""

    name: str
    command: list[str]
    health_url: str
    env: dict[str, str] | None = None


_OUTPUT = threading.Lock()


def say(text: str, file=None) -> None:
    """Write one whole line while servers' logs stream to the same output: ``print`` writes the text
    and its newline in two calls, so a log line could land between them (a test reading the
    ready line found it glued to a server's log line)."""
    out = file or sys.stdout
    with _OUTPUT:
        out.write(text + "\n")
        out.flush()


class ServerFailed(RuntimeError):
    """A server exited or never became healthy; the message names it and quotes its last lines."""


class ManagedServer:
    """A child process in its own process group, its output streamed with a prefix and its last
    lines kept for error messages."""

    def __init__(self, spec: ServerSpec, *, out=None, tail_lines: int = 30, env: dict | None = None):
        self.spec = spec
        self.out = out or sys.stdout
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.bind_error: str | None = None   # uvicorn's "address already in use": buried by the warm-up's
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
            if self.bind_error is None and "error while attempting to bind" in line:
                # SGLang's warm-up then retries for 120 s and fills the tail with its traceback
                self.bind_error = line
            say(f"[{self.spec.name}] {line}", self.out)

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
        cause = (f"; it could not bind its port ({self.bind_error.strip()})"
                 if self.bind_error and self.bind_error not in self.tail else "")
        return ServerFailed(f"the {self.spec.name} server {what}{cause}; its last log lines:\n{last}")

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


def on_cpu(spec: ServerSpec) -> bool:
    """Whether ``spec`` is an SGLang server on the CPU (``--device cpu`` on its command line)."""
    return any(a == "--device" and b == "cpu" for a, b in zip(spec.command, spec.command[1:]))


def start_waves(specs: Sequence[ServerSpec]) -> list[list[ServerSpec]]:
    """``specs`` in start-up waves, in order: a wave's servers start at once, and all of them answer
    before the next wave starts. A GPU server (or a router) is a wave of its own: it sizes its pools
    from the memory the servers before it left, or needs them up. Consecutive CPU servers share one:
    their pools are explicit (``--max-total-tokens``), so nothing is sized from what another took, and
    their start-ups (mostly imports, one core each) overlap on the machine's cores."""
    waves: list[list[ServerSpec]] = []
    for spec in specs:
        if waves and on_cpu(spec) and all(on_cpu(s) for s in waves[-1]):
            waves[-1].append(spec)
        else:
            waves.append([spec])
    return waves


def run_servers(specs: Sequence[ServerSpec], *, health_timeout: float = 600.0, poll: float = 0.5,
                on_ready: Callable[[list[ManagedServer]], None] | None = None,
                stop_event: threading.Event | None = None, out=None, grace: float = 10.0) -> None:
    """Start ``specs`` in order, in :func:`start_waves` (each wave healthy before the next); call
    ``on_ready`` with the servers in ``specs``' order; supervise until ``stop_event`` is set (Ctrl-C
    sets nothing: it raises KeyboardInterrupt, which also stops them) or a server exits
    (:class:`ServerFailed`). Every started server is stopped on the way out."""
    started: list[ManagedServer] = []
    try:
        for wave in start_waves(specs):
            for spec in wave:
                if _answers(spec.health_url):   # e.g. a server left running by a killed earlier run
                    raise ServerFailed(f"something already answers at {spec.health_url}; stop it (or pick "
                                       f"another port) before starting the {spec.name} server")
            waiting: list[ManagedServer] = []
            for spec in wave:
                with signals_held():   # a server that was started is always in ``started``, so stopped
                    server = ManagedServer(spec, out=out, env=spec.env)
                    started.append(server)
                waiting.append(server)
            deadline = time.monotonic() + health_timeout
            while waiting:
                for server in waiting:
                    if not server.alive():
                        raise server.failure(f"exited with code {server.proc.returncode} before it was healthy")
                waiting = [server for server in waiting if not server.healthy()]
                if not waiting:
                    break
                if time.monotonic() > deadline:
                    server = waiting[0]
                    raise server.failure(f"did not answer {server.spec.health_url} within {health_timeout:.0f} s")
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


ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


def replicate(specs: Sequence[ServerSpec], replicas: int, *, host: str, router_port: int, replica_ports: Sequence[int],
              router_policy: str = "cache_aware", gpu_ids: Sequence[int] | None = None,
              python: str = sys.executable, router_args: Sequence[str] = ()) -> list[ServerSpec]:
    """``specs`` (from :func:`build_specs`) with the generator started ``replicas`` times on
    ``replica_ports`` (``generator-0``, ``generator-1``, ...; on GPU ``gpu_ids[i]`` via
    ``--base-gpu-id``) and SGLang's router (``sglang_router.launch_router``) last, on ``router_port``,
    in front of them with ``router_policy``: clients keep talking to one generator URL. The
    replicas and the PRM keep their start-up order (the memory planner's)."""
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    if len(replica_ports) != replicas or len(set(replica_ports)) != replicas or router_port in replica_ports:
        raise ValueError(f"need {replicas} distinct replica ports apart from the router's {router_port}, "
                         f"got {list(replica_ports)}")
    out: list[ServerSpec] = []
    urls = []
    for spec in specs:
        if spec.name != "generator":
            out.append(spec)
            continue
        cmd = list(spec.command)
        at = cmd.index("--port")
        for i, port in enumerate(replica_ports):
            c = cmd[:at + 1] + [str(port)] + cmd[at + 2:]
            if gpu_ids is not None:
                c += ["--base-gpu-id", str(gpu_ids[i])]
            if "--tts-metrics-file" in c:   # one metrics file (prefix) per replica
                m = c.index("--tts-metrics-file") + 1
                c[m] = f"{c[m]}.replica{i}"
            out.append(ServerSpec(f"generator-{i}", c, f"http://{host}:{port}/health", spec.env))
            urls.append(f"http://{host}:{port}")
    out.append(router_spec(urls, host=host, port=router_port, policy=router_policy, python=python,
                           extra=router_args))
    return out


def router_spec(worker_urls: Sequence[str], *, host: str, port: int, policy: str = "cache_aware",
                python: str = sys.executable, extra: Sequence[str] = (), name: str = "router",
                prometheus_port: int | None = None) -> ServerSpec:
    """SGLang's router (``python -m sglang_router.launch_router``, package sglang-router) in front of
    ``worker_urls``, routing by ``policy``. Its Prometheus exporter binds ``prometheus_port``
    (``None``: the router's default, 29000): a second router on the same host needs another one, or it
    exits at start-up ("Address already in use")."""
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"unknown router policy {policy!r}; choose one of {', '.join(ROUTER_POLICIES)}")
    cmd = [python, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls, "--policy", policy,
           "--host", host, "--port", str(port), "--log-level", "warn"]
    if prometheus_port is not None:
        cmd += ["--prometheus-port", str(prometheus_port)]
    cmd += list(extra)
    return ServerSpec(name, cmd, f"http://{host}:{port}/readiness")   # /health answers before workers join


def wait_router_workers(url: str, count: int, timeout: float = 120.0) -> list[str]:
    """Wait until the router at ``url`` lists ``count`` healthy workers (it registers them in the
    background after it starts answering); return their URLs."""
    import json

    deadline = time.monotonic() + timeout
    listed: list = []
    while True:
        try:
            with urllib.request.urlopen(url + "/workers", timeout=5) as res:
                listed = json.loads(res.read()).get("workers") or []
        except (urllib.error.URLError, OSError, ValueError):
            listed = []
        healthy = [w["url"] for w in listed if isinstance(w, dict) and w.get("is_healthy")]
        if len(healthy) >= count:
            return healthy
        if time.monotonic() > deadline:
            raise ServerFailed(f"the router at {url} lists {len(healthy)} healthy workers of {count} after "
                               f"{timeout:.0f} s: {listed}")
        time.sleep(0.2)


#: SGLang's flag for custom logit processors: a request may then carry a processor, serialized code
#: (dill) that the server loads and runs. Online DeepConf's stop inside generation needs it
#: (``sgl_tts.confidence.ConfidenceStop``); nothing sgl-tts starts has it unless asked for.
CUSTOM_LOGIT_PROCESSOR_FLAG = "--enable-custom-logit-processor"
#: The generator's flags for online DeepConf's stop inside generation (``sgl-tts serve
#: --enable-deepconf-stop``).
DEEPCONF_STOP_FLAGS = (CUSTOM_LOGIT_PROCESSOR_FLAG,)
#: SGLang flags with which a request's content runs as code in the server.
REMOTE_CODE_FLAGS = (CUSTOM_LOGIT_PROCESSOR_FLAG,)


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` answers this machine only: ``localhost`` or a loopback
    address (127.0.0.0/8, ``::1``). ``0.0.0.0``, ``::``, an empty host (every interface) and any other
    name (it may resolve to an outside address) are not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_remote_code(host: str, flags: Sequence[str], *, allow_remote_code: bool = False,
                      asked_by: str | None = None) -> None:
    """Refuse (ValueError) a server on a non-loopback ``host`` with a flag of :data:`REMOTE_CODE_FLAGS`
    among ``flags``, unless ``allow_remote_code``: anyone who reaches its port could run code here.
    ``asked_by``: the user's flag that put it there, for the message (default: the SGLang flag)."""
    risky = [f for f in REMOTE_CODE_FLAGS if f in flags]
    if risky and not allow_remote_code and not is_loopback(host):
        raise ValueError(f"{asked_by or risky[0]} turns on SGLang's custom logit processors (a request's "
                         f"processor is code the server runs), and --host {host or repr(host)} is not a loopback "
                         f"address: anyone who reaches the server could run code on this machine. Serve on "
                         f"127.0.0.1 (the default), or pass --allow-remote-code-execution to accept that risk")


def launch_command(model: str, *, host: str, port: int, flags: Sequence[str] = (),
                   plugin: TTSSettings | None = None, extra: Sequence[str] = (),
                   python: str = sys.executable, allow_remote_code: bool = False) -> list[str]:
    """The one builder of SGLang's command line: ``python -m sglang.launch_server`` for ``model`` on
    ``host:port`` with the server's ``flags`` (a memory plan's, the CPU's), the plugin's settings
    rendered by the plugin's own type (:meth:`TTSSettings.args`, only what is on) and ``extra``
    flags last (they win over earlier ones). A flag that lets requests run code in the server
    (:data:`REMOTE_CODE_FLAGS`) on a non-loopback ``host`` is refused unless ``allow_remote_code``
    (:func:`check_remote_code`)."""
    check_remote_code(host, [*flags, *extra], allow_remote_code=allow_remote_code)
    return [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", host, "--port", str(port),
            *flags, *(plugin.args() if plugin is not None else ()), *extra]


def build_specs(generator: str, prm: str, flags: dict, *, host: str, ports: dict[str, int],
                first: str, plugin: TTSSettings | None = None, python: str = sys.executable,
                extra: dict[str, Sequence[str]] | None = None,
                env: dict[str, str] | None = None, prm_plugin: TTSSettings | None = None,
                deepconf_stop: bool = False, allow_remote_code: bool = False) -> list[ServerSpec]:
    """The two servers' command lines in start-up order (``plugin``'s settings, and with
    ``deepconf_stop`` :data:`DEEPCONF_STOP_FLAGS`, go to the generator, whose scheduler runs the
    search's requests; ``prm_plugin``'s, if any, to the PRM, e.g. its CPU attention); ``env`` (a CPU
    server's, :data:`~sgl_tts.launch.cpu_serving.CPU_ENV`) is added to both servers' environment, with
    the SGLang model modules each server's model does not need skipped
    (:func:`~sgl_tts.launch.cpu_serving.model_registry_env`). Custom logit processors on a non-loopback ``host`` need
    ``allow_remote_code`` (ValueError otherwise, :func:`check_remote_code`)."""
    models = {"generator": generator, "prm": prm}
    order = [first, "prm" if first == "generator" else "generator"]
    specs = []
    for name in order:
        own = DEEPCONF_STOP_FLAGS if name == "generator" and deepconf_stop else ()
        cmd = launch_command(models[name], host=host, port=ports[name], flags=[*flags[name].args(), *own],
                             plugin=plugin if name == "generator" else prm_plugin,
                             extra=(extra or {}).get(name, ()), python=python, allow_remote_code=allow_remote_code)
        specs.append(ServerSpec(name, cmd, f"http://{host}:{ports[name]}/health",
                                env if env is None else {**env, **model_registry_env(models[name])}))
    return specs


def remote_code_notice(specs: Sequence[ServerSpec], why: str) -> str | None:
    """The line ``sgl-tts serve`` says on start when a server in ``specs`` runs code its requests
    carry (custom logit processors), naming the servers and ``why``; ``None`` when none does."""
    on = [s for s in specs if any(f in s.command for f in REMOTE_CODE_FLAGS)]
    if not on:
        return None
    where = ", ".join(f"{s.name} ({s.health_url.rsplit('/', 1)[0]})" for s in on)
    return (f"sgl-tts serve: custom logit processors are ON for {where}, {why}: a request may carry code "
            f"that the server runs, so only trusted clients may reach it")


def print_commands(specs: Sequence[ServerSpec], label: str = "", health: bool = True) -> None:
    """A dry run: each server's command line, environment first, under a comment naming it (and
    where it answers when healthy)."""
    import shlex

    for spec in specs:
        print(f"# {label + ' ' if label else ''}{spec.name}" + (f": healthy at {spec.health_url}" if health else ""))
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (spec.env or {}).items())
        print((prefix + " " if prefix else "") + shlex.join(spec.command))


__all__ = ["CUSTOM_LOGIT_PROCESSOR_FLAG", "DEEPCONF_STOP_FLAGS", "ManagedServer", "REMOTE_CODE_FLAGS",
           "ROUTER_POLICIES", "ServerFailed", "ServerSpec", "build_specs", "check_remote_code", "is_loopback",
           "print_commands", "remote_code_notice", "replicate",
           "router_spec", "run_servers", "wait_router_workers", "sigterm_stops_servers"]
