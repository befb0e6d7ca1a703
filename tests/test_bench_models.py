"""Random-weight model folders for the benchmark: real configs and tokenizers padded to exactly their
vocabulary, so every id a random model samples detokenizes."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoTokenizer

from sgl_tts.bench.dummy_models import (CONFIGS, WORD_SPECIALS, padding_merges, tokenizer_dir, write_dummy_model,
                                        write_padded_tokenizer, write_word_tokenizer)


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


def test_any_ids_survive_a_word_tokenizer_decode_and_encode(tmp_path):
    assert write_word_tokenizer(tmp_path, 1000) == 1000
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = [(i * 7919) % 1000 for i in range(300)]
    assert tok.encode(tok.decode(ids)) == ids
    assert tok.convert_ids_to_tokens([996, 997, 998, 999]) == list(WORD_SPECIALS)
    assert tok.encode("t5 t6\n\nt7 ки") == [5, 6, 7, 999]   # the delimiter is whitespace; the tag a word
    with pytest.raises(ValueError, match="vocab_size must be more than 4"):
        write_word_tokenizer(tmp_path / "x", 4)


@pytest.mark.parametrize("tokenizer", ["words", "bytes"])
@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS.glob("*.json")))
def test_every_benchmark_config_becomes_a_servable_folder(tmp_path, name, tokenizer):
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    folder = write_dummy_model(name, tmp_path / name, tokenizer=tokenizer)
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    assert AutoConfig.from_pretrained(folder).vocab_size == cfg["vocab_size"]
    # loaded the way an SGLang server loads it (--tokenizer-path for the word tokenizer's folder)
    tok = get_tokenizer(str(tokenizer_dir(folder)))
    assert (tokenizer_dir(folder) != folder) == (tokenizer == "words")
    assert len(tok) == cfg["vocab_size"]
    assert tok.convert_ids_to_tokens(cfg["vocab_size"] - 1) is not None
    if tokenizer == "words":
        ids = [(i * 104729) % cfg["vocab_size"] for i in range(200)]
        assert tok.encode(tok.decode(ids)) == ids


def test_an_unknown_config_lists_the_known_ones(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config 'gpt-5'; pass a config.json or one of: "
                                                "math-shepherd-mistral-7b, qwen2.5-7b"):
        write_dummy_model("gpt-5", tmp_path)
