"""Search primitives: aggregation, stable top-k, expansion, answers, votes, seeds, final steps."""

from __future__ import annotations

import pytest

from sgl_tts.search import (Advance, PathSoFar, Step, advance, aggregate, derive_seed, expand, expand_proportional,
                            extract_answer, is_final, split_steps, step_limit, top_k, vote)


def test_aggregations():
    xs = [0.9, 0.5, 0.8]
    assert aggregate(xs, "last") == 0.8
    assert aggregate(xs, "min") == 0.5
    assert aggregate(xs, "prod") == pytest.approx(0.36)
    assert aggregate(xs, "mean") == pytest.approx(2.2 / 3)
    assert aggregate([], "min") == 0.0
    with pytest.raises(ValueError, match="unknown aggregation 'max'; choose one of"):
        aggregate(xs, "max")


def test_top_k_is_stable_on_ties():
    assert top_k([0.5, 0.9, 0.5, 0.9, 0.1], 3) == [1, 3, 0]
    assert top_k([0.2, 0.2, 0.2], 2) == [0, 1]
    assert top_k([0.3], 5) == [0]
    assert top_k([0.3, 0.4], 0) == []


def test_expand_splits_the_budget_best_first():
    assert expand(4, 16) == [4, 4, 4, 4]
    assert expand(3, 8) == [3, 3, 2]
    assert expand(5, 3) == [1, 1, 1, 0, 0]
    assert expand(0, 16) == []
    assert sum(expand(7, 16)) == 16


def test_expand_proportional_splits_the_budget_by_score():
    assert expand_proportional([0.6, 0.3, 0.1], 8) == [5, 2, 1]
    assert expand_proportional([1.0, 1.0, 0.0, 0.0], 8) == [4, 4, 0, 0]
    assert expand_proportional([0.5, 0.5, 0.5], 4) == [2, 1, 1]     # leftover ties: lower index
    assert expand_proportional([0.9, -3.0, 0.1], 10) == [9, 0, 1]  # negative counts as zero
    assert expand_proportional([0.0, 0.0, 0.0], 8) == expand(3, 8)
    assert expand_proportional([], 8) == [] and expand_proportional([0.2, 0.7], 0) == [0, 0]
    assert sum(expand_proportional([0.13, 0.29, 0.58, 0.01], 16)) == 16
    with pytest.raises(ValueError, match="total must be >= 0, got -1"):
        expand_proportional([0.5], -1)


def test_step_limit_schedules():
    assert [step_limit([64, 64, 64, 2048], d) for d in range(6)] == [64, 64, 64, 2048, 2048, 2048]
    assert step_limit(32, 9) == 32
    for bad in ([], [64, 0], 0, [1.5]):
        with pytest.raises(ValueError, match="step_tokens must be positive integers"):
            step_limit(bad, 0)


CUT = {"type": "length", "length": 3}
STOP = {"type": "stop", "matched": "\n\n"}
EOS = {"type": "stop", "matched": 0}


def piece(raw, reason):
    return Step(raw.strip(), len(raw), False, reason, raw)


def test_advance_joins_a_cut_step_with_its_continuation():
    grown = advance(PathSoFar(("Step 1: 1+2=3",)), piece("Step 2: ", CUT))
    assert grown == Advance(PathSoFar(("Step 1: 1+2=3",), "Step 2: "), False, True)
    assert grown.scored == ["Step 1: 1+2=3", "Step 2:"]
    grown = advance(grown.path, piece("3*4=12", STOP))
    assert grown == Advance(PathSoFar(("Step 1: 1+2=3", "Step 2: 3*4=12")), False, False)


def test_advance_a_continuation_that_is_only_the_delimiter_closes_its_step():
    grown = advance(PathSoFar((), "Step 1: 1+2=3"), piece("", STOP))
    assert grown == Advance(PathSoFar(("Step 1: 1+2=3",)), False, False)
    # an empty step as a whole ends the path
    assert advance(PathSoFar(("a",)), piece("", STOP)).finished
    assert advance(PathSoFar(("a",)), piece("  ", STOP)).finished


def test_advance_sees_an_answer_that_straddles_the_cut():
    grown = advance(PathSoFar((), "so \\boxed{1"), piece("2} done", STOP))
    assert grown.finished and grown.scored == ["so \\boxed{12} done"]


def test_advance_splits_at_a_delimiter_inside_or_across_a_cut():
    # the delimiter straddles the cut: two steps
    grown = advance(PathSoFar((), "a\n"), piece("\nb", STOP))
    assert grown == Advance(PathSoFar(("a", "b")), False, False)
    # the delimiter is the last thing in a cut piece (SGLang checks the limit first): the step is
    # closed, nothing is open, and no delimiter is added before the next generation
    grown = advance(PathSoFar(), piece("a\n\n", CUT))
    assert grown == Advance(PathSoFar(("a",)), False, True)
    grown = advance(PathSoFar(), piece("a\n\nb", CUT))
    assert grown == Advance(PathSoFar(("a",), "b"), False, True) and grown.scored == ["a", "b"]


def test_advance_ends_a_path_at_the_step_that_holds_the_answer():
    grown = advance(PathSoFar(), piece("\\boxed{3}\n\nmore", CUT))
    assert grown == Advance(PathSoFar(("\\boxed{3}",)), True, False)
    assert advance(PathSoFar(), piece("x \\boxed{3", CUT)).finished is False
    assert advance(PathSoFar(), piece("x \\boxed{3}", CUT)).finished     # an answer in the open step
    assert advance(PathSoFar(), piece("no answer", EOS)) == Advance(PathSoFar(("no answer",)), True, False)


def test_answers_and_votes():
    assert extract_answer("Step 1: 1+2=3\n\nThe answer is \\boxed{3}") == "3"
    assert extract_answer("\\boxed{1} then \\boxed{ 2 }") == "2"
    assert extract_answer("no answer") is None
    assert extract_answer("ANSWER: 42", pattern=r"ANSWER: (\d+)") == "42"
    assert vote(["3", "5", "5", None, None, None]) == "5"
    assert vote(["3", "5"]) == "3"  # tie: first seen
    assert vote([None, None]) is None
    assert vote(["3", "5", "5"], weights=[0.9, 0.1, 0.2]) == "3"
    with pytest.raises(ValueError, match="same length"):
        vote(["3"], weights=[0.1, 0.2])


def test_seeds_are_stable_and_distinct():
    assert derive_seed("beam", 0, "q", 1, 2) == derive_seed("beam", 0, "q", 1, 2)
    seeds = {derive_seed("beam", 0, "q", d, i) for d in range(20) for i in range(16)}
    assert len(seeds) == 320
    assert all(0 <= s < 2 ** 63 for s in seeds)
    assert derive_seed("x", 1) == 2319442240190766601  # fixed across runs and machines


def test_final_steps_and_splitting():
    assert is_final("The answer is \\boxed{3}", {"type": "stop", "matched": "\n\n"})
    assert is_final("Step 2", {"type": "stop", "matched": 0})          # EOS token
    assert not is_final("Step 2: 3+4=7", {"type": "stop", "matched": "\n\n"})
    assert not is_final("Step 2: 3+4", {"type": "length", "length": 64})
    assert split_steps("\n\nStep 1: a\n\n\n\nStep 2: b\n\n") == ["Step 1: a", "Step 2: b"]
