"""A test module's own live servers in groups that start and stop at the same time.

A CPU SGLang server's start is mostly imports, one process and one core at a time, so two starts
overlap on the 2-core machine: ``sgl-tts serve --device cpu`` starts its two servers together for that
reason (:func:`sgl_tts.launch.serve.start_waves`). :class:`~sgl_tts.launch.live_servers.LiveServers`
starts one server at a time, so each group here is a ``LiveServers`` of its own, the groups start in
threads, and each group starts its servers in the order given (:meth:`LiveServers.warm` starts any
set at once; groups keep an order within each). Each server stops in a thread of its own; the fleet
gives each its own torch.distributed port and skips SGLang's crash diagnostics on a stop
(:data:`sgl_tts.launch.cpu_serving.QUICK_STOP_ENV`)."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path
from typing import Mapping, Sequence

from sgl_tts.launch.live_servers import LiveServer, LiveServers


class ServerGroups:
    """Named servers in groups (``{group: {server: spec}}``); a server name is unique over all groups,
    and a router's workers (:meth:`start_router`) must be in one group."""

    def __init__(self, groups: Mapping[str, Mapping[str, LiveServer]], workdir: Path):
        self.groups = {g: LiveServers(specs, Path(workdir) / g) for g, specs in groups.items()}
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
        """Stop every server, all at once (each group stops its own at once)."""
        with cf.ThreadPoolExecutor(len(self.groups)) as pool:
            list(pool.map(LiveServers.stop_all, self.groups.values()))
