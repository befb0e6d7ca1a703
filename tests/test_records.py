"""The one record store (sgl_tts.records.RecordStore) that ``sgl-tts run``, ``bench``, ``load`` and
``bench-frontend`` resume from: its format, its one rule for a partly written last line, its key check,
and the files the three stores before it wrote (literal lines in each old format)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest

from sgl_tts.records import HEADER_KIND, KeyMismatch, RecordStore, StoreError

SETTINGS = {"n": [8], "problems": 1, "trace": {"sigma": 0.5}}


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------- the format
def test_a_header_store_writes_its_settings_first_then_one_line_per_record(tmp_path):
    path = tmp_path / "deep" / "er" / "run.jsonl"   # the folders are made by the first append
    store = RecordStore(path, SETTINGS)
    assert store.read() == [] and not path.exists()   # reading makes nothing
    store.append({"kind": "limit", "batch": 8})
    store.append({"kind": "search", "side": "stock"})
    assert path.read_text() == (json.dumps({"kind": HEADER_KIND, "settings": SETTINGS}) + "\n"
                                + '{"kind": "limit", "batch": 8}\n{"kind": "search", "side": "stock"}\n')
    again = RecordStore(path, {"trace": {"sigma": 0.5}, "problems": 1, "n": (8,)})   # the same key, as JSON
    assert again.read() == [{"kind": "limit", "batch": 8}, {"kind": "search", "side": "stock"}]
    again.append({"kind": "search", "side": "sgl-tts"})
    assert [r.get("side") for r in again.read()] == [None, "stock", "sgl-tts"]
    assert len(_lines(path)) == 4   # one header, never a second


def test_a_field_store_keeps_its_key_in_every_record_and_refuses_a_record_without_it(tmp_path):
    path = tmp_path / "out.jsonl"
    store = RecordStore(path, "abc", field="run_key")
    store.append({"index": 0, "run_key": "abc"})
    assert path.read_text() == '{"index": 0, "run_key": "abc"}\n'   # no header line
    with pytest.raises(ValueError, match=rf"a record for {path} must carry run_key = 'abc', got 'zzz'"):
        store.append({"index": 1, "run_key": "zzz"})
    with pytest.raises(TypeError):
        store.append({"index": 1, "run_key": "abc", "x": object()})   # not JSON: the file is not touched
    assert store.read_numbered() == [(1, {"index": 0, "run_key": "abc"})]
    with pytest.raises(ValueError, match="other_keys='skip' needs a key field"):
        RecordStore(path, "abc", other_keys="skip")


# ------------------------------------------------------------------- a partly written last line
@pytest.mark.parametrize("header", [True, False])
def test_a_partly_written_last_line_is_left_out_then_cut_off_by_the_next_append(tmp_path, caplog, header):
    path = tmp_path / "out.jsonl"
    store = RecordStore(path, "k") if header else RecordStore(path, "k", field="key")
    store.append({"i": 0, "key": "k"})
    complete = path.read_bytes()
    path.write_bytes(complete + b'{"i": 1, "key": "k", "ans')   # a crash mid-write
    with caplog.at_level(logging.WARNING, logger="sgl_tts.records"):
        assert [r["i"] for r in RecordStore(path, "k", field=store.field).read()] == [0]
    assert "dropping a torn last line (25 bytes)" in caplog.text
    assert path.read_bytes().endswith(b'"ans')   # reading changes nothing
    resumed = RecordStore(path, "k", field=store.field)
    resumed.append({"i": 1, "key": "k"})
    assert path.read_bytes() == complete + b'{"i": 1, "key": "k"}\n'   # the torn bytes are gone, not glued
    # a torn line that is valid JSON but for its end of line is still torn: its append never returned
    path.write_bytes(complete + b'{"i": 9, "key": "k"}')
    assert [r["i"] for r in RecordStore(path, "k", field=store.field).read()] == [0]


def test_a_torn_header_of_a_new_file_is_written_again(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_bytes(b'{"kind": "settings", "sett')   # killed while writing the first line
    store = RecordStore(path, SETTINGS)
    assert store.read() == []
    store.append({"kind": "limit"})
    assert _lines(path) == [{"kind": "settings", "settings": SETTINGS}, {"kind": "limit"}]


@pytest.mark.parametrize("data, message", [
    (b'{"i": 0}\nnot json\n{"i": 2}\n', r"line 2 is not valid JSON \(Expecting value\): it is not a test file"),
    (b'{"i": 0}\n{"i": 1\n', r"line 2 is not valid JSON \(Expecting ',' delimiter\): it is not a test file"),
    (b'{"i": 0}\n\n[1, 2]\n', r"line 3 is a JSON list, not an object: it is not a test file"),
    (b'{"i": 0}\n\xe9\n', r"line 2: not UTF-8 text \(byte 0xe9 at column 1\)"),
])
def test_a_complete_line_that_is_not_a_json_object_is_an_error_naming_it(tmp_path, data, message):
    """Only the bytes after the last newline can be a crash's leftover; a bad line that ends is not."""
    path = tmp_path / "out.jsonl"
    path.write_bytes(data)
    store = RecordStore(path, "k", field="key", other_keys="skip", what="a test file")
    with pytest.raises(StoreError, match=f"^{re.escape(str(path))} {message}$"):
        store.read()
    with pytest.raises(StoreError, match=message):
        store.append({"key": "k"})   # nor appended to
    assert path.read_bytes() == data


