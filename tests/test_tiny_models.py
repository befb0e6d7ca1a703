"""The shipped tiny generator and PRM: plain transformers loading, size, tokenizer, step format, and
the generator's behaviour search relies on (right greedily, slips when sampled). The PRM's step
preference is tested in tests/test_programs.py."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

import sgl_tts
from sgl_tts.tiny import task
from sgl_tts.models import default_model_path, shipped_model
from sgl_tts.tiny.training import sample_solutions


@pytest.fixture(scope="module")
def generator_path():
    path = shipped_model("generator")
    assert path is not None, "the trained generator must ship in sgl_tts/models/data/generator"
    return path


@pytest.fixture(scope="module")
def prm_path():
    path = shipped_model("prm")
    assert path is not None, "the trained PRM must ship in sgl_tts/models/data/prm"
    return path


def test_shipped_folders_load_with_plain_transformers_and_stay_small(generator_path, prm_path):
    for path in (generator_path, shipped_model("expert"), prm_path):
        model = AutoModelForCausalLM.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
        assert type(model).__name__ == "Qwen2ForCausalLM"
        assert model.config.head_dim == 64
        assert (path / "model.safetensors").stat().st_size <= 10_000_000
        text = task.prompt(task.test_split()[0].question) + task.test_split()[0].solution()
        assert tok.decode(tok.encode(text)) == text
    assert default_model_path() == generator_path


def test_generator_writes_the_step_format(generator_path):
    problems = task.test_split()[:8]
    be = sgl_tts.LocalBackend(generator_path)
    try:
        texts = sample_solutions(be, problems, 1, temperature=0.0, seed=0)
    finally:
        be.shutdown()
    for p, (text,) in zip(problems, texts):
        g = task.grade(p, text)
        assert g.steps[0].startswith("Step 1: ")
        assert g.answer is not None and len(g.steps) == len(p.ops) + 1
    assert sum(task.grade(p, t).answer_ok for p, (t,) in zip(problems, texts)) >= 6


def test_generator_is_right_greedily_and_slips_when_sampled(generator_path):
    """What test-time scaling needs: the right answer is the mode, sampling at T=0.8 slips."""
    problems = task.test_split()[:24]
    be = sgl_tts.LocalBackend(generator_path)
    try:
        greedy = sample_solutions(be, problems, 1, temperature=0.0, seed=0)
        sampled = sample_solutions(be, problems, 4, temperature=0.8, seed=0)
    finally:
        be.shutdown()
    greedy_acc = sum(task.grade(p, t).answer_ok for p, (t,) in zip(problems, greedy)) / len(problems)
    sampled_acc = sum(task.grade(p, t).answer_ok for p, ts in zip(problems, sampled) for t in ts) / 96
    assert greedy_acc >= 0.9
    assert 0.2 <= sampled_acc <= 0.65
