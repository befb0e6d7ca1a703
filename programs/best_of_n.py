"""Best-of-N and self-consistency: sample N (``num_samples``) full solutions in parallel, then pick.

``fork`` N branches after the prompt, ``gen`` a whole solution in each (its own seed), split the
solutions into steps, score every step with a PRM, and select:

- ``majority``: the most frequent answer (self-consistency; no PRM needed);
- ``prm_best``: the answer of the trajectory with the best aggregated PRM score (best-of-N);
- ``prm_weighted``: answers weighted by their trajectories' aggregated scores.

``prm=None`` runs plain self-consistency. The program's own pick (``answer``) is ``prm_best`` when a
PRM is given, ``majority`` otherwise.
"""

from __future__ import annotations

import time

import sglang as sgl

import sgl_tts
from sgl_tts.search.options import DEFAULT_AGGREGATION, DEFAULT_BUDGET, DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE
from sgl_tts.search import (BOXED, STEP_DELIMITER, SearchResult, SearchTag, Trajectory, aggregate,
                            derive_seed, extract_answer, new_group, read_var, split_steps, top_k, vote)


@sgl.function
def best_of_n(s, question: str, num_samples: int = DEFAULT_BUDGET, prm=None, aggregation: str = DEFAULT_AGGREGATION,
              max_tokens: int = DEFAULT_MAX_TOKENS, sampling_temperature: float = DEFAULT_TEMPERATURE, seed: int = 0,
              delimiter: str = STEP_DELIMITER, answer_pattern: str = BOXED,
              search_group: str | None = None) -> SearchResult:
    t0 = time.perf_counter()
    s += question + delimiter
    forks = s.fork(num_samples)
    group = search_group or new_group()  # the search's id in every request (scheduler plugin)
    for i, f in enumerate(forks):
        tag = SearchTag(group, 0, -1, i)
        f += sgl_tts.gen("solution", max_tokens=max_tokens, temperature=sampling_temperature,
                         seed=derive_seed("best_of_n", seed, question, i), custom_params=tag.custom_params(),
                         rid=tag.request_id())
    texts, done_at = [], []
    for f in forks:  # read in order: a sample's time is when it and every earlier one had finished
        texts.append(read_var(f, "solution"))
        done_at.append(time.perf_counter() - t0)
    tokens = [int((f.get_meta_info("solution") or {}).get("completion_tokens", 0)) for f in forks]
    forks.join()
    steps = [split_steps(t, delimiter) for t in texts]
    scores = prm.score(question, steps) if prm is not None else [[] for _ in steps]
    answers_found = [extract_answer(t, answer_pattern) for t in texts]
    trajectories = [Trajectory(st, sc, aggregate(sc, aggregation), a, k, a is not None, t)
                    for st, sc, a, k, t in zip(steps, scores, answers_found, tokens, done_at)]
    answers = {"majority": vote([t.answer for t in trajectories])}
    if prm is not None:
        best = top_k([t.score for t in trajectories], 1)
        answers["prm_best"] = trajectories[best[0]].answer if best else None
        answers["prm_weighted"] = vote([t.answer for t in trajectories],
                                       [t.score for t in trajectories])
    return SearchResult(answers["prm_best" if prm is not None else "majority"], answers, trajectories,
                        sum(tokens), time.perf_counter() - t0)
