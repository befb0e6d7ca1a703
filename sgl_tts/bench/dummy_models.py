"""Real-size model folders for random-weight serving (``--load-format dummy``): a real
``config.json`` and a byte-level BPE tokenizer padded to exactly the config's vocabulary, so every
id the random model samples detokenizes. No weights are written.
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from pathlib import Path

from sgl_tts.models.tiny import SPECIAL_TOKENS, _bytes_to_unicode, write_byte_level_tokenizer

CONFIGS = Path(__file__).parent / "configs"


def padding_merges(count: int) -> list[tuple[str, str]]:
    """``count`` BPE merges, each adding one new token: every pair of byte symbols, then every
    (pair, byte) triple, and so on (a valid merge list: each merge's parts already exist)."""
    symbols = [s for _, s in sorted(_bytes_to_unicode().items())]
    merges: list[tuple[str, str]] = []
    level = symbols
    while len(merges) < count:
        nxt = []
        for a, b in itertools.product(level, symbols):
            merges.append((a, b))
            nxt.append(a + b)
            if len(merges) == count:
                return merges
        level = nxt
    return merges


def write_padded_tokenizer(path: str | Path, vocab_size: int) -> int:
    """A Qwen2-format tokenizer of exactly ``vocab_size`` tokens (bytes, padding merges, specials)."""
    base = 256 + len(SPECIAL_TOKENS)
    if vocab_size < base:
        raise ValueError(f"vocab_size must be at least {base} (bytes and special tokens), got {vocab_size}")
    return write_byte_level_tokenizer(path, padding_merges(vocab_size - base))


def write_dummy_model(config: str | Path, out: str | Path) -> Path:
    """A model folder for ``--load-format dummy``: ``config`` (a config.json, or a name in this
    package's ``configs/``) and a tokenizer covering its vocabulary."""
    src = Path(config)
    if not src.is_file():
        src = CONFIGS / f"{config}.json"
    if not src.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.json")))
        raise FileNotFoundError(f"no config {config!r}; pass a config.json or one of: {known}")
    cfg = json.loads(src.read_text())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Written and saved once through transformers without the model config beside it, so the folder
    # carries a tokenizer.json: a model type such as mistral would otherwise pick its own tokenizer
    # class for the bare vocab.json/merges.txt.
    with tempfile.TemporaryDirectory() as tmp:
        size = write_padded_tokenizer(tmp, int(cfg["vocab_size"]))
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tmp).save_pretrained(out)
    assert size == int(cfg["vocab_size"])
    shutil.copyfile(src, out / "config.json")
    return out


__all__ = ["CONFIGS", "padding_merges", "write_dummy_model", "write_padded_tokenizer"]
