"""Process reward model (PRM) scorers behind one protocol.

``score(question, steps_batch) -> per-step scores``: for each candidate trajectory (a list of step
texts) one score in [0, 1] per step, batched. Scorers:

- :class:`StepTagPRM` — Math-Shepherd / RLHFlow style: the PRM reads the question and the steps, each
  followed by a step tag; the score of step k is P(good) / (P(good) + P(bad)) of the next token after
  tag k. One forward per trajectory, through any backend with ``next_token_logprobs`` (the CPU
  backend today). A score cache keyed by (question, step prefix) means no step is scored twice (seed
  001 §4.3.2): when a beam grows by one step only the new tag is scored, and the backend reuses the
  KV of the already-scored prefix.
- :class:`RewardHeadPRM` — a PRM with a value / classifier head (SGLang's ``*ForSequenceClassification``
  and ``*ForRewardModel`` classes, served at ``/classify``): the head reads the last token, so step k
  is scored on the input that ends with step k's tag, one input per step (the same cache means one
  new input per beam per depth, and SGLang's radix cache reuses the shared prefix).
- :class:`StepPooledPRM` — the PRMs with a head on every token (Qwen2.5-Math-PRM, Skywork-o1-Open-PRM),
  served by the sgl-tts plugin's step-pooled model classes: one input per trajectory answers every
  new step's score, in the family's own input format (:mod:`~sgl_tts.prm.formats`).

The first two read the same input text (:func:`prm_input`) and work through an SGLang server
(:class:`~sgl_tts.backends.SGLangEndpoint`) or a local CPU model (:class:`~sgl_tts.backends.LocalBackend`
for step tags, :class:`~sgl_tts.backends.classifier.LocalClassifier` for heads).

Modules: :mod:`~sgl_tts.prm.input` (the text a PRM reads and its tag positions),
:mod:`~sgl_tts.prm.scorers` (the protocol, the shared score cache and the two scorers),
:mod:`~sgl_tts.prm.formats` and :mod:`~sgl_tts.prm.step_pooled` (the step-pooled families and their
scorer), :mod:`~sgl_tts.prm.evaluation` (``auc``: how well step scores separate good steps from bad). Every
name is re-exported here.
"""

from __future__ import annotations

from sgl_tts.prm.evaluation import auc
from sgl_tts.prm.input import STEP_TAG, default_prompt, prm_input, tag_positions, tag_work
from sgl_tts.prm.scorers import CachedStepScorer, PRMScorer, RewardHeadPRM, StepTagPRM, head_score, sigmoid
from sgl_tts.prm.formats import FORMATS, StepPooledFormat
from sgl_tts.prm.step_pooled import StepPooledPRM

__all__ = ["CachedStepScorer", "FORMATS", "PRMScorer", "RewardHeadPRM", "STEP_TAG", "StepPooledFormat", "StepPooledPRM",
           "StepTagPRM", "auc", "default_prompt", "head_score", "prm_input", "sigmoid", "tag_positions", "tag_work"]
