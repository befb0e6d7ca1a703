"""Particle filtering (``programs/particle_filtering.py``, issue 35) against a plain-Python
re-derivation of the method on a scripted generator and PRM: every round's candidates, weights and
resampling draws, the final population, its answers; plus the draws, the weights and the options by
hand, and ``sgl-tts run --program particle_filtering`` on the embedded default."""

from __future__ import annotations

import json
import math
import random

import pytest

from programs.particle_filtering import log_weight, particle_filtering, probabilities, resample
from sgl_tts.search import derive_seed
from sgl_tts.search.options import OptionError, ParticleFilteringOptions
from sgl_tts.testing import ScriptedBackend, ScriptedPRM

D = "\n\n"


class Draws:
    """A stand-in for ``random.Random`` whose ``random()`` returns the given values in order."""

    def __init__(self, *values: float):
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def test_systematic_draws_one_uniform_and_spaces_the_positions_evenly():
    # positions (0.1 + k) / 4 = 0.025, 0.275, 0.525, 0.775 against cumulative 0.5, 0.75, 1.0
    assert resample([0.5, 0.25, 0.25], 4, "systematic", Draws(0.1)) == [2, 1, 1]
    # a weight w of N draws is drawn floor(Nw) or ceil(Nw) times, whatever the uniform
    for u in (0.05, 0.3, 0.95):
        got = resample([0.7, 0.2, 0.1], 10, "systematic", Draws(u))
        assert sum(got) == 10 and all(math.floor(10 * w) <= k <= math.ceil(10 * w) for k, w in zip(got, [0.7, 0.2, 0.1]))


def test_multinomial_draws_one_uniform_per_particle_and_a_boundary_goes_to_the_next_particle():
    assert resample([0.5, 0.25, 0.25], 4, "multinomial", Draws(0.6, 0.1, 0.95, 0.74)) == [1, 2, 1]
    # a position on a cumulative bound (0.5) belongs to the particle after it
    assert resample([0.5, 0.5], 2, "multinomial", Draws(0.5, 0.49)) == [1, 1]
    # unnormalised weights are scaled to their sum
    assert resample([2.0, 2.0], 2, "multinomial", Draws(0.25, 0.75)) == [1, 1]
    with pytest.raises(ValueError, match=r"unknown resampling 'stratified'; choose one of \['multinomial', 'systematic'\]"):
        resample([1.0], 1, "stratified", Draws(0.5))


def test_a_weight_is_the_logit_of_the_score_over_the_temperature_and_draws_are_its_softmax():
    assert log_weight(0.8) == pytest.approx(math.log(4.0))
    assert log_weight(0.8, 2.0) == pytest.approx(math.log(4.0) / 2)
    assert log_weight(0.5) == 0.0
    assert log_weight(1.0) == pytest.approx(math.log((1 - 1e-7) / 1e-7))   # clipped, not infinite
    assert log_weight(-3.0) == pytest.approx(-math.log((1 - 1e-7) / 1e-7))
    # softmax of logits of 0.8 and 0.5: odds 4 : 1
    assert probabilities([log_weight(0.8), log_weight(0.5)]) == pytest.approx([0.8, 0.2])
    assert probabilities([1000.0, 1000.0]) == [0.5, 0.5]   # shifted by the maximum: no overflow


@pytest.mark.parametrize("options, message, names", [
    (dict(resampling="stratified"), "unknown resampling 'stratified'", ("resampling",)),
    (dict(weight_temperature=0.0), "weight_temperature must be a positive number, got 0.0", ("weight_temperature",)),
    (dict(weight_temperature=float("inf")), "weight_temperature must be a positive number", ("weight_temperature",)),
    (dict(particle_pick="vote"), "unknown particle_pick 'vote'; choose one of ['best', 'weighted_vote']",
     ("particle_pick",)),
    (dict(overlap_verification=True), "particle filtering has no speculative or overlap_verification policy",
     ("speculative", "overlap_verification")),
    (dict(num_beams=0), "particle filtering needs N >= 1", ("num_beams", "beam_width")),
])
def test_bad_options_are_refused_with_what_they_are_about(options, message, names):
    with pytest.raises(OptionError, match=message.replace("[", r"\[").replace("]", r"\]")) as got:
        ParticleFilteringOptions(**{"num_beams": 4, "beam_width": 1, **options})
    assert got.value.options == names


# ------------------------------------------------------------------ the program against its definition
def script(prefix: str, draw: int | None) -> str:
    """Steps of a few letters; from the third step on, an answer now and then (no delimiter after
    it: the sample ends there)."""
    rng = random.Random(derive_seed("pf-script", prefix, draw))
    depth = prefix.count(D) - 1
    if depth >= 2 and rng.random() < 0.35:
        return f"so \\boxed{{{rng.randrange(3)}}}"
    return "".join(rng.choice("abcde") for _ in range(rng.randrange(2, 8))) + D


def score(text: str) -> float:
    return (derive_seed("pf-score", text) % 10) / 10 + 0.05


