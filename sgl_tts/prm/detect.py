"""Which scorer reads a PRM, from its ``config.json`` architecture (a folder) or the server's
``/model_info`` (a URL): what ``prm_kind: auto`` (``sgl-tts run``, ``sgl-tts serve-search``) uses.

- ``Qwen2ForProcessRewardModel`` / ``Qwen2ForPrmModel``: ``step_pooled`` (:class:`~sgl_tts.prm.StepPooledPRM`,
  the family's format), served by SGLang with the sgl-tts plugin;
- ``*ForSequenceClassification`` / ``*ForRewardModel``: ``reward_head`` (:class:`~sgl_tts.prm.RewardHeadPRM`);
- ``*ForCausalLM``: ``step_tag`` (:class:`~sgl_tts.prm.StepTagPRM`), format ``math-shepherd`` when its
  vocabulary holds Math-Shepherd's ``ки`` tag (its layout, :class:`~sgl_tts.prm.formats.StepTagLayout`),
  else the tag and labels as configured.

Anything else is refused in one line naming what is supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sgl_tts.launch.server_api import model_info
from sgl_tts.prm.formats import MATH_SHEPHERD_TAG, format_for_architecture

KINDS = ("step_tag", "reward_head", "step_pooled")
SUPPORTED = ("Qwen2ForProcessRewardModel (Qwen2.5-Math-PRM), Qwen2ForPrmModel (Skywork-o1-Open-PRM), "
             "*ForSequenceClassification / *ForRewardModel (a head read at each step's tag), "
             "*ForCausalLM (P(good) after each step tag: Math-Shepherd, RLHFlow, the shipped tiny PRM)")


@dataclass(frozen=True)
class DetectedPRM:
    """How to read a PRM: its scorer kind (one of :data:`KINDS`), its family's format where it has one
    (a step-pooled format; ``math-shepherd`` for a causal LM) and the architecture it was told by."""

    kind: str
    format: str | None
    architecture: str


def architectures_of(target: str | Path) -> list[str]:
    """The architectures of a PRM folder (its ``config.json``) or server URL (``/model_info``)."""
    target = str(target)
    if target.startswith(("http://", "https://")):
        try:
            info = model_info(target)
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the PRM server's architecture at {target}/model_info: {exc}") from exc
        return list(info.get("architectures") or [])
    if not Path(target).exists():
        raise ValueError(f"no model at {target}")
    config = Path(target) / "config.json"
    try:
        return list(json.loads(config.read_text()).get("architectures") or [])
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the PRM's architecture from {config}: {exc}") from exc


def _step_tag_format(target: str | Path) -> str | None:
    """A causal-LM PRM folder's family layout, read from its ``tokenizer.json`` vocabulary (a server
    URL: None here; the scorer asks its tokenizer, :func:`sgl_tts.prm.formats.step_tag_layout_for`)."""
    path = Path(str(target)) / "tokenizer.json"
    if str(target).startswith(("http://", "https://")) or not path.is_file():
        return None
    try:
        vocab = json.loads(path.read_text()).get("model", {}).get("vocab") or {}
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(vocab, list):   # a Unigram model's [piece, score] pairs
        vocab = {row[0] for row in vocab if row}
    return "math-shepherd" if ("▁" + MATH_SHEPHERD_TAG in vocab or MATH_SHEPHERD_TAG in vocab) else None


def detect_prm(target: str | Path, architectures: list[str] | None = None) -> DetectedPRM:
    """The scorer kind for the PRM at ``target`` (``architectures``: already known, else read)."""
    archs = architectures if architectures is not None else architectures_of(target)
    for arch in archs:
        fmt = format_for_architecture(arch)
        if fmt is not None:
            return DetectedPRM("step_pooled", fmt.name, arch)
        if arch.endswith(("ForSequenceClassification", "ForRewardModel")):
            return DetectedPRM("reward_head", None, arch)
        if arch.endswith("ForCausalLM"):
            return DetectedPRM("step_tag", _step_tag_format(target), arch)
    raise ValueError(f"{target}: {', '.join(archs) or 'no architecture'} is not a PRM sgl-tts can read; "
                     f"supported: {SUPPORTED}")


__all__ = ["KINDS", "SUPPORTED", "DetectedPRM", "architectures_of", "detect_prm"]
