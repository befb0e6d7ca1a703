"""How the PRMs people use read a trajectory: their input ids and where each step's score is read.

One :class:`StepPooledFormat` per step-pooled family and one :class:`StepTagLayout` per causal-LM
family whose layout is its own, written from the real checkpoints' model cards:

- ``qwen2.5-math-prm`` (``Qwen2ForProcessRewardModel``): the chat template with the system turn
  "Please reason step by step, and put your final answer within \\boxed{}.", the question as the user
  turn and, as the assistant turn, every step followed by ``<extra_0>``; step k's score is the
  class-1 softmax of the head at the k-th ``<extra_0>``. The input stops at the last ``<extra_0>``
  (what follows cannot change a score, and stopping there lets the next depth's input extend it).
- ``skywork-prm`` (``Qwen2ForPrmModel``): BOS, the question, a newline; then every line of every step,
  each followed by the newline token (steps are lines: a step of several lines is scored at its last
  newline); a step's score is the sigmoid of the value there.
- ``math-shepherd`` (a causal LM, Mistral-7B's): ``f"{question} {output}"`` with BOS, where the
  output is the steps joined by a newline, each followed by `` ки``; a step's score is
  P(``+``) / (P(``+``) + P(``-``)) from the logits at its ``ки`` token, the two label tokens being
  the last two of ``"+ -"`` encoded (``▁+``, ``▁-`` in a SentencePiece vocabulary).
- ``rlhflow`` (a causal LM, Llama-3.1-8B's, in its chat format): one user turn per step (the first
  holds ``f"{question} {step}"``), each answered by an assistant turn ``+``; step k's score is
  P(``+``) / (P(``+``) + P(``-``)) three tokens from the end of the conversation through step k's
  answer (the position before its ``+``), the labels being the last token of each encoded alone.

The server answers rows only for the step tokens it computed (:mod:`sgl_tts.plugin.models.step_pooling`),
so :func:`step_marks` gives every position holding the step token, prompt included: the rows belong
to the last of them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

from sgl_tts.protocol import QWEN_PRM_STEP_TOKEN as SEP, SKYWORK_PRM_STEP_TEXT
from sgl_tts.prm.scorers import head_score

QWEN_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class StepPooledFormat:
    """A step-pooled PRM family: its name, its ``config.json`` architecture and how it reads."""

    name: str
    architecture: str

    def step_token_id(self, tokenizer) -> int:
        """The id of the token that closes a step, in ``tokenizer``."""
        if self.name == "qwen2.5-math-prm":
            tid = tokenizer.convert_tokens_to_ids(SEP)
            if tid is None or tid == tokenizer.unk_token_id:
                raise ValueError(f"this tokenizer has no {SEP} token: it is not a Qwen2.5-Math-PRM's")
            return int(tid)
        return int(tokenizer.encode(SKYWORK_PRM_STEP_TEXT, add_special_tokens=False)[-1])

    def encode(self, tokenizer, question: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        """Input ids for ``question`` and ``steps``, and the position of the token closing each step.
        Raises ``ValueError`` for a step the format cannot hold."""
        step_id = self.step_token_id(tokenizer)
        if self.name == "qwen2.5-math-prm":
            if any(SEP in s for s in steps):
                raise ValueError(f"a step holds {SEP}, the Qwen PRM's step token")
            answer = "".join(s + SEP for s in steps)
            text = tokenizer.apply_chat_template(
                [{"role": "system", "content": QWEN_SYSTEM}, {"role": "user", "content": question},
                 {"role": "assistant", "content": answer}], tokenize=False)
            text = text[:text.rindex(SEP) + len(SEP)] if steps else text
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            marks = step_marks(ids, step_id)
            return ids, marks[len(marks) - len(steps):]
        bos = tokenizer.bos_token or ""
        ids = list(tokenizer.encode(bos + question + SKYWORK_PRM_STEP_TEXT, add_special_tokens=False))
        ends = []
        for step in steps:
            for line in step.split(SKYWORK_PRM_STEP_TEXT):
                ids += (list(tokenizer.encode(line, add_special_tokens=False)) if line else []) + [step_id]
            ends.append(len(ids) - 1)
        return ids, ends

    def score(self, row: Sequence[float]) -> float:
        """A row the server answered as a score in [0, 1]: class 1's softmax (Qwen), the sigmoid (Skywork)."""
        return head_score(row, 1)


MATH_SHEPHERD_TAG = "ки"   # Math-Shepherd's step tag (one token, "▁ки", in its vocabulary)


