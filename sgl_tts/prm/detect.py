"""Which scorer reads a PRM, from its ``config.json`` architecture (a folder) or the server's
``/model_info`` (a URL): what ``prm_kind: auto`` (``sgl-tts run``, ``sgl-tts serve-search``) uses.

- ``Qwen2ForProcessRewardModel`` / ``Qwen2ForPrmModel``: ``step_pooled`` (:class:`~sgl_tts.prm.StepPooledPRM`,
  the family's format), served by SGLang with the sgl-tts plugin;
- ``*ForSequenceClassification`` / ``*ForRewardModel``: ``reward_head`` (:class:`~sgl_tts.prm.RewardHeadPRM`);
- ``*ForCausalLM``: ``step_tag`` (:class:`~sgl_tts.prm.StepTagPRM`), format ``math-shepherd`` when its
  vocabulary holds Math-Shepherd's ``ки`` tag, ``rlhflow`` when its chat template is Llama-3's (their
  layouts, :class:`~sgl_tts.prm.formats.StepTagLayout`), else the tag and labels as configured.

Anything else is refused in one line naming what is supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sgl_tts.launch.server_api import model_info
from sgl_tts.prm.formats import format_for_architecture, step_tag_layout_name

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


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _step_tag_format(target: str | Path) -> str | None:
    """A causal-LM PRM folder's family layout (:func:`~sgl_tts.prm.formats.step_tag_layout_name`),
    read from its tokenizer files without loading the tokenizer: the vocabulary and added tokens
    (``tokenizer.json``, ``vocab.json``, ``tokenizer_config.json``) and the chat template. A server
    URL: None here; the scorer asks the server's tokenizer (:func:`~sgl_tts.prm.formats.step_tag_layout_for`)."""
    if str(target).startswith(("http://", "https://")):
        return None
    folder = Path(str(target))
    tokenizer, config = _read_json(folder / "tokenizer.json"), _read_json(folder / "tokenizer_config.json")
    vocab = tokenizer.get("model", {}).get("vocab") if isinstance(tokenizer.get("model"), dict) else None
    tokens = {row[0] for row in vocab if row} if isinstance(vocab, list) else set(vocab or ())   # Unigram: pairs
    tokens |= set(_read_json(folder / "vocab.json"))
    tokens |= {t.get("content") for t in tokenizer.get("added_tokens") or () if isinstance(t, dict)}
    tokens |= {t.get("content") for t in (config.get("added_tokens_decoder") or {}).values() if isinstance(t, dict)}
    template = config.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if not isinstance(template, str) and jinja.is_file():
        template = jinja.read_text(errors="replace")
    return step_tag_layout_name(tokens, template if isinstance(template, str) else None)


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
