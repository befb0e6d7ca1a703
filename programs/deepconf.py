"""DeepConf: self-consistency weighted and filtered by the model's own token confidence, no PRM
(Fu et al. 2025, "Deep Think with Confidence"; in optillm and ThinkBooster).

Every sample is a whole solution (``gen`` with ``max_tokens``, no stop string), asked with its top-k
token log-probabilities (k: ``confidence_top_k``, SGLang's ``top_logprobs_num``; both backends return them).

- **token confidence** of a generated token: minus the mean of the k highest log-probabilities of its
  position, ``C = -(1/k) sum_j log P(j)`` (high: a peaked distribution, the model is sure).
- **group confidence** at token ``t`` (1-based, ``t >= w``, ``w``: ``confidence_window``): the mean token
  confidence of the ``w`` tokens ending at ``t``. A sample shorter than ``w`` has one group, all of its
  tokens.
- **a sample's confidence** (``confidence_measure``): ``lowest_group`` (the least of its group confidences,
  DeepConf's main measure), ``bottom_10`` (the mean of its lowest 10% group confidences, at least
  one), ``tail`` (the mean token confidence of its last ``w`` tokens) or ``mean`` (over all its
  tokens). A sample with no token has confidence 0.

**Offline** (``deepconf_mode="offline"``): sample N, keep the ``keep_fraction`` most confident (``ceil(eta N)``,
at least one; ties to the earlier sample; DeepConf-low is 0.1, DeepConf-high 0.9), and vote among them
with their confidences as weights.

**Online** (``deepconf_mode="online"``, DeepConf's Algorithm 2; confidence ``lowest_group``):

1. *warm-up*: the first ``min(warmup_samples, N)`` samples run whole, as offline's first samples (same
   seeds, so the same texts). The stop threshold ``s`` is the ``1 - keep_fraction`` quantile of their
   confidences (linear interpolation between order statistics, numpy's default).
2. *the rest of the budget* (N minus the warm-up) is sampled all at once. A sample **stops** at the
   first ``t >= w`` whose group confidence is below ``s`` by more than ``TOLERANCE`` (1e-4: float
   noise between batches must not decide a tie; :func:`sgl_tts.confidence.stop_token`). A stopped
   sample never votes. With ``chunk_tokens = 0`` (default) each sample is one ``gen`` and the stop
   happens inside generation, at that token: :class:`sgl_tts.confidence.ConfidenceStop`, an SGLang
   custom logit processor, ends it with an end-of-sequence token next (one token more than DeepConf's
   ``t``; a server needs ``--enable-custom-logit-processor``: ``sgl-tts serve --enable-deepconf-stop``
   gives its generator that, on a loopback ``--host`` unless ``--allow-remote-code-execution``, since a
   server that allows them runs code its clients send; the CPU backend has it). With ``chunk_tokens > 0`` (any server) a sample is sampled that many tokens per
   request (each chunk a ``gen`` continuing the sample's state; the server's prefix cache holds what
   came before) and checked after every chunk: a stop then costs at most ``chunk_tokens - 1`` tokens
   more.
3. *consensus*: after the warm-up, and each time a sample finishes, the vote among the finished
   samples whose confidence is at least ``s`` (their confidences as weights) is read; once the leader
   holds at least ``consensus`` of the weight, sampling stops and the samples still running are
   **dropped**: the samples after the one that settled it (with chunks: of its round) have requests
   in flight, aborted on the server (one abort of the round's rid prefix, ``tts/<group>/<round>/``; a
   backend without aborts lets them run out); with chunks, an earlier sample of the round, whose chunk
   already ended at its token limit, has nothing in flight and is dropped as it is. No chunk follows.
   Samples are read in sample order (with chunks: a round's, round after round), so which samples
   are dropped depends on the samples alone, never on which request ended first (only the dropped
   samples' token counts do). A sample also ends at ``max_tokens`` or when the model ends it.
4. the answer: that vote (every finished sample if none reaches ``s``).

``SearchResult.answers``: ``confidence_filtered`` (the program's answer: offline, the kept fraction's
weighted vote; online, the vote above), ``confidence_weighted`` (every finished sample, weighted) and
``majority`` (every finished sample, one vote each: plain self-consistency). ``trajectories`` are the
finished samples in sample order (``score``: the confidence); ``exit_reason`` is ``consensus`` or
``budget`` (online), ``traces_stopped`` counts the stopped and dropped samples, whose tokens count in
``tokens_generated`` only, and ``requests_aborted`` the dropped samples' requests (chunks, or whole
samples) the server answered as aborted.

Seeds: a whole sample ``i`` is seeded ``derive_seed("deepconf", seed, question, i)``; chunk ``r`` of
an online sample ``i`` ``derive_seed("deepconf", seed, question, i, r)``. Request tags: sample ``i`` at
depth ``r`` (its chunk; 0 for a whole sample), beam ``i``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from typing import Any, Sequence

import sglang as sgl

import sgl_tts
from sgl_tts.confidence import (TOLERANCE, ConfidenceStop, group_confidences, passes, stop_rule, stop_token,
                                 token_confidence)
from sgl_tts.protocol import rid_prefix
from sgl_tts.search import (BOXED, STEP_DELIMITER, SearchResult, SearchTag, Trajectory, derive_seed, extract_answer,
                            new_group, read_var, split_steps, vote)
from sgl_tts.search.options import CONFIDENCE_MEASURES, DEEPCONF_MODES, DEFAULT_TEMPERATURE, DeepConfOptions

logger = logging.getLogger(__name__)

#: the share of a sample's group confidences ``bottom_10`` averages
BOTTOM_SHARE = 0.1
def trace_confidence(confidences: Sequence[float], window: int, measure: str = "lowest_group") -> float:
    """A sample's confidence under ``measure`` (see the module doc); 0 for a sample with no token."""
    if measure not in CONFIDENCE_MEASURES:
        raise ValueError(f"unknown confidence measure {measure!r}; choose one of {list(CONFIDENCE_MEASURES)}")
    if not confidences:
        return 0.0
    if measure == "mean":
        return statistics.fmean(confidences)
    if measure == "tail":
        return statistics.fmean(confidences[-window:])
    groups = group_confidences(confidences, window)
    if measure == "lowest_group":
        return min(groups)
    lowest = sorted(groups)[:max(1, math.ceil(BOTTOM_SHARE * len(groups)))]
    return statistics.fmean(lowest)


