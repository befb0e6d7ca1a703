"""A reward-head PRM made from a step-tag PRM: the same network, read by a classifier head.

A step-tag PRM scores a step by its next-token logits for ``good`` and ``bad`` after the step's tag.
A ``*ForSequenceClassification`` head with two rows, the LM head's rows for ``bad`` and ``good``
(plus a zero bias), computes exactly those two logits at the last token, so its class-1 softmax is
the step-tag score. :func:`write_reward_head` writes that checkpoint: a real classifier-head model
(SGLang serves it at ``/classify``; transformers loads it with ``AutoModelForSequenceClassification``)
whose scores are known in advance, which is what a test of a reward-head scorer needs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "generation_config.json")


def write_reward_head(step_tag_prm: str | os.PathLike, out: str | os.PathLike, *, good: str = "+",
                      bad: str = "-") -> Path:
    """Write ``out``: the causal-LM PRM at ``step_tag_prm`` as a two-class sequence classifier
    (label 0 = ``bad``, 1 = ``good``). Only ``*ForCausalLM`` checkpoints whose transformers family
    has a ``*ForSequenceClassification`` class are supported."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, dst = Path(step_tag_prm), Path(out)
    config = json.loads((src / "config.json").read_text())
    arch = (config.get("architectures") or [""])[0]
    if not arch.endswith("ForCausalLM"):
        raise ValueError(f"{src} is a {arch or 'model without architectures'}, not a *ForCausalLM PRM")
    tok = AutoTokenizer.from_pretrained(src)
    ids = [tok.convert_tokens_to_ids(t) for t in (bad, good)]
    if any(i is None or i == tok.unk_token_id for i in ids):
        raise ValueError(f"label tokens {good!r}/{bad!r} are not single tokens of {src}'s tokenizer")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    head = model.get_output_embeddings().weight.detach()
    dtype = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or "float32"))
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()
               if not k.startswith("lm_head.")}
    tensors["score.weight"] = head[ids].to(dtype).contiguous()
    # SGLang's classification head has a bias (transformers' has none and ignores it): zero it.
    tensors["score.bias"] = torch.zeros(2, dtype=dtype)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config.update(architectures=[arch.replace("ForCausalLM", "ForSequenceClassification")],
                  num_labels=2, id2label={"0": "bad", "1": "good"}, label2id={"bad": 0, "good": 1},
                  tie_word_embeddings=False)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return dst


__all__ = ["write_reward_head"]
