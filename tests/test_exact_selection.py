"""Exact selection: every program keeps exactly the beams its definition says, at every depth.

The generator and the PRM are :mod:`sgl_tts.testing`'s scripted ones, running through SGLang's real
frontend: every sample is a pure function of (prefix, draw) and every step score a pure function of
the step text. Each algorithm is re-derived here from its written definition as plain Python over
the same script (a reference that shares no selection code with ``programs/`` or ``sgl_tts.search``),
and the program must make the same PRM calls, with the same candidates in the same order, and return
the same trajectories, scores, answers and token counts. The scripts make ties (different steps
with equal scores, identical siblings), finished beams at different depths (an answer, or an end of
sequence without one), beams still open at ``max_depth``, and N not divisible by M.
"""

from __future__ import annotations

import re

import pytest

from sgl_tts.search import BOXED, derive_seed
from sgl_tts.testing import ScriptedBackend, ScriptedPRM, continuation

from programs.beam_search import beam_search
from programs.best_of_n import best_of_n
from programs.dvts import dvts

D = "\n\n"
QUESTIONS = ["What is 1+1?", "Name a prime.", "Solve x."]

# Step texts and their scores: "a" and "bb" tie, so do the answers 1 and 3; "dd" ends the sequence
# without an answer.
SCORES = {"a": 0.5, "bb": 0.5, "ccc": 0.8, "\\boxed{1}": 0.9, "\\boxed{2}": 0.4, "\\boxed{3}": 0.9, "dd": 0.5,
          "e": 0.3, "ff": 0.3}


def branchy(prefix: str, draw: int | None) -> str:
    """A continuation from a small vocabulary, so siblings often agree and scores often tie;
    answers become likely only after a few steps, so beams finish at different depths."""
    h = derive_seed("branchy", prefix, draw)
    depth = prefix.count(D)
    opens = ["a" + D, "bb" + D, "ccc" + D, "e" + D, "ff" + D, "a" + D]
    ends = ["\\boxed{1}", "\\boxed{2}" + D, "dd"]
    pool = opens + ends * (depth >= 3) + ends * (depth >= 5)
    return pool[h % len(pool)]


def prm_score(text: str) -> float:
    return SCORES.get(text, 0.25)  # a step cut at its token limit scores 0.25


def agg(scores, how):
    if not scores:
        return 0.0
    return {"last": scores[-1], "min": min(scores), "mean": sum(scores) / len(scores)}[how]


def ranked(values, k):
    """Indices of the k largest values, best first, the earlier index winning ties."""
    order = []
    for i, v in enumerate(values):
        pos = 0
        while pos < len(order) and values[order[pos]] >= v:
            pos += 1
        order.insert(pos, i)
    return order[:k]


def sample(prefix, draw, limit):
    """(step text, closes the step?, finished?, tokens) of one scripted generation."""
    text, reason, tokens = continuation(branchy(prefix, draw), [D], limit)
    finished = bool(re.search(BOXED, text)) or isinstance(reason.get("matched"), int) or not text
    return text, reason["type"] != "length", finished, tokens


def grow(closed, pending, text, closes):
    """(closed steps, pending text, path scored) after a generated piece of a step."""
    whole = pending + text
    if closes:
        closed = closed + ([whole.strip()] if whole.strip() else [])
        return closed, "", closed
    return closed, whole, closed + ([whole.strip()] if whole.strip() else [])


def limit_at(step_tokens, depth):
    return step_tokens[min(depth, len(step_tokens) - 1)] if isinstance(step_tokens, list) else step_tokens


def answer_of(path):
    found = re.findall(BOXED, D.join(path))
    return found[-1].strip() if found else None


