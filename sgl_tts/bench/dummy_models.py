"""Real-size model folders for random-weight serving (``--load-format dummy``): a real
``config.json`` and a tokenizer of exactly the config's vocabulary, so every id the random model
samples detokenizes. No weights are written.

Two tokenizers: ``words`` (the benchmark's default) gives id i the word ``t<i>`` and splits on
whitespace, so any id sequence decodes to text that encodes back to the same ids: the frontend sends
each step's prefix as text, and only an exact round trip lets SGLang's radix cache reuse the steps a
random model wrote, as it does for a real model's text. ``bytes`` is a byte-level BPE padded by merges
(realistic prompts, but random ids rarely survive decode + encode). The word vocabulary ends with the
benchmark PRM's step tag and labels (:data:`WORD_SPECIALS`).
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


WORD_SPECIALS = ("<unk>", "+", "-", "ки")   # the last ids of a word vocabulary
WORD_TAG = " ки "   # the benchmark PRM's step tag: one word token, spaced on both sides (steps are stripped)


def write_word_tokenizer(path: str | Path, vocab_size: int) -> int:
    """A whitespace word-level tokenizer of exactly ``vocab_size`` tokens: ``t0``, ``t1``, ... then
    :data:`WORD_SPECIALS`. Decoding joins words with spaces, so decode then encode is the identity."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = vocab_size - len(WORD_SPECIALS)
    if words < 1:
        raise ValueError(f"vocab_size must be more than {len(WORD_SPECIALS)}, got {vocab_size}")
    vocab = {f"t{i}": i for i in range(words)}
    vocab.update({w: words + k for k, w in enumerate(WORD_SPECIALS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(path))
    return len(vocab)


def tokenizer_dir(folder: str | Path) -> Path:
    """Where a model folder's tokenizer is: its ``tokenizer/`` (a word tokenizer) or the folder."""
    sub = Path(folder) / "tokenizer"
    return sub if sub.is_dir() else Path(folder)


def find_config(config: str | Path) -> Path:
    """``config`` as a config.json path: a file, a folder holding one, or a name in ``configs/``."""
    src = Path(config)
    if src.is_dir():
        src = src / "config.json"
    if not src.is_file():
        src = CONFIGS / f"{config}.json"
    if not src.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.json")))
        raise FileNotFoundError(f"no config {config!r}; pass a config.json or one of: {known}")
    return src


def write_dummy_model(config: str | Path, out: str | Path, tokenizer: str = "words") -> Path:
    """A model folder for ``--load-format dummy``: ``config`` (a config.json, or a name in this
    package's ``configs/``) and a tokenizer (``words`` or ``bytes``) covering its vocabulary."""
    if tokenizer not in ("words", "bytes"):
        raise ValueError(f"tokenizer must be 'words' or 'bytes', got {tokenizer!r}")
    src = find_config(config)
    cfg = json.loads(src.read_text())
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # Written and saved once through transformers without the model config beside it, so the folder
    # carries a tokenizer.json: a model type such as mistral would otherwise pick its own tokenizer
    # class for the bare vocab.json/merges.txt.
    if tokenizer == "words":
        # In its own folder (served with --tokenizer-path): beside a config.json, transformers picks
        # the model type's tokenizer class (e.g. Qwen2Tokenizer), which rebuilds a byte-level BPE
        # from the vocabulary and breaks the word round trip.
        size = write_word_tokenizer(out / "tokenizer", int(cfg["vocab_size"]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            size = write_padded_tokenizer(tmp, int(cfg["vocab_size"]))
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tmp).save_pretrained(out)
    assert size == int(cfg["vocab_size"])
    shutil.copyfile(src, out / "config.json")
    return out


__all__ = ["CONFIGS", "WORD_SPECIALS", "WORD_TAG", "find_config", "padding_merges", "tokenizer_dir", "write_dummy_model",
           "write_padded_tokenizer", "write_word_tokenizer"]
