"""Primitives that TTS programs share: step generation on many forks, score aggregation, stable top-k
selection, beam expansion, answer extraction and voting, and the result types programs return.

A new search algorithm is an ``@sgl.function`` that forks, calls :func:`gen_step`, scores the
candidates with a PRM (:mod:`sgl_tts.prm`), keeps :func:`top_k` of them and :func:`expand`s them.
Everything here is deterministic: ties always go to the earlier candidate, so the same samples and
scores always give the same selection.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import re
from typing import Any, Callable, Mapping, Sequence

import sgl_tts
from sgl_tts.protocol import SearchTag, new_group

STEP_DELIMITER = "\n\n"
BOXED = r"\\boxed\{([^{}]*)\}"

AGGREGATIONS: dict[str, Callable[[Sequence[float]], float]] = {
    "last": lambda xs: xs[-1],
    "min": min,
    "prod": math.prod,
    "mean": lambda xs: sum(xs) / len(xs),
}


def aggregate(scores: Sequence[float], how: str = "last") -> float:
    """One trajectory score from its step scores (``last``, ``min``, ``prod`` or ``mean``); an empty
    trajectory scores 0."""
    if how not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {how!r}; choose one of {sorted(AGGREGATIONS)}")
    return AGGREGATIONS[how](scores) if scores else 0.0


def top_k(scores: Sequence[float], k: int) -> list[int]:
    """Indices of the ``k`` highest scores, best first; ties go to the lower index (stable)."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:max(0, k)]


def expand(count: int, total: int) -> list[int]:
    """How many children each of ``count`` ranked beams gets so that ``total`` are made: an equal
    share, the remainder to the best-ranked beams (``expand(3, 8) == [3, 3, 2]``)."""
    if count <= 0:
        return []
    base, extra = divmod(total, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def expand_proportional(scores: Sequence[float], total: int) -> list[int]:
    """Dynamic branching: how many children each beam gets so that ``total`` are made, proportional
    to its score (negative scores count as 0). Largest remainders get the leftover children, ties to
    the lower index; a beam may get none. All scores zero: an equal split as in :func:`expand`
    (``expand_proportional([0.6, 0.3, 0.1], 8) == [5, 2, 1]``)."""
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    weights = [max(0.0, float(x)) for x in scores]
    mass = sum(weights)
    if not weights or mass == 0.0:
        return expand(len(weights), total)
    quotas = [w / mass * total for w in weights]
    counts = [int(q) for q in quotas]
    order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:total - sum(counts)]:
        counts[i] += 1
    return counts


def extract_answer(text: str, pattern: str = BOXED) -> str | None:
    """The last match of ``pattern``'s first group in ``text`` (default: ``\\boxed{...}``), stripped."""
    found = re.findall(pattern, text)
    return found[-1].strip() if found else None


def vote(answers: Sequence[str | None], weights: Sequence[float] | None = None, tolerance: float = 0.0) -> str | None:
    """The answer with the most votes (or the largest total weight); ties go to the answer seen first;
    ``None`` (no answer) never wins. A total within ``tolerance`` of the largest ties with it (weights
    that carry float noise, e.g. confidences computed in different batches)."""
    if weights is not None and len(weights) != len(answers):
        raise ValueError("answers and weights must have the same length")
    score: dict[str, float] = collections.OrderedDict()
    for i, a in enumerate(answers):
        if a is not None:
            score[a] = score.get(a, 0.0) + (1.0 if weights is None else float(weights[i]))
    if not score:
        return None
    best = max(score.values())
    return next(a for a, v in score.items() if v >= best - tolerance)


def split_steps(text: str, delimiter: str = STEP_DELIMITER) -> list[str]:
    """A solution text as its non-empty steps."""
    return [s.strip() for s in text.strip().split(delimiter) if s.strip()]


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit sampling seed from any parts (the same parts always give the same seed)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclasses.dataclass
class Step:
    """One generation on one fork: a whole step, or a piece of one when it hit its token limit.

    ``final`` and ``text`` judge this piece alone; a search that continues cut steps judges whole
    steps with :func:`advance` instead (a piece can complete, split or answer a step begun earlier).
    """

    text: str
    tokens: int
    final: bool
    finish_reason: Mapping[str, Any] | None = None
    raw: str = ""  # the text as generated, unstripped (what a cut step is continued from)

    @property
    def cut(self) -> bool:
        """The generation hit its token limit (SGLang checks it before stop strings and EOS, so the
        text may even end in the delimiter): the state's text ends as generated, and the next
        generation continues it."""
        return (self.finish_reason or {}).get("type") == "length"

    @property
    def eos(self) -> bool:
        """The model ended the text (an end-of-sequence or stop token, not a stop string)."""
        reason = self.finish_reason or {}
        return reason.get("type") == "stop" and isinstance(reason.get("matched"), int)


