"""Real SGLang servers on this machine's CPU, started on demand and kept for a whole session.

The test bed of every server-side claim (``tests/conftest.py``'s ``live`` fixture) and usable from a
notebook: a :class:`LiveServers` set knows how to start each named server (a :class:`LiveServer`
spec: model, plugin policy or no plugin, metrics file, extra flags), starts one the first time its
URL is asked for (or, several at once, when :meth:`LiveServers.warm` names them), waits until it is
healthy, and stops them all at the end. Each runs
``python -m sglang.launch_server`` with :mod:`sgl_tts.launch.cpu_serving`'s flags in its own process group
(:class:`sgl_tts.launch.serve.ManagedServer`), on a free loopback port, its log written to a file. A server
that exits or never becomes healthy raises :class:`sgl_tts.launch.serve.ServerFailed` with its last log lines.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

from sgl_tts.launch.cpu_serving import CPU_ENV, QUICK_STOP_ENV, cpu_server_flags, model_registry_env
from sgl_tts.plugin.scheduling.observer import SERVER_ENV as OBSERVER_ENV
from sgl_tts.plugin.settings import TTSSettings
from sgl_tts.launch.serve import ManagedServer, ServerFailed, ServerSpec, launch_command

NO_PLUGIN = None   # LiveServer.policy: the sgl-tts plugin is not loaded (SGLANG_PLUGINS=none)
# LiveServer.policy: the plugin loaded observe-only (sgl_tts.plugin.scheduling.observer): stock scheduling, no flag
OBSERVE_ONLY = "observe-only"


@dataclasses.dataclass(frozen=True)
class LiveServer:
    """How to start one server.

    Attributes:
        model: model folder.
        policy: the plugin's ``--tts-policy`` (``off`` / ``prefix-aware``), or ``None``: the plugin is
            not loaded at all (``SGLANG_PLUGINS=none``), stock SGLang, or :data:`OBSERVE_ONLY`: the
            plugin loaded observe-only (``SGLANG_TTS_OBSERVE_ONLY=1``: stock scheduling, no flag, the
            observer's metrics with ``--enable-metrics`` in ``extra`` or ``metrics``).
        metrics: write the plugin's scheduler metrics (``--tts-metrics-file``, observe-only
            ``SGLANG_TTS_METRICS_FILE``; needs a policy).
        kv_bytes: the KV pool's memory (its ``--max-total-tokens`` follows).
        dtype: ``--dtype`` (``float32`` computes what :class:`sgl_tts.LocalBackend` computes).
        seeded_sampling: the plugin's ``--tts-seeded-sampling`` (needs a policy).
        cpu_attention: the plugin's ``--tts-cpu-attention`` (``ragged`` needs a policy: the plugin
            must be loaded; ``off`` is one).
        extra: further ``launch_server`` flags.
    """

    model: str
    policy: str | None = NO_PLUGIN
    metrics: bool = False
    kv_bytes: int = 64 << 20
    dtype: str | None = "float32"
    seeded_sampling: bool = False
    cpu_attention: str = "native"
    extra: tuple[str, ...] = ()

    def __post_init__(self):
        if self.metrics and self.policy is NO_PLUGIN:
            raise ValueError("scheduler metrics come from the sgl-tts plugin: give a policy")
        if self.seeded_sampling and self.policy in (NO_PLUGIN, OBSERVE_ONLY):
            raise ValueError("seeded sampling comes from the sgl-tts plugin: give a policy")
        if self.cpu_attention != "native" and self.policy in (NO_PLUGIN, OBSERVE_ONLY):
            raise ValueError("the ragged CPU attention comes from the sgl-tts plugin: give a policy ('off' will do)")


_GRPC_OFFSET = 10000          # SGLang 0.5.15 derives its gRPC port as port + 10000
_handed_out: set[int] = set()  # ports this process has given away (a server may not have bound it yet)


def ephemeral_port_floor() -> int:
    """The lowest port the kernel hands to sockets bound to port 0 (outgoing connections, SGLang's own
    ``get_free_port`` for its NCCL/gloo port): ``ip_local_port_range``'s first number, 32768 if unknown."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", *, low: int = 10000, high: int | None = None) -> int:
    """A port free on ``host`` in [low, high), as is the port 10,000 above it (SGLang 0.5.15 derives its
    gRPC port as port + 10000 and refuses one above 65535), that this process has not handed out before.

    ``high`` defaults to 10,000 below the kernel's ephemeral range, so neither port can be taken by an
    outgoing connection or a port-0 bind between this check and the server's own bind, which takes a
    minute on a busy CPU. A clean-clone CI lost a server that way: its port, picked in the ephemeral
    range, was in use by the time uvicorn bound it, and SGLang's warm-up waited 120 s and killed it."""
    import random

    if high is None:
        high = ephemeral_port_floor() - _GRPC_OFFSET
    if not 0 < low < high:
        raise ValueError(f"no room for ports in [{low}, {high})")

    def free(port: int) -> bool:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
                return True
            except OSError:
                return False

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        if port in _handed_out:
            continue
        if free(port) and free(port + _GRPC_OFFSET):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port pair on {host} in [{low}, {high})")