@dataclass(frozen=True)
class StepTagLayout:
    """A causal-LM PRM family that votes between two label tokens at each step's tag, laid out its
    own way (:class:`~sgl_tts.prm.StepTagPRM` reads it; the project's own layout is
    :func:`sgl_tts.prm.input.prm_input`)."""

    name: str
    tag: str = MATH_SHEPHERD_TAG
    good: str = "+"
    bad: str = "-"

    def label_ids(self, tokenizer) -> list[int]:
        """The good and bad label ids: the last two tokens of ``"{good} {bad}"`` encoded
        (Math-Shepherd), the last token of each encoded alone (RLHFlow)."""
        if self.name == "rlhflow":
            ids = [int(tokenizer.encode(t, add_special_tokens=False)[-1]) for t in (self.good, self.bad)]
        else:
            ids = list(tokenizer.encode(f"{self.good} {self.bad}", add_special_tokens=False))[-2:]
        if len(ids) < 2 or ids[-2] == ids[-1]:
            raise ValueError(f"{self.good!r} and {self.bad!r} are not two tokens of this tokenizer")
        return ids

    def tag_id(self, tokenizer) -> int:
        """The step tag's id: the last token of the tag encoded."""
        return int(tokenizer.encode(self.tag, add_special_tokens=False)[-1])

    def encode(self, tokenizer, question: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        """Input ids for ``question`` and ``steps`` and each step's tag position. Raises
        ``ValueError`` for a step the layout cannot hold (one holding the tag)."""
        if self.name == "rlhflow":
            return self._encode_chat(tokenizer, question, steps)
        for st in steps:
            if self.tag in st:
                raise ValueError(f"a {self.name} step must not hold its tag {self.tag!r}: {st!r}")
        text = f"{question} " + "\n".join(f"{st} {self.tag}" for st in steps)
        ids = list(tokenizer.encode(text))
        marks = step_marks(ids, self.tag_id(tokenizer))
        if len(marks) < len(steps):
            raise ValueError(f"expected {len(steps)} step tags, found {len(marks)}")
        return ids, marks[len(marks) - len(steps):]


    def _encode_chat(self, tokenizer, question: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        conversation: list[dict[str, str]] = []
        ends = []   # the text's length through each step's answer
        for k, st in enumerate(steps):
            conversation += [{"role": "user", "content": f"{question} {st}" if k == 0 else st},
                             {"role": "assistant", "content": self.good}]
            ends.append(len(tokenizer.apply_chat_template(conversation, tokenize=False)))
        if not steps:
            return [], []
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        # one tokenization of the whole conversation; the conversation through step k is its first
        # tokens up to that step's text end (the card tokenizes each and reads 3 tokens from its end:
        # the position before the answer's "+")
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), [int(e) for _, e in enc["offset_mapping"]]
        positions = [bisect.bisect_right(offsets, end) - 3 for end in ends]
        good = self.label_ids(tokenizer)[0]
        if any(p < 0 or ids[p + 1] != good for p in positions):
            raise ValueError("a step changes how the conversation before its answer is tokenized")
        return ids, positions


STEP_TAG_LAYOUTS: dict[str, StepTagLayout] = {"math-shepherd": StepTagLayout("math-shepherd"),
                                              "rlhflow": StepTagLayout("rlhflow", tag="")}
#: the Llama-3 chat format's header token, in RLHFlow's PRMs' chat template
LLAMA3_HEADER = "<|start_header_id|>"


def step_tag_layout_name(vocab, chat_template: str | None) -> str | None:
    """The causal-LM PRM family a tokenizer's vocabulary (a mapping or set of tokens) and chat
    template say: ``math-shepherd`` (the ``ки`` tag is one token), ``rlhflow`` (a Llama-3 chat
    template), or None (the project's own step-tag layout)."""
    if "▁" + MATH_SHEPHERD_TAG in vocab or MATH_SHEPHERD_TAG in vocab:
        return "math-shepherd"
    if chat_template and LLAMA3_HEADER in chat_template and LLAMA3_HEADER in vocab:
        return "rlhflow"
    return None


def step_tag_layout_for(tokenizer) -> StepTagLayout | None:
    """The causal-LM PRM layout ``tokenizer`` says (:func:`step_tag_layout_name`), or None."""
    template = getattr(tokenizer, "chat_template", None)
    name = step_tag_layout_name(tokenizer.get_vocab(), template if isinstance(template, str) else None)
    return STEP_TAG_LAYOUTS.get(name) if name else None


FORMATS: dict[str, StepPooledFormat] = {
    "qwen2.5-math-prm": StepPooledFormat("qwen2.5-math-prm", "Qwen2ForProcessRewardModel"),
    "skywork-prm": StepPooledFormat("skywork-prm", "Qwen2ForPrmModel"),
}


def step_marks(ids: Sequence[int], step_id: int) -> list[int]:
    """Every position of ``ids`` that holds the step token (the server pools at each of them)."""
    return [i for i, t in enumerate(ids) if t == step_id]


def format_for_architecture(architecture: str) -> StepPooledFormat | None:
    """The step-pooled format served as ``architecture``, if it is one."""
    return next((f for f in FORMATS.values() if f.architecture == architecture), None)


__all__ = ["FORMATS", "LLAMA3_HEADER", "MATH_SHEPHERD_TAG", "QWEN_SYSTEM", "STEP_TAG_LAYOUTS", "StepPooledFormat",
           "StepTagLayout", "format_for_architecture", "step_marks", "step_tag_layout_for", "step_tag_layout_name"]