def kept(confidences: Sequence[float], fraction: float) -> list[int]:
    """The indices of the ``ceil(fraction * n)`` (at least one) most confident samples, ties to the
    earlier sample, in sample order. Confidences within :data:`TOLERANCE` of the next higher one
    tie with it (a run of such is one tie): batch noise must not decide which samples are kept."""
    count = max(1, math.ceil(fraction * len(confidences) - 1e-9))
    by_value = sorted(range(len(confidences)), key=lambda i: -confidences[i])
    tier, tiers = 0, {}
    for prev, i in zip([None] + by_value, by_value):
        if prev is not None and confidences[prev] - confidences[i] > TOLERANCE:
            tier += 1
        tiers[i] = tier
    order = sorted(range(len(confidences)), key=lambda i: (tiers[i], i))
    return sorted(order[:count])


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by linear interpolation between order statistics."""
    if not values:
        raise ValueError("a quantile of no values")
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def stop_threshold(warmup_confidences: Sequence[float], keep_fraction: float) -> float:
    """Online DeepConf's threshold: the ``1 - keep_fraction`` quantile of the warm-up's confidences."""
    return quantile(warmup_confidences, 1.0 - keep_fraction)


def leader_share(answers: Sequence[str | None], weights: Sequence[float]) -> float:
    """The weight share of the vote's leader among the samples with an answer (0 when none has one
    or the weights sum to 0)."""
    totals: dict[str, float] = {}
    for a, w in zip(answers, weights):
        if a is not None:
            totals[a] = totals.get(a, 0.0) + w
    total = sum(totals.values())
    return max(totals.values()) / total if totals and total > 0 else 0.0


@dataclasses.dataclass
class Sample:
    """One sample of a DeepConf run: its text so far, token confidences, tokens and what became of it
    (``running``, ``finished``, ``stopped``: below the threshold, ``dropped``: at consensus)."""

    index: int
    state: Any
    text: str = ""
    confidences: list[float] = dataclasses.field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    status: str = "running"
    confidence: float = 0.0
    aborted: bool = False   # its last chunk was answered as aborted (dropped at consensus)


def _confidences(meta: dict, k: int) -> list[float]:
    """The token confidences of one generation's ``output_top_logprobs``."""
    tops = meta.get("output_top_logprobs")
    if tops is None:
        raise RuntimeError("DeepConf needs token log-probabilities, and the backend returned none "
                           "(output_top_logprobs); use an SGLang server or the CPU backend")
    values = ([e[0] for e in top[:k] if e[0] is not None] for top in tops)
    return [token_confidence(v) for v in values if v]


