"""Training data and quality metrics: slips, corruption, PRM readout examples and tag positions, AUC."""

from __future__ import annotations

import itertools
import random

import pytest
from transformers import AutoTokenizer

from sgl_tts.tiny import task
from sgl_tts.prm import auc
from sgl_tts.tiny.training import (
    corrupt,
    readout_examples,
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


def test_readout_examples_mix_pool_references_and_corruptions_labelled_by_the_checker():
    pool = [(p, p.solution().replace("=", "=1", 1)) for p in task.generate(5, seed=2)]  # first step wrong
    pool_questions = {p.question for p, _ in pool}
    kinds = {"pool": 0, "reference": 0, "corrupted": 0}
    for problem, steps, labels in itertools.islice(readout_examples(pool, seed=0), 300):
        assert labels == [int(v) for v in task.grade(problem, task.STEP_SEPARATOR.join(steps)).prefix_ok]
        assert len(labels) == len(steps) and labels == sorted(labels, reverse=True)
        if problem.question in pool_questions:
            assert labels[0] == 0
            kinds["pool"] += 1
        elif all(labels):
            assert steps == problem.step_texts()
            kinds["reference"] += 1
        else:
            kinds["corrupted"] += 1
    assert 120 < kinds["pool"] < 180 and 35 < kinds["reference"] < 85 and 60 < kinds["corrupted"] < 120
    again = [(p.question, s) for p, s, _ in itertools.islice(readout_examples(pool, seed=0), 50)]
    assert again == [(p.question, s) for p, s, _ in itertools.islice(readout_examples(pool, seed=0), 50)]


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


def test_expert_problems_are_half_hard_and_never_a_test_or_hard_split_question():
    from sgl_tts.tiny.training import expert_problems

    held_out = {p.question for p in task.test_split()} | {p.question for p in task.hard_split()}
    drawn = list(itertools.islice(expert_problems(0), 2000))
    assert not {p.question for p in drawn} & held_out
    levels = [p.level for p in drawn]
    assert set(levels) == {1, 2, 3, 4, 5} and 0.45 < levels.count(5) / len(levels) < 0.55
    assert drawn[:20] == list(itertools.islice(expert_problems(0), 20))   # fixed by its seed
    assert drawn[:20] != list(itertools.islice(expert_problems(1), 20))


def test_train_stream_leaves_out_the_questions_it_is_told_to():
    plain = list(itertools.islice(task.train_stream("x", (1, 2)), 300))
    banned = {p.question for p in plain[:200:2]}   # every other one of the first 200
    again = list(itertools.islice(task.train_stream("x", (1, 2), exclude=banned), 200))
    assert again == plain[1:200:2] + plain[200:300]   # the same draws, the banned ones skipped


def test_train_tiny_runs_every_stage_and_resumes(tmp_path):
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from sgl_tts.tiny.training import TinyRecipe, train_tiny

    recipe = TinyRecipe(generator_steps=2, generator_batch=4, slip_steps=2, expert_steps=2, readout_examples=30,
                        pool_problems=2, pool_samples=1)
    train_tiny(tmp_path, recipe, progress=False)
    for stage in ("generator-base", "generator", "expert", "prm"):
        assert (tmp_path / stage / "model.safetensors").is_file()
        assert json.loads((tmp_path / stage / ".done").read_text())["generator_steps"] == 2
    assert len((tmp_path / "prm-pool.jsonl").read_text().splitlines()) == 2
    cfg = AutoConfig.from_pretrained(tmp_path / "prm")
    assert cfg.num_hidden_layers == 4 + 3 and cfg.tie_word_embeddings is False  # expert + 3 layers
    # the PRM is built from the expert, which the expert stage trained away from the generator
    expert, gen = (load_file(tmp_path / n / "model.safetensors") for n in ("expert", "generator"))
    assert not torch.equal(expert["model.layers.0.mlp.up_proj.weight"], gen["model.layers.0.mlp.up_proj.weight"])
    prm = load_file(tmp_path / "prm" / "model.safetensors")
    assert torch.equal(prm["model.layers.1.mlp.up_proj.weight"][:, :256].float(),
                       expert["model.layers.0.mlp.up_proj.weight"].float())
    done = json.loads((tmp_path / "prm" / ".done").read_text())
    assert cfg.sgl_tts_token_check_prm["readout"] == done["readout"]  # the fitted readout is built in
    assert done["readout_fit"]["examples"] == 30 and done["readout_fit"]["graded_steps"] > 30
    stamp = (tmp_path / "prm" / "model.safetensors").stat().st_mtime_ns
    train_tiny(tmp_path, recipe, progress=False)  # finished stages are skipped on a rerun
    assert (tmp_path / "prm" / "model.safetensors").stat().st_mtime_ns == stamp