def ref_beam_search(q, n, m, max_depth, step_tokens=64, how="last", branching="equal", lookahead=0):
    """Beam search as its docstring defines it. Returns (PRM calls, trajectories, generated)."""
    beams = [(q + D, [], "", 0)] * n            # (text so far, closed, pending, tokens)
    calls, done, best_open, generated = [], [], None, 0
    keep = max(1, n // m)
    for depth in range(max_depth):
        cands = []
        for i, (text, closed, pending, used) in enumerate(beams):
            step, closes, fin, tok = sample(text, derive_seed("beam_search", 0, q, depth, i),
                                            limit_at(step_tokens, depth))
            generated += tok
            c, p, path = grow(closed, pending, step, closes)
            cands.append((text + step + (D if closes else ""), c, p, path, fin, used + tok))
        calls.append([x[3] for x in cands])
        scores = [[prm_score(s) for s in x[3]] for x in cands]
        opened = []
        for x, sc in zip(cands, scores):
            traj = (x[3], sc, agg(sc, how), answer_of(x[3]), x[5], x[4])
            if x[4]:
                done.append(traj)
            else:
                opened.append((x, agg(sc, how)))
                if best_open is None or traj[2] > best_open[2]:
                    best_open = traj
        if len(done) >= n or not opened:
            break
        values = [v for _, v in opened]
        if lookahead:
            values, spent, roll_paths = ref_rollouts([x for x, _ in opened], q, lookahead, depth,
                                                     step_tokens, how)
            generated += spent
            calls.append(roll_paths)
        top = ranked(values, keep)
        if branching == "equal":
            shares = [n // len(top) + (1 if j < n % len(top) else 0) for j in range(len(top))]
        else:
            mass = sum(max(0.0, values[r]) for r in top)
            if mass == 0:
                shares = [n // len(top) + (1 if j < n % len(top) else 0) for j in range(len(top))]
            else:
                quota = [max(0.0, values[r]) / mass * n for r in top]
                shares = [int(x) for x in quota]
                by_rest = ranked([x - int(x) for x in quota], len(top))
                for j in by_rest[:n - sum(shares)]:
                    shares[j] += 1
        beams = []
        for r, count in zip(top, shares):
            text, c, p, _, _, used = opened[r][0]
            beams += [(text, c, p, used)] * count
    pool = done or ([best_open] if best_open else [])
    return calls, pool, generated


def ref_rollouts(cands, q, k, depth, step_tokens, how):
    """Each candidate rolled ``k`` steps further greedily (no seed); valued by the rolled path."""
    paths, spent = [], 0
    for text, closed, pending, path, _, _ in cands:
        for j in range(k):
            step, closes, fin, tok = sample(text, None, limit_at(step_tokens, depth + 1 + j))
            spent += tok
            closed, pending, path = grow(closed, pending, step, closes)
            text += step + (D if closes else "")
            if fin:
                break
        paths.append(path)
    return [agg([prm_score(s) for s in p], how) for p in paths], spent, paths


def ref_dvts(q, n, m, max_depth, step_tokens=64, how="last"):
    """DVTS as its docstring defines it. Returns (PRM calls, trajectories by subtree, generated)."""
    live = [(t, q + D, [], "", 0) for t in range(n // m)]
    calls, results, generated = [], {}, 0
    for depth in range(max_depth):
        cands = []
        for tree, text, closed, pending, used in live:
            for j in range(m):
                step, closes, fin, tok = sample(text, derive_seed("dvts", 0, q, tree, depth, j),
                                                limit_at(step_tokens, depth))
                generated += tok
                c, p, path = grow(closed, pending, step, closes)
                cands.append((tree, text + step + (D if closes else ""), c, p, path, fin, used + tok))
        calls.append([x[4] for x in cands])
        nxt = []
        for k in range(len(live)):
            block = cands[k * m:(k + 1) * m]
            vals = [agg([prm_score(s) for s in x[4]], how) for x in block]
            tree, text, c, p, path, fin, used = block[ranked(vals, 1)[0]]
            sc = [prm_score(s) for s in path]
            results[tree] = (path, sc, agg(sc, how), answer_of(path), used, fin)
            if not fin:
                nxt.append((tree, text, c, p, used))
        live = nxt
        if not live:
            break
    return calls, [results[t] for t in sorted(results)], generated


def as_tuples(trajectories):
    return [(t.steps, t.step_scores, t.score, t.answer, t.tokens, t.finished) for t in trajectories]


def pick(pool):
    finished = [t for t in pool if t[5]] or pool
    return finished[ranked([t[2] for t in finished], 1)[0]][3] if finished else None


BEAM_CASES = [
    dict(num_beams=5, beam_width=2, max_depth=8),                       # N not divisible by M
    dict(num_beams=8, beam_width=4, max_depth=8, aggregation="min"),
    dict(num_beams=7, beam_width=3, max_depth=3),                       # most beams open at max depth
    dict(num_beams=8, beam_width=2, max_depth=8, branching="proportional"),
    dict(num_beams=6, beam_width=2, max_depth=8, step_tokens=[2, 2, 64]),   # varying granularity
    dict(num_beams=6, beam_width=3, max_depth=6, lookahead=2),
    dict(num_beams=1, beam_width=4, max_depth=8),                       # M > N keeps one beam
]


@pytest.mark.parametrize("case", BEAM_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_beam_search_keeps_exactly_the_defined_beams(case):
    backend = ScriptedBackend(branchy)
    for q in QUESTIONS:
        prm = ScriptedPRM(prm_score)
        got = beam_search.run(question=q, prm=prm, backend=backend, **case)
        assert got.error() is None, got.error()
        r = got.ret_value
        calls, pool, generated = ref_beam_search(
            q, case["num_beams"], case["beam_width"], case["max_depth"], case.get("step_tokens", 64),
            case.get("aggregation", "last"), case.get("branching", "equal"), case.get("lookahead", 0))
        assert [c.steps_batch for c in prm.calls] == calls          # every depth's candidates
        assert as_tuples(r.trajectories) == pool
        assert r.answer == (pool[ranked([t[2] for t in pool], 1)[0]][3] if pool else None)
        assert r.tokens_generated == generated


def test_the_beam_search_cases_cover_what_they_claim():
    """The scripted cases reach ties, both kinds of finished beams, open beams at max depth, and
    cut steps (otherwise the exact-selection test above would check less than it says)."""
    seen = {"tie": False, "eos": False, "answer": False, "open_at_max": False, "cut": False}
    for case in BEAM_CASES:
        for q in QUESTIONS:
            calls, pool, _ = ref_beam_search(q, case["num_beams"], case["beam_width"], case["max_depth"],
                                             case.get("step_tokens", 64), case.get("aggregation", "last"),
                                             case.get("branching", "equal"), case.get("lookahead", 0))
            for cands in calls:
                lasts = [prm_score(c[-1]) for c in cands]
                seen["tie"] |= len(set(lasts)) < len(lasts) and len({c[-1] for c in cands}) > 1
                seen["cut"] |= any(c[-1] not in SCORES for c in cands)
            seen["eos"] |= any(t[5] and t[3] is None for t in pool)
            seen["answer"] |= any(t[3] is not None for t in pool)
            seen["open_at_max"] |= any(not t[5] for t in pool)
    assert all(seen.values()), seen


DVTS_CASES = [
    dict(num_beams=6, beam_width=2, max_depth=8),
    dict(num_beams=10, beam_width=4, max_depth=8),                      # 2 subtrees, 2 beams unused
    dict(num_beams=6, beam_width=3, max_depth=2),
    dict(num_beams=6, beam_width=2, max_depth=8, step_tokens=[2, 64], aggregation="mean"),
]


@pytest.mark.parametrize("case", DVTS_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_dvts_keeps_exactly_each_subtrees_best(case):
    backend = ScriptedBackend(branchy)
    for q in QUESTIONS:
        prm = ScriptedPRM(prm_score)
        r = dvts.run(question=q, prm=prm, backend=backend, **case).ret_value
        calls, pool, generated = ref_dvts(q, case["num_beams"], case["beam_width"], case["max_depth"],
                                          case.get("step_tokens", 64), case.get("aggregation", "last"))
        assert [c.steps_batch for c in prm.calls] == calls
        assert as_tuples(r.trajectories) == pool
        assert r.answer == pick(pool)
        assert r.tokens_generated == generated


def whole_solution(prefix: str, draw: int | None) -> str:
    """Best-of-N samples a whole solution at once: two or three steps, then an answer or not."""
    h = derive_seed("whole", prefix, draw)
    steps = ["a", "bb", "ccc", "e"][h % 4:] [:2 + h % 2]
    end = ["\\boxed{1}", "\\boxed{2}", "dd", "\\boxed{3}"][(h >> 8) % 4]
    return D.join(steps + [end])


def test_best_of_n_selects_exactly_by_definition():
    backend = ScriptedBackend(whole_solution)
    ties = 0
    for q in QUESTIONS:
        for n in (1, 3, 8):
            prm = ScriptedPRM(prm_score)
            r = best_of_n.run(question=q, num_samples=n, prm=prm, backend=backend).ret_value
            texts = [whole_solution(q + D, derive_seed("best_of_n", 0, q, i)) for i in range(n)]
            paths = [[s.strip() for s in t.split(D) if s.strip()] for t in texts]
            assert prm.calls[0].steps_batch == paths and len(prm.calls) == 1
            scores = [prm_score(p[-1]) for p in paths]
            answers = [answer_of(p) for p in paths]
            assert r.answers["prm_best"] == answers[ranked(scores, 1)[0]]
            ties += len({a for a, s in zip(answers, scores) if s == max(scores)}) > 1
            tally: dict = {}
            for a, s in zip(answers, scores):
                if a is not None:
                    tally[a] = tally.get(a, 0.0) + s
            assert r.answers["prm_weighted"] == (max(tally, key=lambda a: (tally[a], -list(tally).index(a)))
                                                 if tally else None)
            assert r.tokens_generated == sum(len(t) for t in texts)
    assert ties  # some best score is shared by different answers: the tie-break decides


def test_ties_go_to_the_earlier_beam_a_worked_example():
    """By hand: 7 beams, width 3, so 2 are kept and get 4 + 3 children. Beam i's first step is
    "b<i>"; b1, b3 and b5 tie for best, so b1 and b3 are kept (the earlier ones) and b1, ranked
    first, gets the extra child. The second step is an answer; \\boxed{2} and \\boxed{5} tie, the
    earlier one is the pick."""
    q = "Q"
    index = {derive_seed("beam_search", 0, q, depth, i): i for depth in range(2) for i in range(7)}

    def script(prefix: str, draw: int | None) -> str:
        return f"b{index[draw]}" + D if prefix == q + D else f"\\boxed{{{index[draw]}}}"

    prm = ScriptedPRM({"b0": .5, "b1": .9, "b2": .5, "b3": .9, "b4": .1, "b5": .9, "b6": .2,
                       "\\boxed{2}": .8, "\\boxed{5}": .8}, default=.3)
    r = beam_search.run(question=q, prm=prm, num_beams=7, beam_width=3,
                        backend=ScriptedBackend(script)).ret_value
    assert prm.calls[0].steps_batch == [[f"b{i}"] for i in range(7)]
    assert prm.calls[1].steps_batch == [["b1", f"\\boxed{{{i}}}"] for i in range(4)] + \
        [["b3", f"\\boxed{{{i}}}"] for i in range(4, 7)]
    assert len(prm.calls) == 2 and len(r.trajectories) == 7
    assert r.answer == "2" and r.answers["majority"] == "0"  # all answers once: the first wins
    assert [t.tokens for t in r.trajectories] == [4 + 9] * 7     # "b1\n\n" + "\\boxed{i}"


def test_scripted_backend_applies_stop_length_and_end_of_sequence():
    assert continuation("ab\n\ncd", ["\n\n"], 64) == ("ab", {"type": "stop", "matched": "\n\n"}, 4)
    assert continuation("abcdef", ["\n\n"], 3) == ("abc", {"type": "length", "length": 3}, 3)
    assert continuation("ab", ["\n\n"], 64) == ("ab", {"type": "stop", "matched": 0}, 2)
    assert continuation("ab\n\n", ["\n\n"], 3) == ("ab\n", {"type": "length", "length": 3}, 3)
    assert continuation("x:y", [":", "y"], 64) == ("x", {"type": "stop", "matched": ":"}, 2)


def test_scripted_prm_reports_a_step_it_has_no_score_for():
    prm = ScriptedPRM({"a": 0.5})
    assert prm.score("Q", [["a"], []]) == [[0.5], []]
    with pytest.raises(KeyError, match="no score for step 'b'"):
        prm.score("Q", [["a", "b"]])
    assert ScriptedPRM({"a": 0.5}, default=0.1).score("Q", [["a", "b"]]) == [[0.5, 0.1]]


@pytest.mark.parametrize("program, kwargs", [
    (beam_search, dict(num_beams=5, beam_width=2, max_depth=6)),
    (beam_search, dict(num_beams=6, beam_width=3, max_depth=6, lookahead=1)),
    (dvts, dict(num_beams=6, beam_width=2, max_depth=6)),
], ids=["beam_search", "beam_search_lookahead", "dvts"])
def test_every_request_carries_its_place_in_the_search(program, kwargs):
    """Each generation request names its search group, depth, parent and beam (custom_params) and
    has a unique rid under tts/<group>/: the metadata the scheduler plugin orders by. The parent is
    checked against the text: a depth-d request continues its parent's depth-(d-1) request."""
    backend = ScriptedBackend(branchy)
    program.run(question=QUESTIONS[0], prm=ScriptedPRM(prm_score), backend=backend,
                search_group="g42", **kwargs)
    draws = backend.draws
    assert all(d.custom_params["tts_group"] == "g42" and d.rid.startswith("tts/g42/") for d in draws)
    assert len({d.rid for d in draws}) == len(draws)
    steps = {(d.custom_params["tts_depth"], d.custom_params["tts_beam"]): d for d in draws
             if "lookahead" not in d.rid}
    for (depth, beam), d in steps.items():
        parent = d.custom_params["tts_parent"]
        if depth == 0:
            assert parent == -1 and d.prefix == QUESTIONS[0] + D
            continue
        if program is dvts:  # DVTS names its subtree as the parent
            assert parent == beam // kwargs["beam_width"]
            continue
        up = steps[(depth - 1, parent)]
        assert d.prefix.startswith(up.prefix + up.text), (depth, beam)
    assert all(d.custom_params["tts_class"] == "normal" for d in draws)