def _generate(samples: Sequence[Sample], name: str, rnd: int | None, *, question: str, group: str, seed: int,
              max_tokens: int, temperature: float, top_logprobs: int, stop: dict | None = None) -> None:
    """One ``gen`` per sample (a whole sample, ``rnd=None``, or chunk ``rnd``), all in flight together;
    ``stop``: a :func:`~sgl_tts.confidence.stop_rule` that :class:`ConfidenceStop` applies as they generate."""
    for x in samples:
        tag = SearchTag(group, rnd or 0, -1, x.index)
        parts = ("deepconf", seed, question, x.index) + (() if rnd is None else (rnd,))
        x.state += sgl_tts.gen(name, max_tokens=max_tokens, temperature=temperature, seed=derive_seed(*parts),
                               return_logprob=True, top_logprobs_num=top_logprobs,
                               custom_params=tag.custom_params() | (stop or {}), rid=tag.request_id(),
                               custom_logit_processor=_STOP_PROCESSOR if stop else None)


#: :class:`ConfidenceStop`, serialized as SGLang's requests carry it
_STOP_PROCESSOR = ConfidenceStop.to_str()


def _read(x: Sample, name: str, top_logprobs: int, t0: float) -> dict:
    """Wait for a sample's generation ``name``; add its text, tokens and confidences."""
    x.text += read_var(x.state, name)
    meta = x.state.get_meta_info(name) or {}
    x.tokens += int(meta.get("completion_tokens", 0))
    x.confidences += _confidences(meta, top_logprobs)
    # the state keeps its meta info until the run ends: drop the k entries per token once read
    # (millions of small lists alive at once make every garbage collection walk them all)
    meta.pop("output_top_logprobs", None)
    meta.pop("output_token_logprobs", None)
    x.seconds = time.perf_counter() - t0
    return meta


_O = DeepConfOptions   # the home of the options' defaults (sgl_tts.search.options)


