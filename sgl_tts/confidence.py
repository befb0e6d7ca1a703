"""Token confidence (DeepConf) and the per-token stop that online DeepConf asks of a server.

The rule's one home: the program (``programs/deepconf.py``) reads samples with it, and
:class:`ConfidenceStop` applies it inside generation, as an SGLang custom logit processor, on a real
server (``--enable-custom-logit-processor``) and in the CPU engine alike.

- **token confidence** of a position: minus the mean of its ``k`` highest log-probabilities,
  ``C = -(1/k) sum_j log P(j)``, with SGLang's reported log-probabilities (those of the distribution
  the token is sampled from: the logits divided by the temperature; greedy: the logits).
- **group confidence** at token ``t`` (1-based, ``t >= window``): the mean token confidence of the
  ``window`` tokens ending at ``t``.
- a sample **stops** at the first ``t`` whose group confidence is below the threshold by more than
  :data:`TOLERANCE` (:func:`stop_token`).

:class:`ConfidenceStop` sees each position's logits before its token is sampled. It records the
position's confidence, and once the group ending at the last generated token is below the threshold it
makes the next token the end of sequence (all other logits ``-inf``): a sample that stops at ``t``
returns ``t + 1`` tokens, the last an end of sequence whose reported log-probabilities are the forced
distribution's (not a confidence). The client tells a stopped sample by :func:`stop_token` over the
reported confidences, which finds ``t`` before reaching that last token. The processor keeps its
running confidences in the request's ``custom_params`` (one dict per request, alive while it runs),
so it needs one call per generated token: it is not for speculative decoding, and SGLang's
``SGLANG_RETURN_ORIGINAL_LOGPROB`` (log-probabilities before the temperature) would make the client
and the processor read different confidences.

This module imports torch and SGLang's ``CustomLogitProcessor`` only: a server deserializing the
processor loads nothing of the client.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any, Sequence

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

logger = logging.getLogger(__name__)

#: a confidence within this of a threshold counts as at it: identical samples have equal
#: confidences only up to the float noise of the batches they were computed in (~1e-6), and a
#: threshold is often one of them, so without it that noise would decide which samples stop
TOLERANCE = 1e-4
#: the ``custom_params`` key of a request's stop rule (a dict: ``threshold``, ``window``, ``top_k``,
#: ``temperature``)
STOP_RULE = "tts_confidence_stop"
#: where :class:`ConfidenceStop` keeps a request's confidences so far (in-process only; never sent)
_SEEN = "_tts_confidences"


def token_confidence(top_logprobs: Sequence[float]) -> float:
    """Minus the mean of a position's top-k log-probabilities."""
    if not top_logprobs:
        raise ValueError("a token's confidence needs at least one top log-probability")
    return -sum(top_logprobs) / len(top_logprobs)


def group_confidences(confidences: Sequence[float], window: int) -> list[float]:
    """The group confidence at every token ``t >= window`` (the mean of the ``window`` token
    confidences ending at ``t``), in order; one group of every token when there are fewer."""
    if not confidences:
        return []
    if len(confidences) < window:
        return [statistics.fmean(confidences)]
    return [statistics.fmean(confidences[t - window:t]) for t in range(window, len(confidences) + 1)]


def stop_token(confidences: Sequence[float], window: int, threshold: float, checked: int = 0) -> int | None:
    """The first token count ``t > checked`` with ``t >= window`` whose group confidence is below
    ``threshold`` by more than :data:`TOLERANCE` (where an online sample stops), else ``None``."""
    for t in range(max(window, checked + 1), len(confidences) + 1):
        if statistics.fmean(confidences[t - window:t]) < threshold - TOLERANCE:
            return t
    return None


def passes(confidence: float, threshold: float) -> bool:
    """Whether a confidence reaches a threshold (within :data:`TOLERANCE`)."""
    return confidence >= threshold - TOLERANCE


def stop_rule(threshold: float, window: int, top_k: int, temperature: float) -> dict[str, Any]:
    """A request's ``custom_params`` entry for :class:`ConfidenceStop` (JSON-safe, as SGLang requires)."""
    if window < 1 or top_k < 1:
        raise ValueError(f"window and top_k must be at least 1, got {window} and {top_k}")
    return {STOP_RULE: {"threshold": float(threshold), "window": int(window), "top_k": int(top_k),
                        "temperature": float(temperature)}}


def _stop_token_id(params: dict) -> int | None:
    """The end-of-sequence id of the request (SGLang's ``Req``, or the CPU engine's, as ``__req__``)."""
    req = params.get("__req__")
    ids = getattr(req, "eos_token_ids", None)
    if ids:
        return min(int(t) for t in ids)
    eos = getattr(getattr(req, "tokenizer", None), "eos_token_id", None)
    return int(eos) if eos is not None else None


class ConfidenceStop(CustomLogitProcessor):
    """Online DeepConf's stop inside generation (module doc); rows without a :data:`STOP_RULE` in
    their ``custom_params`` pass unchanged. Never raises on a request's bad rule (it would stop the
    server's scheduler): such a row is left alone and logged."""

    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None) -> torch.Tensor:
        if not custom_param_list:
            return logits
        rows: list[int] = []
        rules: list[dict] = []
        for i, params in enumerate(custom_param_list):
            rule = params.get(STOP_RULE) if isinstance(params, dict) else None
            if not isinstance(rule, dict):
                continue
            try:
                window, threshold = int(rule["window"]), float(rule["threshold"])
                seen = params.setdefault(_SEEN, [])
                if len(seen) >= window and statistics.fmean(seen[-window:]) < threshold - TOLERANCE:
                    eos = _stop_token_id(params)
                    if eos is None:
                        logger.warning("sgl-tts ConfidenceStop: the request has no end-of-sequence token; not stopped")
                    else:
                        logits[i] = float("-inf")
                        logits[i, eos] = 0.0
                        continue
                rows.append(i)
                rules.append(rule)
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning("sgl-tts ConfidenceStop: bad rule %r: %s", rule, exc)
        if rows:
            self._record(logits, rows, rules, custom_param_list)
        return logits

    @staticmethod
    def _record(logits: torch.Tensor, rows: list[int], rules: list[dict], params: list[dict]) -> None:
        """Append each row's token confidence (one log-softmax for the rows, one top-k per distinct k)."""
        idx = torch.tensor(rows, device=logits.device)
        temps = torch.tensor([t if t > 1e-6 else 1.0 for t in (float(r.get("temperature", 1.0)) for r in rules)],
                             device=logits.device, dtype=torch.float32)
        logprobs = torch.log_softmax(logits[idx].float() / temps[:, None], dim=-1)
        ks = [int(r["top_k"]) for r in rules]
        for k in set(ks):
            mine = [j for j, kj in enumerate(ks) if kj == k]
            top = logprobs[torch.tensor(mine, device=logits.device)].topk(min(k, logprobs.shape[-1]), dim=-1).values
            for j, c in zip(mine, (-top.mean(-1)).tolist()):
                params[rows[j]][_SEEN].append(c)


__all__ = ["STOP_RULE", "TOLERANCE", "ConfidenceStop", "group_confidences", "passes", "stop_rule", "stop_token",
           "token_confidence"]