def step_limit(step_tokens: int | Sequence[int], depth: int) -> int:
    """The token limit at ``depth`` of a per-depth schedule (varying granularity: e.g. ``[64, 64, 64,
    2048]`` is 64 tokens for the first three steps, then 2048); an int is the same at every depth."""
    limits = [step_tokens] if isinstance(step_tokens, int) else list(step_tokens)
    if not limits or any(not isinstance(x, int) or x < 1 for x in limits):
        raise ValueError(f"step_tokens must be positive integers, got {step_tokens!r}")
    return limits[min(depth, len(limits) - 1)]


@dataclasses.dataclass(frozen=True)
class PathSoFar:
    """A path's text as steps: the closed ones (stripped) and the step a cut left open.

    ``pending`` is the unstripped text after the path's last delimiter when the last generation was
    cut at its token limit (the next generation continues it); empty otherwise.
    """

    steps: tuple[str, ...] = ()
    pending: str = ""

    @property
    def scored(self) -> list[str]:
        """The steps a PRM scores: the closed ones, then the open one as it stands."""
        return list(self.steps) + ([self.pending.strip()] if self.pending.strip() else [])


@dataclasses.dataclass(frozen=True)
class Advance:
    """What one generation did to a path (:func:`advance`)."""

    path: PathSoFar
    finished: bool   # an answer in a whole step, an end of sequence, or an empty step
    continues: bool  # the next generation goes on inside a step: no delimiter before it

    @property
    def scored(self) -> list[str]:
        return self.path.scored


def advance(path: PathSoFar, step: Step, delimiter: str = STEP_DELIMITER,
            answer_pattern: str = BOXED) -> Advance:
    """Judge a generation on whole steps, not on the newest piece.

    The step text is the open step's ``pending`` text plus this generation. Every delimiter in it
    closes a step (a delimiter can straddle a cut, or sit inside a cut piece: SGLang checks the token
    limit before stop strings). A cut generation leaves its text after the last delimiter open; any
    other generation closes it (SGLang trimmed the delimiter that stopped it). The path is finished
    when a step holds an answer (it ends there: the text after that step is only there because the
    cut hid the stop), the model ended the text, or the step it closed is empty as a whole (a
    continuation that is only the delimiter completes its open step, it is not an empty step).
    """
    text = path.pending + step.raw
    parts = text.split(delimiter)
    closing, tail = (parts[:-1], parts[-1]) if step.cut else (parts, "")
    steps = list(path.steps)
    for part in closing:
        if part.strip():
            steps.append(part.strip())
            if re.search(answer_pattern, part):
                return Advance(PathSoFar(tuple(steps)), True, False)
    grown = PathSoFar(tuple(steps), tail)
    if step.cut:
        return Advance(grown, bool(re.search(answer_pattern, tail)), True)
    return Advance(grown, step.eos or not text.strip(), False)


def is_final(text: str, finish_reason: Mapping[str, Any] | None, pattern: str = BOXED) -> bool:
    """A step ends its trajectory when it holds an answer or the model stopped (EOS, not a stop
    string and not the step's token limit)."""
    if re.search(pattern, text):
        return True
    reason = finish_reason or {}
    return reason.get("type") == "stop" and isinstance(reason.get("matched"), int)


def read_var(state: Any, name: str) -> str:
    """``state[name]``, or the state's own error when its generation failed (SGLang's interpreter
    would raise ``KeyError(name)`` instead, hiding e.g. which server stopped answering)."""
    err = state.error()
    if err is not None:
        raise err if isinstance(err, BaseException) else RuntimeError(str(err))
    return state[name]


def gen_step(states: Sequence[Any], name: str, *, max_tokens: int, temperature: float,
             seeds: Sequence[int] | None = None, delimiter: str | None = STEP_DELIMITER,
             answer_pattern: str = BOXED, custom_params: Sequence[Mapping[str, Any]] | None = None,
             tags: Sequence[SearchTag] | None = None, attempt: str = "") -> list[Step]:
    """Generate one step on every state (all in flight at once) and wait for them.

    Each state gets ``sgl_tts.gen(name, stop=delimiter, ...)``; the stop string is not kept in the
    state's text (SGLang trims it), so a program appends ``delimiter`` before the next step, unless
    the step was cut at ``max_tokens`` (:attr:`Step.cut`; see :func:`advance`). ``tags`` put
    each request's place in the search (:class:`~sgl_tts.protocol.SearchTag`) into its
    ``custom_params`` and ``rid`` (``attempt`` distinguishes repeated requests at one place), which the
    sgl-tts scheduler plugin orders by; stock servers ignore them.
    """
    for i, st in enumerate(states):
        params = dict(custom_params[i]) if custom_params is not None else None
        rid = None
        if tags is not None:
            params = {**(params or {}), **tags[i].custom_params()}
            rid = tags[i].request_id(attempt)
        st += sgl_tts.gen(name, max_tokens=max_tokens, temperature=temperature, stop=delimiter,
                          seed=None if seeds is None else seeds[i], custom_params=params, rid=rid)
    return [read_step(st, name, answer_pattern) for st in states]


