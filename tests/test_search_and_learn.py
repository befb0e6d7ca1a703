"""``beam_search(..., semantics="search-and-learn")`` reproduces huggingface/search-and-learn's beam search.

The reference below is that algorithm re-derived as plain Python from its definition
(``src/sal/search/beam_search.py``, ``sal/search/utils.py``, ``sal/models/reward_models.py`` and vLLM's
finish rules), sharing no code with ``programs/``: a beam's text keeps its stop strings
(``include_stop_str_in_output``); a beam completes on EOS or on its token limit (vLLM's
``stop_reason`` is ``None`` for both) or when it generated nothing; the PRM (RLHFlow) scores the text
split on the delimiter; the N // M best open beams by ``np.argsort`` stay, in their order; the kept
beams are repeated cyclically up to N before each iteration; the last iteration has no stop string;
the result is the first N completed (or the N best, ``sort_completed``) repeated up to N, and the
prediction the best aggregated score among them (``np.argmax``).
"""

from __future__ import annotations

import copy
import random
import re

import numpy as np
import pytest

from sgl_tts.search import BOXED, derive_seed
from sgl_tts.testing import ScriptedBackend, ScriptedPRM, continuation

from programs.beam_search import beam_search

D = "\n\n"


def prm_score(step: str) -> float:
    return (derive_seed("sal-score", step) % 5) / 8 + 0.1


def aggregate(scores, how):
    return {"last": lambda x: x[-1], "min": min, "prod": lambda x: float(np.prod(x))}[how](scores)


def sal_seed(q, i, j):
    return derive_seed("beam_search/search-and-learn", 0, q, i, j)


