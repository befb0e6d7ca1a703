"""The TTS programs (``programs/``) on the shipped tiny generator, and the step-tag PRM scorer.

Selections are checked exactly against the scores the programs saw: a recording scorer wraps the
task's checker (an oracle PRM: 1.0 while a solution is still right, else 0.0) and the test replays
each beam-search depth's selection from the recorded calls.
"""

from __future__ import annotations

import random
import re

import pytest

from sgl_tts import LocalBackend
from sgl_tts.tiny import task
from sgl_tts.models import shipped_model
from sgl_tts.prm import PRMScorer, StepTagPRM
from sgl_tts.search import aggregate, derive_seed, expand, expand_proportional, top_k, vote

from programs.beam_search import beam_search
from programs.best_of_n import best_of_n
from programs.dvts import dvts

PROBLEMS = task.test_split()[:6]


class CheckerPRM:
    """The task's checker as a PRM (Math-Shepherd labels as scores); records every call."""

    def __init__(self, problems):
        self.by_question = {p.question: p for p in problems}
        self.calls: list[tuple[str, list[list[str]], list[list[float]]]] = []

    def score(self, question, steps_batch):
        p = self.by_question[question]
        out = [[float(v) for v in task.grade(p, task.STEP_SEPARATOR.join(st)).prefix_ok]
               for st in steps_batch]
        self.calls.append((question, [list(s) for s in steps_batch], out))
        return out


class HashPRM(CheckerPRM):
    """Scores every step prefix by a stable hash in [0, 1): unrelated to correctness, so a rollout's
    score and its candidate's score rank candidates differently (what a lookahead test needs)."""

    def score(self, question, steps_batch):
        out = [[derive_seed(question, tuple(st[:k + 1])) / 2 ** 63 for k in range(len(st))]
               for st in steps_batch]
        self.calls.append((question, [list(s) for s in steps_batch], out))
        return out


@pytest.fixture(scope="module")
def generator():
    be = LocalBackend(shipped_model("generator"), seed=0)
    yield be
    be.shutdown()


@pytest.fixture(scope="module")
def prm_backend():
    be = LocalBackend(shipped_model("prm"), seed=0)
    yield be
    be.shutdown()


def _run(program, backend, **kwargs):
    states = program.run_batch([dict(question=p.question, **kwargs) for p in PROBLEMS], backend=backend)
    for st in states:
        assert st.error() is None, st.error()
    return [st.ret_value for st in states]


def test_checker_prm_follows_the_protocol():
    assert isinstance(CheckerPRM(PROBLEMS), PRMScorer)


def test_best_of_n_picks_and_votes(generator):
    prm = CheckerPRM(PROBLEMS)
    results = _run(best_of_n, generator, num_samples=8, prm=prm)
    for p, r in zip(PROBLEMS, results):
        assert len(r.trajectories) == 8
        answers = [t.answer for t in r.trajectories]
        right = [a == str(p.answer) for a in answers]
        assert r.answers["majority"] == vote(answers)
        # An oracle PRM's best-of-N is right exactly when some sample is right (pass@N).
        assert (r.answers["prm_best"] == str(p.answer)) == any(right)
        assert r.answer == r.answers["prm_best"]
        assert r.tokens_generated == sum(t.tokens for t in r.trajectories) > 0
        best = top_k([t.score for t in r.trajectories], 1)[0]
        assert r.answers["prm_best"] == r.trajectories[best].answer
    # Plain self-consistency without a PRM picks the majority.
    plain = _run(best_of_n, generator, num_samples=8)
    assert [r.answer for r in plain] == [r.answers["majority"] for r in results]


def test_best_of_n_is_reproducible_batched_solo_and_under_subsampling(generator):
    batched = _run(best_of_n, generator, num_samples=8)
    solo = best_of_n.run(question=PROBLEMS[2].question, num_samples=8, backend=generator).ret_value
    assert [t.steps for t in solo.trajectories] == [t.steps for t in batched[2].trajectories]
    small = _run(best_of_n, generator, num_samples=4)
    for a, b in zip(small, batched):
        assert [t.steps for t in a.trajectories] == [t.steps for t in b.trajectories[:4]]


