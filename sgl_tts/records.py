"""The one store for the records a resumable command appends as each piece of work finishes:
``sgl-tts run``'s problems, ``sgl-tts bench``'s searches, ``sgl-tts load``'s and ``bench-frontend``'s
blocks. A rerun of the same settings reads back what is there and does only the rest.

**Format.** JSON Lines: one JSON object per line, each line ended by ``\\n``. The records are keyed
by their settings (a hash or the settings themselves), in one of two places, as each command has
always written them:

- a **header line** first in the file, ``{"kind": "settings", "settings": KEY}`` (``sgl-tts bench``):
  the whole file belongs to one key;
- a **field of every record** (``run_key`` for ``sgl-tts run``, ``key`` for ``sgl-tts load`` and
  ``bench-frontend``): the file belongs to one key (a record of another is an error), or, with
  ``other_keys="skip"``, holds the records of several, of which a store reads its own.

A key that differs is a :class:`KeyMismatch` naming both (and, for mappings, each entry that differs).

**A crash mid-write.** The one rule: the bytes after the last ``\\n`` are a partly written last line.
Reading leaves them out (with a warning); the first append cuts them off, so the next record starts on
a line of its own. Every append writes one whole line and flushes and fsyncs it before it returns (a
new file's folder too), so a record whose append returned survives the process and, as far as the disk
keeps fsync's promise, the machine. A line that does end in ``\\n`` but is not a JSON object is no
crash's leftover: it is a :class:`StoreError` naming the line.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Literal, Mapping

logger = logging.getLogger(__name__)

#: the ``kind`` of a header line: ``{"kind": "settings", "settings": KEY}``
HEADER_KIND = "settings"


class StoreError(ValueError):
    """A records file that cannot be resumed from: unreadable, not UTF-8, a complete line that is not
    a JSON object, a header missing. The message names the file (and the line) and no remedy, which
    is the command's to add (``--output``, ``--out``)."""


class KeyMismatch(StoreError):
    """A records file written under another key than the store's.

    Attributes:
        path: the file.
        theirs: the key in the file (the header's, or the first foreign record's field).
        ours: the store's key.
        field: the record field the key is in; ``None`` for a header.
        line: the line that holds ``theirs``.
        records: every record of the file after the header (whatever its key), for a command that
            names what wrote the file.
    """

    def __init__(self, path: Path, theirs: Any, ours: Any, field: str | None, line: int, records: list[dict]):
        self.path, self.theirs, self.ours, self.field, self.line, self.records = path, theirs, ours, field, line, records
        super().__init__(f"{path} holds records of other settings ({self.differences()})")

    def differences(self) -> str:
        """What differs, ``NAME: THEIRS there, OURS here``: each differing entry of two mappings, or the
        key itself under its field's name."""
        theirs, ours = self.theirs, self.ours
        if isinstance(theirs, dict) and isinstance(ours, dict):
            return "; ".join(f"{k}: {theirs.get(k)!r} there, {ours.get(k)!r} here"
                             for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k))
        return f"{self.field or HEADER_KIND}: {theirs!r} there, {ours!r} here"