def ref_search_and_learn(q, script, n, m, num_iterations, max_tokens, agg="last", filter_duplicates=False,
                         sort_completed=False):
    """search-and-learn's ``_beam_search`` for one prompt. Returns (PRM calls, final beams, tokens)."""
    beams = [{"text": "", "scores": [], "tokens": 0, "pruned": False, "completed": False} for _ in range(n)]
    completed, calls, generated = [], [], 0
    active = beams
    for i in range(num_iterations):
        active = [b for b in active if not b["pruned"]]
        if len(active) != n:
            repeats = n // len(active) + 1
            active = [copy.deepcopy(b) for b in (active * repeats)[:n]]
        stop = [] if i == num_iterations - 1 else [D]     # the last iteration generates to EOS
        for j, b in enumerate(active):
            text, reason, tokens = continuation(script(q + D + b["text"], sal_seed(q, i, j)), stop, max_tokens)
            generated += tokens
            stop_reason = reason["matched"] if reason["type"] == "stop" and isinstance(reason["matched"], str) else None
            next_text = text + (stop_reason or "")          # include_stop_str_in_output
            b["text"] += next_text
            b["tokens"] += tokens
            if stop_reason is None or next_text == "":     # vLLM: None for EOS and for the length limit
                b["completed"] = True
                completed.append(b)
        calls.append([b["text"].split(D) for b in active])  # RLHFlow: ans.split("\n\n")
        for b in active:
            b["scores"] = [prm_score(s) for s in b["text"].split(D)]
        agg_scores = [aggregate(b["scores"], agg) for b in active if not b["completed"]]
        active = [b for b in active if not b["completed"]]
        if not active:
            break
        if filter_duplicates:
            unique = {}
            for k, b in enumerate(active):
                if b["text"] not in unique:
                    unique[b["text"]] = k
            active = [active[k] for k in unique.values()]
            agg_scores = [agg_scores[k] for k in unique.values()]
        top = np.argsort(np.array(agg_scores).flatten())[-(n // m):]
        for k, b in enumerate(active):
            if k not in top:
                b["pruned"] = True
    if sort_completed:
        completed = sorted(completed, key=lambda b: aggregate(b["scores"], agg), reverse=True)[:n]
    else:
        completed = completed[:n]
    if len(completed) != n:
        completed = [copy.deepcopy(b) for b in (completed * (n // len(completed) + 1))[:n]]
    return calls, completed, generated


def as_tuples(trajectories):
    return [(t.steps, t.step_scores, t.score, t.answer, t.tokens) for t in trajectories]


def ref_tuples(beams, agg):
    out = []
    for b in beams:
        found = re.findall(BOXED, b["text"])
        out.append((b["text"].split(D), b["scores"], aggregate(b["scores"], agg),
                    found[-1].strip() if found else None, b["tokens"]))
    return out


def sal_script(prefix: str, draw: int | None) -> str:
    """Random steps: stop strings, answers, EOS at any point, empty steps, long steps that hit the
    limit, and few distinct texts (duplicates and score ties)."""
    rng = random.Random(derive_seed("sal-script", prefix, draw))
    pieces = ["a", "bb", "\n\n", "\\boxed{1}", "\\boxed{2}", "c", "\n\n", "dddddddd"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 4)))


CASES = [
    dict(num_beams=4, beam_width=2, max_depth=5, step_tokens=6),
    dict(num_beams=5, beam_width=2, max_depth=6, step_tokens=9, aggregation="min"),      # N % M != 0
    dict(num_beams=3, beam_width=4, max_depth=5, step_tokens=8),                         # N // M == 0
    dict(num_beams=6, beam_width=3, max_depth=5, step_tokens=7, filter_duplicates=True),
    dict(num_beams=4, beam_width=1, max_depth=4, step_tokens=12, sort_completed=True, aggregation="prod"),
    dict(num_beams=6, beam_width=2, max_depth=1, step_tokens=10),                        # one (last) iteration
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_search_and_learn_mode_matches_its_reference_over_random_scripts(case):
    backend = ScriptedBackend(sal_script)
    how = case.get("aggregation", "last")
    for k in range(15):
        q = f"Q{k}"
        prm = ScriptedPRM(prm_score)
        got = beam_search.run(question=q, prm=prm, backend=backend, semantics="search-and-learn", **case)
        assert got.error() is None, got.error()
        r = got.ret_value
        calls, final, generated = ref_search_and_learn(
            q, sal_script, case["num_beams"], case["beam_width"], case["max_depth"], case["step_tokens"], how,
            case.get("filter_duplicates", False), case.get("sort_completed", False))
        assert [c.steps_batch for c in prm.calls] == calls, q
        assert as_tuples(r.trajectories) == ref_tuples(final, how), q
        pred = ref_tuples(final, how)[int(np.argmax([aggregate(b["scores"], how) for b in final]))][3]
        assert r.answer == pred and r.tokens_generated == generated


def test_the_random_scripts_reach_every_case():
    """The cases above meet EOS, length finishes, ties, duplicates, refills and short pools."""
    seen = set()
    for case in CASES:
        for k in range(15):
            calls, final, _ = ref_search_and_learn(f"Q{k}", sal_script, case["num_beams"], case["beam_width"],
                                                   case["max_depth"], case["step_tokens"])
            for batch in calls:
                lasts = [prm_score(p[-1]) for p in batch]
                if len(set(lasts)) < len(lasts):
                    seen.add("tie")
                if len({D.join(p) for p in batch}) < len(batch):
                    seen.add("duplicate")
                if any(p[-1] == "" for p in batch):
                    seen.add("empty last step")
            if any(t["tokens"] and not t["text"].endswith(D) for t in final):
                seen.add("completed without a stop string")
            if len({id(b) for b in final}) < len(final) or len({b["text"] for b in final}) < len(final):
                seen.add("refilled or repeated")
    assert seen == {"tie", "duplicate", "empty last step", "completed without a stop string",
                    "refilled or repeated"}, seen


def test_a_hand_worked_search_and_learn_run():
    """By hand, N = 3, M = 2 (one beam kept), 3 iterations, limit 12 tokens, ``last`` aggregation.

    Iteration 0: beams write "a\\n\\n", "b\\n\\n" and "c" (EOS: completed). The PRM sees ["a", ""],
    ["b", ""] and ["c"]: the open beams' last step is the empty one after the delimiter, so they tie,
    and np.argsort keeps the *later* one: "b". Iteration 1: "b" is repeated to 3 beams; they write
    "\\boxed{1}" (EOS: completed), "d\\n\\n" (open) and 20 e's (cut at 12: completed, a length
    finish completes a beam). Iteration 2 is the last: no stop string, so "d"'s copies write through
    a delimiter to the end. Six beams completed; the first three are returned, and the best of them
    by its last score is \\boxed{1}; with sort_completed the three best of all six are returned.
    """
    q = "Q"
    index = {sal_seed(q, i, j): (i, j) for i in range(3) for j in range(3)}
    writes = {(0, 0): "a" + D, (0, 1): "b" + D, (0, 2): "c", (1, 0): "\\boxed{1}", (1, 1): "d" + D,
              (1, 2): "e" * 20, (2, 0): "\\boxed{2}", (2, 1): "f" + D + "\\boxed{3}", (2, 2): "\\boxed{4}"}
    backend = ScriptedBackend(lambda prefix, draw: writes[index[draw]])
    table = {"": 0.5, "a": 0.9, "b": 0.1, "c": 0.6, "\\boxed{1}": 0.7, "e" * 12: 0.2, "d": 0.3,
             "\\boxed{2}": 0.8, "f": 0.4, "\\boxed{3}": 0.95, "\\boxed{4}": 0.05}
    prm = ScriptedPRM(table)
    r = beam_search.run(question=q, prm=prm, backend=backend, num_beams=3, beam_width=2, max_depth=3,
                        step_tokens=12, semantics="search-and-learn").ret_value
    assert [c.steps_batch for c in prm.calls] == [
        [["a", ""], ["b", ""], ["c"]],
        [["b", "\\boxed{1}"], ["b", "d", ""], ["b", "e" * 12]],
        [["b", "d", "\\boxed{2}"], ["b", "d", "f", "\\boxed{3}"], ["b", "d", "\\boxed{4}"]],
    ]
    assert sorted({d.prefix for d in backend.draws if index[d.draw][0] == 1}) == ["Q" + D + "b" + D]
    assert [t.steps for t in r.trajectories] == [["c"], ["b", "\\boxed{1}"], ["b", "e" * 12]]   # as scored
    assert [t.tokens for t in r.trajectories] == [2, 3 + 10, 3 + 12]   # "c" + EOS; "b\n\n" + 9 + EOS; cut
    assert r.answer == "1" and r.tokens_generated == 3 + 3 + 2 + 10 + 3 + 12 + 10 + 12 + 10   # "f..\\boxed{3}" ends on the limit
    prm = ScriptedPRM(table)
    best = beam_search.run(question=q, prm=prm, backend=backend, num_beams=3, beam_width=2, max_depth=3,
                           step_tokens=12, semantics="search-and-learn", sort_completed=True).ret_value
    assert [t.answer for t in best.trajectories] == ["3", "2", "1"] and best.answer == "3"


def test_the_default_mode_differs_where_documented():
    """The same script under both semantics: a step that reaches its token limit is continued by the
    default (and judged whole) but completes the beam under search-and-learn's rules."""
    writes = {"Q" + D: "abcdef" + D, "Q" + D + "abc": "def" + D, "Q" + D + "abcdef" + D: "\\boxed{5}"}
    backend = ScriptedBackend(lambda prefix, draw: writes[prefix])
    kwargs = dict(question="Q", backend=backend, num_beams=1, beam_width=1, max_depth=3, step_tokens=[3, 64])
    ours = beam_search.run(prm=ScriptedPRM(prm_score), **kwargs).ret_value
    assert [(t.steps, t.answer) for t in ours.trajectories] == [(["abcdef", "\\boxed{5}"], "5")]
    prm = ScriptedPRM(prm_score)
    theirs = beam_search.run(prm=prm, semantics="search-and-learn", **kwargs).ret_value
    assert [c.steps_batch for c in prm.calls] == [[["abc"]]]
    assert [(t.steps, t.answer) for t in theirs.trajectories] == [(["abc"], None)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(semantics="sal"), "unknown semantics 'sal'; choose one of \\['sgl-tts', 'search-and-learn'\\]"),
    (dict(semantics="search-and-learn", lookahead=1), "has no branching or lookahead options"),
    (dict(sort_completed=True), "sort_completed belongs to semantics='search-and-learn'"),
    (dict(max_depth=0), "max_depth must be >= 1, got 0"),
])
def test_bad_settings_are_refused_before_any_generation(kwargs, message):
    backend = ScriptedBackend(sal_script)
    with pytest.raises(ValueError, match=message):
        beam_search.run(question="Q", prm=ScriptedPRM(prm_score), backend=backend, **kwargs)
    assert backend.draws == []
