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
"""

from __future__ import annotations

import time
from typing import Sequence

import sglang as sgl

from sgl_tts.search import (BOXED, STEP_DELIMITER, PathSoFar, SearchResult, SearchTag, Trajectory, advance,
                            aggregate, derive_seed, extract_answer, gen_step, new_group, step_limit, top_k, vote)


@sgl.function
def dvts(s, question: str, prm, num_beams: int = 16, beam_width: int = 4, max_depth: int = 40,
         step_tokens: int | Sequence[int] = 64, sampling_temperature: float = 0.8,
         aggregation: str = "last", seed: int = 0, delimiter: str = STEP_DELIMITER,
         answer_pattern: str = BOXED, search_group: str | None = None) -> SearchResult:
    if beam_width < 1 or num_beams < beam_width:
        raise ValueError(f"DVTS needs beam_width >= 1 and num_beams >= beam_width, got num_beams="
                         f"{num_beams} and beam_width={beam_width}")
    step_limit(step_tokens, 0)  # a bad schedule fails before any generation
    t0 = time.perf_counter()
    s += question + delimiter
    roots = s.fork(num_beams // beam_width)
    live = [(i, st, PathSoFar(), 0) for i, st in enumerate(roots)]  # (subtree, state, path, tokens)
    tag = search_group or new_group()  # the search's id in every request (scheduler plugin)
    results: dict[int, Trajectory] = {}
    groups = [roots]
    generated = 0
    for depth in range(max_depth):
        forks, kid_groups = [], []
        for tree, st, path, used in live:
            kids = st.fork(beam_width)
            kid_groups.append(kids)
            forks += [(tree, kid, path, used) for kid in kids]
        for g in groups:  # the parents' groups: their states live on in the forks
            g.join()
        groups = kid_groups
        seeds = [derive_seed("dvts", seed, question, f[0], depth, j % beam_width)
                 for j, f in enumerate(forks)]
        steps = gen_step([f[1] for f in forks], f"step{depth}",
                         max_tokens=step_limit(step_tokens, depth), temperature=sampling_temperature,
                         seeds=seeds, delimiter=delimiter, answer_pattern=answer_pattern,
                         tags=[SearchTag(tag, depth, f[0] if depth else -1, f[0] * beam_width + j % beam_width)
                               for j, f in enumerate(forks)])
        generated += sum(x.tokens for x in steps)
        grown = [advance(path, x, delimiter, answer_pattern) for (_, _, path, _), x in zip(forks, steps)]
        paths = [g.scored for g in grown]
        scores = prm.score(question, paths)
        nxt = []
        for k in range(len(live)):
            block = range(k * beam_width, (k + 1) * beam_width)
            best = block[top_k([aggregate(scores[j], aggregation) for j in block], 1)[0]]
            tree, kid, _, used = forks[best]
            x = steps[best]
            finished = grown[best].finished
            results[tree] = Trajectory(paths[best], scores[best], aggregate(scores[best], aggregation),
                                       extract_answer(delimiter.join(paths[best]), answer_pattern),
                                       used + x.tokens, finished, time.perf_counter() - t0)
            if not finished:
                if not grown[best].continues:  # SGLang trimmed the delimiter that ended the step
                    kid += delimiter
                nxt.append((tree, kid, grown[best].path, used + x.tokens))
        live = nxt
        if not live:
            break
    for g in groups:
        g.join()
    pool = [results[t] for t in sorted(results)]
    eligible = [i for i, t in enumerate(pool) if t.finished] or list(range(len(pool)))
    ranked = top_k([pool[i].score for i in eligible], 1)
    answer = pool[eligible[ranked[0]]].answer if ranked else None
    answers = {"prm_best": answer, "majority": vote([t.answer for t in pool]),
               "prm_weighted": vote([t.answer for t in pool], [t.score for t in pool])}
    return SearchResult(answer, answers, pool, generated, time.perf_counter() - t0)
