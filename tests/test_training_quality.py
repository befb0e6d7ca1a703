"""Training data and quality metrics: corruption, PRM labels and tag positions, voting, AUC."""

from __future__ import annotations

import itertools
import random

import pytest
from transformers import AutoTokenizer

from sgl_tts import task
from sgl_tts.quality import auc, majority
from sgl_tts.training import (
    corrupt,
    prm_examples,
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


def test_prm_examples_label_every_tag_with_the_checker(task_tokenizer):
    tag = task_tokenizer.encode("\n\n")[0]
    pool = [(p, p.solution()) for p in task.generate(5, seed=2)]
    seen = []
    for ids, pos, labels in itertools.islice(prm_examples(task_tokenizer, pool, seed=0), 200):
        assert len(pos) == len(labels) > 0
        assert all(ids[i] == tag for i in pos)
        assert labels == sorted(labels, reverse=True)  # "correct so far" never comes back
        seen.append(tuple(labels))
    assert any(all(x) for x in seen) and any(not all(x) for x in seen)


def test_tag_positions_refuses_steps_that_break_the_tag_structure(task_tokenizer):
    with pytest.raises(ValueError, match="must not contain a blank line"):
        tag_positions(task_tokenizer, "Compute 1+2.", ["Step 1: 1+2=3\n", "x"])
    ids, pos = tag_positions(task_tokenizer, "Compute 1+2.", ["Step 1: 1+2=3", "The answer is \\boxed{3}"])
    assert len(pos) == 2 and pos[-1] == len(ids) - 1


def test_majority_vote_ties_and_weights():
    assert majority(["3", "5", "5", None, None, None]) == "5"
    assert majority(["3", "5"]) == "3"  # tie: first seen
    assert majority([None, None]) is None
    assert majority(["3", "5", "5"], weights=[0.9, 0.1, 0.2]) == "3"


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

    recipe = TinyRecipe(generator_steps=2, generator_batch=4, prm_steps=2, prm_batch=4,
                        pool_problems=2, pool_samples=1)
    train_tiny(tmp_path, recipe, progress=False)
    for stage in ("generator", "prm"):
        assert (tmp_path / stage / "model.safetensors").is_file()
        assert json.loads((tmp_path / stage / ".done").read_text())["generator_steps"] == 2
    assert len((tmp_path / "prm-pool.jsonl").read_text().splitlines()) == 2
    assert AutoConfig.from_pretrained(tmp_path / "prm").tie_word_embeddings is False
    stamp = (tmp_path / "prm" / "model.safetensors").stat().st_mtime_ns
    train_tiny(tmp_path, recipe, progress=False)  # finished stages are skipped on a rerun
    assert (tmp_path / "prm" / "model.safetensors").stat().st_mtime_ns == stamp
