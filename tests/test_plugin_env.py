"""The plugin's environment variables pass SGLang's environment handling silently: SGLang 0.5.15
rewrites every ``SGL_*`` variable to ``SGLANG_*`` with a deprecation warning in each process that
imports ``sglang.srt.environ`` (``_convert_SGL_to_SGLANG``), so the plugin's names are
``SGLANG_TTS_*``."""

from __future__ import annotations

import os
import re
import subprocess
import warnings
from pathlib import Path

import pytest
from sglang.srt import environ as sglang_environ

from sgl_tts.plugin.settings import TTSSettings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bare_env():
    """An environment holding only what a test puts there; the real one back afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    yield os.environ
    os.environ.clear()
    os.environ.update(saved)


def sglang_rewrite() -> list[str]:
    """Run SGLang's own start-of-process rewrite; the warnings it gives."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sglang_environ._convert_SGL_to_SGLANG()
    return [str(w.message) for w in caught]


def test_sglang_rewrites_no_variable_the_plugin_sets(bare_env):
    settings = TTSSettings("prefix-aware", 8, "/tmp/tts-metrics", True)
    bare_env.update(settings.env())
    assert all(name.startswith("SGLANG_TTS_") for name in settings.env())
    before = dict(bare_env)
    assert sglang_rewrite() == []
    assert dict(bare_env) == before        # nothing renamed or added
    assert TTSSettings.from_env() == settings


def test_the_flags_mirror_themselves_under_the_new_names(bare_env):
    from sgl_tts.plugin.settings import add_arguments, apply

    import argparse
    from types import SimpleNamespace

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--tts-policy", "prefix-aware", "--tts-dedup-tokens", "8",
                              "--tts-metrics-file", "/tmp/m", "--tts-seeded-sampling"])
    apply(SimpleNamespace(sampling_backend="pytorch"), args)
    assert bare_env["SGLANG_TTS_POLICY"] == "prefix-aware" and bare_env["SGLANG_TTS_DEDUP_TOKENS"] == "8"
    assert bare_env["SGLANG_TTS_METRICS_FILE"] == "/tmp/m" and bare_env["SGLANG_TTS_SEEDED_SAMPLING"] == "1"
    assert not [k for k in bare_env if k.startswith("SGL_")]
    assert sglang_rewrite() == []
    # and the flag defaults read them back (how an in-process Engine or a child gets them)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    again = parser.parse_args([])
    assert (again.tts_policy, again.tts_dedup_tokens, again.tts_metrics_file, again.tts_seeded_sampling) == \
        ("prefix-aware", 8, "/tmp/m", True)


def test_the_old_names_still_work_in_sglang_processes_with_sglangs_warning(bare_env):
    bare_env.update({"SGL_TTS_POLICY": "prefix-aware", "SGL_TTS_DEDUP_TOKENS": "8"})
    messages = sglang_rewrite()
    assert any("SGL_TTS_POLICY is deprecated, please use SGLANG_TTS_POLICY" in m for m in messages)
    assert TTSSettings.from_env() == TTSSettings("prefix-aware", 8)


def test_no_sgl_prefixed_variable_in_the_projects_code():
    """Code, scripts and notebooks name no ``SGL_*`` variable (SGLang would rewrite it, with a
    warning, wherever it is in a server's environment)."""
    files = subprocess.run(["git", "ls-files", "*.py", "*.sh", "*.ipynb", "*.toml", "*.cfg", "*.ini",
                            "*.yaml", "*.yml"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files.append("dev.sh")
    here = Path(__file__).resolve()
    pattern = re.compile(r"\bSGL_[A-Z0-9_]*[A-Z0-9]")
    found = []
    for name in files:
        path = ROOT / name
        if path.resolve() == here or not path.is_file():
            continue
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                found.append(f"{name}:{lineno}: {line.strip()}")
    assert found == []
