"""The installed project: pins, the console script and the README's main command."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import sglang
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_pins_are_the_ones_installed_and_the_lock_covers_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["dev"]
    lock = [line.strip() for line in (ROOT / "requirements/lock.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert {_name(d) for d in deps} <= {_name(x) for x in lock}
    for pin in ("sglang==0.5.15", "torch==2.11.0", "transformers==5.12.1"):
        assert pin in project["dependencies"] and pin in lock
    assert sglang.__version__ == "0.5.15"
    assert torch.__version__.split("+")[0] == "2.11.0"
    assert transformers.__version__ == "5.12.1"


def test_the_environment_leaves_out_what_every_sglang_process_would_pay_for():
    # dev.sh's PRUNE: jsonschema (what pulls it in) works without it, and an SGLang import no longer
    # builds its grammar
    import importlib.util

    import jsonschema

    assert importlib.util.find_spec("rfc3987_syntax") is None
    assert "iri" not in jsonschema.FormatChecker().checkers
    jsonschema.validate({"a": 1}, {"type": "object"}, format_checker=jsonschema.FormatChecker())


_FAKE_PYTHON = """#!/usr/bin/env bash
# a stand-in interpreter for dev.sh's build: `-m venv DIR` makes a venv whose python logs pip calls
if [[ "${1:-}" == -m && "${2:-}" == venv ]]; then
  mkdir -p "$3/bin" "$3/lib/python3.11/site-packages"
  cp "$FAKE_VENV_PYTHON" "$3/bin/python"
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""

_FAKE_VENV_PYTHON = """#!/usr/bin/env bash
site="$(dirname "$0")/../lib/python3.11/site-packages"
if [[ "${1:-}" == -c ]]; then
  [[ -f "$site/../../../.sgl_tts_installed" ]]; exit $?
fi
echo "$*" >> "$DEV_SH_LOG"
case "$*" in
  *"-r "*) mkdir -p "$site/rfc3987_syntax-1.1.0.dist-info" "$site/jsonschema-4.0.dist-info" ;;
  *"uninstall -q -y rfc3987-syntax"*) rm -rf "$site"/rfc3987_syntax-*.dist-info ;;
  *"-e "*) touch "$site/../../../.sgl_tts_installed" ;;
esac
"""


def test_dev_sh_builds_prunes_and_runs_on_a_fresh_machine(tmp_path):
    # A first run builds the environment, prunes it, installs the clone and runs the command, and
    # ends (a fresh machine's first ./dev.sh demo once hung after "environment ready": the prune
    # waited on the build's own lock). pip is a stand-in here; what dev.sh does around it is real.
    fake, venv_python, log = tmp_path / "python3", tmp_path / "venv-python", tmp_path / "pip.log"
    fake.write_text(_FAKE_PYTHON)
    venv_python.write_text(_FAKE_VENV_PYTHON)
    fake.chmod(0o755)
    venv_python.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), REAL_PYTHON=sys.executable, FAKE_VENV_PYTHON=str(venv_python),
               DEV_SH_LOG=str(log), SGLANG_TTS_CACHE=str(tmp_path / "cache"))

    def dev_sh(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(ROOT / "dev.sh"), *args], capture_output=True, text=True, env=env, timeout=60)

    out = dev_sh("run", "echo", "ran")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ran\n" and "environment ready" in out.stderr
    calls = log.read_text().splitlines()
    assert [c.split()[2] for c in calls] == ["install", "install", "uninstall", "install"]
    assert "-r" in calls[1] and calls[2].endswith("rfc3987-syntax") and "-e" in calls[3]
    venv, = (tmp_path / "cache").glob("venv-*")
    site = venv / "lib/python3.11/site-packages"
    assert (venv / ".complete").exists() and sorted(p.name for p in site.iterdir()) == ["jsonschema-4.0.dist-info"]
    # the second run builds nothing; an environment built before the prune list is pruned once
    (site / "rfc3987_syntax-1.0.dist-info").mkdir()
    again = dev_sh("run", "echo", "again")
    assert again.returncode == 0 and again.stdout == "again\n", again.stderr
    assert "building" not in again.stderr
    assert log.read_text().splitlines()[len(calls):] == ["-m pip uninstall -q -y rfc3987-syntax"]
    assert not list(site.glob("rfc3987_syntax-*"))


