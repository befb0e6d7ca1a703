"""``sgl-tts run``: config from YAML + flags, the dataset checks, resumable JSONL output, the summary.

Most runs use :mod:`sgl_tts.testing`'s scripted generator and PRM (exact expectations, no model);
the end-to-end ones use the shipped tiny models on the CPU backend, including a real kill mid-run.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from sgl_tts import experiment
from sgl_tts.cli import run as run_command
from sgl_tts.experiment import RunConfig, RunError, read_problems, run, summarize
from sgl_tts.search import derive_seed
from sgl_tts.testing import ScriptedBackend, ScriptedPRM

from programs.best_of_n import best_of_n

D = "\n\n"


def solution(prefix: str, draw: int | None) -> str:
    """A scripted whole solution: two steps and an answer that depends on the draw."""
    h = derive_seed(prefix, draw)
    return D.join(["s1", f"s{h % 3}", f"The answer is \\boxed{{{h % 4}}}"])


def step(prefix: str, draw: int | None) -> str:
    """A scripted step-wise solution for tree searches: answers after three steps."""
    h = derive_seed(prefix, draw)
    if prefix.count(D) >= 3:
        return f"The answer is \\boxed{{{h % 4}}}"
    return f"s{h % 3}" + D


PRM_TABLE = {"s0": 0.2, "s1": 0.6, "s2": 0.9, "The answer is \\boxed{0}": 0.1,
             "The answer is \\boxed{1}": 0.8, "The answer is \\boxed{2}": 0.5,
             "The answer is \\boxed{3}": 0.8}


def dataset(tmp_path, count=6, answers=True) -> Path:
    path = tmp_path / "problems.jsonl"
    with path.open("w") as fh:
        for i in range(count):
            rec = {"id": f"p{i}", "question": f"Question {i}?"}
            if answers:
                rec["answer"] = str(i % 4)
            fh.write(json.dumps(rec) + "\n")
    return path


def cfg_for(tmp_path, **kw) -> RunConfig:
    base = dict(problems=str(dataset(tmp_path)), output=str(tmp_path / "out.jsonl"), program="best_of_n",
                n=8, progress=False, in_flight=3)
    base.update(kw)
    cfg = RunConfig(**base)
    cfg.validate()
    return cfg


def lines(path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


# --------------------------------------------------------------------------------------- config
def test_yaml_then_flags_override_defaults(tmp_path):
    conf = tmp_path / "run.yaml"
    conf.write_text(yaml.safe_dump({"program": "dvts", "n": 12, "beam-width": 3,
                                    "step_tokens": [16, 64], "prm": "/models/a", "temperature": 0.5}))
    ap = argparse.ArgumentParser()
    run_command.add_config_arguments(ap)
    args = ap.parse_args(["--config", str(conf), "--n", "6", "--step-tokens", "8,8,32",
                          "--prm", "/models/prm", "--no-progress"])
    cfg = run_command.config_from_args(args)
    assert (cfg.program, cfg.n, cfg.beam_width, cfg.step_tokens, cfg.prm, cfg.temperature, cfg.progress) == \
        ("dvts", 6, 3, [8, 8, 32], "/models/prm", 0.5, False)
    assert cfg.max_depth == RunConfig.max_depth  # untouched default
    args = ap.parse_args(["--config", str(conf), "--program", "beam_search", "--semantics", "search-and-learn",
                          "--filter-duplicates", "--sort-completed"])
    sal = run_command.config_from_args(args)
    assert {k: v for k, v in sal.program_arguments("Q", None).items() if k in ("semantics", "filter_duplicates",
                                                                           "sort_completed")} == \
        {"semantics": "search-and-learn", "filter_duplicates": True, "sort_completed": True}
    args = ap.parse_args(["--config", str(conf)])
    from_yaml = run_command.config_from_args(args)
    assert (from_yaml.n, from_yaml.step_tokens, from_yaml.prm) == (12, [16, 64], "/models/a")


@pytest.mark.parametrize("content, message", [
    ({"beam_widht": 4}, "unknown setting 'beam_widht'; known settings: problems, output"),
    ({"n": "many"}, "n: expected an integer, got 'many'"),
    ({"n": 2.5}, "n: expected an integer, got 2.5"),
    ({"progress": "maybe"}, "progress: expected true or false, got 'maybe'"),
    ({"program": "mcst"}, "unknown program 'mcst'; choose one of beam_search, dvts, best_of_n, self_consistency, mcts, particle_filtering"),
    ({"negative_exit": True}, "negative_exit: settings of program mcts"),
    ({"program": "dvts", "parallel": 4, "threshold": 0.5}, "parallel, threshold: settings of program mcts"),
    ({"program": "mcts", "negative_exit": True}, "negative early exit needs aggregation 'min' or 'prod'"),
    ({"program": "mcts", "parallel": 0}, "parallel must be a positive integer, got 0"),
    ({"program": "mcts", "prm": "none"}, "mcts needs a PRM; drop prm: none"),
    ({"program": "mcts", "first_step_cutoff": "high"}, "first_step_cutoff: expected a number, got 'high'"),
    ({"program": "mcts", "aggregation": "min", "negative_exit": True, "futility": "leaf"}, "unknown futility 'leaf'"),
    ({"program": "beam_search", "prm": "none"}, "beam_search needs a PRM; drop prm: none"),
    ({"n": 0}, "n must be a positive integer, got 0"),
    ({"aggregation": "max"}, "unknown aggregation 'max'; choose one of last, min, prod, mean"),
    ({"program": "dvts", "n": 2, "beam_width": 4}, "DVTS needs N >= M (at least one subtree of M beams), got N=2 and M=4"),
    # beam search's and DVTS's options are the programs' own checks (sgl_tts.search.options), same words
    ({"semantics": "sal"}, "unknown semantics 'sal'; choose one of ['sgl-tts', 'search-and-learn']"),
    ({"program": "dvts", "semantics": "search-and-learn"}, "semantics: settings of program beam_search"),
    ({"program": "dvts", "filter_duplicates": True, "sort_completed": True},
     "filter_duplicates, sort_completed: settings of program beam_search"),
    ({"semantics": "search-and-learn", "lookahead": 2}, "semantics='search-and-learn' has no branching or lookahead"),
    ({"sort_completed": True}, "sort_completed belongs to semantics='search-and-learn'"),
    ({"branching": "random"}, "unknown branching 'random'; choose one of ['equal', 'proportional']"),
    ({"lookahead": -1}, "lookahead must be >= 0, got -1"),
    ({"max_depth": 0}, "max_depth must be a positive integer, got 0"),
    ({"semantics": "search-and-learn", "speculative": "exact"},
     "semantics='search-and-learn' runs search-and-learn's own loop; speculative and overlap_verification"),
    ({"speculative": "fast"}, "unknown speculative mode 'fast'; choose off, exact, exact-no-lookahead, truncate, auto"),
    ({"program": "best_of_n", "overlap_verification": True},
     "speculative, overlap_verification and overlap_by_family are settings of beam_search and dvts"),
    ({"program": "best_of_n", "overlap_by_family": True},
     "speculative, overlap_verification and overlap_by_family are settings of beam_search and dvts"),
    ({"program": "dvts", "overlap_by_family": True},
     "overlap_by_family is a way of overlapped verification: it needs overlap_verification=True"),
])
def test_bad_settings_name_the_setting(tmp_path, content, message):
    conf = tmp_path / "run.yaml"
    conf.write_text(yaml.safe_dump(content))
    with pytest.raises(RunError) as err:
        RunConfig.from_sources(str(conf))
    assert message in str(err.value)


@pytest.mark.parametrize("content, where, message", [
    (b"n: 4\nprm: caf\xe9\n", "line 2", "not UTF-8 text (byte 0xe9 at column 9)"),
    (b"n: 4\n  beam_width: 2\n", "line 2", "not valid YAML: mapping values are not allowed here"),
    (b"n: 4\nprogram: [dvts\nbeam_width: 2\n", "line 3",
     "not valid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence that began on line 2)"),
    (b"n: 4\nprm: a\x00b\n", "line 2", "not valid YAML: unacceptable character #x0000"),
    (b"- n\n- 4\n", "", "must be a mapping of settings, got list"),
    (b"n: 4\nprogram: dvts\nbeam_widht: 4\n", "line 3", "unknown setting 'beam_widht'; known settings: problems"),
    (b"# a comment\nn: many\n", "line 2", "n: expected an integer, got 'many'"),
    (b"n: 4\nprogram: mcst\n", "line 2", "unknown program 'mcst'; choose one of beam_search"),
    (b"program: dvts\nn: 2\nbeam_width: 4\n", "line 2", "DVTS needs N >= M (at least one subtree of M beams), got N=2 and M=4"),
])
def test_config_file_errors_name_the_file_and_line(tmp_path, content, where, message, capsys):
    """Every error of a --config file is one line: the file, the line yaml (or the bad key) is on,
    what is wrong; the same line from `sgl-tts run` on stderr."""
    conf = tmp_path / "run.yaml"
    conf.write_bytes(content)
    with pytest.raises(RunError) as err:
        RunConfig.from_sources(str(conf))
    head = f"config file {conf} {where}: " if where else f"config file {conf} "
    assert str(err.value).startswith(head + message), str(err.value)
    assert run_command.main(["--config", str(conf), "--output", str(tmp_path / "o.jsonl")]) == 1
    assert capsys.readouterr().err == f"sgl-tts run: error: {err.value}\n"


def test_a_config_flag_that_fixes_the_file_wins_and_a_flag_error_names_no_file(tmp_path):
    conf = tmp_path / "run.yaml"
    conf.write_text("program: dvts\nn: 2\nbeam_width: 4\n")
    assert RunConfig.from_sources(str(conf), {"n": 8}).n == 8
    with pytest.raises(RunError) as err:
        RunConfig.from_sources(str(conf), {"n": 2, "beam_width": 4})
    assert str(err.value) == "DVTS needs N >= M (at least one subtree of M beams), got N=2 and M=4"


def test_a_config_that_is_missing_or_a_directory_is_named(tmp_path):
    with pytest.raises(RunError, match="^config file .*nope.yaml not found; pass --config PATH"):
        RunConfig.from_sources(str(tmp_path / "nope.yaml"))
    with pytest.raises(RunError) as err:
        RunConfig.from_sources(str(tmp_path))
    assert str(err.value) == f"config file {tmp_path} is a directory; pass --config PATH to a YAML file " \
                             f"of RunConfig keys"


def test_settings_that_change_results_change_the_run_key(tmp_path):
    a = cfg_for(tmp_path)
    assert a.run_key() == cfg_for(tmp_path, in_flight=1, output="elsewhere.jsonl", plot="x.png").run_key()
    beam = cfg_for(tmp_path, program="beam_search")
    assert beam.run_key() != cfg_for(tmp_path, program="beam_search", semantics="search-and-learn").run_key()
    assert beam.run_key() != cfg_for(tmp_path, program="beam_search", filter_duplicates=True).run_key()
    # a setting added later stays out of the key at its default: runs written before it still resume
    fields = {k: v for k, v in dataclasses.asdict(beam).items() if k not in RunConfig.NOT_IN_RUN_KEY
              and k not in ("filter_duplicates", "semantics", "sort_completed", "speculative",
                            "overlap_verification", "overlap_by_family", "accept_threshold", "parallel", "c_puct", "threshold", "positive_exit",
                            "negative_exit", "futility", "first_step_cutoff", "resampling", "weight_temperature",
                            "particle_pick", "deepconf_mode", "keep_fraction", "confidence_window",
                            "confidence_top_k", "confidence_measure", "warmup_samples", "consensus",
                            "chunk_tokens")}
    fields["seeds"] = "depth-parent-ordinal"   # beam search's seed scheme since issue 18
    fields["prm_kind"] = "step_tag"   # prm_kind auto (issue 65) is keyed as the step_tag it was before
    assert beam.run_key() == hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    # exact speculation and overlapped verification never change a result: the same key
    assert beam.run_key() == cfg_for(tmp_path, program="beam_search", speculative="exact",
                                     overlap_verification=True).run_key()
    assert beam.run_key() == cfg_for(tmp_path, program="beam_search", overlap_verification=True,
                                     overlap_by_family=True).run_key()
    assert beam.run_key() == cfg_for(tmp_path, program="beam_search", speculative="exact-no-lookahead").run_key()
    assert beam.run_key() != cfg_for(tmp_path, program="beam_search", speculative="truncate").run_key()
    assert beam.run_key() == cfg_for(tmp_path, program="beam_search", prm_kind="step_tag").run_key()
    assert beam.run_key() != cfg_for(tmp_path, program="beam_search", prm_kind="reward_head").run_key()
    assert a.run_key() != cfg_for(tmp_path, n=4).run_key()
    assert a.run_key() != cfg_for(tmp_path, seed=1).run_key()


# -------------------------------------------------------------------------------------- dataset
@pytest.mark.parametrize("text, message", [
    ('{"question": "a"}\n{"answer": 3}\n', 'line 2: no "question" field; each line must be a JSON object'),
    ('{"question": "a"}\nnot json\n', "line 2: not valid JSON (Expecting value)"),
    ('["a"]\n', "line 1: expected a JSON object, got list"),
    ('{"question": ""}\n', 'line 1: "question" must be a non-empty string'),
    ("\n\n", "has no problems; each line must be a JSON object"),
])
def test_bad_datasets_give_one_clear_line(tmp_path, text, message, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    out = tmp_path / "out.jsonl"
    assert run_command.main(["--problems", str(path), "--output", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("sgl-tts run: error: ")
    assert message in err
    assert not out.exists()  # nothing was started


@pytest.mark.parametrize("content, where, message", [
    (b'{"question": "a"}\n{"question": "caf\xe9"}\n', "line 2", "not UTF-8 text (byte 0xe9 at column 18)"),
    (b'\xff\xfe{\x00"\x00', "line 1", "not UTF-8 text (byte 0xff at column 1)"),
    (b'{"question": "a"}\n{"question": "b"\n', "line 2", "not valid JSON (Expecting ',' delimiter)"),
    (b'{"question": "a"}\n\n3\n', "line 3", "expected a JSON object, got int"),
    (b'{"question": 7}\n', "line 1", '"question" must be a non-empty string'),
    (b'{"question": "a", "answer": ["1"]}\n', "line 1", '"answer" must be a string or a number, got list'),
    (b'{"question": "a", "answer": true}\n', "line 1", '"answer" must be a string or a number, got bool'),
    (b'{"question": "a", "id": {"n": 1}}\n', "line 1", '"id" must be a string or an integer, got dict'),
    (b"", "", "has no problems; each line must be a JSON object"),
])
def test_every_dataset_error_names_the_file_and_line(tmp_path, content, where, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(RunError) as err:
        read_problems(path)
    head = f"{path} {where}: " if where else f"{path} "
    assert str(err.value).startswith(head + message), str(err.value)
    assert "\n" not in str(err.value)


def test_a_dataset_with_a_bom_crlf_and_numbers_reads(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"question": "a", "answer": 3}\r\n{"question": "b", "answer": 0.5, "id": 9}\r\n'
                     b'{"question": "c", "answer": null, "id": null}\n')
    Problem = experiment.ProblemRecord
    assert read_problems(path) == [Problem(0, "0", "a", "3"), Problem(1, "9", "b", "0.5"), Problem(2, "2", "c", None)]


def test_a_dataset_that_is_a_directory_is_named(tmp_path, capsys):
    assert run_command.main(["--problems", str(tmp_path), "--output", str(tmp_path / "o.jsonl")]) == 1
    assert capsys.readouterr().err == f"sgl-tts run: error: problems file {tmp_path} is a directory; pass " \
        f"--problems PATH to a JSONL file (each line must be a JSON object {{\"question\": \"...\", \"answer\": " \
        f"\"...\" (optional)}})\n"


def test_an_output_file_that_is_not_utf8_or_a_directory_is_named(tmp_path):
    cfg = cfg_for(tmp_path)
    Path(cfg.output).write_bytes(b'{"index": 0}\n\xe9\n')
    with pytest.raises(RunError) as err:
        run(cfg, generator=ScriptedBackend(solution), prm=ScriptedPRM(PRM_TABLE, default=0.0))
    assert str(err.value).startswith(f"{cfg.output} line 2: not UTF-8 text (byte 0xe9 at column 1)")
    with pytest.raises(RunError) as err:
        run(cfg_for(tmp_path, output=str(tmp_path)), generator=ScriptedBackend(solution),
            prm=ScriptedPRM(PRM_TABLE, default=0.0))
    assert str(err.value).startswith(f"output file {tmp_path} is a directory; pass --output PATH")


def test_a_missing_dataset_names_the_flag(tmp_path, capsys):
    assert run_command.main(["--problems", str(tmp_path / "nope.jsonl")]) == 1
    assert "problems file " + str(tmp_path / "nope.jsonl") + " not found; pass --problems PATH" in \
        capsys.readouterr().err


def test_an_unreachable_generator_server_says_how_to_start_one(tmp_path, capsys):
    problems = dataset(tmp_path)
    assert run_command.main(["--problems", str(problems), "--output", str(tmp_path / "o.jsonl"),
                            "--generator", "http://127.0.0.1:9", "--prm", "none",
                            "--program", "self_consistency"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach an SGLang server at http://127.0.0.1:9" in err
    assert "python -m sglang.launch_server" in err


def test_a_prm_that_fails_is_caught_before_the_run(tmp_path):
    class BrokenPRM:
        def score(self, question, steps_batch):
            raise RuntimeError("CUDA out of memory")

    cfg = cfg_for(tmp_path, prm="http://prm-host:30001")
    with pytest.raises(RunError, match="the PRM \\(http://prm-host:30001\\) failed to score a test step: "
                                       "CUDA out of memory; check --prm, --prm-kind and that its server is up"):
        run(cfg, generator=ScriptedBackend(solution), prm=BrokenPRM())
    assert not Path(cfg.output).exists() or Path(cfg.output).read_text() == ""


def test_a_missing_prm_folder_is_named(tmp_path, capsys):
    problems = dataset(tmp_path)
    assert run_command.main(["--problems", str(problems), "--output", str(tmp_path / "o.jsonl"),
                            "--prm", str(tmp_path / "no-prm"), "--n", "2"]) == 1
    assert f"no model at {tmp_path / 'no-prm'}" in capsys.readouterr().err


# ------------------------------------------------------------------------------ output and resume
def test_each_problem_is_one_line_and_a_failure_keeps_the_rest(tmp_path):
    """A PRM that breaks on problem 3 stops the run with the problem named; every problem finished
    before is on disk, and the rerun (PRM fixed) does only the rest."""
    cfg = cfg_for(tmp_path, in_flight=1)

    class FlakyPRM(ScriptedPRM):
        broken = True

        def score(self, question, steps_batch):
            if self.broken and question == "Question 3?":
                raise RuntimeError("PRM server went away")
            return super().score(question, steps_batch)

    prm = FlakyPRM(PRM_TABLE, default=0.0)
    with pytest.raises(RunError, match="problem p3 \\(line 4\\) failed: RuntimeError: PRM server went away; "
                                       "4 of 6 problems are in .*out.jsonl; fix the cause and rerun"):
        run(cfg, generator=ScriptedBackend(solution), prm=prm)
    # p4 had started before p3's failure came back (one problem in flight): it finished and was kept
    assert [r["id"] for r in lines(cfg.output)] == ["p0", "p1", "p2", "p4"]
    prm.broken = False
    summary, records = run(cfg, generator=ScriptedBackend(solution), prm=prm)
    got = lines(cfg.output)
    assert sorted(r["index"] for r in got) == list(range(6))      # no duplicate, none lost
    assert [r["index"] for r in records] == list(range(6)) and summary.problems == 6


def test_a_torn_last_line_is_dropped_and_other_settings_are_refused(tmp_path, caplog):
    cfg = cfg_for(tmp_path, limit=2)
    run(cfg, generator=ScriptedBackend(solution), prm=ScriptedPRM(PRM_TABLE, default=0.0))
    with open(cfg.output, "a") as fh:
        fh.write('{"index": 2, "id": "p2", "quest')             # killed mid-write
    cfg = cfg_for(tmp_path)
    summary, _ = run(cfg, generator=ScriptedBackend(solution), prm=ScriptedPRM(PRM_TABLE, default=0.0))
    assert "dropping a torn last line" in caplog.text
    assert sorted(r["index"] for r in lines(cfg.output)) == list(range(6)) and summary.problems == 6
    with pytest.raises(RunError, match="holds results of different settings .* use another --output"):
        run(cfg_for(tmp_path, n=4), generator=ScriptedBackend(solution), prm=ScriptedPRM(PRM_TABLE, default=0.0))
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"question": f"Other {i}?"}) + "\n" for i in range(6)))
    with pytest.raises(RunError, match="is for a different problem set"):
        run(cfg_for(tmp_path, problems=str(other)), generator=ScriptedBackend(solution),
            prm=ScriptedPRM(PRM_TABLE, default=0.0))


# ------------------------------------------------------------------------------------- summary
def test_subsampled_accuracy_is_what_a_smaller_best_of_n_run_gives(tmp_path):
    cfg = cfg_for(tmp_path, n=8)
    backend = ScriptedBackend(solution)
    _, records = run(cfg, generator=backend, prm=ScriptedPRM(PRM_TABLE, default=0.0))
    for rec in records:
        for size in (1, 2, 4, 8):
            smaller = best_of_n.run(question=rec["question"], num_samples=size, prm=ScriptedPRM(PRM_TABLE, default=0.0),
                                    backend=backend).ret_value
            assert rec["subsampled"][str(size)] == smaller.answers, (rec["id"], size)


def test_summary_numbers_from_records():
    def traj(answer, tokens, seconds):
        return {"steps": [], "step_scores": [], "score": 0.5, "answer": answer, "tokens": tokens,
                "finished": True, "seconds": seconds}

    records = [
        {"reference": "1", "answers": {"majority": "1", "prm_weighted": "2", "prm_best": "1"},
         "correct": {"majority": True, "prm_weighted": False, "prm_best": True}, "pass": True,
         "subsampled": {"1": {"majority": "2", "prm_weighted": "2", "prm_best": "1"},
                        "2": {"majority": "1", "prm_weighted": "2", "prm_best": "1"}},
         "trajectories": [traj("1", 10, 1.0), traj("2", 30, 3.0)], "seconds": 3.5,
         "tokens_generated": 50, "tokens_kept": 40},
        {"reference": "5", "answers": {"majority": "4", "prm_weighted": "5", "prm_best": "4"},
         "correct": {"majority": False, "prm_weighted": True, "prm_best": False}, "pass": True,
         "subsampled": {"1": {"majority": "4", "prm_weighted": "4", "prm_best": "4"},
                        "2": {"majority": "4", "prm_weighted": "5", "prm_best": "4"}},
         "trajectories": [traj("4", 20, 2.0), traj("5", 20, 2.0)], "seconds": 1.5,
         "tokens_generated": 40, "tokens_kept": 40},
        {"reference": None, "answers": {"majority": "7", "prm_weighted": "7", "prm_best": "7"},
         "subsampled": {"1": {"majority": "7", "prm_weighted": "7", "prm_best": "7"},
                        "2": {"majority": "7", "prm_weighted": "7", "prm_best": "7"}},
         "trajectories": [traj("7", 40, 4.0)], "seconds": 4.5, "tokens_generated": 40, "tokens_kept": 40},
    ]
    s = summarize(records, n=2)
    assert (s.problems, s.graded, s.pass_at_n) == (3, 2, 1.0)
    assert s.accuracy == {"majority": 0.5, "prm_weighted": 0.5, "prm_best": 0.5}
    assert s.accuracy_at == {"1": {"majority": 0.0, "prm_weighted": 0.0, "prm_best": 0.5},
                             "2": {"majority": 0.5, "prm_weighted": 0.5, "prm_best": 0.5}}
    # precise goodput: mean tokens per trajectory (24) / mean trajectory completion time (2.4 s)
    assert s.mean_tokens_per_trajectory == 24 and s.mean_trajectory_seconds == pytest.approx(2.4)
    assert s.goodput_tokens_per_s == pytest.approx(10.0)
    assert s.latency_seconds == {"mean": pytest.approx(19 / 6), "p50": 3.5, "p90": pytest.approx(4.3),
                                 "max": 4.5}
    assert (s.tokens_generated, s.tokens_kept) == (130, 120)
    assert experiment.subsample_sizes(12) == [1, 2, 4, 8, 12] and experiment.subsample_sizes(1) == [1]
    assert "N < 2: the first trajectories" not in s.table()
    assert "N < 2: the first trajectories of the N=2 tree search" in summarize(records, 2, "dvts").table()


# --------------------------------------------------------------------------- tiny models, CPU
class TinyRuns:
    """``sgl-tts run`` (its ``main``, in this process) on the first three test problems with the
    shipped tiny models, N=4, M=2: each program's plain run is made once per module, checked by the
    end-to-end test and compared with by the exact speculation test."""

    def __init__(self, work: Path):
        from sgl_tts.tiny import task

        self.work = work
        self.problems = work / "problems.jsonl"
        task.write_jsonl(task.test_split()[:3], self.problems)
        self._plain: dict[str, tuple[list[str], dict, Path, Path]] = {}

    def argv(self, program: str, out: Path, *extra: str) -> list[str]:
        return ["--problems", str(self.problems), "--output", str(out), "--program", program, "--n", "4",
                "--beam-width", "2", "--no-progress", "--json", *extra]

    def plain(self, program: str, capsys) -> tuple[list[str], dict, Path, Path]:
        """The plain run of ``program`` with a plot: its argv, its ``--json`` report, output and plot."""
        if program not in self._plain:
            out, plot = self.work / f"{program}.jsonl", self.work / f"{program}.png"
            argv = self.argv(program, out, "--plot", str(plot))
            assert run_command.main(argv) == 0
            self._plain[program] = (argv, json.loads(capsys.readouterr().out), out, plot)
        return self._plain[program]


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory) -> TinyRuns:
    return TinyRuns(tmp_path_factory.mktemp("tiny-runs"))


@pytest.mark.parametrize("program", ["best_of_n", "self_consistency", "beam_search", "dvts"])
def test_every_program_runs_end_to_end_on_the_tiny_models(tiny_runs, program, capsys):
    argv, info, out, plot = tiny_runs.plain(program, capsys)
    recs = lines(out)
    assert sorted(r["index"] for r in recs) == [0, 1, 2]
    assert all(r["trajectories"] and r["tokens_generated"] > 0 for r in recs)
    s = info["summary"]
    rules = ["majority"] if program == "self_consistency" else ["majority", "prm_weighted", "prm_best"]
    assert list(s["accuracy"]) == rules
    for rule in rules:
        assert s["accuracy"][rule] == sum(r["correct"][rule] for r in recs) / 3
        assert s["accuracy_at"]["4"][rule] == s["accuracy"][rule]
    assert s["accuracy"]["majority"] >= 2 / 3  # the tiny generator solves these with 4 samples
    assert plot.stat().st_size > 10_000 and Path(info["plot"]) == plot
    assert json.loads(out.with_suffix(".summary.json").read_text())["summary"] == s
    # Rerun: everything is done already; nothing is added.
    assert run_command.main(argv) == 0
    assert len(lines(out)) == 3


@pytest.mark.parametrize("program", ["beam_search", "dvts"])
def test_exact_speculation_on_the_tiny_models_returns_the_plain_runs_trajectories(tiny_runs, program, capsys):
    """LocalBackend (priority admission: speculative requests after normal ones), the real tiny
    generator and PRM: the same seeds give the same samples, so exact speculation with LookAhead and
    overlapped verification returns every trajectory of the plain run (the end-to-end test's), and
    reports its tokens."""
    _, plain_info, plain_out, _ = tiny_runs.plain(program, capsys)
    out = tiny_runs.work / f"{program}-spec.jsonl"
    assert run_command.main(tiny_runs.argv(program, out, "--speculative", "exact", "--overlap-verification")) == 0
    plain_s, plain = plain_info["summary"], lines(plain_out)
    spec_s, spec = json.loads(capsys.readouterr().out)["summary"], lines(out)
    assert sorted(r["index"] for r in spec) == sorted(r["index"] for r in plain) == [0, 1, 2]
    for a, b in zip(sorted(plain, key=lambda r: r["index"]), sorted(spec, key=lambda r: r["index"])):
        assert [(t["steps"], t["step_scores"], t["tokens"]) for t in a["trajectories"]] == \
               [(t["steps"], t["step_scores"], t["tokens"]) for t in b["trajectories"]]
        assert a["answers"] == b["answers"] and a["run_key"] == b["run_key"]
        assert b["tokens_generated"] - b["tokens_speculative"] + b["tokens_reused"] == a["tokens_generated"]
    assert spec_s["tokens_speculative"] > 0 and spec_s["tokens_reused"] > 0 and plain_s["tokens_speculative"] == 0


def sgl_tts_run_command(*args) -> list[str]:
    """`sgl-tts run ARGS` as a subprocess command (run it with :func:`cli_env`)."""
    return [sys.executable, "-m", "sgl_tts.cli", "run", *map(str, args)]


def cli_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))


JSONL_FIX = 'each line must be a JSON object {"question": "...", "answer": "..." (optional)}'


@pytest.mark.parametrize("content, message", [
    (b'{"question": "a"}\n{"question": "caf\xe9"}\n',
     "not UTF-8 text (byte 0xe9 at column 18); save the file as UTF-8"),
    (b'{"question": "a"}\n{"question": "b"\n', f"not valid JSON (Expecting ',' delimiter); {JSONL_FIX}"),
])
def test_a_bad_dataset_is_one_line_on_stderr_of_the_command(tmp_path, content, message):
    """The real `sgl-tts run` process: its whole stderr is the one error line (file and line number),
    no warning or traceback after it, exit status 1, before any model loads."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    out = tmp_path / "out.jsonl"
    done = subprocess.run(sgl_tts_run_command("--problems", path, "--output", out), env=cli_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert done.stderr == f"sgl-tts run: error: {path} line 2: {message}\n"
    assert not out.exists()


def test_a_killed_run_resumes_without_duplicates_or_losses(tmp_path):
    """A real `sgl-tts run` process on the tiny models is killed (SIGKILL) once some problems are
    written; the same command line (its config and driver, in this process) then finishes the rest:
    every problem exactly once, each line the same as an uninterrupted run's."""
    from sgl_tts.tiny import task
    problems = tmp_path / "problems.jsonl"
    total = 4
    task.write_jsonl(task.test_split()[:total], problems)
    out = tmp_path / "out.jsonl"

    def arguments(output):
        return ["--problems", str(problems), "--output", str(output), "--program", "best_of_n", "--n", "4",
                "--in-flight", "1", "--no-progress"]

    def run_here(output) -> str:
        """The command line's run in this process; what it printed."""
        printed = io.StringIO()
        run(run_command.config_from_args(run_command.build_parser().parse_args(arguments(output))), stream=printed)
        return printed.getvalue()

    proc = subprocess.Popen(sgl_tts_run_command(*arguments(out)), env=cli_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = len(lines(out))
    assert 2 <= before < total, before
    assert f"resuming {out}: {before} of {total} problems already done" in run_here(out)
    resumed = lines(out)
    assert sorted(r["index"] for r in resumed) == list(range(total))
    straight = tmp_path / "straight.jsonl"
    run_here(straight)
    key = lambda r: (r["index"], r["answers"], [t["steps"] for t in r["trajectories"]])  # noqa: E731
    assert sorted(map(key, resumed)) == sorted(map(key, lines(straight)))


def test_mcts_runs_on_the_tiny_models_deterministically_and_reports_its_exits(tmp_path, capsys):
    """`sgl-tts run --program mcts` on the embedded tiny models (LocalBackend): serial MCTS with both
    early exits; every problem records why its search stopped, the summary counts them, and a second
    run of the same settings writes the same trees' trajectories (position-keyed seeds). The first
    run lays its engines out as the default 8 in flight do (processes: a generator engine per core,
    the PRM's); the second keeps 3 in flight, on engines in threads of this process (what is in
    flight and where the engines run are not in the run key: neither may change a tree)."""
    from sgl_tts.tiny import task
    assert RunConfig(program="mcts").engine_layout.engine_in == "process"
    assert RunConfig(program="mcts", in_flight=3).engine_layout.engine_in == "thread"
    problems = tmp_path / "problems.jsonl"
    task.write_jsonl(task.test_split()[:3], problems)
    runs = []
    for name, in_flight in (("a", []), ("b", ["--in-flight", "3"])):
        out = tmp_path / f"{name}.jsonl"
        assert run_command.main(["--problems", str(problems), "--output", str(out), "--program", "mcts",
                                "--n", "6", "--beam-width", "3", "--max-depth", "8", "--aggregation", "min",
                                "--negative-exit", "--threshold", "0.8", "--no-progress", "--json", *in_flight]) == 0
        summary = json.loads(capsys.readouterr().out)["summary"]
        runs.append((summary, sorted(lines(out), key=lambda r: r["index"])))
    (summary, first), (_, second) = runs
    assert all(r["exit_reason"] in ("accepted", "futile", "budget", "exhausted") for r in first)
    assert summary["exits"] == dict(collections.Counter(r["exit_reason"] for r in first))
    assert [(r["exit_reason"], r["answers"], [t["steps"] for t in r["trajectories"]], r["tokens_generated"])
            for r in first] == \
           [(r["exit_reason"], r["answers"], [t["steps"] for t in r["trajectories"]], r["tokens_generated"])
            for r in second]
    assert all(r["trajectories"] and r["tokens_generated"] > 0 for r in first)
