"""Issue 34's hard workload: the hard and mixed splits, their JSONL round trip, the hardness measurement
and the first-step cut-off (seed 004 Fig. 6a) against their definitions, and ``sgl-tts workload``."""

from __future__ import annotations

import json

import pytest

from sgl_tts.tiny import task
from sgl_tts.tiny.hardness import (FirstStep, Solution, choose_cutoff, first_step_points, measure_hardness,
                                   solve_and_score)


def test_the_test_split_and_training_levels_are_unchanged_by_the_hard_level():
    # the hard level lives apart from LEVELS: "all levels" (test split, training stream) are still 1-4
    assert sorted(task.LEVELS) == [1, 2, 3, 4] and sorted(task.HARD_LEVELS) == [5]
    t = task.test_split()
    assert t[0].question == "Compute ((15*4)*7)-7."
    assert t[499].question == "Compute ((((((((16+29)*8)*2)+87)+98)+15)+32)+34)+12."
    stream = task.train_stream()
    assert {next(stream).level for _ in range(400)} == {1, 2, 3, 4}


def test_hard_split_is_fixed_distinct_and_harder_only_in_its_multipliers():
    hard = task.hard_split(200)
    assert hard == task.hard_split(200) and hard[:10] == task.hard_split(10)
    assert len({p.question for p in hard}) == 200
    assert not {p.question for p in hard} & {p.question for p in task.test_split()}
    spec = task.HARD_LEVELS[5]
    for p in hard:
        assert p.level == 5 and len(p.ops) == spec.ops
        assert all(0 <= v <= task.MAX_VALUE for v in p.values)
        assert all(1 <= y <= spec.max_operand for op, y in p.ops if op in "+-")
        assert all(2 <= y <= spec.max_multiplier for op, y in p.ops if op == "*")
    # what makes it hard: multipliers the generator never saw (training and test use 2-9)
    big = sum(1 for p in hard for op, y in p.ops if op == "*" and y > 9)
    assert big >= 100
    assert max(y for p in hard for op, y in p.ops if op == "*") > 20


def test_mixed_split_alternates_test_and_hard_test_first():
    m = task.mixed_split(7)
    t, h = task.test_split(), task.hard_split(3)
    assert m == [t[0], h[0], t[1], h[1], t[2], h[2], t[3]]
    assert [task.is_hard(p) for p in m] == [False, True] * 3 + [False]
    assert task.split("mixed", 7) == m and task.split("hard", 3) == h and task.split("test", 2) == t[:2]
    assert len(task.split("test")) == 500 and len(task.split("hard")) == 200


@pytest.mark.parametrize("args, message", [
    (("nope", 3), "unknown split 'nope'; choose from test, hard, mixed"),
    (("hard", 0), "count must be >= 1, got 0"),
    (("test", 501), "the test split has 500 problems, asked for 501"),
])
def test_split_errors_name_the_problem(args, message):
    with pytest.raises(ValueError, match=message):
        task.split(*args)


def test_unknown_level_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown level 6; levels are \[1, 2, 3, 4\] and hard \[5\]"):
        task.generate(3, "x", levels=[6])


