"""Diverse verifier tree search (DVTS, search-and-learn): N/M independent subtrees, each greedy on
its own best candidate.

``num_beams`` (N) is split into N // ``beam_width`` (M) subtrees. At every depth each live subtree
forks its current path M times, samples one step per fork (``gen`` with the step delimiter as stop
string; all subtrees in flight together), the PRM scores every candidate in one call, and each
subtree keeps only its own best candidate (ties to the earlier fork). A subtree ends when its pick
is finished (an answer, or EOS); one still open at ``max_depth`` ends with its last pick.
``step_tokens`` may be a per-depth schedule, as in beam search (a cut step is continued, and judged
whole with what continues it: :func:`sgl_tts.search.advance`). Unlike
beam search no subtree can take over another's budget, which keeps the N/M final answers diverse.
The pick is the best aggregated score among the subtrees' results (finished ones first).
``speculative``, ``overlap_verification`` and ``overlap_by_family`` work as in beam search
(:mod:`sgl_tts.search.pipeline`): a candidate whose step ended speculates the next steps of its
subtree; they are kept only if it is the subtree's pick. A subtree's M beams are one family.
"""

from __future__ import annotations

import time
from typing import Sequence

import sglang as sgl

from sgl_tts.search.options import DEFAULT_TEMPERATURE, DVTSOptions
from sgl_tts.search.beams import Beam
from sgl_tts.search.lookahead import LookAhead
from sgl_tts.search.overlap import OverlappedVerification
from sgl_tts.search.pipeline import StepPipeline
from sgl_tts.search.speculation import Speculation, Speculator
from sgl_tts.search import (BOXED, STEP_DELIMITER, SearchResult, Trajectory, derive_seed, extract_answer,
                            new_group, step_limit, top_k, vote)


_O = DVTSOptions   # the home of the options' defaults (sgl_tts.search.options)


@sgl.function
def dvts(s, question: str, prm, num_beams: int = _O.num_beams, beam_width: int = _O.beam_width,
         max_depth: int = _O.max_depth, step_tokens: int | Sequence[int] = _O.step_tokens,
         sampling_temperature: float = DEFAULT_TEMPERATURE, aggregation: str = _O.aggregation, seed: int = 0,
         delimiter: str = STEP_DELIMITER, answer_pattern: str = BOXED, search_group: str | None = None,
         speculative: "bool | str | Speculation" = _O.speculative, overlap_verification: bool = _O.overlap_verification,
         overlap_by_family: bool = _O.overlap_by_family) -> SearchResult:
    # every option checked before any generation, as `sgl-tts run` checks them (sgl_tts.search.options)
    DVTSOptions(num_beams, beam_width, max_depth, step_tokens, aggregation, speculative, overlap_verification,
                overlap_by_family)
    policy = Speculation.of(speculative)
    t0 = time.perf_counter()
    s += question + delimiter
    tag = search_group or new_group()  # the search's id in every request (scheduler plugin)
    trees = num_beams // beam_width
    # a candidate's subtree: its parent's at every depth after the first (root beam i is subtree i)
    tree_of: dict[tuple[int, int], int] = {}   # (depth, candidate index) -> subtree
    pipe = StepPipeline(question, prm, tag, temperature=sampling_temperature, aggregation=aggregation,
                        delimiter=delimiter, answer_pattern=answer_pattern, seed=seed,
                        seed_of=lambda depth, parent, j: derive_seed(
                            "dvts", seed, question, *((j // beam_width, depth, j % beam_width) if depth == 0
                                                      else (tree_of[(depth - 1, parent)], depth, j))),
                        limit_of=lambda depth: step_limit(step_tokens, depth), max_depth=max_depth,
                        t0=t0, speculator=Speculator.of(policy, bins=beam_width), lookahead=LookAhead.of(policy),
                        overlap=OverlappedVerification.of(overlap_verification, by_family=overlap_by_family))
    # the root forks once per subtree and each subtree's root forks its M candidates, as at every depth
    beams = []
    for tree, st in enumerate(s.fork(trees)):
        beams += [Beam(kid, ordinal=tree * beam_width + j) for j, kid in enumerate(st.fork(beam_width))]
        st.stream_executor.end()   # the subtree's root lives on in its forks
    results: dict[int, Trajectory] = {}
    try:
        for depth in range(max_depth):
            for i, b in enumerate(beams):
                tree_of[(depth, i)] = b.ordinal // beam_width if depth == 0 else tree_of[(depth - 1, b.parent)]
            cands = pipe.run_depth(beams, depth)
            beams = []
            kept = []
            for tree in range(trees):
                block = [c for c in cands if tree_of[(depth, c.index)] == tree]
                if not block:
                    continue
                best = block[top_k([c.value for c in block], 1)[0]]
                finished = best.grown.finished
                path = best.path
                results[tree] = Trajectory(path, best.scores, best.value,
                                           extract_answer(delimiter.join(path), answer_pattern),
                                           best.tokens, finished, best.seconds)
                if not finished:
                    kept.append((best, beam_width))
            if not kept:
                break
            beams = pipe.expand(kept, depth)
    finally:
        pipe.finish(beams)
    pool = [results[t] for t in sorted(results)]
    eligible = [i for i, t in enumerate(pool) if t.finished] or list(range(len(pool)))
    ranked = top_k([pool[i].score for i in eligible], 1)
    answer = pool[eligible[ranked[0]]].answer if ranked else None
    answers = {"prm_best": answer, "majority": vote([t.answer for t in pool]),
               "prm_weighted": vote([t.answer for t in pool], [t.score for t in pool])}
    return SearchResult.of(answer, answers, pool, pipe.costs, time.perf_counter() - t0)
