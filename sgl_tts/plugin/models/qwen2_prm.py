"""The two Qwen2-bodied PRMs, as SGLang model classes with step pooling
(:mod:`~sgl_tts.plugin.models.step_pooling`). Written from the checkpoints' public model cards and
``config.json``s; the weight names are the checkpoints'.

- ``Qwen2ForProcessRewardModel`` (Qwen2.5-Math-PRM-7B / 72B): the Qwen2 body and ``score``, a
  ``Linear(hidden, hidden)`` -> ReLU -> ``Linear(hidden, num_labels = 2)`` on every token
  (``score.0.*``, ``score.2.*``). A step's score is the class-1 softmax at the ``<extra_0>`` written
  after it. Each row answered is the two logits.
- ``Qwen2ForPrmModel`` (Skywork-o1-Open-PRM-Qwen-2.5-1.5B / 7B): the Qwen2 body and a value head
  ``v_head.summary``, a ``Linear(hidden, 1)`` (its dropout is off at inference). A step's score is
  the sigmoid of the value at the newline that closes the step. Each row answered is that value.
"""

from __future__ import annotations

import torch
from torch import nn

from sgl_tts.plugin.models.step_pooling import StepPooledQwen2, step_token_id
from sgl_tts.protocol import QWEN_PRM_STEP_TOKEN, SKYWORK_PRM_STEP_TEXT, STEP_POOLED_DEFAULT_IDS


class Qwen2ForProcessRewardModel(StepPooledQwen2):
    """Qwen2.5-Math-PRM: two class logits at every ``<extra_0>``."""

    HEAD_WEIGHTS = ("score.0.weight", "score.0.bias", "score.2.weight", "score.2.bias")

    def make_head(self, config) -> None:
        labels = int(getattr(config, "num_labels", 2) or 2)
        self.score = nn.Sequential(nn.Linear(config.hidden_size, config.hidden_size), nn.ReLU(),
                                   nn.Linear(config.hidden_size, labels))

    def find_step_token(self, config) -> int:
        return step_token_id(config, token=QWEN_PRM_STEP_TOKEN,
                             default=STEP_POOLED_DEFAULT_IDS["Qwen2ForProcessRewardModel"])

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(hidden)


class ValueHead(nn.Module):
    """Skywork's ``v_head``: ``summary``, one linear value per token (dropout is a no-op here)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden.to(self.summary.weight.dtype))


class Qwen2ForPrmModel(StepPooledQwen2):
    """Skywork-o1-Open-PRM: one value at every newline that closes a step."""

    HEAD_WEIGHTS = ("v_head.summary.weight", "v_head.summary.bias")

    def make_head(self, config) -> None:
        self.v_head = ValueHead(config.hidden_size)

    def find_step_token(self, config) -> int:
        return step_token_id(config, text=SKYWORK_PRM_STEP_TEXT, default=STEP_POOLED_DEFAULT_IDS["Qwen2ForPrmModel"])

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.v_head(hidden)


EntryClass = [Qwen2ForProcessRewardModel, Qwen2ForPrmModel]
