"""Random-weight model folders for the benchmark: real configs and tokenizers padded to exactly their
vocabulary, so every id a random model samples detokenizes."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoTokenizer

from sgl_tts.bench.dummy_models import CONFIGS, padding_merges, write_dummy_model, write_padded_tokenizer


def test_a_padded_tokenizer_has_exactly_the_vocabulary_and_every_id_decodes(tmp_path):
    assert write_padded_tokenizer(tmp_path, 1000) == 1000
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 1000
    assert all(tok.convert_ids_to_tokens(i) is not None for i in range(1000))
    text = "Compute ((3+4)*5)-6.\n\nStep 1: 3+4=7"
    assert tok.decode(tok.encode(text)) == text
    assert len(set(a + b for a, b in padding_merges(70_000))) == 70_000   # every merge a new token
    with pytest.raises(ValueError, match="vocab_size must be at least 259"):
        write_padded_tokenizer(tmp_path / "x", 10)


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS.glob("*.json")))
def test_every_benchmark_config_becomes_a_servable_folder(tmp_path, name):
    folder = write_dummy_model(name, tmp_path / name)
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    assert AutoConfig.from_pretrained(folder).vocab_size == cfg["vocab_size"]
    tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == cfg["vocab_size"]
    assert tok.convert_ids_to_tokens(cfg["vocab_size"] - 1) is not None


def test_an_unknown_config_lists_the_known_ones(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config 'gpt-5'; pass a config.json or one of: "
                                                "math-shepherd-mistral-7b, qwen2.5-7b"):
        write_dummy_model("gpt-5", tmp_path)