class RecordStore:
    """One records file of one key (see the module's docstring for the format and the crash rule).

    Args:
        path: the JSON Lines file; it and its folder are made by the first append.
        key: the settings' key, any JSON value (a mapping is compared entry by entry after a JSON round
            trip, so tuples equal the lists read back).
        field: the record field that carries the key; ``None`` (default): a header line carries it.
        other_keys: with a ``field``, what a record of another key means: ``"refuse"`` (a
            :class:`KeyMismatch`) or ``"skip"`` (the file holds several runs; it stays, unread).
        what: what the file is, for errors: ``"an sgl-tts run output"``.
    """

    def __init__(self, path: str | os.PathLike, key: Any, *, field: str | None = None,
                 other_keys: Literal["refuse", "skip"] = "refuse", what: str = "a records file"):
        if other_keys not in ("refuse", "skip"):
            raise ValueError(f"other_keys must be 'refuse' or 'skip', got {other_keys!r}")
        if field is None and other_keys != "refuse":
            raise ValueError("a header keys the whole file: other_keys='skip' needs a key field")
        self.path = Path(path)
        self.key = json.loads(json.dumps(key))
        self.field = field
        self.other_keys = other_keys
        self.what = what
        self._lock = threading.Lock()
        self._opened = False

    # ---------------------------------------------------------------------------------- reading
    def read(self) -> list[dict]:
        """This key's records in file order (never the header); ``[]`` for a missing or empty file."""
        return [rec for _, rec in self.read_numbered()]

    def read_numbered(self) -> list[tuple[int, dict]]:
        """:meth:`read` with each record's line number (from 1)."""
        return self._check(self._scan(warn=True)[0])

    def _scan(self, warn: bool) -> tuple[list[tuple[int, dict]], int, int]:
        """Every complete line's object with its number, where the complete lines end and the file's
        size."""
        if self.path.is_dir():
            raise StoreError(f"{self.path} is a directory")
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return [], 0, 0
        except OSError as exc:
            raise StoreError(f"{self.path} cannot be read: {exc.strerror or exc}") from None
        end = data.rfind(b"\n") + 1
        if end < len(data) and warn:
            logger.warning("%s: dropping a torn last line (%d bytes) left by an interrupted write", self.path,
                           len(data) - end)
        out = []
        try:
            text = utf8_text(data[:end], self.path)
        except ValueError as exc:
            raise StoreError(str(exc)) from None
        for number, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise StoreError(f"{self.path} line {number} is not valid JSON ({exc.msg}): it is not "
                                 f"{self.what}") from None
            if not isinstance(rec, dict):
                raise StoreError(f"{self.path} line {number} is a JSON {type(rec).__name__}, not an object: it "
                                 f"is not {self.what}")
            out.append((number, rec))
        return out, end, len(data)

    def _check(self, lines: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
        """The lines of this key; a header that is missing or of another key, or a record of another key
        where they are refused, raises."""
        if self.field is None:
            if not lines:
                return []
            (number, header), rest = lines[0], lines[1:]
            if header.get("kind") != HEADER_KIND or HEADER_KIND not in header:
                raise StoreError(f"{self.path} is not {self.what} (its first line holds no settings)")
            if header[HEADER_KIND] != self.key:
                raise KeyMismatch(self.path, header[HEADER_KIND], self.key, None, number, [r for _, r in rest])
            return rest
        mine = []
        for number, rec in lines:
            if rec.get(self.field) == self.key:
                mine.append((number, rec))
            elif self.other_keys == "refuse":
                raise KeyMismatch(self.path, rec.get(self.field), self.key, self.field, number, [r for _, r in lines])
        return mine

    # ---------------------------------------------------------------------------------- writing
    def open(self) -> None:
        """Make the file ready for appends (the first :meth:`append` does it; call it to fail before
        the work): check the key of what is there, cut off a partly written last line, and give a new
        or empty file its header line."""
        with self._lock:
            self._open()

    def append(self, record: Mapping[str, Any]) -> None:
        """Add ``record`` as one line, flushed and fsynced before this returns. A record of a keyed
        field must carry the store's key there."""
        if self.field is not None and record.get(self.field) != self.key:
            raise ValueError(f"a record for {self.path} must carry {self.field} = {self.key!r}, "
                             f"got {record.get(self.field)!r}")
        line = (json.dumps(record) + "\n").encode()   # a record that is not JSON fails before the file is touched
        with self._lock:
            self._open()
            self._write(line)

    def _open(self) -> None:
        if self._opened:
            return
        lines, end, size = self._scan(warn=False)
        self._check(lines)
        new = not self.path.exists()
        if new:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        if end < size:
            logger.info("%s: cutting off a torn last line (%d bytes)", self.path, size - end)
            with self.path.open("r+b") as fh:
                fh.truncate(end)
                fh.flush()
                os.fsync(fh.fileno())
        if self.field is None and not lines:
            self._write((json.dumps({"kind": HEADER_KIND, HEADER_KIND: self.key}) + "\n").encode())
        if new:
            self.path.touch()
            _fsync_dir(self.path.parent)   # the file's name survives a crash too
        self._opened = True

    def _write(self, line: bytes) -> None:
        with self.path.open("ab") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())


def utf8_text(data: bytes, where: str | os.PathLike) -> str:
    """``data`` as UTF-8 text (a leading byte-order mark dropped); bytes that are not UTF-8 are a
    ``ValueError`` ``WHERE line N: not UTF-8 text (byte 0x.. at column C)``."""
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = bom + exc.start
        line = data.count(b"\n", 0, at) + 1
        column = at - (data.rfind(b"\n", 0, at) + 1) + 1
        raise ValueError(f"{where} line {line}: not UTF-8 text (byte 0x{data[at]:02x} at column {column})") from None


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["HEADER_KIND", "KeyMismatch", "RecordStore", "StoreError", "utf8_text"]
