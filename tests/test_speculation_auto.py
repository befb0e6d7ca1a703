"""``speculative: auto`` as a run setting (issue 33, D1): the decode curve a run decides on (a file, or
``measure``: the generator server's, cached per server), whether the verifier shares the device,
the policy the programs get, and the branches every record and summary report. The curve measured
on a live server is tests/test_live_speculation_auto.py's."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from sgl_tts.experiment import RunConfig, RunError
from sgl_tts.experiment.driver import with_decode_curve, with_verifier_slowdown
from sgl_tts.experiment.summary import summarize
from sgl_tts.launch.decode_curve import MeasuredCurve, curve_key
from sgl_tts.search.speculation import Speculation
from sgl_tts.search.speculation_cost import COSTS_MORE, NO_CURVE
from sgl_tts.server_costs import DecodeCurve, VerifierSlowdown


def _curve_file(tmp_path, points, name="curve.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"points": points}))
    return str(path)


def test_a_curve_file_is_read_and_read_again_once_rewritten(tmp_path):
    path = _curve_file(tmp_path, [[1, 0.01], [8, 0.03]])
    assert DecodeCurve.load(path).points == ((1, 0.01), (8, 0.03))
    st = os.stat(path)
    with open(path, "w") as fh:   # same size, later time: a new version of the file
        json.dump({"points": [[1, 0.02], [8, 0.03]]}, fh)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert DecodeCurve.load(path).points == ((1, 0.02), (8, 0.03))
    with pytest.raises(ValueError, match="must increase"):
        DecodeCurve.load(_curve_file(tmp_path, [[8, 0.01], [1, 0.03]], "bad.json"))


@pytest.mark.parametrize("settings, message, named", [
    (dict(speculation_curve="none"), "settings of speculative: auto", "speculation_curve"),
    (dict(verifier_shares_device="yes", speculative="exact"), "settings of speculative: auto", "verifier_shares_device"),
    (dict(speculative="auto", verifier_shares_device="maybe"), "must be auto, yes or no, got 'maybe'",
     "verifier_shares_device"),
    (dict(speculative="auto", speculation_curve="/no/such/curve.json"), "not a decode curve file", "speculation_curve"),
    (dict(verifier_slowdown="none"), "settings of speculative: auto", "verifier_slowdown"),
    (dict(speculative="auto", verifier_slowdown="/no/such/slowdown.json"), "not a verifier slowdown file",
     "verifier_slowdown"),
])
def test_bad_auto_settings_are_refused_naming_the_setting(settings, message, named):
    with pytest.raises(RunError, match=message) as err:
        RunConfig(program="beam_search", n=4, beam_width=2, **settings).validate()
    assert named in err.value.settings


@pytest.mark.parametrize("generator, prm, shares", [
    (None, None, True),                                                   # both CPU backends here
    ("http://127.0.0.1:30000", "http://localhost:30001", True),          # one host, two names
    ("http://gpu-a:30000", "http://gpu-a:30001", True),
    ("http://gpu-a:30000", "http://gpu-b:30001", False),
    ("http://gpu-a:30000", None, False),                                 # the PRM on this machine
])
def test_the_verifier_shares_the_device_when_both_are_served_from_one_host(generator, prm, shares):
    cfg = RunConfig(program="beam_search", n=4, beam_width=2, speculative="auto", generator=generator, prm=prm)
    assert cfg.shares_device is shares
    for given, want in (("yes", True), ("no", False)):
        assert RunConfig(program="beam_search", speculative="auto", generator=generator, prm=prm,
                         verifier_shares_device=given).shares_device is want


def test_auto_gives_the_programs_the_controller_on_the_files_curve(tmp_path):
    path = _curve_file(tmp_path, [[1, 0.01], [64, 0.2]])
    cfg = RunConfig(program="dvts", n=8, beam_width=2, speculative="auto", speculation_curve=path,
                    verifier_shares_device="no")
    cfg.validate()
    spec = cfg.program_arguments("1+1?", None)["speculative"]
    assert spec == Speculation(controlled=True, curve=DecodeCurve.of([(1, 0.01), (64, 0.2)]),
                               verifier_shares_device=False)
    # none: the controller with no curve, which starts nothing; measure left unresolved: the search
    # measures its generator server's (and refuses a generator that is none)
    for unresolved, measure in (("measure", True), ("none", False)):
        got = RunConfig(program="dvts", n=8, beam_width=2, speculative="auto",
                        speculation_curve=unresolved).program_arguments("1+1?", None)["speculative"]
        assert got == Speculation(controlled=True, verifier_shares_device=True, measure_curve=measure)
    # the other modes keep their names (the programs' presets)
    assert RunConfig(program="dvts", n=8, beam_width=2, speculative="exact").program_arguments("q", None)[
        "speculative"] == "exact"


def test_the_curve_settings_leave_the_run_key_alone_and_auto_resumes_an_exact_run(tmp_path):
    base = RunConfig(program="beam_search", n=4, beam_width=2)
    auto = RunConfig(program="beam_search", n=4, beam_width=2, speculative="auto",
                     speculation_curve=_curve_file(tmp_path, [[1, 0.01]]), verifier_shares_device="no")
    assert auto.run_key() == base.run_key() == RunConfig(program="beam_search", n=4, beam_width=2,
                                                          speculative="exact").run_key()
    assert RunConfig(program="beam_search", n=4, beam_width=2, speculative="truncate").run_key() != base.run_key()


def test_measure_is_resolved_only_for_auto_on_a_server():
    plain = RunConfig(program="beam_search", n=4, beam_width=2, speculative="exact")
    assert with_decode_curve(plain) is plain
    cpu = RunConfig(program="beam_search", n=4, beam_width=2, speculative="auto")
    assert with_decode_curve(cpu) is cpu   # no URL: what the generator is decides (run refuses a CPU backend)
    given = RunConfig(program="beam_search", n=4, beam_width=2, speculative="auto", speculation_curve="none",
                      generator="http://127.0.0.1:1")
    assert with_decode_curve(given) is given   # a given curve (or none) is never measured
    down = RunConfig(program="beam_search", n=4, beam_width=2, speculative="auto", generator="http://127.0.0.1:1")
    with pytest.raises(RunError, match=r"speculative: auto: http://127.0.0.1:1: cannot read /server_info"):
        with_decode_curve(down)


def test_auto_on_a_generator_that_is_no_server_is_refused_before_the_first_search(tmp_path):
    """``sgl-tts run`` with ``speculative: auto`` on a CPU backend (here a scripted one, as a run may be
    given): no server to measure a curve on, so the run is refused naming the setting that gives one,
    and nothing is written; given a curve (or none on purpose) the same run goes on."""
    from sgl_tts.experiment import run
    from sgl_tts.launch.decode_curve import curve_dir
    from sgl_tts.testing import ScriptedBackend, ScriptedPRM
    from test_speculation import PACE, heavy, score

    cfg = RunConfig(program="beam_search", n=8, beam_width=2, max_depth=7, step_tokens=(24,), limit=1,
                    speculative="auto", progress=False, output=str(tmp_path / "out.jsonl"))
    backend = ScriptedBackend(heavy, seconds_per_token=PACE)
    with pytest.raises(RunError) as err:
        run(cfg, generator=backend, prm=ScriptedPRM(score))
    assert str(err.value) == (
        "speculative: auto decides on the generator's decode curve, and the generator (ScriptedBackend) is not a "
        "server to measure one on: give speculation_curve: FILE (a JSON file with points: [[batch, seconds], ...]; "
        f"sgl-tts run caches a server's under {curve_dir()}), none (no curve: no branch starts), or a generator "
        "server's URL")
    assert err.value.settings == ("speculation_curve",) and backend.draws == []
    assert not (tmp_path / "out.jsonl").exists()
    for curve in (_curve_file(tmp_path, [[1, 0.02], [64, 0.02]]), "none"):
        _, records = run(dataclasses.replace(cfg, speculation_curve=curve, output=str(tmp_path / f"{len(curve)}.jsonl")),
                         generator=ScriptedBackend(heavy, seconds_per_token=PACE), prm=ScriptedPRM(score))
        assert len(records) == 1 and records[0]["branches"]["started" if curve != "none" else "declined"] > 0


def test_records_and_the_summary_report_the_branches():
    def record(i, branches=None):
        rec = {"index": i, "reference": None, "answer": "1", "answers": {"majority": "1"}, "subsampled": {},
               "tokens_generated": 10, "tokens_kept": 5, "seconds": 1.0, "pass": True,
               "trajectories": [{"tokens": 5, "seconds": 1.0, "answer": "1"}]}
        if branches:
            rec["branches"] = branches
        return rec

    records = [record(0, {"started": 3, "declined": 5, "stopped": 1, "stood_down": {COSTS_MORE: 5}}),
               record(1, {"started": 0, "declined": 2, "stopped": 0, "stood_down": {COSTS_MORE: 1, NO_CURVE: 1}}),
               record(2)]
    s = summarize(records, 4, "beam_search")
    assert s.branches == {"started": 3, "declined": 7, "stopped": 1, "stood_down": {COSTS_MORE: 6, NO_CURVE: 1}}
    assert (f"speculative branches: 3 started, 1 stopped at a barrier, 7 not started "
            f"(why they stood down: {COSTS_MORE}: 6, {NO_CURVE}: 1)") in s.table()
    assert summarize(records[2:], 4, "beam_search").branches == {}


def test_a_measured_curve_round_trips_and_its_key_follows_the_server():
    m = MeasuredCurve(DecodeCurve.of([(1, 0.01), (2, 0.012)]), {"model_path": "/m/gen", "max_total_tokens": 100},
                      {"cpu": "x", "cores": 2, "sglang": "0.5.15"}, 256, 16, "2026-11-27")
    assert MeasuredCurve.from_json(json.loads(json.dumps(m.to_json())), "p.json") == \
        MeasuredCurve(m.curve, m.server, m.machine, 256, 16, "2026-11-27", "p.json")
    key = curve_key(m.server, (1, 2), 256, 16)
    assert key.startswith("gen-") and key == curve_key(dict(m.server), (1, 2), 256, 16)
    assert key != curve_key({**m.server, "max_total_tokens": 200}, (1, 2), 256, 16)
    assert key != curve_key(m.server, (1, 2, 4), 256, 16) != curve_key(m.server, (1, 2), 512, 16)
    with pytest.raises(Exception, match="format"):
        MeasuredCurve.from_json({**m.to_json(), "format": 0})


def test_a_slowdown_file_reaches_the_programs_and_stays_out_of_the_run_key(tmp_path):
    curve = _curve_file(tmp_path, [[1, 0.01], [64, 0.2]])
    slowdown = _curve_file(tmp_path, [[0, 0.5], [4, 0.9]], "slowdown.json")
    cfg = RunConfig(program="beam_search", n=8, beam_width=2, speculative="auto", speculation_curve=curve,
                    verifier_slowdown=slowdown)
    cfg.validate()
    spec = cfg.program_arguments("1+1?", None)["speculative"]
    assert spec.slowdown == VerifierSlowdown.of([(0, 0.5), (4, 0.9)]) and spec.slowdown.per_row == pytest.approx(0.2)
    assert spec.verifier_shares_device    # both CPU backends: one host
    assert cfg.run_key() == RunConfig(program="beam_search", n=8, beam_width=2, speculative="exact").run_key()
    bad = _curve_file(tmp_path, [[1, 0.5], [4, 0.9]], "no-alone.json")   # no 0-row point: no PRM alone
    with pytest.raises(RunError, match=r"not a verifier slowdown file \(a verifier slowdown needs the PRM alone"):
        RunConfig(program="beam_search", n=8, beam_width=2, speculative="auto", verifier_slowdown=bad).validate()


def test_the_slowdown_is_measured_only_for_auto_where_the_prm_shares_a_host_with_the_generator():
    on = dict(program="beam_search", n=4, beam_width=2, speculative="auto")
    for cfg in (RunConfig(program="beam_search", n=4, beam_width=2, speculative="exact"),
                RunConfig(**on),                                                        # CPU backends: no servers
                RunConfig(**on, generator="http://gpu-a:1", prm="http://gpu-b:1"),      # two hosts: never slowed
                RunConfig(**on, generator="http://127.0.0.1:1", prm="http://127.0.0.1:2", verifier_slowdown="none"),
                RunConfig(**on, generator="http://127.0.0.1:1", prm="http://127.0.0.1:2", verifier_shares_device="no")):
        assert with_verifier_slowdown(cfg) is cfg
    down = RunConfig(**on, generator="http://127.0.0.1:1", prm="http://127.0.0.1:2")
    with pytest.raises(RunError, match=r"speculative: auto: http://127.0.0.1:1: cannot read /server_info") as err:
        with_verifier_slowdown(down)
    assert err.value.settings == ("verifier_slowdown",)


def test_a_cached_slowdown_is_written_whole_and_one_that_does_not_parse_is_named(tmp_path):
    from sgl_tts.launch.cpu_profile import ProfileError, read_cached, write_json_atomically
    from sgl_tts.launch.verifier_slowdown import MeasuredSlowdown

    data = {"format": 1, "points": [[0, 1.0], [4, 1.4]], "generator": {"model_path": "g"}, "prm": {"model_path": "p"},
            "machine": {}, "prm_batch": 8, "context": 256, "date": "2026-11-27"}
    path = write_json_atomically(tmp_path / "deep" / "slowdown.json", data)
    assert [p.name for p in path.parent.iterdir()] == ["slowdown.json"]     # no temporary file left
    got = read_cached(path, MeasuredSlowdown.from_json, "verifier slowdown")
    assert got.slowdown.per_row == pytest.approx(0.1) and got.path == str(path) and got.to_json()["per_row"] == 0.1
    path.write_text(json.dumps(data)[:40])   # cut short, as a crash without the atomic write would leave it
    with pytest.raises(ProfileError, match=f"{path}: not a verifier slowdown .*remeasure to replace it"):
        read_cached(path, MeasuredSlowdown.from_json, "verifier slowdown")
    path.write_text(json.dumps({**data, "format": 2}))
    with pytest.raises(ProfileError, match="a verifier slowdown of format 2, not 1"):
        read_cached(path, MeasuredSlowdown.from_json, "verifier slowdown")


def test_slowdown_rows_beyond_the_running_request_limit_are_measured_at_the_limit():
    from sgl_tts.launch.verifier_slowdown import rows_within_cap, running_request_cap

    assert rows_within_cap((0, 4, 16), 8) == (0, 4, 8)
    assert rows_within_cap((0, 4, 16), 4) == (0, 4)        # the limit is already a row: not twice
    assert rows_within_cap((0, 4, 16), 2) == (0, 2)
    assert rows_within_cap((0, 4, 16), 16) == (0, 4, 16)
    assert rows_within_cap((0, 4, 16), None) == (0, 4, 16)   # a server that does not say
    # the scheduler's effective limit wins over the flag (SGLang may lower it to fit the pool)
    info = {"max_running_requests": 64, "internal_states": [{"effective_max_running_requests_per_dp": 8}]}
    assert running_request_cap(info) == 8
    assert running_request_cap({"max_running_requests": 64, "internal_states": [{}]}) == 64
    assert running_request_cap({"max_running_requests": None}) is None
