"""Step pooling: a PRM's head read at every step token of a request, in one forward.

SGLang 0.5.15's pooler reads one position per request (``PoolingType.LAST`` or ``CLS``), so a
reward head it serves gives one score per request: one request per step prefix. A PRM scores every
step, at the token that closes it (Qwen2.5-Math-PRM's ``<extra_0>``, Skywork's newline), so here
the head runs on the hidden states of exactly those tokens and each request answers one row per
step token: ``[[head output], ...]`` through SGLang's ``/encode`` and ``/classify``, whose
embedding may be a list per request.

Only the part of a request this forward computes is seen: the tokens the radix cache already held
(the prompt and steps a sibling or an earlier depth sent) are not computed again, and with chunked
prefill only the last chunk's rows reach the answer. So a request's rows belong to its **last** step
tokens, as many as it answers; the client (:class:`sgl_tts.prm.StepPooledPRM`) aligns them from the
end and asks again, with the input cut at that token, for a step it wanted and did not get.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: the files a model folder's tokenizer is read from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def step_token_id(config, *, token: str | None = None, text: str | None = None, default: int) -> int:
    """The id of the token that closes a step, from the tokenizer beside the checkpoint
    (``config._name_or_path``): the added token ``token`` or the last token of ``text``. Without a
    tokenizer there (a config served with random weights, its tokenizer apart), ``default``, the real
    checkpoint's id."""
    path = getattr(config, "_name_or_path", "") or ""
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    tok = None
    if path and Path(path).is_dir() and not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        # a folder without a tokenizer (transformers would make a blank one of the model type's class)
        logger.info("sgl-tts: no tokenizer in %s; step token id %d", path, default)
    elif path:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            logger.info("sgl-tts: no tokenizer at %s (%s); step token id %d", path, exc, default)
    if tok is None:
        tid = default
    elif token is not None:
        tid = tok.convert_tokens_to_ids(token)
        if tid is None or tid == tok.unk_token_id:
            raise ValueError(f"the tokenizer at {path} has no {token!r} token, which this PRM scores at")
    else:
        ids = tok.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError(f"the tokenizer at {path} encodes {text!r}, which this PRM scores at, as no token")
        tid = ids[-1]
    if vocab and not 0 <= int(tid) < vocab:
        raise ValueError(f"step token id {tid} is outside this model's vocabulary of {vocab}")
    return int(tid)


def pool_steps(hidden: torch.Tensor, input_ids: torch.Tensor, seq_lens: list[int], step_id: int,
               head: nn.Module) -> list[torch.Tensor]:
    """``head`` on the hidden states of every ``step_id`` token, split per request: one
    ``[steps, labels]`` float32 tensor per request of the batch (``seq_lens``: each request's tokens
    in ``input_ids``, in order)."""
    at = torch.nonzero(input_ids == step_id).squeeze(1)
    rows = head(hidden.index_select(0, at)).float()
    ends = torch.tensor(seq_lens, dtype=torch.long).cumsum(0)
    owner = torch.bucketize(at.cpu(), ends, right=True)
    counts = torch.bincount(owner, minlength=len(seq_lens)).tolist()
    return list(rows.split(counts[:len(seq_lens)]))


class StepPooledQwen2(nn.Module):
    """A Qwen2 body and a head read at the step token (subclasses give the head, its weight names
    and the step token). Serves only embeddings (``--is-embedding`` is implied by the plugin)."""

    HEAD_WEIGHTS: tuple[str, ...] = ()

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        from sglang.srt.models.qwen2 import Qwen2Model
        from sglang.srt.utils import add_prefix

        self.config, self.quant_config = config, quant_config
        self.model = Qwen2Model(config, quant_config=quant_config, prefix=add_prefix("model", prefix))
        self.make_head(config)
        self.step_id = self.find_step_token(config)
        logger.info("sgl-tts: %s pools at step token id %d", type(self).__name__, self.step_id)

    def make_head(self, config) -> None:
        raise NotImplementedError

    def find_step_token(self, config) -> int:
        raise NotImplementedError

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch, input_embeds=None,
                get_embedding: bool = True, **kwargs):
        from sglang.srt.layers.pooler import EmbeddingPoolerOutput

        if not get_embedding:
            raise ValueError(f"{type(self).__name__} is a process reward model: it scores, it does not generate")
        hidden = self.model(input_ids, positions, forward_batch, input_embeds)
        lens = forward_batch.extend_seq_lens_cpu
        if lens is None:
            lens = forward_batch.extend_seq_lens.tolist()
        return EmbeddingPoolerOutput(embeddings=pool_steps(hidden, input_ids, list(lens), self.step_id, self.head))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """SGLang's Qwen2 loading for the body; the LM head a checkpoint may carry is dropped; a
        checkpoint without this head's weights is refused (its head would stay random)."""
        from sglang.srt.models.qwen2 import Qwen2ForCausalLM

        seen: set[str] = set()

        def body_and_head():
            for name, w in weights:
                if name.startswith("lm_head."):
                    continue
                seen.add(name)
                yield name, w

        Qwen2ForCausalLM.load_weights(self, body_and_head())
        missing = [n for n in self.HEAD_WEIGHTS if n not in seen]
        if missing:
            raise ValueError(f"this checkpoint has no {', '.join(missing)}: it is not a {type(self).__name__} "
                             f"(found {len(seen)} tensors, e.g. {sorted(seen)[:3]})")


__all__ = ["StepPooledQwen2", "pool_steps", "step_token_id"]
