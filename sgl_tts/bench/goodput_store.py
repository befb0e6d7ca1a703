"""The goodput benchmark's records file: the settings line, then one fsynced JSON line per record; a run
of the same settings resumes from it (:func:`read_records`), one of other settings is refused. The
file is a :class:`sgl_tts.records.RecordStore` (one rule for a torn last line, shared with ``run`` and
``load``)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from sgl_tts.bench.errors import BenchError
from sgl_tts.bench.goodput_settings import BenchSettings
from sgl_tts.records import KeyMismatch, RecordStore, StoreError


def _record_store(path: Path, settings: BenchSettings) -> RecordStore:
    """The run's output as a :class:`~sgl_tts.records.RecordStore`: the settings in its header line."""
    return RecordStore(path, settings.to_json(), what="a benchmark output")


def read_records(path: Path, settings: BenchSettings) -> list[dict]:
    """The records of an earlier run of the same settings (a torn last line is dropped); an output of
    other settings is refused rather than mixed."""
    try:
        return _record_store(path, settings).read()
    except KeyMismatch as exc:
        command = next((r["command"] for r in exc.records if r.get("kind") == "run" and r.get("command")), None)
        again = f"; it was written by `{command}`: give that command's flags again" if command else ""
        raise BenchError(f"{path} holds a run of other settings ({exc.differences()}){again} (--report-only "
                         "rebuilds its report with them), or pick another --output") from None
    except StoreError as exc:
        raise BenchError(f"{exc}; move the file away or pick another --output") from None


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


__all__ = ["RecordWriter", "read_records"]
