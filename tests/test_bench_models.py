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


@pytest.mark.parametrize("name, arch, fmt", [("qwen2.5-math-prm-7b", "Qwen2ForProcessRewardModel", "qwen2.5-math-prm"),
                                             ("skywork-prm-1.5b", "Qwen2ForPrmModel", "skywork-prm")])
def test_the_benchmarks_prm_configs_are_the_real_architectures_and_pool_at_the_real_ids(tmp_path, name, arch, fmt):
    """Served with random weights and the word tokenizer apart, the plugin's class reads no tokenizer
    beside the config and pools at the real checkpoint's step-token id, the one the benchmark's
    verifier closes each step with."""
    from sgl_tts.bench.goodput_trace import WordStepPooledFormat
    from sgl_tts.plugin.models import ARCHITECTURES
    from sgl_tts.plugin.models.qwen2_prm import Qwen2ForPrmModel, Qwen2ForProcessRewardModel
    from sgl_tts.prm.detect import DetectedPRM, detect_prm

    folder = write_dummy_model(name, tmp_path / name)
    assert detect_prm(folder) == DetectedPRM("step_pooled", fmt, arch) and arch in ARCHITECTURES
    config = AutoConfig.from_pretrained(folder)
    cls = {"Qwen2ForProcessRewardModel": Qwen2ForProcessRewardModel, "Qwen2ForPrmModel": Qwen2ForPrmModel}[arch]
    step_id = cls.find_step_token(None, config)
    assert step_id == {"Qwen2ForProcessRewardModel": 151651, "Qwen2ForPrmModel": 198}[arch] < config.vocab_size
    words = AutoTokenizer.from_pretrained(tokenizer_dir(folder))
    ids, ends = WordStepPooledFormat(arch).encode(words, "t1 t2", ["t3 t4", "t5"])
    assert ids == [1, 2, 3, 4, step_id, 5, step_id] and ends == [4, 6]
