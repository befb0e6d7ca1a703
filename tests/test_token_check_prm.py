"""The token-check PRM: built from a model (here the generator, for the shipped PRM the expert), it
computes the documented share (checked digits that model would not have written, averaged over the
solution so far); the shipped folder is exactly that construction from the shipped expert, and it sees
the generator's confident mistakes on the hard split, which a PRM built from the generator cannot."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sgl_tts import LocalBackend
from sgl_tts.tiny import task
from sgl_tts.models import shipped_model
from sgl_tts.models.token_check_prm import (
    CHECKED_DIGITS,
    CONFIG_KEY,
    Readout,
    build_token_check_prm,
    fit_readout,
)
from sgl_tts.prm import StepTagPRM, tag_positions


@pytest.fixture(scope="module")
def generator_path():
    return shipped_model("generator")


@pytest.fixture(scope="module")
def identity_prm(tmp_path_factory, generator_path):
    """The construction with log-odds = -share, so a step score p gives share = log((1 - p) / p)."""
    return build_token_check_prm(generator_path, tmp_path_factory.mktemp("prm") / "prm")


@pytest.fixture(scope="module")
def identity_scorer(identity_prm):
    backend = LocalBackend(identity_prm)
    yield StepTagPRM(backend, cache=False)
    backend.shutdown()


def reference_shares(generator_path, question: str, steps: list[str]) -> list[float]:
    """The share at every tag, computed directly from the generator's logits (the definition)."""
    tok = AutoTokenizer.from_pretrained(generator_path)
    model = AutoModelForCausalLM.from_pretrained(generator_path, dtype=torch.float32)
    ids, tags = tag_positions(tok, question, steps)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    digits = [tok.convert_tokens_to_ids(d) for d in CHECKED_DIGITS]
    start, tag_id = len(tok.encode(task.prompt(question))), ids[tags[0]]
    check = []
    for i in range(start, len(ids)):
        if ids[i] in digits:
            prev = logits[i - 1, digits]
            own = prev[digits.index(ids[i])]
            check.append((i, float((prev - own).clamp(0, 1).sum())))
        elif ids[i] != tag_id:  # every other solution token except the tags counts in the mean
            check.append((i, 0.0))
    return [sum(c for i, c in check if i < t) / sum(1 for i, _ in check if i < t) for t in tags]


def slipped(problem: task.Problem, k: int, rng: random.Random) -> list[str]:
    """The reference steps with one digit of step k's result changed and carried on."""
    steps = problem.step_texts()
    x, (op, y), z = problem.values[k], problem.ops[k], problem.values[k + 1]
    digits = list(str(z))
    i = rng.randrange(len(digits))
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i] and (d != "0" or i > 0)])
    v = int("".join(digits))
    steps[k] = f"Step {k + 1}: {x}{op}{y}={v}"
    for j in range(k + 1, len(problem.ops)):
        o, yy = problem.ops[j]
        steps[j] = f"Step {j + 1}: {v}{o}{yy}={task.apply(v, o, yy)}"
        v = task.apply(v, o, yy)
    steps[-1] = task.answer_step(v)
    return steps


def test_prm_computes_the_documented_share(generator_path, identity_scorer):
    rng = random.Random(0)
    for p in task.test_split()[:12]:
        for steps in (p.step_texts(), slipped(p, rng.randrange(len(p.ops)), rng)):
            got = [math.log((1 - s) / s) for s in identity_scorer.score(p.question, [steps])[0]]
            want = reference_shares(generator_path, p.question, steps)
            assert got == pytest.approx(want, abs=2e-3)


def test_one_changed_digit_lowers_that_step_and_every_later_one_only(identity_scorer):
    rng = random.Random(1)
    for p in task.test_split()[:20]:
        k = rng.randrange(len(p.ops))
        good, bad = identity_scorer.score(p.question, [p.step_texts(), slipped(p, k, rng)])
        assert bad[:k] == pytest.approx(good[:k], abs=1e-6)   # the prefix is the same
        assert all(b < g - 1e-3 for b, g in zip(bad[k:], good[k:]))


