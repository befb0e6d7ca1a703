"""The installed project: pins, the console script and the README's main command."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

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


def test_readme_main_command_runs_a_program_and_prints_its_result(tmp_path):
    exe = shutil.which("sgl-tts")
    assert exe is not None, "the sgl-tts console script is not installed"
    env = dict(os.environ, SGL_TTS_CACHE=str(tmp_path))
    out = subprocess.run([exe, "demo", "--json", "--runtime", "cpu", "--width", "4", "--step-tokens", "8"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["backend"] == "LocalBackend"
    from sgl_tts.models import default_model_path

    assert result["model"] == str(default_model_path())  # the shipped tiny generator
    assert len(result["steps"]) == 4
    assert all(1 <= s["completion_tokens"] <= 8 for s in result["steps"])
    # 8 tokens of the trained generator's first step: "Step 1: 3+4=7" begins "Step 1: 3+"
    assert all(s["text"].startswith("Step 1: ") for s in result["steps"])
    assert result["tokens"] == sum(s["completion_tokens"] for s in result["steps"])
    assert result["answer"] in ("yes", "no")
    # The table form prints the same program's result.
    table = subprocess.run([exe, "demo", "--runtime", "cpu", "--width", "2", "--step-tokens", "4"], capture_output=True,
                           text=True, env=env, timeout=300)
    assert table.returncode == 0, table.stderr
    assert "selected answer:" in table.stdout and "branch  tokens" in table.stdout


def test_demo_reports_bad_input_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sgl_tts.cli", "demo", "--target", str(tmp_path / "x"),
                          "--runtime", "cpu"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"sgl-tts: error: no model at {tmp_path / 'x'}: expected a Hugging Face model folder")


def test_cli_dispatches_training_and_quality_commands(capsys):
    import pytest

    from sgl_tts.cli import main

    for command, flag in (("train-tiny", "--generator-steps"), ("quality", "--generator")):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0
        assert flag in capsys.readouterr().out
