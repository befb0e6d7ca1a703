"""A test module's own live servers in groups that start and stop at the same time.

A CPU SGLang server's start is mostly imports, one process and one core at a time, so two starts
overlap on the 2-core machine: ``sgl-tts serve --device cpu`` starts its two servers together for that
reason (:func:`sgl_tts.launch.serve.start_waves`). :class:`~sgl_tts.launch.live_servers.LiveServers`
starts one server at a time, so each group here is a ``LiveServers`` of its own, the groups start in
threads, and each group starts its servers in the order given. Each server stops in a thread of its
own, without SGLang's crash diagnostics (:data:`QUICK_STOP_ENV`)."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from pathlib import Path
from typing import Mapping, Sequence

from sgl_tts.launch.live_servers import LiveServer, LiveServers, free_port
from sgl_tts.launch.serve import ServerSpec


# SGLang 0.5.15 answers SIGTERM with crash diagnostics that first sleep 5 s "to let GPU activity
# settle" (tokenizer_manager.py, on by default): nothing to settle on the CPU, and 5 s of every stop
QUICK_STOP_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


class _QuickStop(LiveServers):
    """:class:`LiveServers` whose servers skip SGLang's crash diagnostics on SIGTERM."""

    def command(self, name: str) -> ServerSpec:
        spec = super().command(name)
        return dataclasses.replace(spec, env={**(spec.env or {}), **QUICK_STOP_ENV})


class ServerGroups:
    """Named servers in groups (``{group: {server: spec}}``); a server name is unique over all groups,
    and a router's workers (:meth:`start_router`) must be in one group."""

    def __init__(self, groups: Mapping[str, Mapping[str, LiveServer]], workdir: Path):
        # SGLang takes its torch.distributed port from the kernel's ephemeral range when the server
        # starts and binds it after the scheduler's imports, a minute later on a busy CPU, by which time
        # another socket may hold it (EADDRINUSE, seen with two starts at once): each server gets one
        # below that range instead, as its HTTP port (free_port)
        def own_port(spec: LiveServer) -> LiveServer:
            return dataclasses.replace(spec, extra=(*spec.extra, "--nccl-port", str(free_port())))

        self.groups = {g: _QuickStop({name: own_port(spec) for name, spec in specs.items()}, Path(workdir) / g)
                       for g, specs in groups.items()}
        self._group_of = {name: self.groups[g] for g, specs in groups.items() for name in specs}
        if len(self._group_of) != sum(len(specs) for specs in groups.values()):
            raise ValueError("a server name is in two groups")

    def start(self) -> "ServerGroups":
        """Start every server (each group in a thread of its own) and wait until all answer."""
        def group_up(servers: LiveServers) -> None:
            for name in servers.specs:
                servers.url(name)

        with cf.ThreadPoolExecutor(len(self.groups)) as pool:
            for done in [pool.submit(group_up, servers) for servers in self.groups.values()]:
                done.result()   # a server that failed to start raises here, with its log
        return self

    def url(self, name: str) -> str:
        return self._group_of[name].url(name)

    def metrics_records(self, name: str) -> list[dict]:
        return self._group_of[name].metrics_records(name)

    def log_text(self, name: str) -> str:
        return self._group_of[name].log_text(name)

    def kill(self, name: str) -> None:
        self._group_of[name].kill(name)

    def start_router(self, name: str, workers: Sequence[str], policy: str = "cache_aware") -> str:
        """SGLang's router ``name`` in front of ``workers`` (all of one group), as
        :meth:`LiveServers.start_router`."""
        servers = {id(self._group_of[w]): self._group_of[w] for w in workers}
        if len(servers) != 1:
            raise ValueError(f"a router's workers must be in one group: {', '.join(workers)}")
        group = next(iter(servers.values()))
        self._group_of[name] = group   # the router is a server of its workers' group (kill, stop_all)
        return group.start_router(name, workers, policy)

    def stop_all(self) -> None:
        """Stop every server, each in a thread of its own (:meth:`LiveServers.stop` holds its set's
        lock only to take the server out), then close the groups."""
        running = [(servers, name) for servers in self.groups.values() for name in servers.running()]
        with cf.ThreadPoolExecutor(max(1, len(running))) as pool:
            list(pool.map(lambda job: job[0].stop(job[1]), running))
        for servers in self.groups.values():
            servers.stop_all()
