"""Tiny checkpoints in the real formats of the PRMs people use, for tests and examples.

No model hub is reachable, so a test of the served PRM classes needs folders laid out like the real
ones: the real ``config.json`` architecture, the real weight names, a tokenizer carrying the real
special tokens and conventions. :func:`write_tiny_prm` writes one with seeded random weights (a
small Qwen2 body and the format's head):

- ``qwen2.5-math-prm``: ``Qwen2ForProcessRewardModel``; ``score.0`` / ``score.2`` (hidden -> hidden,
  ReLU, hidden -> 2); ``<extra_0>`` an added special token; Qwen2's chat template.
- ``skywork-prm``: ``Qwen2ForPrmModel``; ``v_head.summary`` (hidden -> 1); a BOS token (Skywork's
  input starts with it); steps closed by a newline token.
- ``math-shepherd``: ``MistralForCausalLM`` (a Mistral body and its LM head) with a SentencePiece-style
  tokenizer (``<s>`` / ``</s>`` / ``<unk>``, ``▁`` for a space, byte fallback) whose vocabulary holds
  Math-Shepherd's step tag ``▁ки`` and its labels ``▁+`` / ``▁-`` as single tokens.
- ``rlhflow``: ``LlamaForCausalLM`` with a byte-level tokenizer carrying Llama 3's chat tokens
  (``<|begin_of_text|>``, ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|eot_id|>``) and a chat
  template of Llama 3's shape (each turn: header, role, header end, a blank line, the trimmed content,
  ``<|eot_id|>``).
"""

from __future__ import annotations

import json
from pathlib import Path

from sgl_tts.models.tiny import SPECIAL_TOKENS, TinyModelSpec, write_byte_level_tokenizer
from sgl_tts.prm.formats import MATH_SHEPHERD_TAG
from sgl_tts.protocol import QWEN_PRM_STEP_TOKEN

FORMATS = ("qwen2.5-math-prm", "skywork-prm", "math-shepherd", "rlhflow")
LLAMA3_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Qwen2's chat template with Qwen2.5-Math's default system turn, reduced to system/user/assistant.
QWEN_PRM_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nPlease reason step by step, and put your final answer within "
    "\\\\boxed{}.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _add_special_tokens(path: Path, tokens: tuple[str, ...], vocab_size: int) -> int:
    """Append ``tokens`` to the tokenizer at ``path`` as added special tokens; the new vocab size."""
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for k, token in enumerate(tokens):
        cfg["added_tokens_decoder"][str(vocab_size + k)] = {
            "content": token, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": True}
    cfg["additional_special_tokens"] = list(tokens)
    cfg_path.write_text(json.dumps(cfg, indent=1, ensure_ascii=False))
    return vocab_size + len(tokens)


def write_sentencepiece_tokenizer(out: Path, pieces: str) -> int:
    """A SentencePiece-style (Llama / Mistral) tokenizer in ``out``: ``<unk>``, ``<s>``, ``</s>``, the
    256 byte-fallback tokens, ``▁`` and every character of ``pieces``, and merged pieces for
    Math-Shepherd's tag and labels (``▁ки``, ``▁+``, ``▁-``); BOS is added to every input. Returns the
    vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(("<unk>", "<s>", "</s>"))}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for ch in "▁" + pieces + MATH_SHEPHERD_TAG:
        vocab.setdefault(ch, len(vocab))
    merges = [("к", "и"), ("▁", "ки"), ("▁", "+"), ("▁", "-")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(out)
    return len(vocab)


def _write_math_shepherd(out: Path, spec: TinyModelSpec, seed: int, dtype: str) -> Path:
    import string

    import torch
    from transformers import MistralConfig, MistralForCausalLM

    vocab = write_sentencepiece_tokenizer(out, string.ascii_letters + string.digits + string.punctuation)
    config = MistralConfig(
        vocab_size=vocab, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, rope_theta=spec.rope_theta, sliding_window=None,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, dtype=dtype)
    config.architectures = ["MistralForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MistralForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    return out


def _write_rlhflow(out: Path, spec: TinyModelSpec, seed: int, dtype: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = _add_special_tokens(out, LLAMA3_TOKENS, write_byte_level_tokenizer(out))
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok_cfg.update(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=LLAMA3_CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1, ensure_ascii=False))
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, rope_theta=spec.rope_theta,
        tie_word_embeddings=False, bos_token_id=vocab - 4, eos_token_id=vocab - 1, dtype=dtype)
    config.architectures = ["LlamaForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    return out


def write_tiny_prm(fmt: str, out: str | Path, *, spec: TinyModelSpec = TinyModelSpec(tie_word_embeddings=False),
                   seed: int = 0, dtype: str = "float32") -> Path:
    """Write a tiny ``fmt`` PRM (one of :data:`FORMATS`) into ``out`` with weights seeded by ``seed``."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2Model

    if fmt not in FORMATS:
        raise ValueError(f"unknown PRM format {fmt!r}; the formats are {', '.join(FORMATS)}")
    out = Path(out)
    if fmt in ("math-shepherd", "rlhflow"):
        return (_write_math_shepherd if fmt == "math-shepherd" else _write_rlhflow)(out, spec, seed, dtype)
    vocab = write_byte_level_tokenizer(out)
    eos = vocab - len(SPECIAL_TOKENS)   # <|endoftext|>
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    if fmt == "qwen2.5-math-prm":
        vocab = _add_special_tokens(out, (QWEN_PRM_STEP_TOKEN,), vocab)
        tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
        tok_cfg["chat_template"] = QWEN_PRM_CHAT_TEMPLATE
        arch, extra = "Qwen2ForProcessRewardModel", {"num_labels": 2}
    else:
        tok_cfg["bos_token"] = "<|endoftext|>"
        arch, extra = "Qwen2ForPrmModel", {}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1, ensure_ascii=False))
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, rope_theta=spec.rope_theta,
        tie_word_embeddings=False, bos_token_id=eos if fmt == "skywork-prm" else None, eos_token_id=eos,
        pad_token_id=eos, dtype=dtype, **extra)
    config.architectures = [arch]
    h = spec.hidden_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        body = Qwen2Model(config)
        if fmt == "qwen2.5-math-prm":
            head = {"score.0.weight": torch.randn(h, h) / h ** 0.5, "score.0.bias": torch.randn(h) * 0.1,
                    "score.2.weight": torch.randn(2, h) / h ** 0.5, "score.2.bias": torch.randn(2) * 0.1}
        else:
            head = {"v_head.summary.weight": torch.randn(1, h) / h ** 0.5, "v_head.summary.bias": torch.randn(1) * 0.1}
    tensors = {f"model.{k}": v for k, v in body.state_dict().items()}
    tensors.update(head)
    torch_dtype = getattr(torch, dtype)
    save_file({k: v.detach().to(torch_dtype).contiguous() for k, v in tensors.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    return out


__all__ = ["FORMATS", "LLAMA3_CHAT_TEMPLATE", "LLAMA3_TOKENS", "write_sentencepiece_tokenizer", "write_tiny_prm"]