def reference(question: str, n: int, max_depth: int, seed: int, temperature: float, method: str):
    """Particle filtering as its definition reads (module docstring of the program), in plain Python:
    a particle is its list of steps; returns the final population as (steps, finished, log-weight)."""
    active = [(i, [], -1, i) for i in range(n)]   # (index, steps, parent index, copy ordinal)
    finished: list[tuple[list[str], bool, float]] = []
    population = []
    for depth in range(max_depth):
        grown = []
        for index, steps, parent, ordinal in active:
            prefix = question + D + "".join(x + D for x in steps)
            text = script(prefix, derive_seed("particle_filtering", seed, question, depth, parent, ordinal))
            step = text.split(D)[0]
            done = D not in text   # the answer: the sample ended
            value = min(1 - 1e-7, max(1e-7, score(step)))
            grown.append((steps + [step], done, math.log(value / (1 - value)) / temperature))
        pool = finished + grown
        top = max(w for _, _, w in pool)
        weights = [math.exp(w - top) for _, _, w in pool]
        total = sum(weights)
        rng = random.Random(derive_seed("particle_filtering/resample", seed, question, depth))
        if method == "systematic":
            u = rng.random()
            points = [(u + k) / n for k in range(n)]
        else:
            points = [rng.random() for _ in range(n)]
        counts = [0] * len(pool)
        for x in points:
            acc = 0.0
            for i, w in enumerate(weights):
                acc += w / total
                if x < acc or i == len(pool) - 1:
                    counts[i] += 1
                    break
        population = [pool[i] for i in range(len(pool)) for _ in range(counts[i])]
        finished = [p for p in population if p[1]]
        first = len(pool) - len(grown)   # this round's candidates follow the finished particles
        active = []
        for i, (steps, done, _) in enumerate(grown):
            if not done:
                active += [(i, steps, i, j) for j in range(counts[first + i])]
        if not active:
            break
    return population


def run(question, **kw):
    backend = ScriptedBackend(script)
    state = particle_filtering.run(question=question, prm=ScriptedPRM(score), backend=backend, **kw)
    assert state.error() is None, state.error()
    return state.ret_value


@pytest.mark.parametrize("method", ["multinomial", "systematic"])
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_the_search_is_its_definition_round_by_round(method, temperature):
    """Six questions, each its own draws: the final population (steps, finished, weights), its
    distinct particles as trajectories, and the three answers, as the plain re-derivation has them."""
    resampled_away = 0
    for q in ("q1", "q2", "q3", "q4", "q5", "q6"):
        want = reference(q, 8, 6, 3, temperature, method)
        got = run(q, num_particles=8, max_depth=6, step_tokens=24, seed=3, resampling=method,
                  weight_temperature=temperature)
        distinct = []
        for p in want:
            if all(p is not d for d in distinct):
                distinct.append(p)
        assert [(t.steps, t.finished) for t in got.trajectories] == [(s, f) for s, f, _ in distinct]
        assert [t.score for t in got.trajectories] == pytest.approx([score(s[-1]) for s, _, _ in distinct])
        weights = [w for _, _, w in want]
        probs = [math.exp(w - max(weights)) for w in weights]
        answers = [_answer(s) for s, _, _ in want]
        best = max(range(len(want)), key=lambda i: (weights[i], -i))
        assert got.answers["prm_best"] == answers[best] and got.answer == answers[best]
        assert got.answers["prm_weighted"] == _vote(answers, probs)
        assert got.answers["majority"] == _vote(answers, [1.0] * len(answers))
        resampled_away += len(want) - len(distinct)
    assert resampled_away > 0   # copies happened: the draws mattered


def _answer(steps):
    last = steps[-1]
    return last[last.index("{") + 1:last.index("}")] if "\\boxed{" in last else None


def _vote(answers, weights):
    total: dict = {}
    for a, w in zip(answers, weights):
        if a is not None:
            total[a] = total.get(a, 0.0) + w
    if not total:
        return None
    best = max(total.values())
    return next(a for a in total if total[a] == best)   # ties to the answer seen first


def test_the_same_seed_resamples_the_same_way_and_the_pick_chooses_the_answer():
    a = run("q7", num_particles=8, max_depth=6, step_tokens=24, seed=5)
    b = run("q7", num_particles=8, max_depth=6, step_tokens=24, seed=5)
    assert [(t.steps, t.score) for t in a.trajectories] == [(t.steps, t.score) for t in b.trajectories]
    assert a.answers == b.answers and a.tokens_generated == b.tokens_generated
    vote = run("q7", num_particles=8, max_depth=6, step_tokens=24, seed=5, particle_pick="weighted_vote")
    assert vote.answers == a.answers and vote.answer == a.answers["prm_weighted"]


def test_sgl_tts_run_runs_particle_filtering_on_the_embedded_default(tmp_path, capsys):
    from sgl_tts.cli import run as run_command
    from sgl_tts.tiny import task

    problems = tmp_path / "problems.jsonl"
    task.write_jsonl(task.test_split()[:2], problems)
    out = tmp_path / "pf.jsonl"
    assert run_command.main(["--problems", str(problems), "--output", str(out), "--program", "particle_filtering",
                            "--n", "4", "--resampling", "systematic", "--particle-pick", "weighted_vote",
                            "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 and all(r["trajectories"] and r["tokens_generated"] > 0 for r in records)
    assert all(set(r["answers"]) == {"prm_best", "prm_weighted", "majority"} for r in records)
    assert all(r["answer"] == r["answers"]["prm_weighted"] for r in records)
    assert summary["problems"] == 2
    # another program's setting is refused, naming its owner
    assert run_command.main(["--problems", str(problems), "--output", str(tmp_path / "x.jsonl"),
                            "--program", "dvts", "--resampling", "systematic", "--no-progress"]) == 1
    assert capsys.readouterr().err == "sgl-tts run: error: resampling: settings of program particle_filtering\n"