def test_shipped_prm_is_exactly_the_construction_from_the_shipped_expert(tmp_path):
    shipped = shipped_model("prm")
    model = AutoModelForCausalLM.from_pretrained(shipped)
    meta = getattr(model.config, CONFIG_KEY)
    assert meta["checked"] == list(CHECKED_DIGITS) and (meta["good"], meta["bad"]) == ("+", "-")
    rebuilt = build_token_check_prm(shipped_model("expert"), tmp_path / "prm", readout=Readout(**meta["readout"]))
    assert (rebuilt / "model.safetensors").read_bytes() == (shipped / "model.safetensors").read_bytes()
    assert meta["readout"]["slope"] > 0  # more unexpected digits -> lower P(+)


def test_fit_readout_recovers_a_logistic_model():
    gen = torch.Generator().manual_seed(0)
    shares = torch.rand(20000, generator=gen, dtype=torch.float64) * 0.05
    p = torch.sigmoid(3.0 - 120.0 * shares)
    labels = (torch.rand(20000, generator=gen, dtype=torch.float64) < p).int()
    r = fit_readout(shares.tolist(), labels.tolist())
    assert r.bias == pytest.approx(3.0, abs=0.15) and r.slope == pytest.approx(120.0, rel=0.06)
    with pytest.raises(ValueError, match="need both correct and incorrect steps"):
        fit_readout([0.0, 0.1], [1, 1])
    with pytest.raises(ValueError, match="need as many labels as shares"):
        fit_readout([0.0, 0.1], [1])


def test_build_refuses_what_it_cannot_check(tmp_path, generator_path):
    with pytest.raises(ValueError, match="'10' must be a single token"):
        build_token_check_prm(generator_path, tmp_path / "a", checked=["1", "10"])
    with pytest.raises(ValueError, match="checked tokens must be distinct"):
        build_token_check_prm(generator_path, tmp_path / "b", checked=["1", "1"])
    with pytest.raises(ValueError, match="16 checked tokens need 37 side dimensions"):
        build_token_check_prm(generator_path, tmp_path / "c", checked=list("0123456789+-*=:{"))
    with pytest.raises(ValueError, match="step tag 'Step 1' must be a single token"):
        build_token_check_prm(generator_path, tmp_path / "d", tag="Step 1")
    assert not any((tmp_path / n).exists() for n in "abcd")  # nothing half-written


def test_the_shipped_prm_sees_the_generators_confident_mistakes_on_hard_problems(identity_prm):
    """Greedy solutions of hard problems (multipliers up to 30, which the generator never learned): the
    generator ranks its wrong digits first, so the PRM built from it scores them as clean (step AUC
    about chance); the shipped PRM, built from the expert, which knows those products, ranks them low.
    Also the sampled steps, what a search scores."""
    from sgl_tts.tiny.hardness import measure_hardness, solve_and_score

    hardness = {}
    gen = LocalBackend(shipped_model("generator"), seed=0)
    try:
        for name, path in (("expert", shipped_model("prm")), ("generator", identity_prm)):
            prm_backend = LocalBackend(path, seed=0)
            try:
                sols = solve_and_score(gen, StepTagPRM(prm_backend, cache=False), task.hard_split(24),
                                       samples=1, temperature=0.8, seed=0, progress=False)
            finally:
                prm_backend.shutdown()
            hardness[name] = measure_hardness(sols, 0.8)
    finally:
        gen.shutdown()
    assert hardness["expert"].greedy_accuracy < 0.75                  # the generator does fail on them
    # measured (greedy / sampled step AUC): 0.89 / 0.995 from the expert, 0.48 / 0.95 from the generator
    assert hardness["generator"].greedy_step_auc < 0.6
    assert hardness["expert"].greedy_step_auc > 0.8 and hardness["expert"].step_auc > 0.9, hardness
