"""The arithmetic task: seeded generation, fixed splits, step format and the checker's verdicts."""

from __future__ import annotations

import json

import pytest

from sgl_tts.tiny import task
from sgl_tts.tiny.task import Problem, grade

P = Problem(12, (("+", 7), ("*", 3), ("-", 5)), level=2)


def test_question_solution_and_answer_format():
    assert P.question == "Compute ((12+7)*3)-5."
    assert P.values == [12, 19, 57, 52]
    assert P.solution() == ("Step 1: 12+7=19\n\nStep 2: 19*3=57\n\nStep 3: 57-5=52\n\n"
                            "The answer is \\boxed{52}")
    assert task.prompt(P.question) == "Compute ((12+7)*3)-5.\n\n"


def test_generation_is_deterministic_per_seed_and_differs_across_seeds():
    a = task.generate(50, seed=7)
    assert a == task.generate(50, seed=7)
    assert a != task.generate(50, seed=8)
    assert len({p.question for p in a}) == 50
    assert [p.level for p in a[:8]] == [1, 2, 3, 4, 1, 2, 3, 4]


def test_levels_shape_and_value_range():
    for p in task.generate(400, seed=1):
        spec = task.LEVELS[p.level]
        assert len(p.ops) == spec.ops
        assert all(0 <= v <= task.MAX_VALUE for v in p.values)
        assert all(y <= max(spec.max_operand, spec.max_multiplier) for _, y in p.ops)
        assert grade(p, p.solution()).answer_ok


def test_test_split_is_fixed_and_never_in_training():
    test = task.test_split()
    assert len(test) == 500
    assert test[0] == task.test_split()[0]
    questions = {p.question for p in test}
    stream = task.train_stream()
    train = [next(stream) for _ in range(3000)]
    assert not questions & {p.question for p in train}


@pytest.mark.parametrize("text, step_ok, prefix_ok, answer_ok", [
    (P.solution(), (True, True, True, True), (True, True, True, True), True),
    # arithmetic slip in step 2, carried on consistently: later steps are locally wrong too
    ("Step 1: 12+7=19\n\nStep 2: 19*3=56\n\nStep 3: 56-5=51\n\nThe answer is \\boxed{51}",
     (True, False, False, False), (True, False, False, False), False),
    # copy error: wrong operand, right arithmetic
    ("Step 1: 12+8=20\n\nStep 2: 20*3=60", (False, False), (False, False), False),
    # wrong operation
    ("Step 1: 12-7=5", (False,), (False,), False),
    # step numbering and format matter
    ("Step 2: 12+7=19", (False,), (False,), False),
    ("Step 1: 12 + 7 = 19", (False,), (False,), False),
    # errors that cancel still count as wrong steps, though the answer is right
    ("Step 1: 12+7=20\n\nStep 2: 19*3=57\n\nStep 3: 57-5=52\n\nThe answer is \\boxed{52}",
     (False, True, True, True), (False, False, False, False), True),
    # an extra step after the answer is wrong
    (P.solution() + "\n\nStep 5: 1+1=2", (True, True, True, True, False),
     (True, True, True, True, False), True),
    ("", (), (), False),
])
def test_checker_verdicts(text, step_ok, prefix_ok, answer_ok):
    g = grade(P, text)
    assert g.step_ok == step_ok
    assert g.prefix_ok == prefix_ok
    assert g.answer_ok is answer_ok


def test_extract_answer_takes_the_last_box():
    assert task.extract_answer("\\boxed{3} then \\boxed{ 52 }") == "52"
    assert task.extract_answer("no box") is None


def test_jsonl_round_trip(tmp_path):
    probs = task.generate(5, seed=3)
    path = task.write_jsonl(probs, tmp_path / "d.jsonl")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in recs] == [f"arith-{i:04d}" for i in range(5)]
    assert all(set(r) >= {"question", "answer"} for r in recs)
    assert [Problem.from_record(r) for r in recs] == probs
    assert recs[0]["answer"] == str(probs[0].answer)


def test_unknown_level_is_refused():
    with pytest.raises(ValueError, match="unknown level 9"):
        task.generate(3, seed=0, levels=[9])
