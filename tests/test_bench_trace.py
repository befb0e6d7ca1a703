"""The benchmark's step-length trace: deterministic per (seed, problem, path, depth), independent
across paths, and shaped like seed 000 Fig. 3 (a mean of a few hundred tokens, stragglers in the
thousands)."""

from __future__ import annotations

import pytest

from sgl_tts.bench.trace import StepTrace


def test_the_same_path_always_gets_the_same_steps():
    a, b = StepTrace(seed=1), StepTrace(seed=1)
    for path in [(0,), (0, 3), (5, 1, 2)]:
        for depth in range(4):
            assert a.step_tokens("p7", path, depth) == b.step_tokens("p7", path, depth)
            assert a.ends("p7", path, depth) == b.ends("p7", path, depth)
    other = StepTrace(seed=2)
    differ = sum(StepTrace(seed=1).step_tokens("p", (i,), 0) != other.step_tokens("p", (i,), 0) for i in range(50))
    assert differ > 40                                       # another seed is another trace
    siblings = {StepTrace().step_tokens("p", (0, j), 1) for j in range(16)}
    assert len(siblings) > 10                                # siblings draw independently


def test_the_shape_is_heavy_tailed_like_the_seed():
    d = StepTrace().describe()
    assert 200 <= d["mean_tokens"] <= 320 and 130 <= d["p50_tokens"] <= 170
    assert 0.01 <= d["share_over_1000"] <= 0.06             # stragglers in the thousands
    assert d["p99_tokens"] > 1000 and d["max_tokens"] <= 4096
    assert 6 <= d["mean_steps"] <= 10 and d["max_steps"] <= 40


def test_ends_respect_min_and_max_depth_and_bad_parameters_are_refused():
    t = StepTrace(min_depth=3, max_depth=5, end_probability=1.0)
    assert [t.ends("p", (0,), d) for d in range(5)] == [False, False, True, True, True]
    never = StepTrace(end_probability=0.0, max_depth=4)
    assert [never.ends("p", (1,), d) for d in range(4)] == [False, False, False, True]
    assert StepTrace(sigma=0.0, median_tokens=100).step_tokens("p", (0,), 0) == 100
    with pytest.raises(ValueError, match="end_probability must be in"):
        StepTrace(end_probability=1.5)
    with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
        StepTrace(min_tokens=10, max_tokens=5)
