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

import collections
import random
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
    """The table's score, or one of four derived from the text (a cut step, a random script's step)."""
    return SCORES[text] if text in SCORES else (derive_seed("score", text) % 4) / 8 + 0.1


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


def sample(prefix, draw, limit, script=None):
    """(piece, finish reason, tokens) of one scripted generation."""
    return continuation((script or branchy)(prefix, draw), [D], limit)


EVENTS: collections.Counter = collections.Counter()   # what the random scripts made happen


def judge(body, reason):
    """A path judged on whole steps: ``body`` is everything generated so far (with the delimiters that
    stopped earlier generations), ``reason`` how the newest generation ended. A step is the text between
    two delimiters; the newest one is still open when the generation was cut at its token limit. The
    path is finished at the first step that holds an answer, at an end of sequence, or when its newest
    step, whole, is empty. Returns (steps the PRM scores, finished, cut)."""
    cut = reason["type"] == "length"
    parts = body.split(D)
    closed, open_part = (parts[:-1], parts[-1]) if cut else (parts, "")
    steps = []
    for part in closed:
        if part.strip():
            steps.append(part.strip())
            if re.search(BOXED, part):
                return steps, True, False
    if cut:
        return steps + ([open_part.strip()] if open_part.strip() else []), bool(re.search(BOXED, open_part)), True
    return steps, isinstance(reason["matched"], int) or not parts[-1].strip(), False


def note_events(body, piece, reason):
    """Count the cases the whole-step rules exist for (after a cut, ``body`` does not end in D)."""
    was_cut = body != "" and not body.endswith(D)
    open_before = body.split(D)[-1]
    if was_cut and open_before.strip() and piece == "" and reason.get("matched") == D:
        EVENTS["delimiter-only continuation"] += 1
    if was_cut and open_before.endswith("\n") and piece.startswith("\n"):
        EVENTS["delimiter across the cut"] += 1
    if was_cut and re.search(BOXED, open_before + piece) and not re.search(BOXED, open_before) \
            and not re.search(BOXED, piece):
        EVENTS["answer across the cut"] += 1
    if reason["type"] == "length" and D in piece:
        EVENTS["delimiter inside a cut piece"] += 1


def extend(body, piece, reason):
    """The body after a generation: a stop string was trimmed by SGLang and is put back."""
    stopped = reason["type"] == "stop" and reason["matched"] == D
    return body + piece + (D if stopped else "")


def limit_at(step_tokens, depth):
    return step_tokens[min(depth, len(step_tokens) - 1)] if isinstance(step_tokens, list) else step_tokens


def answer_of(path):
    found = re.findall(BOXED, D.join(path))
    return found[-1].strip() if found else None