def test_a_folder_or_a_file_without_settings_is_named(tmp_path):
    with pytest.raises(StoreError, match=f"^{tmp_path} is a directory$"):
        RecordStore(tmp_path, "k").read()
    path = tmp_path / "notes.jsonl"
    path.write_text('{"kind": "search"}\n')
    with pytest.raises(StoreError, match=f"^{path} is not a benchmark output \\(its first line holds no settings\\)$"):
        RecordStore(path, SETTINGS, what="a benchmark output").read()


# ------------------------------------------------------------------------------- the key check
def test_a_header_of_other_settings_names_what_differs_both_ways(tmp_path):
    path = tmp_path / "run.jsonl"
    RecordStore(path, SETTINGS).append({"kind": "run", "command": "sgl-tts bench --n 8"})
    ours = {**SETTINGS, "n": [16], "beam_width": 4}
    with pytest.raises(KeyMismatch) as err:
        RecordStore(path, ours).read()
    assert str(err.value) == f"{path} holds records of other settings (beam_width: None there, 4 here; n: [8] there, [16] here)"
    assert (err.value.theirs, err.value.ours, err.value.line) == (SETTINGS, ours, 1)
    assert err.value.records == [{"kind": "run", "command": "sgl-tts bench --n 8"}]   # what wrote it, for the command
    before = path.read_bytes()
    with pytest.raises(KeyMismatch):
        RecordStore(path, ours).append({"kind": "limit"})   # never appended to
    assert path.read_bytes() == before


def test_a_keyed_field_refuses_or_skips_other_keys(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"i": 0, "run_key": "aaa"}\n{"i": 1, "run_key": "bbb"}\n{"i": 2, "run_key": "aaa"}\n')
    with pytest.raises(KeyMismatch) as err:
        RecordStore(path, "aaa", field="run_key").read()
    assert str(err.value) == f"{path} holds records of other settings (run_key: 'bbb' there, 'aaa' here)"
    assert err.value.line == 2
    skip = RecordStore(path, "aaa", field="run_key", other_keys="skip")
    assert skip.read_numbered() == [(1, {"i": 0, "run_key": "aaa"}), (3, {"i": 2, "run_key": "aaa"})]
    RecordStore(path, "bbb", field="run_key", other_keys="skip").append({"i": 3, "run_key": "bbb"})
    assert [r["i"] for r in skip.read()] == [0, 2] and len(_lines(path)) == 4   # the other run's lines stay


