"""What a CPU engine request asks and returns: sampling and logprob specs, the completion, the
checks a request passes, and SGLang 0.5.15's finish and trim rules.

Semantics follow SGLang 0.5.15's server (``Req.update_finish_state`` and the detokenizer's
``trim_matched_stop``) so that a program gets the same text from this backend and from a server:

* the length limit is checked first, then stop strings (on the decoded tail of the last
  ``max_stop_tokens + 1`` tokens), then stop token ids / EOS (all skipped when ``ignore_eos``);
* a matched stop string is cut from the text at its first occurrence; a matched stop token is dropped;
  a length finish trims nothing;
* input logprobs start at ``logprob_start_len`` and their first entry is ``None``; ``token_ids_logprob``
  rows are aligned the same way; sampled-token logprobs are taken after temperature scaling and
  custom logit processors, clamped below at the dtype's smallest float (a masked token: finfo.min);
* ``output_top_logprobs`` entries are ``(logprob, id, text)`` tuples, not lists as in SGLang's JSON:
  read-only, and untracked by the garbage collector (k of them per generated token).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence


class UnsupportedFeatureError(NotImplementedError):
    """A request asked for something this backend does not implement (it is never ignored)."""


@dataclasses.dataclass
class SamplingSpec:
    """Sampling and stopping parameters of one request (SGLang's meanings)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    seed: int | None = None

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                f"got {self.min_new_tokens}."
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a non-negative finite number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1


@dataclasses.dataclass
class LogprobSpec:
    """Which log-probabilities to return (SGLang's ``/generate`` fields)."""

    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: tuple[int, ...] | None = None
    return_text_in_logprobs: bool = False


@dataclasses.dataclass
class Completion:
    """What a finished request returns: SGLang's ``text``, ``output_ids`` and ``meta_info``."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]


def check_request(input_ids: Sequence[int], sampling: SamplingSpec, logprobs: LogprobSpec | None,
                  score_positions: tuple[Sequence[int], Sequence[int]] | None, *, vocab_size: int,
                  max_positions: int | None
                  ) -> tuple[list[int], LogprobSpec, tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """Validate one request as :meth:`BatchEngine.submit` takes it (ValueError naming the field);
    returns its token ids, logprob spec and score positions in the engine's form. Shared with
    :class:`~sgl_tts.backends.engine_process.EngineProcess`, which checks before sending."""
    ids = [int(t) for t in input_ids]
    if not ids:
        raise ValueError("a request needs at least one input token")
    sampling.validate()
    if max_positions and len(ids) + sampling.max_new_tokens > max_positions:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds "
            f"the model's max_position_embeddings ({max_positions}); shorten the prompt or "
            f"lower max_new_tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"input token ids out of the vocabulary (size {vocab_size}): {bad[:5]}")
    lp = logprobs or LogprobSpec()
    if lp.return_logprob and lp.logprob_start_len is not None and lp.logprob_start_len > len(ids):
        raise ValueError(
            f"logprob_start_len={lp.logprob_start_len} is higher than the number of input "
            f"tokens ({len(ids)}); use a smaller logprob_start_len")
    sp = None
    if score_positions is not None:
        pos, tids = (tuple(int(p) for p in score_positions[0]),
                     tuple(int(t) for t in score_positions[1]))
        if any(not 0 <= p < len(ids) for p in pos):
            raise ValueError(f"score positions must lie in [0, {len(ids)}), got {pos}")
        if any(not 0 <= t < vocab_size for t in tids):
            raise ValueError(f"score token ids must lie in [0, {vocab_size}), got {tids}")
        sp = (pos, tids)
    return ids, lp, sp


def stop_window(stops: Sequence[str], tokenizer) -> int:
    """How many trailing tokens SGLang decodes to look for stop strings (``stop_str_max_len + 1``)."""
    return max(len(tokenizer.encode(s, add_special_tokens=False)) for s in stops) + 1


def finish_reason(output_ids: Sequence[int], sampling: SamplingSpec, tokenizer,
                  eos_ids: frozenset[int], stop_window: int) -> dict | None:
    """Whether a request ends after its latest token, in SGLang 0.5.15's order and form.

    Length first, then stop strings (searched in the decoded tail of the last ``stop_window``
    tokens, SGLang's ``stop_str_max_len + 1``), then stop token ids / EOS unless ``ignore_eos``.
    Returns SGLang's ``finish_reason`` JSON or ``None``.
    """
    if len(output_ids) >= sampling.max_new_tokens:
        return {"type": "length", "length": sampling.max_new_tokens}
    if sampling.stop:
        tail = tokenizer.decode(list(output_ids[-stop_window:]))
        for stop in sampling.stop:
            if stop in tail:
                return {"type": "stop", "matched": stop}
    if sampling.ignore_eos:
        return None
    t = output_ids[-1]
    if t in sampling.stop_token_ids or t in eos_ids:
        return {"type": "stop", "matched": t}
    return None


def output_text(output_ids: Sequence[int], reason: dict | None, sampling: SamplingSpec,
                tokenizer) -> str:
    """The text SGLang returns: a matched stop token is dropped, a matched stop string is cut at its
    first occurrence (both kept with ``no_stop_trim``), a length finish trims nothing."""
    ids = list(output_ids)
    matched = (reason or {}).get("matched")
    if not matched:  # as SGLang's trim_matched_stop: nothing to trim (this includes token id 0)
        return tokenizer.decode(ids, skip_special_tokens=sampling.skip_special_tokens)
    if isinstance(matched, int) and not sampling.no_stop_trim and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=sampling.skip_special_tokens)
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos != -1:
            text = text[:pos + len(matched)] if sampling.no_stop_trim else text[:pos]
    return text


def sample(scaled: "torch.Tensor", specs: Sequence[SamplingSpec], draws: "torch.Tensor") -> "torch.Tensor":
    """One token per row of ``scaled`` (temperature-scaled logits [n, vocab]): top-k / top-p / min-p
    filtering (SGLang's rules, on sorted probabilities), then row i's uniform draw ``draws[i]`` mapped
    through the kept probabilities' CDF in *vocabulary* order.

    Inverting the CDF in vocabulary order (not sorted order) keeps a seeded draw stable when
    batching perturbs logits by float noise: near-equal probabilities may swap places in a sort,
    but a token's interval in vocabulary order only moves by the noise itself.
    """
    import torch

    probs = scaled.softmax(-1)
    probs_sorted, idx = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[1]
    top_k = torch.tensor([s.top_k if s.top_k > 0 else vocab for s in specs])
    top_p = torch.tensor([s.top_p for s in specs])
    min_p = torch.tensor([s.min_p for s in specs])
    ranks = torch.arange(vocab)[None]
    cum = probs_sorted.cumsum(-1)
    drop_sorted = (ranks >= top_k[:, None]) | ((cum - probs_sorted) > top_p[:, None])
    drop_sorted |= probs_sorted < (probs_sorted[:, :1] * min_p[:, None])
    drop_sorted[:, 0] = False  # the most likely token always survives
    drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
    kept = probs.masked_fill(drop, 0.0)
    cdf = kept.cumsum(-1)
    pick = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True).squeeze(1)
    # Rounding at the CDF's end must not land past the last kept token.
    last_kept = vocab - 1 - (~drop).flip(1).float().argmax(1)
    return torch.minimum(pick, last_kept)


def top_logprobs(logprobs: "torch.Tensor", k: int) -> list[list[tuple[float, int]]]:
    """The ``k`` highest (logprob, token id) pairs of each row, as SGLang lists them."""
    vals, idx = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(v, i)) for v, i in zip(vals.tolist(), idx.tolist())]


class LogitProcessors:
    """SGLang custom logit processors by their serialized text (``CustomLogitProcessor.to_str()``),
    each loaded once with SGLang's deserializer, and applied as SGLang's sampler applies them."""

    def __init__(self) -> None:
        self._loaded: dict[str, Any] = {}

    def load(self, text: str):
        """The processor ``text`` names (a ``ValueError`` saying why when it does not load)."""
        proc = self._loaded.get(text)
        if proc is None:
            from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

            try:
                proc = CustomLogitProcessor.from_str(text)
            except Exception as exc:
                raise ValueError(f"the custom logit processor could not be loaded: {exc}") from exc
            self._loaded[text] = proc
        return proc

    def apply(self, rows: Sequence[tuple[str | None, dict | None]], logits: "torch.Tensor") -> None:
        """Each processor once over the rows of ``logits`` ([n, vocab]) whose ``(processor,
        custom_params)`` name it, in place; rows without one are untouched."""
        mine: dict[str, list[int]] = {}
        for i, (text, _) in enumerate(rows):
            if text is not None:
                mine.setdefault(text, []).append(i)
        import torch

        for text, idx in mine.items():
            at = torch.tensor(idx)
            logits[at] = self.load(text)(logits[at], [rows[i][1] for i in idx])


__all__ = ["Completion", "LogitProcessors", "LogprobSpec", "SamplingSpec", "UnsupportedFeatureError", "check_request",
           "finish_reason", "output_text", "sample", "stop_window", "top_logprobs"]
