"""The goodput benchmark's records file: the settings line, then one fsynced JSON line per record; a run
of the same settings resumes from it (:func:`read_records`), one of other settings is refused."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Sequence

from sgl_tts.bench.errors import BenchError
from sgl_tts.bench.goodput_settings import BenchSettings

logger = logging.getLogger(__name__)


def read_records(path: Path, settings: BenchSettings) -> list[dict]:
    """The records of an earlier run of the same settings (a torn last line is dropped); an output of
    other settings is refused rather than mixed."""
    if not path.exists() or path.stat().st_size == 0:
        return []
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                logger.warning("%s: dropping a torn last line", path)
                break
            raise BenchError(f"{path}:{i + 1} is not JSON; move the file away or pick another --output")
    if not out or out[0].get("kind") != "settings":
        raise BenchError(f"{path} is not a benchmark output (its first line holds no settings)")
    if out[0]["settings"] != settings.to_json():
        theirs, ours = out[0]["settings"], settings.to_json()
        differ = "; ".join(f"{k}: {theirs.get(k)!r} there, {ours.get(k)!r} here"
                           for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k))
        command = next((r["command"] for r in out[1:] if r.get("kind") == "run" and r.get("command")), None)
        again = f"; it was written by `{command}`: give that command's flags again" if command else ""
        raise BenchError(f"{path} holds a run of other settings ({differ}){again} (--report-only rebuilds "
                         "its report with them), or pick another --output")
    return out[1:]


class RecordWriter:
    """Writes the run's output: the settings line and the records kept from an earlier run (written
    afresh, so a torn line is gone), then one flushed and fsynced line per new record."""

    def __init__(self, path: Path, settings: BenchSettings, records: Sequence[dict] = ()):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as fh:
            for rec in [{"kind": "settings", "settings": settings.to_json()}, *records]:
                fh.write(json.dumps(rec) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        self.path = path
        self.records: list[dict] = list(records)

    def __call__(self, record: dict) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.records.append(record)


__all__ = ["RecordWriter", "read_records"]
