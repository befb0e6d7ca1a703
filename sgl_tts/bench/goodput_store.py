"""The goodput benchmark's records file: the settings line, then one fsynced JSON line per record; a run
of the same settings resumes from it (:func:`read_records`), one that only adds algorithms, beam
counts or (the load mode) offered rates extends it (its settings line widened), one of other settings
is refused. The file is a :class:`sgl_tts.records.RecordStore` (one rule for a torn last line, shared with ``run`` and ``load``)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

from sgl_tts.bench.errors import BenchError
from sgl_tts.bench.goodput_settings import BenchSettings
from sgl_tts.records import HEADER_KIND, KeyMismatch, RecordStore, StoreError

logger = logging.getLogger(__name__)
# the settings a run may add to: its records are per (algorithm, n) and, in the load mode, per offered
# rate (each rate's arrivals are one seeded pattern compressed by it), each one's as it would be alone
GRID = ("algorithms", "n", "arrivals")


def _record_store(path: Path, settings: BenchSettings) -> RecordStore:
    """The run's output as a :class:`~sgl_tts.records.RecordStore`: the settings in its header line."""
    return RecordStore(path, settings.to_json(), what="a benchmark output")


def read_records(path: Path, settings: BenchSettings) -> list[dict]:
    """The records of an earlier run of the same settings (a torn last line is dropped); an output of
    other settings is refused rather than mixed."""
    try:
        return _record_store(path, settings).read()
    except KeyMismatch as exc:
        if _adds_to(exc.theirs, exc.ours):
            _widen(path, exc.ours)
            logger.info("%s: extended to %s", path, "; ".join(f"{k} {exc.ours[k]}" for k in GRID if k in exc.ours))
            return _record_store(path, settings).read()
        command = next((r["command"] for r in exc.records if r.get("kind") == "run" and r.get("command")), None)
        again = f"; it was written by `{command}`: give that command's flags again" if command else ""
        raise BenchError(f"{path} holds a run of other settings ({exc.differences()}){again} (--report-only "
                         "rebuilds its report with them), or pick another --output") from None
    except StoreError as exc:
        raise BenchError(f"{exc}; move the file away or pick another --output") from None


def read_with_settings(path: Path) -> tuple[BenchSettings, list[dict]]:
    """Another run's records with the settings they were written with (its first line), for a report
    that shows them beside this run's (``--with-records``)."""
    try:
        with path.open("rb") as fh:
            first = json.loads(fh.readline() or b"null")
        settings = BenchSettings(**first[HEADER_KIND])
    except FileNotFoundError:
        raise BenchError(f"{path}: no such records file") from None
    except (ValueError, TypeError, KeyError) as exc:   # not JSON, no settings line, settings of another shape
        raise BenchError(f"{path} does not start with a benchmark's settings line ({exc})") from None
    return settings, read_records(path, settings)


def _adds_to(theirs, ours) -> bool:
    """Whether settings ``ours`` are ``theirs`` with algorithms, beam counts or offered rates added
    (nothing else differs, nothing is taken away; a one-at-a-time run has no rates)."""
    if not (isinstance(theirs, dict) and isinstance(ours, dict)) or theirs.keys() != ours.keys():
        return False
    grid = [k for k in GRID if k in ours]
    return (all(theirs[k] == ours[k] for k in ours if k not in grid)
            and all(isinstance(theirs[k], list) and set(theirs[k]) <= set(ours[k]) for k in grid))


def _widen(path: Path, key: dict) -> None:
    """Give ``path``'s settings line ``key``, the records after it untouched: written to a file beside
    it, fsynced, then put in its place (a crash leaves the old file or the new one, whole)."""
    data = path.read_bytes()
    first = data.find(b"\n") + 1
    header = json.loads(data[:first])
    header[HEADER_KIND] = key
    tmp = path.with_name(path.name + ".widening")
    with tmp.open("wb") as fh:
        fh.write((json.dumps(header) + "\n").encode() + data[first:])
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class RecordWriter:
    """Appends to the run's output (the settings line first in a new file; a torn last line cut off
    first) one flushed and fsynced line per new record; ``records``: those already in it
    (:func:`read_records`), which :attr:`records` goes on from."""

    def __init__(self, path: Path, settings: BenchSettings, records: Sequence[dict] = ()):
        self.store = _record_store(path, settings)
        self.store.open()
        self.path = path
        self.records: list[dict] = list(records)

    def __call__(self, record: dict) -> None:
        self.store.append(record)
        self.records.append(record)


__all__ = ["RecordWriter", "read_records", "read_with_settings"]
