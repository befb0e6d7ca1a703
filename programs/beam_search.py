"""Step-wise beam search guided by a PRM (search-and-learn / FlashTTS style).

N beams (``num_beams``) sample one step each (``fork`` + ``gen`` with the step delimiter as stop
string); the PRM scores every candidate; candidates that finished (an answer, an end of sequence, or
an empty step) are set aside; the best N/M unfinished ones are kept and each is forked M
(``beam_width``) times (fewer kept → more children each, so N candidates are always in flight);
repeat until N trajectories finished, none is left, or ``max_depth``. The pick is the finished
trajectory with the best aggregated score (the best unfinished one if none finished). Ties always go
to the earlier candidate.

Steps are judged whole: a step cut at its token limit (``step_tokens``, which may be a per-depth
schedule: varying granularity, e.g. ``[64, 64, 64, 2048]``) is scored as it stands and continued at
the next depth, and the continuation is judged together with the cut text (an answer or a delimiter
that straddles the cut is seen where it is; see :func:`sgl_tts.search.advance`).

Variants (seed 000 §3.1): ``branching="proportional"`` is dynamic branching: the kept beams share the
N children in proportion to their aggregated scores instead of equally (a low-scored beam may get
none). ``lookahead=k`` ranks the open candidates by the PRM score of a k-step greedy rollout from
each (its tokens count as generated; the rollouts are not kept). ``filter_duplicates=True`` drops an
open candidate whose path (its steps) equals an earlier one's before ranking (off by default;
search-and-learn's recipes turn it on).

``accept_threshold=t`` is positive early exit (seed 004's beam-search baseline): the search stops after
the first depth at which a finished trajectory's aggregated score reaches ``t`` (``exit_reason``
``accepted``); what it returns is what it had then.

Every step request's sampling seed is keyed by (depth, parent candidate, child ordinal), so the same
seed gives the same samples however the search is scheduled. ``speculative=True`` (speculative beam
extension with LookAhead verification) and ``overlap_verification=True`` hide generation and
verification latency without changing a kept beam (:mod:`sgl_tts.search.pipeline`); ``speculative="truncate"``
is FlashTTS's approximate R mode. ``overlap_by_family=True`` overlaps by family (siblings' PRM requests
go together once all their steps ended), for a PRM whose cache is under pressure.

``semantics="search-and-learn"`` reproduces huggingface/search-and-learn's ``beam_search``
(``src/sal/search/beam_search.py``) instead; ``max_depth`` is its ``num_iterations`` and
``step_tokens`` its ``max_tokens``. What differs from the default, one line each:

- stop string: kept in the step text (``include_stop_str_in_output``), and the PRM gets the text split
  on the delimiter, so a path that ends in one has an empty last step (as its default RLHFlow PRM);
- token limit: a step that reaches ``step_tokens`` completes its beam (no cut-and-continue);
- last iteration: generates with no stop string, to EOS or ``step_tokens``, so every beam completes;
- loop end: runs until no active beam is left (or ``max_depth``), not until N have completed;
- empty step: completes a beam only when nothing at all was generated (the stop string counts);
- selection: the N // M best by ``np.argsort`` (its tie order), kept in their candidate order;
- N // M == 0 (M > N): keeps every active beam (``argsort[-0:]`` is everything), not one;
- expansion: the kept beams are repeated cyclically to N (b0, b1, ..., b0, b1, ...), not M each;
- result: the first N completed beams (``sort_completed=True``: the N best), refilled to N by
  repeating them; the pick is the best aggregated score among those (ties to the first); each
  trajectory's steps are its text split on the delimiter, as its PRM scored them;
- lookahead: search-and-learn generates lookahead steps its beam search never reads; not generated;
- ``branching`` and ``lookahead`` do not apply; ``filter_duplicates`` compares whole texts.

Both modes send ``question + delimiter`` as the prompt (search-and-learn applies a chat template).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import numpy as np
import sglang as sgl

from sgl_tts.search.options import DEFAULT_TEMPERATURE, BeamSearchOptions
from sgl_tts.search.beams import Beam, Candidate
from sgl_tts.search.lookahead import LookAhead
from sgl_tts.search.overlap import OverlappedVerification
from sgl_tts.search.pipeline import StepPipeline
from sgl_tts.search.speculation import Speculation, Speculator
from sgl_tts.search import (BOXED, STEP_DELIMITER, SearchResult, SearchTag, Trajectory, advance, aggregate,
                            derive_seed, expand, expand_proportional, extract_answer, gen_step, new_group,
                            step_limit, top_k, vote)


_O = BeamSearchOptions   # the home of the options' defaults (sgl_tts.search.options)


@sgl.function
def beam_search(s, question: str, prm, num_beams: int = _O.num_beams, beam_width: int = _O.beam_width,
                max_depth: int = _O.max_depth, step_tokens: int | Sequence[int] = _O.step_tokens,
                sampling_temperature: float = DEFAULT_TEMPERATURE, aggregation: str = _O.aggregation, seed: int = 0,
                delimiter: str = STEP_DELIMITER, answer_pattern: str = BOXED, branching: str = _O.branching,
                lookahead: int = _O.lookahead, search_group: str | None = None,
                filter_duplicates: bool = _O.filter_duplicates, semantics: str = _O.semantics,
                sort_completed: bool = _O.sort_completed, speculative: "bool | str | Speculation" = _O.speculative,
                overlap_verification: bool = _O.overlap_verification,
                accept_threshold: float | None = _O.accept_threshold,
                overlap_by_family: bool = _O.overlap_by_family) -> SearchResult:
    # every option checked before any generation, as `sgl-tts run` checks them (sgl_tts.search.options)
    BeamSearchOptions(num_beams, beam_width, max_depth, step_tokens, aggregation, speculative, overlap_verification,
                      overlap_by_family=overlap_by_family, branching=branching, lookahead=lookahead,
                      semantics=semantics, filter_duplicates=filter_duplicates, sort_completed=sort_completed,
                      accept_threshold=accept_threshold)
    if semantics == "search-and-learn":
        return _search_and_learn(s, question, prm, num_beams, beam_width, max_depth, step_tokens,
                                 sampling_temperature, aggregation, seed, delimiter, answer_pattern,
                                 search_group, filter_duplicates, sort_completed)
    policy = Speculation.of(speculative)
    t0 = time.perf_counter()
    tag = search_group or new_group()             # the search's id in every request (scheduler plugin)
    s += question + delimiter
    pipe = StepPipeline(question, prm, tag, temperature=sampling_temperature, aggregation=aggregation,
                        delimiter=delimiter, answer_pattern=answer_pattern, seed=seed,
                        seed_of=lambda depth, parent, j: derive_seed("beam_search", seed, question, depth, parent, j),
                        limit_of=lambda depth: step_limit(step_tokens, depth), max_depth=max_depth,
                        t0=t0, speculator=Speculator.of(policy, bins=beam_width), lookahead=LookAhead.of(policy),
                        overlap=OverlappedVerification.of(overlap_verification, by_family=overlap_by_family))
    beams = [Beam(st, ordinal=i) for i, st in enumerate(s.fork(num_beams))]
    keep = max(1, num_beams // beam_width)
    done: list[Trajectory] = []
    best_open: Trajectory | None = None
    exit_reason = None
    try:
        for depth in range(max_depth):
            # 1. every beam samples its next step; the PRM scores every candidate path
            cands = pipe.run_depth(beams, depth)
            beams = []
            # 2. finished candidates are set aside; the rest stay open
            open_cands = []
            for c in cands:
                traj = c.trajectory(delimiter, answer_pattern)
                if traj.finished:
                    done.append(traj)
                else:
                    open_cands.append(c)
                    if best_open is None or traj.score > best_open.score:
                        best_open = traj
            if len(done) >= num_beams or not open_cands:
                break
            if accept_threshold is not None and any(t.score >= accept_threshold for t in done):
                exit_reason = "accepted"   # positive early exit: a finished trajectory is good enough
                break
            if filter_duplicates:
                open_cands = _first_of_each_path(open_cands)
            # 3. keep the best N/M open candidates (or their lookahead values) and expand them to N
            values = [c.value for c in open_cands]
            if lookahead:
                values, tokens = _lookahead_values(open_cands, question, prm, lookahead, depth, step_tokens,
                                                   aggregation, delimiter, answer_pattern,
                                                   [SearchTag(tag, depth + 1, c.index, c.index) for c in open_cands])
                pipe.costs.tokens_normal += tokens
            ranked = top_k(values, keep)
            shares = (expand(len(ranked), num_beams) if branching == "equal"
                      else expand_proportional([values[r] for r in ranked], num_beams))
            beams = pipe.expand([(open_cands[r], children) for r, children in zip(ranked, shares) if children], depth)
    finally:
        pipe.finish(beams)
    pool = done or ([best_open] if best_open else [])
    pick = top_k([t.score for t in pool], 1)
    answer = pool[pick[0]].answer if pick else None
    result = SearchResult.of(answer, _answers(answer, pool), pool, pipe.costs, time.perf_counter() - t0)
    result.exit_reason = exit_reason
    return result


def _first_of_each_path(cands: list[Candidate]) -> list[Candidate]:
    seen, out = set(), []
    for c in cands:
        key = (c.grown.path.steps, c.grown.path.pending.strip())
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _answers(answer: str | None, pool: list[Trajectory]) -> dict[str, str | None]:
    return {"prm_best": answer, "majority": vote([t.answer for t in pool]),
            "prm_weighted": vote([t.answer for t in pool], [t.score for t in pool])}


def _lookahead_values(cands: list[Candidate], question: str, prm, lookahead: int, depth: int,
                      step_tokens: int | Sequence[int], aggregation: str, delimiter: str,
                      answer_pattern: str, tags: Sequence[SearchTag]) -> tuple[list[float], int]:
    """Lookahead (Snell et al.): roll every candidate ``lookahead`` steps further at temperature 0 on
    a fork of its state, score the rolled-out paths in one PRM call, and value each candidate by its
    rollout's aggregated score. The rollouts are discarded; returns the values and their tokens."""
    groups = [c.beam.state.fork(1) for c in cands]
    rolls = [(g[0], c.grown) for g, c in zip(groups, cands)]
    for state, grown in rolls:
        if not grown.continues:
            state += delimiter
    tokens = 0
    for j in range(lookahead):
        live = [i for i, (_, grown) in enumerate(rolls) if not grown.finished]
        if not live:
            break
        outs = gen_step([rolls[i][0] for i in live], f"lookahead{depth}_{j}",
                        max_tokens=step_limit(step_tokens, depth + 1 + j), temperature=0.0,
                        delimiter=delimiter, answer_pattern=answer_pattern,
                        tags=[tags[i] for i in live], attempt=f"lookahead{j}")
        tokens += sum(x.tokens for x in outs)
        for i, x in zip(live, outs):
            state, grown = rolls[i]
            grown = advance(grown.path, x, delimiter, answer_pattern)
            if not grown.finished and not grown.continues:
                state += delimiter
            rolls[i] = (state, grown)
    scores = prm.score(question, [grown.scored for _, grown in rolls])
    for g in groups:
        g.join()
    return [aggregate(sc, aggregation) for sc in scores], tokens


