"""The order in which a run takes the test modules that use the session's live servers (the ``live``
fixture of ``tests/conftest.py``).

Each session server starts on first use (~30 s on a quiet 2-core machine), and a module that stops
them to make room for servers of its own makes the next module that uses them start them again: in
file-name order the session's nine servers started 21 times (by reading the modules; two are
tests/test_live_failures.py's deliberate restarts), in this order 11 (measured: 302 s of waiting on
a 2-core Xeon, 2026-11-28; the run's summary line ``live servers: ...`` says it each run).

A module says how it uses them with the ``live_servers`` marker; the run takes first the modules that do not use them (before any session
server starts), then those that start extra session servers and stop them after (``extra``, while
few others run), those that share them (the default), those that stop all but the PRM for servers of
their own (``own-but-prm``), and last those that stop them all (``own``; and any test that asks for
``live_stopped``). Modules stay whole (their fixtures set up once), in file-name order within a rank.
"""

from __future__ import annotations

import pytest

LIVE_ORDER = {"extra": 1, "shared": 2, "own-but-prm": 3, "own": 4}


def live_rank(item: pytest.Item) -> int:
    """``item``'s rank in :data:`LIVE_ORDER` (0: it does not use the session's live servers)."""
    names = getattr(item, "fixturenames", ())
    if "live" not in names:
        return 0
    if "live_stopped" in names:
        return LIVE_ORDER["own"]
    marker = item.get_closest_marker("live_servers")
    if marker is None:
        return LIVE_ORDER["shared"]
    if len(marker.args) != 1 or marker.args[0] not in LIVE_ORDER:
        raise pytest.UsageError(f"{item.nodeid}: the live_servers marker takes one of {', '.join(LIVE_ORDER)}; "
                                f"got {marker.args!r}")
    return LIVE_ORDER[marker.args[0]]


def order_by_live_servers(items: list[pytest.Item]) -> None:
    """Sort ``items`` in place, stably, by their module's rank: the highest of its items'."""
    rank: dict = {}
    for item in items:
        rank[item.path] = max(rank.get(item.path, 0), live_rank(item))
    items.sort(key=lambda item: rank[item.path])
