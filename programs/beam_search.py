"""Step-wise beam search guided by a PRM (search-and-learn / FlashTTS style).

N beams (``num_beams``) sample one step each (``fork`` + ``gen`` with the step delimiter as stop
string); the PRM scores every candidate; candidates that finished (an answer, or EOS) are set aside;
the best N/M unfinished ones are kept and each is forked M (``beam_width``) times (fewer kept → more
children each, so N candidates are always in flight); repeat until N trajectories finished, none is
left, or ``max_depth``. The pick is the finished trajectory with the best aggregated score (the best
unfinished one if none finished). Ties always go to the earlier candidate.

Variants (seed 000 §3.1): ``branching="proportional"`` is dynamic branching: the kept beams share the
N children in proportion to their aggregated scores instead of equally (a low-scored beam may get
none). ``step_tokens`` may be a per-depth schedule, varying granularity (e.g. ``[64, 64, 64,
2048]``): a step cut at its limit is scored as it stands and continued at the next depth.
``lookahead=k`` ranks the open candidates by the PRM score of a k-step greedy rollout from each
(its tokens count as generated; the rollouts are not kept).
"""

from __future__ import annotations

import time
from typing import Sequence

import sglang as sgl

from sgl_tts.search import (BOXED, STEP_DELIMITER, SearchResult, SearchTag, Trajectory, aggregate,
                            continue_path, derive_seed, expand, expand_proportional, extract_answer, gen_step,
                            new_group, step_limit, top_k, vote)

BRANCHING = ("equal", "proportional")


@sgl.function
def beam_search(s, question: str, prm, num_beams: int = 16, beam_width: int = 4, max_depth: int = 40,
                step_tokens: int | Sequence[int] = 64, sampling_temperature: float = 0.8,
                aggregation: str = "last", seed: int = 0, delimiter: str = STEP_DELIMITER,
                answer_pattern: str = BOXED, branching: str = "equal", lookahead: int = 0,
                search_group: str | None = None) -> SearchResult:
    if num_beams < 1 or beam_width < 1:
        raise ValueError(f"beam search needs num_beams >= 1 and beam_width >= 1, got {num_beams} and {beam_width}")
    if branching not in BRANCHING:
        raise ValueError(f"unknown branching {branching!r}; choose one of {list(BRANCHING)}")
    if lookahead < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead}")
    step_limit(step_tokens, 0)  # a bad schedule fails before any generation
    t0 = time.perf_counter()
    s += question + delimiter
    group = s.fork(num_beams)
    beams = [(st, [], "", 0) for st in group]   # (state, closed steps, pending cut step, tokens)
    tag = search_group or new_group()             # the search's id in every request (scheduler plugin)
    parents = [-1] * num_beams                    # each beam's parent index at the previous depth
    groups = [group]
    done: list[Trajectory] = []
    best_open: Trajectory | None = None
    generated = 0
    keep = max(1, num_beams // beam_width)
    for depth in range(max_depth):
        seeds = [derive_seed("beam_search", seed, question, depth, i) for i in range(len(beams))]
        steps = gen_step([b[0] for b in beams], f"step{depth}", max_tokens=step_limit(step_tokens, depth),
                         temperature=sampling_temperature, seeds=seeds, delimiter=delimiter,
                         answer_pattern=answer_pattern,
                         tags=[SearchTag(tag, depth, parents[i], i) for i in range(len(beams))])
        generated += sum(x.tokens for x in steps)
        cands = [(st, *continue_path(closed, pending, x), x, used + x.tokens)
                 for (st, closed, pending, used), x in zip(beams, steps)]
        scores = prm.score(question, [c[3] for c in cands])
        open_idx = []
        for i, ((st, _, _, path, x, used), sc) in enumerate(zip(cands, scores)):
            traj = Trajectory(path, sc, aggregate(sc, aggregation),
                              extract_answer(delimiter.join(path), answer_pattern),
                              used, x.final or not x.text, time.perf_counter() - t0)
            if traj.finished:
                done.append(traj)
            else:
                open_idx.append(i)
                if best_open is None or traj.score > best_open.score:
                    best_open = traj
        if len(done) >= num_beams or not open_idx:
            break
        values = [aggregate(scores[i], aggregation) for i in open_idx]
        if lookahead:
            values, tokens = _lookahead_values([cands[i] for i in open_idx], question, prm, lookahead,
                                               depth, step_tokens, aggregation, delimiter, answer_pattern,
                                               [SearchTag(tag, depth + 1, i, i) for i in open_idx])
            generated += tokens
        ranked = top_k(values, keep)
        if branching == "equal":
            shares = expand(len(ranked), num_beams)
        else:
            shares = expand_proportional([values[r] for r in ranked], num_beams)
        ranked, shares = [r for r, c in zip(ranked, shares) if c], [c for c in shares if c]
        beams, parents = [], []
        for r, children in zip(ranked, shares):
            st, closed, pending, _, _, used = cands[open_idx[r]]
            parents += [open_idx[r]] * children
            kids = st.fork(children)
            groups.append(kids)
            for kid in kids:
                if not pending:  # a cut step goes on where it stopped
                    kid += delimiter
                beams.append((kid, closed, pending, used))
        for g in groups[:-len(ranked)]:
            g.join()
        groups = groups[-len(ranked):]
    for g in groups:
        g.join()
    pool = done or ([best_open] if best_open else [])
    pick = top_k([t.score for t in pool], 1)
    answer = pool[pick[0]].answer if pick else None
    answers = {"prm_best": answer, "majority": vote([t.answer for t in pool]),
               "prm_weighted": vote([t.answer for t in pool], [t.score for t in pool])}
    return SearchResult(answer, answers, pool, generated, time.perf_counter() - t0)


def _lookahead_values(cands, question: str, prm, lookahead: int, depth: int,
                      step_tokens: int | Sequence[int], aggregation: str, delimiter: str,
                      answer_pattern: str, tags: Sequence[SearchTag]) -> tuple[list[float], int]:
    """Lookahead (Snell et al.): roll every candidate ``lookahead`` steps further at temperature 0 on
    a fork of its state, score the rolled-out paths in one PRM call, and value each candidate by its
    rollout's aggregated score. The rollouts are discarded; returns the values and their tokens."""
    roll = []
    for (st, closed, pending, path, *_), tag in zip(cands, tags):
        fork = st.fork(1)
        if not pending:
            fork[0] += delimiter
        roll.append({"group": fork, "state": fork[0], "closed": closed, "pending": pending, "path": path,
                     "done": False, "tag": tag})
    tokens = 0
    for j in range(lookahead):
        live = [r for r in roll if not r["done"]]
        if not live:
            break
        outs = gen_step([r["state"] for r in live], f"lookahead{depth}_{j}",
                        max_tokens=step_limit(step_tokens, depth + 1 + j), temperature=0.0,
                        delimiter=delimiter, answer_pattern=answer_pattern,
                        tags=[r["tag"] for r in live], attempt=f"lookahead{j}")
        tokens += sum(x.tokens for x in outs)
        for r, x in zip(live, outs):
            r["closed"], r["pending"], r["path"] = continue_path(r["closed"], r["pending"], x)
            r["done"] = x.final or not x.text
            if not r["done"] and not r["pending"]:
                r["state"] += delimiter
    scores = prm.score(question, [r["path"] for r in roll])
    for r in roll:
        r["group"].join()
    return [aggregate(sc, aggregation) for sc in scores], tokens
