"""Build tiny Qwen2-architecture models with a byte-level BPE tokenizer in Qwen2's own format.

Why Qwen2's format: with ``model_type=qwen2``, transformers 5 always builds ``Qwen2Tokenizer`` from
``vocab.json`` + ``merges.txt`` and ignores a custom ``tokenizer.json``; a vocabulary written in that
byte-level format loads as ``Qwen2Tokenizer`` and round-trips every string exactly (any byte is a token).
Head dim 64 keeps the models acceptable to SGLang's GPU attention kernels.
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from pathlib import Path
from typing import Sequence

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen2's chat template, reduced to what a tiny model needs (system/user/assistant turns).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map that byte-level BPE vocabularies use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def byte_symbols(text: str) -> str:
    """``text`` in the byte-level alphabet of the vocabulary (e.g. a space becomes ``Ġ``)."""
    b2u = _bytes_to_unicode()
    return "".join(b2u[b] for b in text.encode("utf-8"))


def word_merges(words: Sequence[str]) -> list[tuple[str, str]]:
    """Merges that make each of ``words`` one token, built left to right (``St``, ``Ste``, ``Step``).

    Words are given as text; a word must be one pre-token under Qwen2's splitting rules (letters with
    at most one leading space or symbol, or a run of newlines) for its merges to apply.
    """
    merges: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for word in words:
        sym = byte_symbols(word)
        for i in range(2, len(sym) + 1):
            pair = (sym[: i - 1], sym[i - 1])
            if pair not in seen:
                seen.add(pair)
                merges.append(pair)
    return merges


def write_byte_level_tokenizer(path: str | Path, merges: Sequence[tuple[str, str]] = ()) -> int:
    """Write a Qwen2-format byte-level BPE tokenizer into ``path``; returns the vocabulary size.

    ``merges`` are pairs of *byte-level symbols* (as produced by the byte->unicode map), applied in
    order; each adds one token. With no merges every byte is one token.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    b2u = _bytes_to_unicode()
    vocab: dict[str, int] = {b2u[b]: i for i, b in enumerate(sorted(b2u))}
    for a, b in merges:
        if a not in vocab or b not in vocab:
            raise ValueError(f"merge ({a!r}, {b!r}) uses a symbol that is not in the vocabulary yet")
        vocab.setdefault(a + b, len(vocab))
    base = len(vocab)
    added = {
        str(base + i): {
            "content": tok, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (path / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
    return base + len(SPECIAL_TOKENS)


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny Qwen2 model. The defaults give ~1M parameters: fast enough for CPU tests."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True


def build_tiny_model(
    path: str | Path,
    spec: TinyModelSpec = TinyModelSpec(),
    *,
    seed: int = 0,
    merges: Sequence[tuple[str, str]] = (),
) -> Path:
    """Write a randomly initialised (seeded) tiny Qwen2 model + tokenizer folder to ``path``.

    The result loads with ``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer``;
    the same seed always gives the same weights.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    vocab_size = write_byte_level_tokenizer(path, merges)
    eos = vocab_size - len(SPECIAL_TOKENS)  # <|endoftext|>
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
        dtype="float32",
    )
    if spec.hidden_size != spec.num_attention_heads * spec.head_dim:
        raise ValueError("hidden_size must equal num_attention_heads * head_dim")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path
