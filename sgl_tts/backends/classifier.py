"""A reward / classifier-head model on the CPU, answering like SGLang's ``/classify``.

SGLang serves ``*ForSequenceClassification`` and ``*ForRewardModel`` checkpoints as pooling models:
``/classify`` returns, per input, the head's output at the input's last token (no softmax).
:class:`LocalClassifier` gives the same rows from a local Hugging Face folder with transformers, so
:class:`~sgl_tts.prm.RewardHeadPRM` runs unchanged against either.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Sequence


class LocalClassifier:
    """``classify(inputs)`` on a local ``AutoModelForSequenceClassification`` folder (CPU, float32).

    Args:
        model_path: a Hugging Face folder whose config names a sequence-classification architecture.
        batch_size: inputs run together (right-padded; each row is read at its own last token).
    """

    def __init__(self, model_path: str | os.PathLike, *, batch_size: int = 32, threads: int | None = 1,
                 trust_remote_code: bool = False):
        import torch
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no model at {path}: expected a Hugging Face model folder with "
                                    f"config.json (model hubs are not used; pass a local path)")
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        archs = getattr(config, "architectures", None) or []
        if not any(a.endswith(("ForSequenceClassification", "ForRewardModel")) for a in archs):
            raise ValueError(f"{path} is a {', '.join(archs) or 'model without architectures'}, not a "
                             f"reward / classifier-head model (a *ForSequenceClassification "
                             f"checkpoint); for a causal-LM PRM use --prm-kind step_tag")
        self.model_path = str(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # an SGLang-only key (e.g. a zero head bias) is not news
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=torch.float32, trust_remote_code=trust_remote_code).eval()
        finally:
            hf_logging.set_verbosity(verbosity)
        self.batch_size = batch_size
        self.threads = threads
        self._lock = threading.Lock()
        self.forwarded_inputs = 0

    def classify(self, inputs: Sequence[str | Sequence[int]]) -> list[list[float]]:
        """The head's output at the last token of every input (texts or token-id lists)."""
        import torch

        ids = [self.tokenizer.encode(x) if isinstance(x, str) else [int(t) for t in x] for x in inputs]
        if any(not x for x in ids):
            raise ValueError("cannot classify an empty input")
        body = self.model.base_model
        head = getattr(self.model, "score", None) or getattr(self.model, "classifier")
        out: list[list[float]] = []
        with self._lock, torch.inference_mode():
            old = torch.get_num_threads()
            if self.threads:
                torch.set_num_threads(self.threads)
            try:
                for b in range(0, len(ids), self.batch_size):
                    chunk = ids[b:b + self.batch_size]
                    width = max(len(x) for x in chunk)
                    tokens = torch.zeros(len(chunk), width, dtype=torch.long)
                    mask = torch.zeros(len(chunk), width, dtype=torch.long)
                    for i, x in enumerate(chunk):
                        tokens[i, :len(x)] = torch.tensor(x)
                        mask[i, :len(x)] = 1
                    hidden = body(input_ids=tokens, attention_mask=mask).last_hidden_state
                    last = hidden[torch.arange(len(chunk)), mask.sum(1) - 1]
                    out += head(last).float().tolist()
                    self.forwarded_inputs += len(chunk)
            finally:
                torch.set_num_threads(old)
        return out

    def shutdown(self) -> None:
        pass


__all__ = ["LocalClassifier"]