class LiveServers:
    """Named CPU SGLang servers, each started the first time it is used (:meth:`url`), all stopped by
    :meth:`stop_all` (or on leaving a ``with`` block)."""

    def __init__(self, specs: Mapping[str, LiveServer], workdir: str | os.PathLike, *,
                 health_timeout: float = 600.0, host: str = "127.0.0.1", python: str = sys.executable):
        self.specs = dict(specs)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.health_timeout = health_timeout
        self.host = host
        self.python = python
        self._ports: dict[str, int] = {}
        self._running: dict[str, ManagedServer] = {}
        self._logs: dict[str, object] = {}
        self._lock = threading.Lock()   # the tables above
        self._starting: dict[str, threading.Lock] = {}   # one per server: two servers start at once
        self.starts: list[tuple[str, float]] = []   # (name, seconds until it answered), in start order

    # ------------------------------------------------------------------ paths and commands
    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def metrics_prefix(self, name: str) -> Path:
        """``--tts-metrics-file`` of ``name``: the plugin writes ``<prefix>.<scheduler pid>``."""
        return self.workdir / f"{name}.metrics.jsonl"

    def command(self, name: str) -> ServerSpec:
        spec = self._spec(name)
        port = self._ports.setdefault(name, free_port(self.host))
        # SGLang otherwise takes its torch.distributed port from the kernel's ephemeral range when it
        # starts and binds it a minute later on a busy CPU: two servers starting at once (warm) once
        # met there (EADDRINUSE). One below that range, as the HTTP port, cannot be taken meanwhile.
        nccl = self._ports.setdefault(f"{name}/nccl", free_port(self.host))
        env = {**CPU_ENV, **QUICK_STOP_ENV, **model_registry_env(spec.model)}
        plugin = None
        if spec.policy is NO_PLUGIN:
            env["SGLANG_PLUGINS"] = "none"
        elif spec.policy == OBSERVE_ONLY:
            env.update(OBSERVER_ENV)
            if spec.metrics:
                env["SGLANG_TTS_METRICS_FILE"] = str(self.metrics_prefix(name))
        else:
            plugin = TTSSettings(spec.policy, seeded_sampling=spec.seeded_sampling,
                                 metrics_file=str(self.metrics_prefix(name)) if spec.metrics else None,
                                 cpu_attention=spec.cpu_attention)
        cmd = launch_command(spec.model, host=self.host, port=port, python=self.python,
                             flags=[*cpu_server_flags(spec.model, spec.kv_bytes, dtype=spec.dtype).args(),
                                    "--nccl-port", str(nccl)],
                             plugin=plugin, extra=spec.extra)
        return ServerSpec(name, cmd, f"http://{self.host}:{port}/health", env)

    def _spec(self, name: str) -> LiveServer:
        try:
            return self.specs[name]
        except KeyError:
            raise KeyError(f"no live server named {name!r}; known: {', '.join(sorted(self.specs))}") from None

    # ------------------------------------------------------------------ life cycle
    def url(self, name: str) -> str:
        """The base URL of ``name``, started (and waited for) if it is not running."""
        with self._start_lock(name):
            with self._lock:
                server = self._running.get(name)
            if server is None or not server.alive():
                if server is not None:   # died since: report it rather than silently restarting
                    raise server.failure(f"exited with code {server.proc.returncode}")
                self._start(name)
            return f"http://{self.host}:{self._ports[name]}"

    def warm(self, *names: str) -> list[str]:
        """The URLs of ``names``, those not running started at the same time (each in a thread) and
        waited for. A CPU server's start is mostly one process importing on one core, so on the
        2-core machine two starts overlap: two test servers took 105 s together against 203 s one
        after the other (2026-12-02, under load). A server that fails to start raises (the others
        are still waited for, and stay up)."""
        import concurrent.futures as cf

        if len(names) < 2:
            return [self.url(n) for n in names]
        with cf.ThreadPoolExecutor(len(names), thread_name_prefix="live-start") as pool:
            futures = [pool.submit(self.url, n) for n in names]
            cf.wait(futures)
        return [f.result() for f in futures]

    def _start_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._starting.setdefault(name, threading.Lock())

    def start(self, name: str) -> str:
        """(Re)start ``name`` on its port (after :meth:`kill`), wait until healthy, return its URL."""
        with self._start_lock(name):
            with self._lock:
                old = self._running.pop(name, None)
            if old is not None:
                old.stop(grace=5)
            self._start(name)
            return f"http://{self.host}:{self._ports[name]}"

    def _start(self, name: str, spec: ServerSpec | None = None) -> None:
        """Start ``name`` (its :meth:`command`, or ``spec``) and wait until it answers its health URL."""
        spec = spec or self.command(name)
        log = open(self.log_path(name), "a", buffering=1)
        server = ManagedServer(spec, out=log, tail_lines=40, env=spec.env)
        with self._lock:
            self._logs[name] = log
            self._running[name] = server
        began = time.monotonic()
        deadline = began + self.health_timeout
        while not server.healthy():
            if not server.alive():
                raise server.failure(f"exited with code {server.proc.returncode} before it was healthy "
                                     f"(log: {self.log_path(name)})")
            if time.monotonic() > deadline:
                server.stop(grace=5)
                raise server.failure(f"did not answer {spec.health_url} within {self.health_timeout:.0f} s "
                                     f"(log: {self.log_path(name)})")
            time.sleep(0.5)
        self.starts.append((name, time.monotonic() - began))

    def start_router(self, name: str, workers: Sequence[str], policy: str = "cache_aware") -> str:
        """(Re)start SGLang's router ``name`` in front of the named servers (each started if need be)
        with ``policy``; return its URL."""
        from sgl_tts.launch.serve import router_spec, wait_router_workers

        urls = self.warm(*workers)
        with self._start_lock(name):
            with self._lock:
                old = self._running.pop(name, None)
                port = self._ports.setdefault(name, free_port(self.host))
                metrics_port = self._ports.setdefault(f"{name}/prometheus", free_port(self.host))
            if old is not None:
                old.stop(grace=5)
            # healthy = /readiness: once the router has registered its workers. Each router gets
            # its own Prometheus port: two on the default one and the second exits at start-up
            self._start(name, router_spec(urls, host=self.host, port=port, policy=policy, python=self.python,
                                          name=name, prometheus_port=metrics_port))
        url = f"http://{self.host}:{port}"
        wait_router_workers(url, len(urls), timeout=self.health_timeout)
        return url

    def pid(self, name: str) -> int | None:
        """The process id of running server ``name`` (its launcher; SGLang's scheduler and detokenizer
        are its children), or ``None`` when it is not running."""
        server = self._running.get(name)
        return server.proc.pid if server is not None and server.alive() else None

    def kill(self, name: str) -> None:
        """SIGKILL ``name``'s whole process group at once (a crash, not a clean stop); a later
        :meth:`start` brings it back on the same port."""
        import signal

        with self._lock:
            server = self._running.pop(name, None)
        if server is not None:
            try:
                os.killpg(server.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            server.stop(grace=5)

    def stop(self, *names: str) -> None:
        """Stop the named servers cleanly; each starts again on its next :meth:`url`. A test that
        starts servers of its own stops the idle ones first: a CPU server takes about 2 GB, and the
        machine has 24 GiB."""
        import concurrent.futures as cf

        with self._lock:
            stopped = [(n, self._running.pop(n)) for n in names if n in self._running]

        def stop_one(job: tuple[str, ManagedServer]) -> None:
            job[1].stop(grace=10)
            self._retire_metrics(job[0])

        if stopped:   # all at once: each waits for its own processes to end
            with cf.ThreadPoolExecutor(len(stopped), thread_name_prefix="live-stop") as pool:
                list(pool.map(stop_one, stopped))

    def _retire_metrics(self, name: str) -> None:
        """Move a stopped server's metrics files to ``<workdir>/stopped-<k>/``: what
        :meth:`metrics_records` reads is then the running scheduler's alone (a restarted server's
        records would otherwise follow its predecessor's, in file-name order)."""
        from sgl_tts.plugin.scheduling.metrics import scheduler_files

        files = scheduler_files(self.metrics_prefix(name))
        if not files:
            return
        for k in itertools.count():   # servers stopped at once each take a folder of their own
            target = self.workdir / f"stopped-{k}"
            try:
                target.mkdir()
                break
            except FileExistsError:
                continue
        for f in files:
            f.rename(target / f.name)

    def running(self) -> list[str]:
        return [name for name, server in self._running.items() if server.alive()]

    def stop_all(self) -> None:
        """Stop every server, all at once (each stop waits for its server's processes to end)."""
        import concurrent.futures as cf

        with self._lock:
            servers, self._running = self._running, {}
        if servers:
            with cf.ThreadPoolExecutor(len(servers), thread_name_prefix="live-stop") as pool:
                list(pool.map(lambda server: server.stop(grace=10), servers.values()))
        for log in self._logs.values():
            log.close()
        self._logs.clear()

    def __enter__(self) -> "LiveServers":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    # ------------------------------------------------------------------ what the servers wrote
    def metrics_records(self, name: str) -> list[dict]:
        """Every record the plugin's scheduler metrics wrote for ``name`` since it last started (all
        its scheduler processes; a stopped server's records are moved aside by :meth:`stop`). The
        plugin buffers; it writes at least at every prefill batch."""
        from sgl_tts.plugin.scheduling.metrics import read_records, scheduler_files

        return read_records(scheduler_files(self.metrics_prefix(name)))

    def log_text(self, name: str) -> str:
        path = self.log_path(name)
        return path.read_text(errors="replace") if path.exists() else ""


def loads(url: str) -> dict:
    """The (first) scheduler's entry of ``GET /v1/loads``: running and waiting requests, used KV
    tokens, queues. A snapshot: SGLang 0.5.15's scheduler publishes it at each prefill, every 15th
    decode step (``--load-snapshot-publish-interval``) and when it goes idle."""
    import urllib.request

    with urllib.request.urlopen(url + "/v1/loads", timeout=60) as res:
        return json.loads(res.read())["loads"][0]


def in_flight(url: str) -> int:
    """Requests running or waiting on ``url``, as its :func:`loads` snapshot shows them."""
    ld = loads(url)
    return int(ld["num_running_reqs"]) + int(ld["num_waiting_reqs"])


def settled_loads(url: str, timeout: float = 5.0) -> dict:
    """:func:`loads` once it shows no request running or waiting, or the last one read when
    ``timeout`` seconds have passed: for checking that a server was left empty. The answer to a
    request's last step can reach its client before the scheduler publishes its idle snapshot, so a
    read right after the last answer may still count requests that are gone."""
    deadline = time.monotonic() + timeout
    while True:
        ld = loads(url)
        if (ld["num_running_reqs"], ld["num_waiting_reqs"]) == (0, 0) or time.monotonic() > deadline:
            return ld
        time.sleep(0.05)


__all__ = ["LiveServer", "LiveServers", "NO_PLUGIN", "OBSERVE_ONLY", "ServerFailed", "free_port", "in_flight", "loads",
           "settled_loads"]