def test_jsonl_round_trip_and_bad_lines_named(tmp_path):
    probs = task.mixed_split(5)
    path = task.write_jsonl(probs, tmp_path / "mixed.jsonl", prefix="mixed")
    assert task.read_jsonl(path) == probs
    lines = path.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "\n" + json.dumps({"question": "Compute 1+2.", "answer": "3"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a task problem \(KeyError"):
        task.read_jsonl(bad)
    rec = json.loads(lines[1])
    rec["answer"] = str(int(rec["answer"]) + 1)
    bad.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: answer \d+ does not match its operations"):
        task.read_jsonl(bad)


# ----------------------------------------------------------------------------- the cut-off
def pts(*pairs):
    return [FirstStep(f, g, False, 5) for f, g in pairs]


POINTS = pts((0.1, 0.05), (0.2, 0.1), (0.5, 0.45), (0.85, 0.82), (0.9, 0.7), (0.95, 0.9), (0.95, 0.85))


def test_cutoff_with_no_reach_allowed_worked_by_hand():
    # scanning up: below 0.2 {0.1}: none reached 0.8; below 0.5: none; below 0.85: none; below 0.9:
    # (0.85, 0.82) reached -> stop. The last good score is 0.85, the one under it 0.5: cut-off 0.675
    c = choose_cutoff(POINTS, 0.8, max_reach=0.0)
    assert c.cutoff == pytest.approx(0.675)
    assert (c.below, c.reached_below, c.above, c.reached_above) == (3, 0, 4, 3)


def test_cutoff_with_some_reach_allowed_worked_by_hand():
    # max_reach 0.5. Below 0.9 the band [0.85, 0.9) is one trajectory that reached (1 > 0.5): no.
    # Below 0.95 every band from an observed score up: [0.9] 0/1, [0.85, 0.9] 1/2, [0.5, ..] 1/3,
    # [0.2, ..] 1/4, [0.1, ..] 1/5, all <= 0.5: yes, and nothing higher is observed. The score under
    # 0.95 is 0.9: cut-off 0.925
    c = choose_cutoff(POINTS, 0.8, max_reach=0.5)
    assert c.cutoff == pytest.approx(0.925)
    assert (c.below, c.reached_below, c.above, c.reached_above) == (5, 1, 2, 2)


def test_cutoff_is_not_put_above_a_band_that_reaches_however_many_score_near_zero():
    # 100 first steps at 0 (none reach), then 0.95 (reached), 0.955, 0.96, and 20 clean ones at 0.963.
    # Over all trajectories below 0.963 only 1 of 103 reached (under 2%), but the band [0.95, 0.963)
    # reached 1 of 3; likewise below 0.96 and 0.955. Below 0.95 only the zeros: cut-off (0 + 0.95) / 2
    points = pts(*([(0.0, 0.0)] * 100), (0.95, 0.85), (0.955, 0.5), (0.96, 0.3), *([(0.963, 0.9)] * 20))
    c = choose_cutoff(points, 0.8)
    assert c.cutoff == pytest.approx(0.475)
    assert (c.below, c.reached_below, c.above, c.reached_above) == (100, 0, 23, 21)


def test_cutoff_none_when_the_lowest_trajectories_already_reach():
    c = choose_cutoff(pts((0.9, 0.85), (0.95, 0.9)), 0.8, max_reach=0.0)
    assert c.cutoff is None and (c.below, c.above, c.reached_above) == (0, 2, 2)


def test_correlations_by_definition():
    # x = 1, 2, 3; y = 1, 3, 2: covariance 1 over sqrt(2 * 2) = 0.5; the ranks are the values
    c = choose_cutoff(pts((0.1, 0.1), (0.2, 0.3), (0.3, 0.2)), 0.8)
    assert c.pearson == pytest.approx(0.5) and c.spearman == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no scored trajectories"):
        choose_cutoff([], 0.8)
    with pytest.raises(ValueError, match=r"max_reach must be in \[0, 1\), got 1"):
        choose_cutoff(POINTS, 0.8, max_reach=1)


# ----------------------------------------------------------------------------- hardness
def sol(problem, level, greedy, labels, scores, correct):
    return Solution(problem, level, greedy, tuple(f"s{i}" for i in range(len(labels))), tuple(labels),
                    tuple(scores), correct)


def test_hardness_separates_greedy_and_sampled_and_skips_unscored_steps():
    sols = [
        sol(0, 4, False, [1, 1], [0.9, 0.8], True), sol(0, 4, False, [1, 0], [0.9, 0.2], False),
        sol(0, 4, True, [1, 1], [0.9, 0.9], True),
        sol(1, 5, False, [0, 0], [0.3, 0.7], False), sol(1, 5, False, [1, 0], [], False),   # no scores
        sol(1, 5, True, [0, 0], [0.9, 0.9], False),
    ]
    h = measure_hardness(sols, 0.8)
    assert (h.problems, h.samples, h.greedy_accuracy, h.sample_accuracy) == (2, 2, 0.5, 0.25)
    # sampled steps with scores: positives 0.9, 0.8, 0.9; negatives 0.2, 0.3, 0.7: every positive
    # above every negative -> AUC 1 (the unscored sample's two steps are not counted)
    assert (h.step_auc, h.graded_steps, h.wrong_steps) == (1.0, 6, 3)
    # greedy: positives 0.9, 0.9 tie the negatives 0.9, 0.9 -> 0.5
    assert h.greedy_step_auc == 0.5
    assert h.by_level == {4: {"greedy": 1.0, "sample": 0.5}, 5: {"greedy": 0.0, "sample": 0.0}}
    points = first_step_points(sols, "min")
    assert [(p.first, p.final, p.correct, p.level) for p in points] == [
        (0.9, 0.8, True, 4), (0.9, 0.2, False, 4), (0.3, 0.3, False, 5)]
    assert [p.final for p in first_step_points(sols, "prod")] == pytest.approx([0.72, 0.18, 0.21])


def test_solve_and_score_pairs_every_solution_with_its_own_grades_and_scores():
    """The shipped models in process on two hard problems: each solution's labels are the checker's and
    its scores are the PRM's for that very text (a batch misaligned by one would fail)."""
    from sgl_tts import LocalBackend
    from sgl_tts.models import shipped_model
    from sgl_tts.prm import StepTagPRM

    probs = task.hard_split(2)
    gen = LocalBackend(shipped_model("generator"), seed=0)
    prm_backend = LocalBackend(shipped_model("prm"), seed=0)
    try:
        prm = StepTagPRM(prm_backend, cache=False)
        sols = solve_and_score(gen, prm, probs, samples=2, temperature=0.8, seed=0, progress=False)
        assert [(s.problem, s.greedy) for s in sols] == [(0, False), (0, False), (0, True),
                                                        (1, False), (1, False), (1, True)]
        for s in sols:
            p = probs[s.problem]
            g = task.grade(p, task.STEP_SEPARATOR.join(s.steps))
            assert s.labels == tuple(int(v) for v in g.prefix_ok) and s.level == 5
            assert s.scores, "every sample of the tiny generator keeps the tag structure"
            alone = prm.score(p.question, [list(s.steps)])[0]
            assert [round(x, 4) for x in s.scores] == [round(x, 4) for x in alone]
        with pytest.raises(ValueError, match="samples must be >= 1, got 0"):
            solve_and_score(gen, prm, probs, samples=0)
    finally:
        gen.shutdown()
        prm_backend.shutdown()


# ----------------------------------------------------------------------------- the command
def test_workload_command_writes_the_split_and_refuses_bad_arguments(tmp_path, capsys):
    from sgl_tts.cli.workload import main

    out = tmp_path / "hard.jsonl"
    assert main(["--split", "hard", "--count", "4", "--out", str(out)]) == 0
    assert task.read_jsonl(out) == task.hard_split(4)
    assert json.loads(out.read_text().splitlines()[0])["id"] == "hard-0000"
    assert "wrote 4 hard problems" in capsys.readouterr().out
    assert main(["--split", "hard", "--count", "0"]) == 2
    assert "sgl-tts workload: error: count must be >= 1, got 0" in capsys.readouterr().err
    assert main(["--split", "hard", "--count", "3", "--measure", "--max-reach", "1.5"]) == 2
    assert "--max-reach must be in [0, 1), got 1.5" in capsys.readouterr().err


def test_the_recorded_workloads_are_what_the_command_writes(tmp_path):
    """docs/results/{hard,mixed}_workload.jsonl (the load run's problems) are reproducible from
    `sgl-tts workload --split hard|mixed --count 200 --out FILE`."""
    from pathlib import Path

    from sgl_tts.cli.workload import main

    docs = Path(__file__).resolve().parents[1] / "docs" / "results"
    for name in ("hard", "mixed"):
        out = tmp_path / f"{name}.jsonl"
        assert main(["--split", name, "--count", "200", "--out", str(out)]) == 0
        assert out.read_bytes() == (docs / f"{name}_workload.jsonl").read_bytes(), name


# ----------------------------------------------------------------------------- the checker as a PRM
def test_checker_prm_scores_correct_so_far_by_the_definition():
    from sgl_tts.tiny.checker_prm import CheckerPRM

    p = task.hard_split(1)[0]
    prm = CheckerPRM([p], good=0.9, bad=0.1)
    ref = p.step_texts()
    # a wrong result at step 3 (index 2), later steps computing on from it: bad from there on
    x, op, y = p.values[2], *p.ops[2]
    wrong = ref[:2] + [f"Step 3: {x}{op}{y}={task.apply(x, op, y) + 1}"] + ref[3:]
    got = prm.score(p.question, [ref, wrong, ref[:1], []])
    assert got[0] == [0.9] * len(ref)
    assert got[1] == [0.9, 0.9] + [0.1] * (len(ref) - 2)
    assert got[2] == [0.9] and got[3] == []
    with pytest.raises(KeyError, match="CheckerPRM knows no problem 'Compute 1\\+2.'"):
        prm.score("Compute 1+2.", [ref])
    with pytest.raises(ValueError, match="need 0 <= bad < good <= 1, got bad=0.5, good=0.5"):
        CheckerPRM([p], good=0.5, bad=0.5)


def test_load_verifier_setting():
    from sgl_tts.bench.load import LoadSettings

    assert LoadSettings(verifier="checker").key() != LoadSettings().key()
    assert LoadSettings(problems=32).key() == "fd484b0160b1"   # the default keeps the recorded runs' key
    with pytest.raises(ValueError, match="verifier must be one of prm, checker, got 'oracle'"):
        LoadSettings(verifier="oracle")