@sgl.function
def deepconf(s, question: str, num_samples: int = _O.num_samples, deepconf_mode: str = _O.deepconf_mode,
             keep_fraction: float = _O.keep_fraction, confidence_window: int = _O.confidence_window,
             confidence_top_k: int = _O.confidence_top_k, confidence_measure: str = _O.confidence_measure,
             warmup_samples: int = _O.warmup_samples, consensus: float = _O.consensus,
             chunk_tokens: int = _O.chunk_tokens, max_tokens: int = _O.max_tokens,
             sampling_temperature: float = DEFAULT_TEMPERATURE, seed: int = 0, delimiter: str = STEP_DELIMITER,
             answer_pattern: str = BOXED, search_group: str | None = None) -> SearchResult:
    DeepConfOptions(num_samples=num_samples, deepconf_mode=deepconf_mode, keep_fraction=keep_fraction,
                    confidence_window=confidence_window, confidence_top_k=confidence_top_k,
                    confidence_measure=confidence_measure, warmup_samples=warmup_samples, consensus=consensus,
                    chunk_tokens=chunk_tokens, max_tokens=max_tokens)
    # the body's short names
    mode, window, top_logprobs, measure = deepconf_mode, confidence_window, confidence_top_k, confidence_measure
    t0 = time.perf_counter()
    s += question + delimiter
    group = search_group or new_group()
    common = dict(question=question, group=group, seed=seed, temperature=sampling_temperature,
                  top_logprobs=top_logprobs)
    first = num_samples if mode == "offline" else min(warmup_samples, num_samples)
    samples = [Sample(i, st) for i, st in enumerate(s.fork(first))]
    exit_reason = None
    try:
        _generate(samples, "sample", None, max_tokens=max_tokens, **common)
        for x in samples:
            _read(x, "sample", top_logprobs, t0)
            x.status = "finished"
            x.confidence = trace_confidence(x.confidences, window, measure)
        if mode == "offline":
            voters = [samples[i] for i in kept([x.confidence for x in samples], keep_fraction)]
        else:
            threshold = stop_threshold([x.confidence for x in samples], keep_fraction)
            rest = [Sample(first + i, st) for i, st in enumerate(s.fork(num_samples - first))] \
                if num_samples > first else []
            samples += rest
            exit_reason = _online(samples[:first], rest, threshold, consensus, window, chunk_tokens, max_tokens,
                                  answer_pattern, t0, common)
            finished = [x for x in samples if x.status == "finished"]
            voters = [x for x in finished if passes(x.confidence, threshold)] or finished
    finally:   # every fork's worker thread ends, also when a generation failed
        for x in samples:
            x.state.stream_executor.end()
    return _result(samples, voters, exit_reason, delimiter, answer_pattern, time.perf_counter() - t0)


def _online(warm: list[Sample], rest: list[Sample], threshold: float, consensus: float, window: int,
            chunk_tokens: int, max_tokens: int, answer_pattern: str, t0: float, common: dict) -> str:
    """Online DeepConf's sampling after the warm-up (module doc, steps 2 and 3): ``consensus`` or ``budget``."""
    top_logprobs = common["top_logprobs"]

    def settled() -> bool:
        voters = [x for x in warm + rest if x.status == "finished" and passes(x.confidence, threshold)]
        return leader_share([extract_answer(x.text, answer_pattern) for x in voters],
                            [x.confidence for x in voters]) >= consensus - TOLERANCE

    if settled():
        for x in rest:
            x.status = "dropped"
        return "consensus" if rest else "budget"
    if chunk_tokens == 0:
        return _online_whole(rest, threshold, window, max_tokens, settled, t0, common)
    rnd = 0
    while True:
        running = [x for x in rest if x.status == "running"]
        if not running:
            return "budget"
        name = f"chunk{rnd}"
        for limit, group in _by_limit(running, chunk_tokens, max_tokens):
            _generate(group, name, rnd, max_tokens=limit, **common)
        for i, x in enumerate(running):
            checked = len(x.confidences)
            reason = (_read(x, name, top_logprobs, t0).get("finish_reason") or {}).get("type")
            if reason == "abort" or stop_token(x.confidences, window, threshold, checked) is not None:
                x.status = "stopped"
            elif reason != "length" or x.tokens >= max_tokens:
                x.status = "finished"
                x.confidence = trace_confidence(x.confidences, window)
                if settled():
                    for y in running[:i]:   # chunk read, ended at its limit: nothing in flight, nor read again
                        if y.status == "running":
                            y.status = "dropped"
                    # the later samples' chunks of this round are still generating: abort them
                    _drop(running[i + 1:], rid_prefix(common["group"], rnd), name, top_logprobs, t0)
                    return "consensus"
        rnd += 1


