"""Training data and quality metrics: slips, corruption, PRM labels and tag positions, AUC."""

from __future__ import annotations

import itertools
import random

import pytest
from transformers import AutoTokenizer

from sgl_tts import task
from sgl_tts.quality import auc
from sgl_tts.training import (
    corrupt,
    prm_examples,
    slipped_steps,
    tag_positions,
    write_task_tokenizer,
)


@pytest.fixture(scope="module")
def task_tokenizer(tmp_path_factory, tiny_model_path):
    path = tmp_path_factory.mktemp("tok")
    write_task_tokenizer(path)
    (path / "config.json").write_text((tiny_model_path / "config.json").read_text())
    return AutoTokenizer.from_pretrained(path)


def test_task_tokenizer_round_trips_and_keeps_digits_apart(task_tokenizer):
    for p in task.generate(40, seed=5):
        text = task.prompt(p.question) + p.solution()
        ids = task_tokenizer.encode(text)
        assert task_tokenizer.decode(ids) == text
        pieces = [task_tokenizer.decode([i]) for i in ids]
        assert all(len(x) == 1 for x in pieces if any(c.isdigit() for c in x))
    assert len(task_tokenizer.encode("\n\n")) == 1
    assert len(task_tokenizer.encode("Step")) == 1


def test_corrupted_references_always_contain_a_wrong_step():
    rng = random.Random(0)
    for p in task.generate(300, seed=11):
        steps = corrupt(p, rng)
        g = task.grade(p, task.STEP_SEPARATOR.join(steps))
        assert len(g.steps) == len(p.ops) + 1
        assert not all(g.step_ok)
        assert g.prefix_ok[0] or not g.step_ok[0]


def test_slipped_steps_change_one_result_digit_and_carry_the_value_on():
    rng = random.Random(0)
    for p in task.generate(100, seed=4):
        assert slipped_steps(p, rng, 0.0) == p.step_texts()
    slipped = total = 0
    for p in task.generate(400, seed=5):
        steps = slipped_steps(p, rng, 0.25)
        g = task.grade(p, task.STEP_SEPARATOR.join(steps))
        x = p.start
        for k, (op, y) in enumerate(p.ops):
            m = task._STEP.match(steps[k])
            assert m and int(m[2]) == x and m[3] == op and int(m[4]) == y  # carried on, never miscopied
            z, true = int(m[5]), task.apply(x, op, y)
            if z != true:
                slipped += 1
                a, b = str(z).zfill(len(str(true))), str(true).zfill(len(str(z)))
                assert sum(c != d for c, d in zip(a, b)) == 1  # exactly one digit off
            assert 0 <= z <= task.MAX_VALUE
            x = z
            total += 1
        assert steps[-1] == task.answer_step(x)
        assert g.answer_ok == (x == p.answer)
    assert 0.20 < slipped / total < 0.26  # a few slips are skipped when they would leave [0, 999]


def test_prm_examples_label_tags_with_the_checker_and_tokens_up_to_the_first_error(task_tokenizer):
    tag = task_tokenizer.encode("\n\n")[0]
    pool = [(p, p.solution()) for p in task.generate(5, seed=2)]
    seen = []
    for ids, pos, labels, is_tag in itertools.islice(prm_examples(task_tokenizer, pool, seed=0), 200):
        assert len(pos) == len(labels) == len(is_tag) > 0 and pos == sorted(pos)
        tag_labels = [lab for lab, t in zip(labels, is_tag) if t]
        assert all(ids[p] == tag for p, t in zip(pos, is_tag) if t)
        assert tag_labels == sorted(tag_labels, reverse=True)  # "correct so far" never comes back
        token_labels = [lab for lab, t in zip(labels, is_tag) if not t]
        # Tokens are labelled right up to the first wrong one, which is the only one labelled 0.
        assert token_labels.count(0) <= 1 and (0 not in token_labels or token_labels[-1] == 0)
        if 0 in token_labels:
            first_bad_tag = tag_labels.index(0)
            wrong = [p for p, lab, t in zip(pos, labels, is_tag) if not t and lab == 0][0]
            tags = [p for p, t in zip(pos, is_tag) if t]
            assert (tags[first_bad_tag - 1] if first_bad_tag else 0) < wrong < tags[first_bad_tag]
        seen.append(tuple(tag_labels))
    assert any(all(x) for x in seen) and any(not all(x) for x in seen)


def test_tag_positions_refuses_steps_that_break_the_tag_structure(task_tokenizer):
    with pytest.raises(ValueError, match="must not contain the step tag"):
        tag_positions(task_tokenizer, "Compute 1+2.", ["Step 1: 1+2=3\n", "x"])
    ids, pos = tag_positions(task_tokenizer, "Compute 1+2.", ["Step 1: 1+2=3", "The answer is \\boxed{3}"])
    assert len(pos) == 2 and pos[-1] == len(ids) - 1


def test_auc_equals_pairwise_definition():
    rng = random.Random(3)
    scores = [rng.choice([0.1, 0.2, 0.5, 0.7, 0.9]) for _ in range(60)]
    labels = [rng.randint(0, 1) for _ in range(60)]
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    pairwise = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg) / (len(pos) * len(neg))
    assert auc(scores, labels) == pytest.approx(pairwise)
    assert auc([0.1, 0.9], [0, 1]) == 1.0


def test_train_tiny_runs_every_stage_and_resumes(tmp_path):
    import json

    from transformers import AutoConfig

    from sgl_tts.training import TinyRecipe, train_tiny

    recipe = TinyRecipe(generator_steps=2, generator_batch=4, slip_steps=2, prm_steps=2, prm_batch=4,
                        prm_refine_steps=1, pool_problems=2, pool_samples=1)
    train_tiny(tmp_path, recipe, progress=False)
    assert {p.name for p in (tmp_path / "prm").glob(".*")} == {".stage1", ".refine0", ".refine1", ".done"}
    assert AutoConfig.from_pretrained(tmp_path / "prm").num_hidden_layers == 5  # generator + 1 layer
    for stage in ("generator-base", "generator", "prm"):
        assert (tmp_path / stage / "model.safetensors").is_file()
        assert json.loads((tmp_path / stage / ".done").read_text())["generator_steps"] == 2
    assert len((tmp_path / "prm-pool.jsonl").read_text().splitlines()) == 2
    assert AutoConfig.from_pretrained(tmp_path / "prm").tie_word_embeddings is True
    stamp = (tmp_path / "prm" / "model.safetensors").stat().st_mtime_ns
    train_tiny(tmp_path, recipe, progress=False)  # finished stages are skipped on a rerun
    assert (tmp_path / "prm" / "model.safetensors").stat().st_mtime_ns == stamp
