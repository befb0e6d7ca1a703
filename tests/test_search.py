"""Search primitives: aggregation, stable top-k, expansion, answers, votes, seeds, final steps."""

from __future__ import annotations

import pytest

from sgl_tts.search import (Step, aggregate, continue_path, derive_seed, expand, expand_proportional,
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


def test_step_limit_schedules_and_continue_path_joins_cut_steps():
    assert [step_limit([64, 64, 64, 2048], d) for d in range(6)] == [64, 64, 64, 2048, 2048, 2048]
    assert step_limit(32, 9) == 32
    for bad in ([], [64, 0], 0, [1.5]):
        with pytest.raises(ValueError, match="step token limits must be positive integers"):
            step_limit(bad, 0)
    cut = {"type": "length", "length": 3}
    closed, pending, path = continue_path(["Step 1: 1+2=3"], "", Step("Step 2:", 3, False, cut, "Step 2: "))
    assert (closed, pending, path) == (["Step 1: 1+2=3"], "Step 2: ", ["Step 1: 1+2=3", "Step 2:"])
    stop = {"type": "stop", "matched": "\n\n"}
    closed, pending, path = continue_path(closed, pending, Step("3*4=12", 6, False, stop, "3*4=12"))
    assert closed == path == ["Step 1: 1+2=3", "Step 2: 3*4=12"] and pending == ""
    final = Step("The answer is \\boxed{12}", 9, True, cut, "The answer is \\boxed{12}")
    assert not final.cut and continue_path(closed, "", final)[1] == ""


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