def _online_whole(rest: list[Sample], threshold: float, window: int, max_tokens: int, settled, t0: float,
                  common: dict) -> str:
    """Online sampling with the stop inside generation: each sample one ``gen``, read in sample order."""
    top_logprobs = common["top_logprobs"]
    rule = stop_rule(threshold, window, top_logprobs, common["temperature"])
    _generate(rest, "sample", None, max_tokens=max_tokens, stop=rule, **common)
    for i, x in enumerate(rest):
        try:
            reason = (_read(x, "sample", top_logprobs, t0).get("finish_reason") or {}).get("type")
        except Exception as exc:
            if "custom logit processor" in str(exc):   # SGLang's refusal, said for DeepConf
                raise RuntimeError("online DeepConf stops samples inside generation with a custom logit processor, "
                                   "and the server does not allow them: start it with "
                                   "--enable-custom-logit-processor (sgl-tts serve: --enable-deepconf-stop; a "
                                   "server that allows them runs code its clients send, so keep it on a loopback "
                                   "host), or set chunk_tokens (e.g. 32) to stop between chunks instead "
                                   f"({exc})") from exc
            raise
        if reason == "abort" or stop_token(x.confidences, window, threshold) is not None:
            x.status = "stopped"   # a stopped sample's last token is the forced end of sequence
            continue
        x.status = "finished"
        x.confidence = trace_confidence(x.confidences, window)
        if settled():   # the later samples may still be generating: abort them
            _drop(rest[i + 1:], rid_prefix(common["group"], 0), "sample", top_logprobs, t0)
            return "consensus"
    return "budget"


def _drop(samples: Sequence[Sample], prefix: str, name: str, top_logprobs: int, t0: float) -> None:
    """Abort these samples' requests in flight (rid ``prefix``: chunks, or whole samples) and count what
    they had generated."""
    if samples:
        abort = getattr(samples[0].state.stream_executor.backend, "abort_prefix", None)
        if abort is not None:   # a backend without aborts lets the chunks run to their end
            try:
                abort(prefix)
            except Exception as exc:   # nothing is lost but time: the chunks run to their end
                logger.warning("sgl-tts: could not abort DeepConf samples %s: %s", prefix, exc)
    for x in samples:
        try:
            meta = _read(x, name, top_logprobs, t0)
            x.aborted = (meta.get("finish_reason") or {}).get("type") == "abort"
        except Exception:   # a request that failed as it was aborted counts no tokens
            x.aborted = True
        x.status = "dropped"


def _by_limit(samples: Sequence[Sample], chunk_tokens: int, max_tokens: int) -> list[tuple[int, list[Sample]]]:
    """The samples of a round grouped by their chunk's token limit (the last chunk may be shorter)."""
    groups: dict[int, list[Sample]] = {}
    for x in samples:
        groups.setdefault(min(chunk_tokens, max_tokens - x.tokens), []).append(x)
    return list(groups.items())


def _result(samples: list[Sample], voters: list[Sample], exit_reason: str | None, delimiter: str,
            answer_pattern: str, seconds: float) -> SearchResult:
    finished = [x for x in samples if x.status == "finished"]
    answer_of = {x.index: extract_answer(x.text, answer_pattern) for x in finished}
    answers = {   # totals within TOLERANCE tie (to the answer seen first): batch noise must not pick the answer
        "confidence_filtered": vote([answer_of[x.index] for x in voters], [x.confidence for x in voters], TOLERANCE),
        "confidence_weighted": vote([answer_of[x.index] for x in finished], [x.confidence for x in finished],
                                    TOLERANCE),
        "majority": vote([answer_of[x.index] for x in finished]),
    }
    trajectories = [Trajectory(split_steps(x.text, delimiter), [], x.confidence, answer_of[x.index], x.tokens,
                               answer_of[x.index] is not None, x.seconds) for x in finished]
    return SearchResult(answers["confidence_filtered"], answers, trajectories, sum(x.tokens for x in samples),
                        seconds, exit_reason=exit_reason,
                        requests_aborted=sum(x.aborted for x in samples),
                        traces_stopped=sum(x.status in ("stopped", "dropped") for x in samples))


__all__ = ["CONFIDENCE_MEASURES", "DEEPCONF_MODES", "TOLERANCE", "DeepConfOptions", "Sample", "deepconf", "group_confidences",
           "kept", "leader_share", "passes", "quantile", "stop_threshold", "stop_token", "token_confidence",
           "trace_confidence"]