# --------------------------------------------------------------------------------- durability
def test_every_append_is_fsynced_and_a_new_files_folder_too(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "new" / "run.jsonl"
    store = RecordStore(path, SETTINGS)
    store.append({"kind": "limit"})
    assert synced == [str(path), str(path.parent), str(path)]   # the header, the new name, the record
    synced.clear()
    store.append({"kind": "search"})
    assert synced == [str(path)]


CRASHING_WRITER = textwrap.dedent("""
    import sys
    from sgl_tts.records import RecordStore

    store = RecordStore(sys.argv[1], "k", field="key")
    for i in range(1000):
        store.append({"i": i, "key": "k", "pad": "x" * 20000})   # a line longer than a write buffer
        print(i, flush=True)   # said only once the append returned
""")


def test_a_crash_mid_write_loses_no_record_whose_append_returned(tmp_path):
    """The writer dies inside a write: the file-size limit (``RLIMIT_FSIZE``) lets the kernel write a
    line only in part and fails the rest, as a full disk or a kill between two ``write`` calls would."""
    import resource

    path = tmp_path / "out.jsonl"
    RecordStore(path, "k", field="key").append({"i": -1, "key": "k"})
    limit = path.stat().st_size + 2 * 20040 + 5000   # two whole lines, then a third cut short

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    child = subprocess.run([sys.executable, "-c", CRASHING_WRITER, str(path)], capture_output=True, text=True,
                           preexec_fn=small_files, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                           timeout=120)
    assert child.returncode != 0 and "File too large" in child.stderr
    acked = [int(x) for x in child.stdout.split()]
    assert acked == [0, 1] and path.stat().st_size == limit and not path.read_bytes().endswith(b"\n")
    store = RecordStore(path, "k", field="key")
    assert [r["i"] for r in store.read()] == [-1, 0, 1]   # every acknowledged record, the torn one left out
    store.append({"i": 2, "key": "k"})   # resumed where it stopped
    assert [r["i"] for r in store.read()] == [-1, 0, 1, 2]
    assert all(line.endswith("}") for line in path.read_text().split("\n")[:-1])   # every line whole


# ---------------------------------------------------------------- the files the old stores wrote
def test_a_benchmark_output_of_the_old_writer_resumes(tmp_path):
    from sgl_tts.bench.errors import BenchError
    from sgl_tts.bench.goodput_settings import BenchSettings
    from sgl_tts.bench.goodput_store import RecordWriter, read_records

    settings = BenchSettings(n=(8,), problems=1)
    path = tmp_path / "bench.jsonl"
    old = (json.dumps({"kind": "settings", "settings": settings.to_json()}) + "\n"
           '{"kind": "run", "command": "sgl-tts bench --n 8", "date": "2026-11-30"}\n'
           '{"kind": "limit", "batch": 8, "tokens": 1, "seconds": 1.0, "tokens_per_s": 1.0}\n'
           '{"kind": "search", "side": "stock", "algorithm": "beam_search", "n": 8, "problem": 0}\n'
           '{"kind": "search", "side": "sgl-t')
    path.write_text(old)
    got = read_records(path, settings)
    assert [r["kind"] for r in got] == ["run", "limit", "search"]
    writer = RecordWriter(path, settings, got)
    writer({"kind": "search", "side": "sgl-tts", "algorithm": "beam_search", "n": 8, "problem": 0})
    assert [r.get("side") for r in read_records(path, settings)] == [None, None, "stock", "sgl-tts"]
    assert path.read_text().startswith(old[:old.rindex("\n") + 1])   # what was there stays byte for byte
    path.write_text('{"kind": "settings", "settings": {}}\nnot json\n')
    with pytest.raises(BenchError, match=f"^{path} line 2 is not valid JSON .*: it is not a benchmark output; move "
                                         "the file away or pick another --output$"):
        read_records(path, settings)


def test_a_run_output_of_the_old_writer_resumes(tmp_path):
    from sgl_tts.experiment import ProblemRecord, RunError, read_results

    problems = [ProblemRecord(i, str(i), f"Question {i}?", str(i)) for i in range(3)]
    path = tmp_path / "out.jsonl"
    path.write_text('{"index": 0, "id": "0", "question": "Question 0?", "reference": "0", "answer": "0", '
                    '"run_key": "0123456789ab", "trajectories": []}\n'
                    '{"index": 2, "id": "2", "question": "Question 2?", "reference": "2", "answer": "5", '
                    '"run_key": "0123456789ab", "trajectories": []}\n'
                    '{"index": 1, "id": "1", "question": "Quest')
    done = read_results(path, "0123456789ab", problems)
    assert sorted(done) == [0, 2] and done[2]["answer"] == "5"
    with pytest.raises(RunError, match=r"holds results of different settings \(run key 0123456789ab, these "
                                       r"settings ffffffffffff\); use another --output or delete the file"):
        read_results(path, "ffffffffffff", problems)
    with pytest.raises(RunError, match=r"out.jsonl line 2 is for a different problem set \(problem 2 differs\)"):
        read_results(path, "0123456789ab", problems[:2] + [ProblemRecord(2, "2", "Another?", "2")])


def test_a_load_or_frontend_output_of_the_old_writer_resumes_with_other_settings_kept(tmp_path):
    from sgl_tts.bench.load import read_records, record_store

    path = tmp_path / "load.jsonl"
    old = ('{"side": "plain", "rate": 0.5, "problem": 0, "key": "5d1c0e3b2a41", "latency": 3.2}\n'
           '{"backend": "cpu", "program": "beam_search", "k": 4, "key": "99aa00bb11cc", "searches_per_s": 0.5}\n'
           '{"side": "plain", "rate": 0.5, "problem": 1, "key": "5d1c0e3b2a41", "latency": 2.9}\n'
           '{"side": "plain", "rate": 1.0, "prob')
    path.write_text(old)
    assert [r["problem"] for r in read_records(path, "5d1c0e3b2a41")] == [0, 1]
    assert [r["k"] for r in read_records(path, "99aa00bb11cc")] == [4]
    record_store(path, "5d1c0e3b2a41").append({"side": "plain", "rate": 1.0, "problem": 0, "key": "5d1c0e3b2a41"})
    assert [(r["rate"], r["problem"]) for r in read_records(path, "5d1c0e3b2a41")] == [(0.5, 0), (0.5, 1), (1.0, 0)]
    assert len(_lines(path)) == 4