def test_readme_main_command_compares_the_methods(tmp_path):
    exe = shutil.which("sgl-tts")
    assert exe is not None, "the sgl-tts console script is not installed"
    env = dict(os.environ, SGLANG_TTS_CACHE=str(tmp_path))
    out = subprocess.run([exe, "demo", "--json", "--problems", "3", "--ns", "1,4", "--no-plot"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    from sgl_tts.models import shipped_model

    assert result["generator"] == str(shipped_model("generator"))
    assert result["prm"] == str(shipped_model("prm"))
    assert result["problems"] == 3 and result["plot"] is None
    rows = result["rows"]
    assert [(r["method"], r["n"]) for r in rows] == [
        ("single sample", 1), ("majority vote", 4), ("PRM best-of-N", 4), ("PRM-weighted vote", 4),
        ("PRM beam search", 4), ("PRM particle filtering", 4), ("DeepConf online", 4)]
    for r in rows:
        assert r["accuracy"] * 3 == pytest.approx(round(r["accuracy"] * 3))  # k of 3 problems
        assert r["tokens_per_problem"] > 10 and r["seconds"] > 0
    assert rows[0]["tokens_per_problem"] * 3 < rows[1]["tokens_per_problem"]  # 4 samples vs 1
    d = result["details"]
    assert d["samples"] == 4
    assert d["pass@4"] >= max(r["accuracy"] for r in rows[1:4])
    assert 0.0 <= d["prm_step_auc"] <= 1.0 and d["prm_steps_graded"] > 12


def test_demo_prints_the_comparison_as_a_table_and_saves_the_plot(tmp_path, monkeypatch, capsys):
    """The table form of the command above: its ``main`` in this process (the console script and
    the JSON form are the test above's), on one problem."""
    from sgl_tts.cli import main

    monkeypatch.setenv("SGLANG_TTS_CACHE", str(tmp_path))
    plot = tmp_path / "demo.png"
    assert main(["demo", "--problems", "1", "--ns", "1,4", "--plot", str(plot)]) == 0
    table = capsys.readouterr().out
    assert "| method | N | accuracy | vs single | tokens/problem | seconds |" in table
    assert "| PRM beam search | 4 |" in table and "| PRM particle filtering | 4 |" in table
    assert "| DeepConf online | 4 |" in table and "DeepConf offline" not in table
    assert f"plot: {plot}" in table
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--target", "{tmp}/x"], "sgl-tts: error: no model at {tmp}/x: expected a Hugging Face model folder"),
    (["--ns", "4,16"], "sgl-tts: error: N values must be positive and include 1"),
    (["--ns", "1,a"], "sgl-tts: error: --ns takes comma-separated integers, got '1,a'"),
    (["--problems", "0"], "sgl-tts: error: --problems must be at least 1"),
    (["--cpu-replicas", "0"], "sgl-tts: error: cpu replicas must be at least 1, got 0"),
    (["--cpu-engine", "thread", "--cpu-replicas", "2"],
     "sgl-tts: error: 2 cpu replicas need engines in processes, and this layout has threads (cpu engine 'thread')"),
])
def test_demo_reports_bad_input_in_one_line(tmp_path, args, message, capsys):
    """The command's ``main`` in this process (what ``sgl-tts demo`` runs: its exit status is what
    main returns)."""
    from sgl_tts.cli import main

    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["demo", *args]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(message.replace("{tmp}", str(tmp_path)))


def test_the_sgl_tts_process_exits_with_its_commands_status_and_a_frozen_heap(tmp_path):
    """``entry`` (the console script and ``python -m sgl_tts.cli``) exits with what the command
    returned, its heap frozen by the time exit handlers run; ``main`` in a process that goes on
    leaves the collector alone."""
    import gc

    from sgl_tts.cli import main

    probe = ("import atexit, gc, sys; atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0)); "
             "sys.argv = ['sgl-tts', *sys.argv[1:]]; from sgl_tts.cli import entry; entry()")
    for args, code in ((["info"], 0), (["run", "--problems", str(tmp_path / "none.jsonl")], 1)):
        done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == code, done.stderr
        assert done.stdout.rstrip().endswith("frozen True"), done.stdout[-300:]
    before = gc.get_freeze_count()
    assert main(["run", "--problems", str(tmp_path / "none.jsonl")]) == 1
    assert gc.get_freeze_count() == before


def test_cli_dispatches_training_and_quality_commands(capsys):
    import pytest

    from sgl_tts.cli import main

    for command, flag in (("train-tiny", "--generator-steps"), ("quality", "--generator"),
                          ("run", "--beam-width")):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        assert flag in capsys.readouterr().out


def test_no_module_over_700_lines_and_no_function_over_80():
    """Issue 31's size rule, for the library, the programs and the benchmark scripts: a module that
    grows past 700 lines or a function past 80 has taken on a second job and is split by job."""
    import ast

    modules, functions = [], []
    for folder in ("sgl_tts", "programs", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            name = str(path.relative_to(ROOT))
            if len(text.splitlines()) > 700:
                modules.append((name, len(text.splitlines())))
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = node.end_lineno - node.lineno + 1
                    if length > 80:
                        functions.append((f"{name}:{node.lineno} {node.name}", length))
    assert modules == [] and functions == []


def test_failures_at_once_prints_a_failures_traceback_before_the_next_test_runs(tmp_path):
    """The GPU lease's tests phase sets SGLANG_TTS_FAILURES_AT_ONCE: a failure's reason must be out
    before the next test starts, since the lease's cap may end pytest before its summary."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_logreport  # noqa: F401\n")
    (tmp_path / "test_two.py").write_text(
        "def test_fails():\n    assert 2 + 2 == 5, 'the reason'\n\n\n"
        "def test_next():\n    print('NEXT RUNS', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    env.pop("SGLANG_TTS_FAILURES_AT_ONCE", None)

    def pytest_run(extra: dict[str, str]) -> str:
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "-v", str(tmp_path)],
                              capture_output=True, text=True, env={**env, **extra}, cwd=tmp_path, timeout=300).stdout

    # with the variable and without it, both runs at once (each imports the conftest's torch)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        out, plain = pool.map(pytest_run, [{"SGLANG_TTS_FAILURES_AT_ONCE": "1"}, {}])
    early = out.index("---- test_two.py::test_fails failed (call) ----")
    assert early < out.index("the reason") < out.index("---- end of test_two.py::test_fails ----") \
        < out.index("NEXT RUNS") < out.index("= FAILURES =")
    # without the variable, the reason waits for the summary, as pytest has it
    assert "---- test_two.py::test_fails" not in plain and plain.index("NEXT RUNS") < plain.index("the reason")