# ------------------------------------------------------------------------ search-and-learn semantics
@dataclasses.dataclass
class _SalBeam:
    """search-and-learn's ``Beam``: its whole text (stop strings kept), last scores, tokens."""

    state: Any
    text: str = ""
    scores: list[float] = dataclasses.field(default_factory=list)
    tokens: int = 0
    parent: int = -1
    completed: bool = False


def _search_and_learn(s, question, prm, n, m, iterations, step_tokens, temperature, aggregation, seed,
                      delimiter, answer_pattern, search_group, filter_duplicates, sort_completed) -> SearchResult:
    t0 = time.perf_counter()
    tag = search_group or new_group()
    s += question + delimiter
    groups = [s.fork(n)]
    active = [_SalBeam(st) for st in groups[0]]
    completed: list[_SalBeam] = []
    generated = 0
    for i in range(iterations):
        if len(active) != n:   # repeat the kept beams cyclically up to n, each copy sampling on its own
            active, groups = _repeat_to(active, n, groups)
        last = i == iterations - 1   # the last iteration generates to the end: no stop string
        seeds = [derive_seed("beam_search/search-and-learn", seed, question, i, j) for j in range(n)]
        steps = gen_step([b.state for b in active], f"step{i}", max_tokens=step_limit(step_tokens, i),
                         temperature=temperature, seeds=seeds, delimiter=None if last else delimiter,
                         answer_pattern=answer_pattern,
                         tags=[SearchTag(tag, i, b.parent, j) for j, b in enumerate(active)])
        generated += sum(x.tokens for x in steps)
        for b, x in zip(active, steps):
            stopped = (x.finish_reason or {}).get("matched") == delimiter and not last
            piece = x.raw + (delimiter if stopped else "")    # include_stop_str_in_output
            if stopped:
                b.state += delimiter    # the state's text is the beam's text
            b.text += piece
            b.tokens += x.tokens
            b.completed = not stopped or piece == ""   # EOS or the token limit (vLLM: stop_reason None)
        scores = prm.score(question, [b.text.split(delimiter) for b in active])
        for b, sc in zip(active, scores):
            b.scores = list(sc)
        completed += [b for b in active if b.completed]
        active = [b for b in active if not b.completed]
        if not active:
            break
        if filter_duplicates:
            firsts = {}
            for j, b in enumerate(active):
                firsts.setdefault(b.text, j)
            active = [active[j] for j in firsts.values()]
        values = np.array([aggregate(b.scores, aggregation) for b in active])
        top = set(np.argsort(values.flatten())[-(n // m):].tolist())   # n // m == 0: [-0:] keeps all
        active = [b for j, b in enumerate(active) if j in top]
    for g in groups:
        g.join()
    if sort_completed:
        completed = sorted(completed, key=lambda b: aggregate(b.scores, aggregation), reverse=True)
    completed = completed[:n]
    completed = (completed * (n // len(completed) + 1))[:n]   # refilled to n by repeating
    # steps as its PRM saw them (step_scores[i] scores steps[i]): split on the delimiter, unstripped
    pool = [Trajectory(b.text.split(delimiter), b.scores,
                       aggregate(b.scores, aggregation), extract_answer(b.text, answer_pattern), b.tokens, True,
                       time.perf_counter() - t0) for b in completed]
    answer = pool[int(np.argmax([t.score for t in pool]))].answer
    return SearchResult(answer, _answers(answer, pool), pool, generated, time.perf_counter() - t0)


def _repeat_to(active: list[_SalBeam], n: int, groups: list) -> tuple[list[_SalBeam], list]:
    """``(active * (n // len(active) + 1))[:n]`` as forks: each copy continues from its beam's state
    and samples on its own. Returns the new beams and fork groups (the old groups are joined)."""
    picks = (list(range(len(active))) * (n // len(active) + 1))[:n]
    forks = {j: active[j].state.fork(picks.count(j)) for j in sorted(set(picks))}
    copies = {j: iter(f) for j, f in forks.items()}
    out = [_SalBeam(next(copies[j]), active[j].text, list(active[j].scores), active[j].tokens, j) for j in picks]
    for g in groups:
        g.join()
    return out, list(forks.values())