def _replay_beam_search(calls, num_beams, beam_width, aggregation="last", branching="equal"):
    """Check every depth's kept beams (and their children counts) against the scores of the depth
    before."""
    keep = max(1, num_beams // beam_width)
    for (_, cands, scores), (_, nxt, _) in zip(calls, calls[1:]):
        open_idx = [i for i, c in enumerate(cands) if "\\boxed" not in c[-1]]
        ranked = top_k([aggregate(scores[i], aggregation) for i in open_idx], keep)
        if branching == "equal":
            shares = expand(len(ranked), num_beams)
        else:
            shares = expand_proportional([aggregate(scores[open_idx[r]], aggregation) for r in ranked],
                                         num_beams)
        expected = []
        for r, children in zip(ranked, shares):
            expected += [cands[open_idx[r]]] * children
        assert [c[:-1] for c in nxt] == expected


def test_beam_search_keeps_the_top_scored_beams_at_every_depth(generator):
    for p in PROBLEMS[:3]:
        prm = CheckerPRM(PROBLEMS)
        r = beam_search.run(question=p.question, prm=prm, num_beams=8, beam_width=4,
                            backend=generator).ret_value
        assert len(prm.calls) >= len(p.ops)  # one scoring call per depth
        assert all(len(c[1]) == 8 for c in prm.calls)
        _replay_beam_search(prm.calls, 8, 4)
        assert r.trajectories and all(t.finished for t in r.trajectories)
        pick = top_k([t.score for t in r.trajectories], 1)[0]
        assert r.answer == r.trajectories[pick].answer
        assert r.tokens_generated >= max(t.tokens for t in r.trajectories) > 0


def test_dynamic_branching_gives_children_in_proportion_to_scores(generator):
    uneven = 0
    for p in PROBLEMS[:3]:
        prm = CheckerPRM(PROBLEMS)
        # beam_width 1 keeps every open beam, so wrong ones (oracle score 0) are kept too
        r = beam_search.run(question=p.question, prm=prm, num_beams=8, beam_width=1,
                            branching="proportional", backend=generator).ret_value
        _replay_beam_search(prm.calls, 8, 1, branching="proportional")
        assert all(len(c[1]) == 8 for c in prm.calls) and r.trajectories
        # With the oracle's 0/1 scores a wrong kept beam gets no children: somewhere the split
        # differs from the equal one (so the replay above did check dynamic branching).
        for _, cands, scores in prm.calls[:-1]:
            open_idx = [i for i, c in enumerate(cands) if "\\boxed" not in c[-1]]
            kept = [scores[open_idx[r]][-1] for r in top_k([scores[i][-1] for i in open_idx], 8)]
            uneven += expand_proportional(kept, 8) != expand(len(kept), 8)
    assert uneven > 0
    with pytest.raises(ValueError, match="unknown branching 'random'"):
        beam_search.run(question="Compute 1+2.", prm=CheckerPRM(PROBLEMS), branching="random",
                        backend=generator)


def test_lookahead_ranks_candidates_by_their_rollouts(generator):
    checked = differs = 0
    for p in PROBLEMS[:3]:
        prm = HashPRM(PROBLEMS)
        r = beam_search.run(question=p.question, prm=prm, num_beams=8, beam_width=4, lookahead=2,
                            backend=generator).ret_value
        calls = prm.calls
        k = 0
        while k + 2 < len(calls):  # per depth: the candidates, then their rollouts
            (_, cands, _), (_, rolled, roll_scores), (_, nxt, _) = calls[k], calls[k + 1], calls[k + 2]
            open_c = [c for c in cands if "\\boxed" not in c[-1]]
            assert len(rolled) == len(open_c)
            for c, rc in zip(open_c, rolled):  # a rollout extends its candidate by up to 2 steps
                assert rc[:len(c)] == c and len(c) <= len(rc) <= len(c) + 2
            ranked = top_k([sc[-1] for sc in roll_scores], 2)
            own = [sc[-1] for c, sc in zip(cands, calls[k][2]) if "\\boxed" not in c[-1]]
            differs += top_k(own, 2) != ranked
            expected = [open_c[i] for i, n in zip(ranked, expand(len(ranked), 8)) for _ in range(n)]
            assert [c[:-1] for c in nxt] == expected
            checked += 1
            k += 2
        assert r.trajectories
        assert r.tokens_generated > sum(t.tokens for t in r.trajectories)  # rollouts cost tokens
    assert checked >= 6 and differs > 0  # the rollouts changed the ranking somewhere
    with pytest.raises(ValueError, match="lookahead must be >= 0, got -1"):
        beam_search.run(question="Compute 1+2.", prm=CheckerPRM(PROBLEMS), lookahead=-1,
                        backend=generator)


def test_beam_search_with_an_oracle_prm_solves_what_sampling_can(generator):
    prm = CheckerPRM(PROBLEMS)
    results = _run(beam_search, generator, prm=prm, num_beams=8, beam_width=4)
    sampled = _run(best_of_n, generator, num_samples=8, prm=CheckerPRM(PROBLEMS))
    beam_right = sum(r.answer == str(p.answer) for p, r in zip(PROBLEMS, results))
    bon_right = sum(r.answer == str(p.answer) for p, r in zip(PROBLEMS, sampled))
    assert beam_right >= bon_right
    again = _run(beam_search, generator, prm=CheckerPRM(PROBLEMS), num_beams=8, beam_width=4)
    assert [[t.steps for t in r.trajectories] for r in again] == \
        [[t.steps for t in r.trajectories] for r in results]


def test_beam_search_rejects_bad_arguments(generator):
    with pytest.raises(ValueError, match="^beam search needs N >= 1 beams and a beam width M >= 1, got N=0 and M=4$"):
        beam_search.run(question="Compute 1+2.", prm=CheckerPRM(PROBLEMS), num_beams=0,
                        backend=generator)


def _replay_dvts(calls, beam_width, aggregation="last"):
    """Check that every live subtree continues from its own best candidate of the depth before."""
    for (_, cands, scores), (_, nxt, _) in zip(calls, calls[1:]):
        expected = []
        for start in range(0, len(cands), beam_width):
            block = range(start, start + beam_width)
            best = block[top_k([aggregate(scores[j], aggregation) for j in block], 1)[0]]
            if "\\boxed" not in cands[best][-1]:
                expected += [cands[best]] * beam_width
        assert [c[:-1] for c in nxt] == expected


def test_dvts_grows_each_subtree_from_its_own_best_candidate(generator):
    for p in PROBLEMS[:3]:
        prm = CheckerPRM(PROBLEMS)
        r = dvts.run(question=p.question, prm=prm, num_beams=12, beam_width=4, backend=generator).ret_value
        assert len(prm.calls[0][1]) == 12 and len(prm.calls) >= len(p.ops)
        _replay_dvts(prm.calls, 4)
        assert len(r.trajectories) == 3 and all(t.finished for t in r.trajectories)
        # Each subtree's result is its last pick: a candidate of the call where it finished.
        seen = [c for call in prm.calls for c in call[1]]
        assert all(t.steps in seen for t in r.trajectories)
        pick = top_k([t.score for t in r.trajectories], 1)[0]
        assert r.answer == r.trajectories[pick].answer
        assert r.answers["majority"] == vote([t.answer for t in r.trajectories])
        assert r.tokens_generated >= sum(t.tokens for t in r.trajectories) > 0
    again = dvts.run(question=PROBLEMS[0].question, prm=CheckerPRM(PROBLEMS), num_beams=12,
                     beam_width=4, backend=generator).ret_value
    first = dvts.run(question=PROBLEMS[0].question, prm=CheckerPRM(PROBLEMS), num_beams=12,
                     beam_width=4, backend=generator).ret_value
    assert [t.steps for t in again.trajectories] == [t.steps for t in first.trajectories]


STEP_FORMAT = re.compile(r"Step \d+: \d+[-+*]\d+=\d+|The answer is \\boxed\{\d+\}")


@pytest.mark.parametrize("program", [beam_search, dvts], ids=["beam_search", "dvts"])
def test_varying_granularity_cuts_early_steps_and_continues_them(generator, program):
    tok = generator.tokenizer
    for p in PROBLEMS[:3]:
        prm = CheckerPRM(PROBLEMS)
        r = program.run(question=p.question, prm=prm, num_beams=8, beam_width=4, step_tokens=[3, 3, 64],
                        backend=generator).ret_value
        first, second = prm.calls[0][1], prm.calls[1][1]
        # Depth 0 stops every step after 3 tokens ("Step", " ", "1"), scored as it stands.
        assert all(len(c) == 1 and len(tok.encode(c[0])) <= 3 for c in first)
        # Depth 1 goes on with the same step (no delimiter inserted after a cut).
        assert all(len(c) == 1 and any(c[0].startswith(f[0]) for f in first) for c in second)
        # What comes out is whole steps in the task's format.
        assert r.trajectories and all(t.finished for t in r.trajectories)
        assert all(STEP_FORMAT.fullmatch(st) for t in r.trajectories for st in t.steps)
    with pytest.raises(ValueError, match="step_tokens must be positive integers"):
        program.run(question="Compute 1+2.", prm=CheckerPRM(PROBLEMS), step_tokens=[64, 0],
                    backend=generator)


def test_dvts_rejects_bad_arguments(generator):
    with pytest.raises(ValueError, match=r"^DVTS needs N >= M \(at least one subtree of M beams\), got N=2 and M=4$"):
        dvts.run(question="Compute 1+2.", prm=CheckerPRM(PROBLEMS), num_beams=2, beam_width=4,
                 backend=generator)


# ------------------------------------------------------------------------------ step-tag PRM
def test_step_tag_prm_cache_scores_each_step_once_and_changes_nothing(prm_backend):
    p = PROBLEMS[3]
    steps = p.step_texts()
    cached = StepTagPRM(prm_backend)
    fresh = StepTagPRM(prm_backend, cache=False)
    grown = [cached.score(p.question, [steps[:k]])[0] for k in range(1, len(steps) + 1)]
    assert cached.scored_steps == len(steps)            # every step scored exactly once
    assert cached.cached_steps == sum(range(len(steps)))
    whole = fresh.score(p.question, [steps])[0]
    assert grown[-1] == pytest.approx(whole, abs=1e-4)
    assert all(g == pytest.approx(whole[:len(g)], abs=1e-4) for g in grown)
    assert cached.score(p.question, [[]]) == [[]]
    assert cached.score(p.question, [["Step 1: 1\n\n2"]]) == [[0.0]]  # untaggable: zero, no failure


def test_prm_prefers_a_correct_step_to_the_same_step_with_one_digit_changed(prm_backend):
    """The shipped PRM, on a fixed sample of held-out problems: the reference step scores above the
    same step with one digit of its result changed (same prefix before it)."""
    prm = StepTagPRM(prm_backend, cache=False)
    rng = random.Random(7)
    wins, total = 0, 0
    for p in task.test_split()[:40]:
        steps = p.step_texts()
        k = rng.randrange(len(p.ops))
        x, (op, y), z = p.values[k], p.ops[k], p.values[k + 1]
        digits = list(str(z))
        i = rng.randrange(len(digits))
        digits[i] = rng.choice([d for d in "0123456789" if d != digits[i] and (d != "0" or i > 0)])
        bad = f"Step {k + 1}: {x}{op}{y}={int(''.join(digits))}"
        good_s, bad_s = prm.score(p.question, [steps[:k + 1], steps[:k] + [bad]])
        wins += good_s[-1] > bad_s[-1]
        total += 1
    # The shipped token-check PRM wins all 40 (2026-11-22; the closest pair is 0.12 vs 0.00, a
    # reference step the generator itself would not have written). A changed result digit is one the
    # generator did not rank first, so any loss here means the PRM no longer checks digits.
    assert wins == total, f"{wins}/{total}"
