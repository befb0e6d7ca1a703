"""The shipped tiny generator: plain transformers loading, size, tokenizer, step format.
(The PRM ships with the rest of the tiny-models issue; its tests come with it.)"""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

import sgl_tts
from sgl_tts import task
from sgl_tts.models import default_model_path, shipped_model
from sgl_tts.training import sample_solutions


@pytest.fixture(scope="module")
def generator_path():
    path = shipped_model("generator")
    assert path is not None, "the trained generator must ship in sgl_tts/models/data/generator"
    return path


def test_shipped_folder_loads_with_plain_transformers_and_stays_small(generator_path):
    for path in (generator_path,):
        model = AutoModelForCausalLM.from_pretrained(path)
        tok = AutoTokenizer.from_pretrained(path)
        assert type(model).__name__ == "Qwen2ForCausalLM"
        assert model.config.head_dim == 64
        assert (path / "model.safetensors").stat().st_size <= 10 * 1024 * 1024
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
