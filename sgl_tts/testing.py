"""Scripted stand-ins for a generator and a PRM, so you can unit-test your own searches exactly.

A search is only as testable as its inputs are predictable. Here the generator's continuation is a
pure function of ``(prefix, draw)`` and the PRM's step score a pure function of the step text, so a
test knows every sample and every score in advance and can check a search's selections one by one.
Both run through SGLang's real frontend: :class:`ScriptedBackend` is an SGLang ``BaseBackend``, so
``fork``, ``gen`` (stop strings, ``max_tokens``), ``join``, ``run`` and ``run_batch`` are SGLang's own
interpreter; :class:`ScriptedPRM` follows :class:`sgl_tts.prm.PRMScorer` and is called from inside the
program like any scorer.

Example::

    import sglang as sgl
    from sgl_tts.testing import ScriptedBackend, ScriptedPRM

    def script(prefix: str, draw: int | None) -> str:
        # what the "model" writes after `prefix`; `draw` is the request's sampling seed
        depth = prefix.count("\\n\\n")
        return "The answer is \\\\boxed{4}" if depth >= 3 else f"step {draw % 3}\\n\\n"

    backend = ScriptedBackend(script)
    prm = ScriptedPRM({"step 0": 0.2, "step 1": 0.9, "step 2": 0.5}, default=0.5)
    result = my_search.run(question="2+2?", prm=prm, backend=backend).ret_value
    assert prm.calls[0].steps_batch == ...   # every scoring call, in order

Generation semantics (SGLang 0.5.15's, with one character per token and an end-of-sequence token
after the script's text): the script's text is what the model would write from the prefix before it
stops on its own. After each token SGLang's checks run in its order: the token limit first
(``{"type": "length", "length": max_tokens}``, the text kept whole: a stop string or the end of
sequence that lands on the last allowed token does not count), then stop strings (the text cut at
the first one, ``{"type": "stop", "matched": stop}``), then the end of sequence
(``{"type": "stop", "matched": ScriptedBackend.EOS_TOKEN_ID}``). ``completion_tokens`` counts every
token generated, a matched stop string and the end-of-sequence token included, as SGLang does. Sampling parameters (temperature, top-p, ...) do not change the text: the script
decides. With ``seconds_per_token`` a request takes that long per token, so steps of different
lengths end at different times (stragglers), and :meth:`ScriptedBackend.abort_prefix` /
:meth:`ScriptedBackend.stop_speculative` end running requests early as the sgl-tts plugin's group
abort and two-phase stop do. ``draw`` is the request's sampling seed (``sgl_tts.gen(..., seed=...)``; sgl-tts programs
derive one per fork with :func:`sgl_tts.search.derive_seed`), or ``None`` when the request has none.
With ``top_logprobs`` (``(prefix, continuation, index) -> the top log-probabilities at token
``index`` of the script's continuation``) a request
that asks for log-probabilities (``return_logprob``, ``top_logprobs_num``) gets SGLang's
``output_token_logprobs`` and ``output_top_logprobs`` for every token generated. A request that
carries sgl-tts's :class:`~sgl_tts.confidence.ConfidenceStop` processor (online DeepConf's stop) is
stopped where it would stop on a server, from those log-probabilities: the end of sequence is forced
as the next token, reported as SGLang reports it; other custom logit processors are refused.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Mapping, Sequence

from sglang.lang.backend.base_backend import BaseBackend
from sglang.lang.chat_template import get_chat_template
from sglang.lang.ir import SglSamplingParams

from sgl_tts.backends import UnsupportedFeatureError
from sgl_tts.backends.request import AbortLedger, aborted_answer, take_request_fields

Script = Callable[[str, "int | None"], str]
#: ``(prefix, continuation, index) -> log-probabilities``: the top log-probabilities (highest first)
#: of the position where token ``index`` of the script's ``continuation`` of ``prefix`` is generated
#: (``index == len(continuation)``: the end-of-sequence token)
TopLogprobs = Callable[[str, "str | Sequence[str]", int], Sequence[float]]


@dataclasses.dataclass(frozen=True)
class Draw:
    """One generation request a :class:`ScriptedBackend` answered."""

    prefix: str
    draw: int | None
    text: str
    finish_reason: dict
    max_tokens: int
    stop: tuple[str, ...]
    rid: str | None = None
    custom_params: dict | None = None


class ScriptedBackend(BaseBackend):
    """An SGLang frontend backend whose continuation of a prefix is ``script(prefix, draw)``.

    Args:
        script: ``(prefix, draw) -> text``; must be a pure function (the frontend runs forks on
            several threads, in no fixed order).
        name: what ``get_model_name`` reports.

    Every answered request is kept in :attr:`draws` (in the order they were answered, which differs
    between runs when forks run concurrently; compare sorted or by prefix).
    """

    EOS_TOKEN_ID = 0

    def __init__(self, script: Script, *, name: str = "scripted", seconds_per_token: float = 0.0,
                 top_logprobs: TopLogprobs | None = None):
        super().__init__()
        if not callable(script):
            raise TypeError(f"script must be a function (prefix, draw) -> text, got {script!r}")
        if top_logprobs is not None and not callable(top_logprobs):
            raise TypeError(f"top_logprobs must be a function (prefix, continuation, index) -> log-probabilities, "
                            f"got {top_logprobs!r}")
        self.top_logprobs = top_logprobs
        if seconds_per_token < 0:
            raise ValueError(f"seconds_per_token must be >= 0, got {seconds_per_token}")
        self.script = script
        self.name = name
        self.seconds_per_token = seconds_per_token
        self.chat_template = get_chat_template("default")
        self.is_chat_model = False
        self.draws: list[Draw] = []
        self._lock = threading.Lock()
        self._running: dict[int, tuple[str | None, dict | None, threading.Event, list]] = {}
        self._aborts = AbortLedger()
        self.peak = 0   # the most paced requests generating at once
        self._open = threading.Event()   # cleared by pause(): requests wait (no CPU) until resume()
        self._open.set()
        self._held = 0
        self._held_changed = threading.Condition()

    def pause(self) -> None:
        """Hold every request that arrives from now on until :meth:`resume` (a backend that stalls:
        what a search does while it waits can be watched)."""
        self._open.clear()

    def resume(self) -> None:
        """Let every held request, and those to come, be answered."""
        self._open.set()

    def wait_held(self, count: int, timeout: float | None = None) -> bool:
        """Wait until at least ``count`` requests are held by :meth:`pause`; ``True`` if they are."""
        with self._held_changed:
            return self._held_changed.wait_for(lambda: self._held >= count, timeout)

    def _hold(self) -> None:
        if self._open.is_set():
            return
        with self._held_changed:
            self._held += 1
            self._held_changed.notify_all()
        try:
            self._open.wait()
        finally:
            with self._held_changed:
                self._held -= 1

    def running(self) -> int:
        """How many paced requests are generating now."""
        with self._lock:
            return len(self._running)

    def abort_prefix(self, prefix: str) -> int:
        """Abort every running request whose rid starts with ``prefix`` (as the sgl-tts plugin's group
        abort does): it answers at once with the tokens it has, ``finish_reason`` ``abort``. Returns
        how many were running. A request made before the abort but not sent yet is answered as aborted
        when it comes (:class:`~sgl_tts.backends.request.AbortLedger`, as :class:`SGLangEndpoint` does)."""
        self._aborts.record(prefix)
        return self._interrupt(lambda rid, params: bool(rid) and rid.startswith(prefix), "abort")

    def stop_speculative(self) -> int:
        """Stop every running speculative request (``tts_class`` ``speculative``) as the plugin's
        two-phase scheduling does when normal work is refused room: it answers at once with the
        tokens it has, ``finish_reason`` ``length``. Returns how many were running."""
        return self._interrupt(lambda rid, params: (params or {}).get("tts_class") == "speculative", "stop")

    def _interrupt(self, match, how: str) -> int:
        # an interrupted request stops counting as running at once (as a server frees its slot at the
        # abort), not when its thread next wakes: `peak` and `running()` never count it again
        with self._lock:
            keys = [k for k, v in self._running.items() if match(v[0], v[1])]
            hit = [self._running.pop(k) for k in keys]
        for _, _, event, why in hit:
            why.append(how)
            event.set()
        return len(hit)

    def get_model_name(self) -> str:
        return self.name

    def generate(self, s, sampling_params: SglSamplingParams):
        fields = take_request_fields()
        self._hold()
        prefix = s.text_
        full = self.script(prefix, fields.seed)
        if not isinstance(full, str):
            raise TypeError(f"the script returned {type(full).__name__}, not str, for prefix "
                            f"{prefix[-40:]!r} and draw {fields.seed}")
        limit = sampling_params.max_new_tokens
        limit = 128 if limit is None else int(limit)
        stop = sampling_params.stop
        stop = tuple(x for x in ((stop,) if isinstance(stop, str) else (stop or ())) if x)
        if self._aborts.covers(fields):   # aborted before it was sent: never generated
            text, meta = aborted_answer(fields)
            with self._lock:
                self.draws.append(Draw(prefix, fields.seed, text, meta["finish_reason"], limit, stop, fields.rid,
                                       dict(fields.custom_params) if fields.custom_params else None))
            return text, meta
        text, reason, generated = continuation(full, stop, limit, self.EOS_TOKEN_ID)
        scripted = full
        forced = self._confidence_stop(prefix, full, generated, fields)
        if forced is not None:   # the processor made token `forced` the end of sequence
            full = list(full)[:forced]
            text, reason, generated = continuation(full, stop, limit, self.EOS_TOKEN_ID)
        if self.seconds_per_token:
            text, reason, generated = self._paced(full, text, reason, generated, fields)
        meta = {"id": fields.rid or f"scripted-{len(self.draws)}", "finish_reason": reason,
                "prompt_tokens": len(prefix), "completion_tokens": generated, "cached_tokens": 0}
        if self.top_logprobs is not None and (sampling_params.return_logprob or sampling_params.top_logprobs_num):
            meta.update(self._logprobs(prefix, scripted, generated, int(sampling_params.top_logprobs_num or 0), forced))
        with self._lock:
            self.draws.append(Draw(prefix, fields.seed, text, reason, limit, stop, fields.rid,
                                   dict(fields.custom_params) if fields.custom_params else None))
        return text, meta

    def _confidence_stop(self, prefix: str, full, generated: int, fields) -> int | None:
        """Where sgl-tts's :class:`~sgl_tts.confidence.ConfidenceStop` processor, if the request carries
        it, would make the next token the end of sequence: the token count ``t < generated`` at which
        the scripted confidences (``top_logprobs``) first stop the sample, else ``None``. Other
        processors are refused."""
        if fields.custom_logit_processor is None:
            return None
        from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

        from sgl_tts.confidence import STOP_RULE, ConfidenceStop, stop_token, token_confidence

        if not isinstance(CustomLogitProcessor.from_str(fields.custom_logit_processor), ConfidenceStop):
            raise UnsupportedFeatureError("a ScriptedBackend applies one custom logit processor: sgl-tts's "
                                          "ConfidenceStop")
        rule = (fields.custom_params or {}).get(STOP_RULE)
        if rule is None:
            return None
        if self.top_logprobs is None:
            raise UnsupportedFeatureError("ConfidenceStop on a ScriptedBackend needs its top_logprobs")
        k = int(rule["top_k"])
        confidences = [token_confidence([float(v) for v in self.top_logprobs(prefix, full, i)][:k])
                       for i in range(generated - 1)]   # the positions whose next token it may force
        return stop_token(confidences, int(rule["window"]), float(rule["threshold"]))

    #: what SGLang reports at a forced end of sequence: all mass on it, the rest clamped to finfo.min
    FORCED_LOGPROB = -3.4028234663852886e+38

    def _logprobs(self, prefix: str, full, generated: int, k: int, forced: int | None = None) -> dict:
        """SGLang's ``output_token_logprobs`` / ``output_top_logprobs`` of the ``generated`` tokens,
        from ``top_logprobs(prefix, full, index)`` (the sampled token's log-probability: the first
        value; token ids: the values' ranks); token ``forced`` is a forced end of sequence."""
        out, top = [], []
        for index in range(generated):
            if index == forced:
                out.append([0.0, self.EOS_TOKEN_ID, None])
                top.append([[0.0, self.EOS_TOKEN_ID, None]] + [[self.FORCED_LOGPROB, j, None] for j in range(1, k)])
                continue
            values = [float(v) for v in self.top_logprobs(prefix, full, index)]
            if not values:
                raise ValueError(f"top_logprobs returned nothing for token {index} after {prefix[-40:]!r}")
            out.append([values[0], 0, None])
            top.append([[v, j, None] for j, v in enumerate(values[:k])])
        return {"output_token_logprobs": out, "output_top_logprobs": top} if k else {"output_token_logprobs": out}

    def _paced(self, full, text, reason, generated, fields):
        """Take ``seconds_per_token`` per generated token; an abort or a stop ends it early with the
        tokens generated by then (whole tokens of ``full``)."""
        event, why = threading.Event(), []
        key = id(event)
        with self._lock:
            self._running[key] = (fields.rid, dict(fields.custom_params or {}), event, why)
            self.peak = max(self.peak, len(self._running))
        t0 = time.monotonic()
        try:
            if not event.wait(generated * self.seconds_per_token):
                return text, reason, generated
        finally:
            with self._lock:
                self._running.pop(key, None)
        done = min(generated - 1, int((time.monotonic() - t0) / self.seconds_per_token))
        if done < 0 or done >= generated:
            return text, reason, generated
        tokens = list(full) if isinstance(full, str) else list(full)
        partial = "".join(tokens[:done])
        if why[0] == "abort":
            return partial, {"type": "abort", "message": "aborted"}, done
        return partial, {"type": "length", "length": done}, done

    def generate_stream(self, s, sampling_params: SglSamplingParams):
        yield self.generate(s, sampling_params)

    def select(self, s, choices, temperature, choices_method=None):
        raise UnsupportedFeatureError("select on a ScriptedBackend (script the choice as text)")

    def concatenate_and_append(self, src_rids, dst_rid):
        raise UnsupportedFeatureError("concatenate_and_append on a ScriptedBackend")

    def shutdown(self) -> None:
        pass


def continuation(full: str | Sequence[str], stop: Sequence[str], max_tokens: int,
                 eos_token_id: int = ScriptedBackend.EOS_TOKEN_ID) -> tuple[str, dict, int]:
    """What a model that would write ``full`` returns under ``stop`` and ``max_tokens``, with an
    end-of-sequence token after ``full``: ``(text, finish_reason, completion tokens)``. A string is
    one token per character; a sequence gives each token's text. After each token the checks run in SGLang 0.5.15's order
    (``Req.update_finish_state``): the token limit first (the text is kept whole, even when its last
    token completed a stop string or was the end of sequence), then stop strings (the text is cut at
    the first one), then the end of sequence."""
    tokens = list(full) + [None]   # None: the end-of-sequence token (no text)
    for n in range(1, len(tokens) + 1):
        out = "".join(t for t in tokens[:n] if t is not None)
        if n >= max_tokens:
            return out, {"type": "length", "length": max_tokens}, n
        matched = next((st for st in stop if st in out), None)   # the first listed, as SGLang's loop
        if matched is not None:
            return out[:out.find(matched)], {"type": "stop", "matched": matched}, n
        if tokens[n - 1] is None:
            return out, {"type": "stop", "matched": eos_token_id}, n
    raise AssertionError("unreachable: the end-of-sequence token always ends the text")


@dataclasses.dataclass(frozen=True)
class ScoreCall:
    """One call of :meth:`ScriptedPRM.score`: its question, the trajectories and what they got."""

    question: str
    steps_batch: list[list[str]]
    scores: list[list[float]]


class ScriptedPRM:
    """A PRM whose score of a step is a pure function of the step's text.

    Args:
        step_score: ``text -> score``, or a mapping from step text to score.
        default: the score of a step the mapping does not hold (``None``: such a step is an error,
            with the step in the message).

    Every call is kept in :attr:`calls`, in the order the calls ended: a program's calls, unless it
    verifies overlapped (then they run on several threads, and two made a moment apart can swap).
    """

    def __init__(self, step_score: Callable[[str], float] | Mapping[str, float], *,
                 default: float | None = None):
        if isinstance(step_score, Mapping):
            table = dict(step_score)

            def lookup(text: str) -> float:
                if text in table:
                    return table[text]
                if default is None:
                    raise KeyError(f"ScriptedPRM has no score for step {text!r} (and no default)")
                return default
            self.step_score: Callable[[str], float] = lookup
        elif callable(step_score):
            self.step_score = step_score
        else:
            raise TypeError("step_score must be a function or a mapping of step text to score")
        self.calls: list[ScoreCall] = []
        self._lock = threading.Lock()

    def score(self, question: str, steps_batch: Sequence[Sequence[str]]) -> list[list[float]]:
        batch = [list(steps) for steps in steps_batch]
        scores = [[float(self.step_score(st)) for st in steps] for steps in batch]
        with self._lock:
            self.calls.append(ScoreCall(question, batch, scores))
        return [list(s) for s in scores]


__all__ = ["Draw", "ScoreCall", "ScriptedBackend", "ScriptedPRM", "continuation"]