def ref_beam_search(q, n, m, max_depth, step_tokens=64, how="last", branching="equal", lookahead=0,
                    script=None, filter_duplicates=False, accept=None):
    """Beam search as its docstring defines it. Returns (PRM calls, trajectories, generated)."""
    beams = [("", 0, -1, i) for i in range(n)]   # (body so far, tokens, parent candidate, child ordinal)
    calls, done, best_open, generated = [], [], None, 0
    keep = max(1, n // m)
    for depth in range(max_depth):
        cands = []
        for i, (body, used, parent, ordinal) in enumerate(beams):
            # a step's seed: its depth, its parent's candidate index and its place among that parent's children
            piece, reason, tok = sample(q + D + body, derive_seed("beam_search", 0, q, depth, parent, ordinal),
                                        limit_at(step_tokens, depth), script)
            generated += tok
            note_events(body, piece, reason)
            path, fin, _ = judge(body + piece, reason)
            cands.append((extend(body, piece, reason), path, fin, used + tok, i))
        calls.append([x[1] for x in cands])
        opened = []
        for x in cands:
            sc = [prm_score(s) for s in x[1]]
            traj = (x[1], sc, agg(sc, how), answer_of(x[1]), x[3], x[2])
            if x[2]:
                done.append(traj)
            else:
                opened.append((x, agg(sc, how)))
                if best_open is None or traj[2] > best_open[2]:
                    best_open = traj
        if len(done) >= n or not opened:
            break
        if accept is not None and any(t[2] >= accept for t in done):   # positive early exit
            break
        if filter_duplicates:
            firsts = {}
            for x, v in opened:
                firsts.setdefault(tuple(x[1]), (x, v))
            opened = list(firsts.values())
        values = [v for _, v in opened]
        if lookahead:
            values, spent, roll_paths = ref_rollouts([x for x, _ in opened], q, lookahead, depth,
                                                     step_tokens, how, script)
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
            body, _, _, used, index = opened[r][0]
            beams += [(body, used, index, j) for j in range(count)]
    pool = done or ([best_open] if best_open else [])
    return calls, pool, generated


def ref_rollouts(cands, q, k, depth, step_tokens, how, script=None):
    """Each candidate rolled ``k`` steps further greedily (no seed); valued by the rolled path."""
    paths, spent = [], 0
    for body, path, *_ in cands:
        for j in range(k):
            piece, reason, tok = sample(q + D + body, None, limit_at(step_tokens, depth + 1 + j), script)
            spent += tok
            path, fin, _ = judge(body + piece, reason)
            body = extend(body, piece, reason)
            if fin:
                break
        paths.append(path)
    return [agg([prm_score(s) for s in p], how) for p in paths], spent, paths


def ref_dvts(q, n, m, max_depth, step_tokens=64, how="last", script=None):
    """DVTS as its docstring defines it. Returns (PRM calls, trajectories by subtree, generated)."""
    live = [(t, "", 0) for t in range(n // m)]
    calls, results, generated = [], {}, 0
    for depth in range(max_depth):
        cands = []
        for tree, body, used in live:
            for j in range(m):
                piece, reason, tok = sample(q + D + body, derive_seed("dvts", 0, q, tree, depth, j),
                                            limit_at(step_tokens, depth), script)
                generated += tok
                path, fin, _ = judge(body + piece, reason)
                cands.append((tree, extend(body, piece, reason), path, fin, used + tok))
        calls.append([x[2] for x in cands])
        nxt = []
        for k in range(len(live)):
            block = cands[k * m:(k + 1) * m]
            vals = [agg([prm_score(s) for s in x[2]], how) for x in block]
            tree, body, path, fin, used = block[ranked(vals, 1)[0]]
            sc = [prm_score(s) for s in path]
            results[tree] = (path, sc, agg(sc, how), answer_of(path), used, fin)
            if not fin:
                nxt.append((tree, body, used))
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
    dict(num_beams=7, beam_width=3, max_depth=2),                       # most beams open at max depth
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


@pytest.mark.parametrize("accept", [0.4, 0.5, 0.9])   # scores finished steps get: the boundary counts
def test_beam_search_with_positive_early_exit_stops_at_the_first_good_enough_depth(accept):
    backend = ScriptedBackend(branchy)
    stopped = 0
    for q in QUESTIONS:
        prm = ScriptedPRM(prm_score)
        r = beam_search.run(question=q, prm=prm, backend=backend, num_beams=6, beam_width=2, max_depth=8,
                            accept_threshold=accept).ret_value
        calls, pool, generated = ref_beam_search(q, 6, 2, 8, accept=accept)
        full, _, _ = ref_beam_search(q, 6, 2, 8)
        assert [c.steps_batch for c in prm.calls] == calls
        assert as_tuples(r.trajectories) == pool and r.tokens_generated == generated
        # the other stops are checked first and are the same in both: fewer depths means accepted
        early = len(calls) < len(full)
        assert r.exit_reason == ("accepted" if early else None)
        stopped += early
    assert stopped > 0


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
            assert r.tokens_generated == sum(len(t) + 1 for t in texts)  # + the end-of-sequence token
    assert ties  # some best score is shared by different answers: the tie-break decides


def test_ties_go_to_the_earlier_beam_a_worked_example():
    """By hand: 7 beams, width 3, so 2 are kept and get 4 + 3 children. Beam i's first step is
    "b<i>"; b1, b3 and b5 tie for best, so b1 and b3 are kept (the earlier ones) and b1, ranked
    first, gets the extra child. The second step is an answer; \\boxed{2} and \\boxed{5} tie, the
    earlier one is the pick."""
    q = "Q"
    # a step's seed is keyed by (depth, parent candidate, child ordinal); number the second steps 0..6
    # in expansion order: b1's four children, then b3's three
    index = {derive_seed("beam_search", 0, q, 0, -1, i): i for i in range(7)}
    index |= {derive_seed("beam_search", 0, q, 1, 1, j): j for j in range(4)}
    index |= {derive_seed("beam_search", 0, q, 1, 3, j): 4 + j for j in range(3)}

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
    assert [t.tokens for t in r.trajectories] == [4 + 9 + 1] * 7     # "b1\n\n" + "\\boxed{i}" + EOS


def test_scripted_backend_applies_stop_length_and_end_of_sequence():
    assert continuation("ab\n\ncd", ["\n\n"], 64) == ("ab", {"type": "stop", "matched": "\n\n"}, 4)
    assert continuation("abcdef", ["\n\n"], 3) == ("abc", {"type": "length", "length": 3}, 3)
    assert continuation("ab", ["\n\n"], 64) == ("ab", {"type": "stop", "matched": 0}, 3)   # EOS is a token
    # SGLang checks the limit first: a stop string or the end of sequence on the last allowed token
    # does not count
    assert continuation("ab\n\ncd", ["\n\n"], 4) == ("ab\n\n", {"type": "length", "length": 4}, 4)
    assert continuation("ab", ["\n\n"], 3) == ("ab", {"type": "length", "length": 3}, 3)
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
        up = steps[(depth - 1, parent)]   # the parent is its candidate index at the previous depth
        assert d.prefix.startswith(up.prefix + up.text), (depth, beam)
    assert all(d.custom_params["tts_class"] == "normal" for d in draws)
    # siblings are numbered 0, 1, ... in beam order (the ordinal keys a step's seed)
    for depth in {k[0] for k in steps}:
        if depth == 0:
            continue
        families: dict[int, list[int]] = {}
        for (dd, beam), d in sorted(steps.items()):
            if dd == depth:
                families.setdefault(d.custom_params["tts_parent"], []).append(d.custom_params["tts_ordinal"])
        assert all(o == list(range(len(o))) for o in families.values()), families


def jagged(prefix: str, draw: int | None) -> str:
    """A random script whose pieces make cuts land anywhere: delimiters and answers straddle them,
    continuations are only a delimiter, steps are empty, sequences end early. A prefix that ends
    inside an answer is continued with the rest of it, as a model would."""
    rng = random.Random(derive_seed("jagged", prefix, draw))
    pieces = ["a", "bb", "\n", "\n\n", "\\boxed{1}", "\\boxed{2}", "c ", "\n\n"]
    rest = next((t[k:] for t in ("\\boxed{1}", "\\boxed{2}") for k in range(len(t) - 1, 0, -1)
                 if prefix.endswith(t[:k])), "")
    return rest + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))


JAGGED_CASES = [
    dict(num_beams=4, beam_width=2, max_depth=6, step_tokens=[3, 2, 5]),
    dict(num_beams=5, beam_width=2, max_depth=6, step_tokens=2, aggregation="min"),
    dict(num_beams=3, beam_width=5, max_depth=5, step_tokens=[4, 1, 3]),            # M > N
    dict(num_beams=6, beam_width=4, max_depth=5, step_tokens=3, filter_duplicates=True),
    dict(num_beams=6, beam_width=2, max_depth=5, step_tokens=[2, 4], branching="proportional"),
    dict(num_beams=4, beam_width=2, max_depth=4, step_tokens=[3, 2], lookahead=2),
]


@pytest.mark.parametrize("case", JAGGED_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_beam_search_judges_whole_steps_over_random_scripts(case):
    """Replayed against the reference over many random scripts: cut steps continued, delimiters and
    answers across cuts, a delimiter as the last token of a cut piece, empty steps, EOS, ties."""
    backend = ScriptedBackend(jagged)
    for k in range(12):
        q = f"Q{k}"
        prm = ScriptedPRM(prm_score)
        got = beam_search.run(question=q, prm=prm, backend=backend, **case)
        assert got.error() is None, got.error()
        r = got.ret_value
        calls, pool, generated = ref_beam_search(
            q, case["num_beams"], case["beam_width"], case["max_depth"], case["step_tokens"],
            case.get("aggregation", "last"), case.get("branching", "equal"), case.get("lookahead", 0),
            script=jagged, filter_duplicates=case.get("filter_duplicates", False))
        assert [c.steps_batch for c in prm.calls] == calls, q
        assert as_tuples(r.trajectories) == pool, q
        assert r.answer == (pool[ranked([t[2] for t in pool], 1)[0]][3] if pool else None)
        assert r.tokens_generated == generated


@pytest.mark.parametrize("case", [dict(num_beams=6, beam_width=2, max_depth=6, step_tokens=[3, 2, 5]),
                                  dict(num_beams=6, beam_width=3, max_depth=5, step_tokens=2)],
                         ids=["schedule", "two-tokens"])
def test_dvts_judges_whole_steps_over_random_scripts(case):
    backend = ScriptedBackend(jagged)
    for k in range(12):
        q = f"Q{k}"
        prm = ScriptedPRM(prm_score)
        r = dvts.run(question=q, prm=prm, backend=backend, **case).ret_value
        calls, pool, generated = ref_dvts(q, case["num_beams"], case["beam_width"], case["max_depth"],
                                          case["step_tokens"], script=jagged)
        assert [c.steps_batch for c in prm.calls] == calls, q
        assert as_tuples(r.trajectories) == pool, q
        assert r.tokens_generated == generated


def test_the_random_scripts_reach_every_case_of_whole_steps():
    EVENTS.clear()
    for case in JAGGED_CASES:
        for k in range(12):
            ref_beam_search(f"Q{k}", case["num_beams"], case["beam_width"], case["max_depth"], case["step_tokens"],
                            script=jagged)
    assert set(EVENTS) == {"delimiter-only continuation", "delimiter across the cut", "answer across the cut",
                           "delimiter inside a cut piece"}, EVENTS
    assert min(EVENTS.values()) >= 3, EVENTS


def _one_beam(script, step_tokens, program=beam_search, **kw):
    prm = ScriptedPRM(prm_score)
    args = dict(num_beams=1, beam_width=1) if program is beam_search else dict(num_beams=2, beam_width=2)
    r = program.run(question="Q", prm=prm, backend=ScriptedBackend(script), max_depth=4,
                    step_tokens=step_tokens, **args, **kw).ret_value
    return r, [c.steps_batch for c in prm.calls]


def test_a_continuation_that_is_only_the_delimiter_completes_the_cut_step():
    texts = {"Q" + D: "abcdef", "Q" + D + "abc": D + "tail", "Q" + D + "abc" + D: "\\boxed{7}"}
    r, calls = _one_beam(lambda prefix, draw: texts[prefix], [3, 64])
    assert calls == [[["abc"]], [["abc"]], [["abc", "\\boxed{7}"]]]
    assert r.answer == "7" and r.trajectories[0].steps == ["abc", "\\boxed{7}"]


def test_an_answer_across_the_cut_ends_the_beam_where_it_is():
    texts = {"Q" + D: "so \\boxed{42} more" + D, "Q" + D + "so \\boxed": "{42} more" + D + "x"}
    r, calls = _one_beam(lambda prefix, draw: texts[prefix], [9, 64])
    assert calls == [[["so \\boxed"]], [["so \\boxed{42} more"]]]
    assert r.trajectories[0].finished and r.answer == "42"


@pytest.mark.parametrize("program", [beam_search, dvts], ids=["beam_search", "dvts"])
def test_a_delimiter_at_the_limit_or_across_the_cut_separates_two_steps(program):
    at_limit = {"Q" + D: "ab" + D + "zz", "Q" + D + "ab" + D: "cd" + D + "\\boxed{1}"}
    _, calls = _one_beam(lambda prefix, draw: at_limit.get(prefix, "\\boxed{1}"), [4, 64], program)
    width = 1 if program is beam_search else 2
    assert calls[:2] == [[["ab"]] * width, [["ab", "cd"]] * width]
    across = {"Q" + D: "ab\n", "Q" + D + "ab\n": "\ncd" + D + "\\boxed{1}"}
    _, calls = _one_beam(lambda prefix, draw: across.get(prefix, "\\boxed{1}"), [3, 64], program)
    assert calls[:2] == [[["ab"]] * width, [["ab", "cd"]] * width]


def test_lookahead_rollouts_judge_whole_steps():
    """A rollout continues a cut step: the delimiter-only continuation closes it, not ends it."""
    texts = {"Q" + D: "abcdef", "Q" + D + "abc": D + "t", "Q" + D + "abc" + D: "\\boxed{7}"}
    prm = ScriptedPRM(prm_score)
    beam_search.run(question="Q", prm=prm, backend=ScriptedBackend(lambda p, d: texts[p]), num_beams=1,
                    beam_width=1, max_depth=2, step_tokens=[3, 64, 64], lookahead=2)
    assert [c.steps_batch for c in prm.calls][:2] == [[["abc"]], [["abc", "\\boxed{7}"]]]