def read_step(state: Any, name: str, answer_pattern: str = BOXED) -> Step:
    """The :class:`Step` that ``state``'s generation ``name`` produced (waits for it; raises the
    state's own error when it failed)."""
    text = read_var(state, name)
    meta = state.get_meta_info(name) or {}
    reason = meta.get("finish_reason")
    return Step(text.strip(), int(meta.get("completion_tokens", 0)), is_final(text, reason, answer_pattern),
                reason, text)


@dataclasses.dataclass
class Trajectory:
    """A finished (or, when the search ran out of depth, unfinished) candidate solution.

    ``seconds`` is when it was complete, counted from the start of its program run (its beam
    completion time: precise goodput, seed 000 §6.1, divides mean ``tokens`` by mean ``seconds``).
    """

    steps: list[str]
    step_scores: list[float]
    score: float
    answer: str | None
    tokens: int
    finished: bool
    seconds: float = 0.0

    @property
    def text(self) -> str:
        return STEP_DELIMITER.join(self.steps)


@dataclasses.dataclass
class SearchResult:
    """What every program returns: its pick, other selections, every trajectory, and its costs.

    Attributes:
        answer: the program's own pick.
        answers: the answer under each selection rule the program computed (e.g. ``majority``,
            ``prm_best``, ``prm_weighted``).
        trajectories: every completed trajectory (plus the best unfinished one if none completed).
        tokens_generated: every token the program generated, pruned branches included
            (``tokens_normal + tokens_speculative``).
        seconds: wall time of the program.
        tokens_speculative: of those, generated by speculative requests (speculative beam extension);
            ``tokens_reused`` of them became a kept child's step, the rest (``tokens_wasted``) did not.
        seconds_generating, seconds_verifying: the program's time split by what it waited for, summed
            over depths (generation: until a depth's last step ended; verification: from then until
            its last score), for step-wise searches; 0 where a program does not split it.
        prm_requests: PRM requests sent (one path scored; 0 where a program does not count them).
        exit_reason: why a search that can stop early stopped (MCTS: ``accepted``, ``futile``,
            ``budget``, ``exhausted``); ``None`` for the others.
        tree: the search's tree (MCTS: its :class:`sgl_tts.mcts.MCTSTree`, to inspect or draw).
        requests_aborted: requests the search gave up that the server answered as aborted (MCTS:
            cancelled rollouts' expansions; DeepConf online: its dropped samples' requests; 0 where a
            program does not count them).
        branches_started, branches_declined, branches_stopped: speculative branches started, not
            started because the cost controller (``speculative="auto"``) judged they would not pay,
            and stopped at a depth's barrier; ``stood_down``: the declined and the stopped ones by
            reason.
        traces_stopped: samples a search stopped before they ended (DeepConf online: below its
            confidence threshold, or still running at consensus); their tokens count in
            ``tokens_generated`` only.
    """

    answer: str | None
    answers: dict[str, str | None]
    trajectories: list[Trajectory]
    tokens_generated: int
    seconds: float
    tokens_speculative: int = 0
    tokens_reused: int = 0
    seconds_generating: float = 0.0
    seconds_verifying: float = 0.0
    prm_requests: int = 0
    exit_reason: str | None = None
    tree: Any = dataclasses.field(default=None, repr=False, compare=False)
    requests_aborted: int = 0
    branches_started: int = 0
    branches_declined: int = 0
    branches_stopped: int = 0
    stood_down: dict[str, int] = dataclasses.field(default_factory=dict)
    traces_stopped: int = 0

    @classmethod
    def of(cls, answer: str | None, answers: dict[str, str | None], trajectories: list[Trajectory], costs: Any,
           seconds: float) -> "SearchResult":
        """A result whose costs come from a :class:`sgl_tts.search.beams.Costs`."""
        return cls(answer, answers, trajectories, costs.tokens_normal + costs.tokens_speculative, seconds,
                   costs.tokens_speculative, costs.tokens_reused, costs.seconds_generating,
                   costs.seconds_verifying, costs.prm_requests, branches_started=costs.branches_started,
                   branches_declined=costs.branches_declined, branches_stopped=costs.branches_stopped,
                   stood_down=dict(costs.stood_down))

    @property
    def tokens_kept(self) -> int:
        return sum(t.tokens for t in self.trajectories)

    @property
    def tokens_normal(self) -> int:
        return self.tokens_generated - self.tokens_speculative

    @property
    def tokens_wasted(self) -> int:
        """Speculative tokens no kept child used."""
        return self.tokens_speculative - self.tokens_reused


__all__ = ["AGGREGATIONS", "BOXED", "STEP_DELIMITER", "SearchResult", "Step", "Trajectory",
           "Advance", "PathSoFar", "advance", "aggregate", "derive_seed", "read_var", "expand", "expand_proportional",
           "extract_answer", "gen_step", "is_final", "read_step", "new_group", "SearchTag", "split_steps", "step_limit", "top_k", "vote"]
