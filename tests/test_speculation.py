"""Speculative beam extension, LookAhead verification and overlapped verification (sgl_tts.search.pipeline)
never change what a search keeps: checked against the plain search on scripted programs whose step
lengths are heavy-tailed and whose generation takes time per token (ScriptedBackend pacing), so
beams really finish while stragglers run, branches really are stopped and aborted mid-step."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import sglang as sgl

import sgl_tts
from programs.beam_search import beam_search
from programs.dvts import dvts
from sgl_tts.backends.local import admission_priority
from sgl_tts.backends.request import RequestFields
from sgl_tts.search.overlap import OverlappedVerification
from sgl_tts.search.pipeline import StepPipeline
from sgl_tts.search.speculation import Speculation, speculative_potential
from sgl_tts.search import aggregate, derive_seed, expand, top_k
from sgl_tts.testing import ScriptedBackend, ScriptedPRM

D = "\n\n"
PACE = 0.002   # seconds per scripted token
QUESTIONS = ["q1", "q2", "q3"]


def heavy(prefix: str, draw: int | None) -> str:
    """Heavy-tailed steps (Pareto lengths, many cut at the token limit), answers from depth 3."""
    rng = random.Random(derive_seed("heavy", prefix, draw))
    if prefix.count(D) >= 4 and rng.random() < 0.4:
        return f"so \\boxed{{{rng.randrange(4)}}}"
    n = min(40, int(1 + rng.paretovariate(1.1) * 2))
    return "".join(rng.choice("abcd ") for _ in range(n)) + D


def score(text: str) -> float:
    return (derive_seed("score", text) % 8) / 8 + 0.05   # 8 levels: ties are common


def run(program, q, *, backend=None, prm=None, **kw):
    backend = backend or ScriptedBackend(heavy, seconds_per_token=PACE)
    prm = prm or ScriptedPRM(score)
    state = program.run(question=q, prm=prm, backend=backend, **kw)
    assert state.error() is None, state.error()
    return state.ret_value, prm, backend


def kept(result):
    return [(t.steps, t.step_scores, t.score, t.answer, t.tokens, t.finished) for t in result.trajectories]


SETTINGS = dict(num_beams=8, beam_width=2, max_depth=7, step_tokens=24)


@pytest.mark.parametrize("program", [beam_search, dvts], ids=["beam_search", "dvts"])
@pytest.mark.parametrize("policy, overlap", [
    (Speculation(lookahead=False), False),
    (Speculation(), False),
    (Speculation(), True),
    (False, True),
    (Speculation(), "by-family"),
    (False, "by-family"),
], ids=["speculate", "speculate+lookahead", "speculate+lookahead+overlap", "overlap",
        "speculate+lookahead+overlap-by-family", "overlap-by-family"])
def test_every_trajectory_is_the_plain_searchs(program, policy, overlap):
    """Exact mode: every trajectory (steps, scores, tokens), every answer; the plain search's tokens are
    exactly the normal ones plus the speculative ones reused."""
    speculated = 0
    for q in QUESTIONS:
        plain, _, _ = run(program, q, **SETTINGS)
        got, _, backend = run(program, q, speculative=policy, overlap_verification=bool(overlap),
                              overlap_by_family=overlap == "by-family", **SETTINGS)
        assert kept(got) == kept(plain)
        assert got.answers == plain.answers and got.answer == plain.answer
        assert got.tokens_generated == got.tokens_normal + got.tokens_speculative
        assert plain.tokens_generated == got.tokens_normal + got.tokens_reused
        assert 0 <= got.tokens_reused <= got.tokens_speculative
        assert got.tokens_wasted == got.tokens_speculative - got.tokens_reused
        assert backend.running() == 0
        speculated += got.tokens_reused
    if policy:
        assert speculated > 0   # the cases do reuse speculative steps


@pytest.mark.parametrize("program", [beam_search, dvts], ids=["beam_search", "dvts"])
def test_branches_stopped_by_the_scheduler_are_generated_again_in_exact_mode(program):
    """The scheduler stops speculative requests mid-step (two-phase scheduling): in exact mode a kept
    child whose branch was stopped asks for its whole step again, from its parent's text, so every
    trajectory is still the plain search's."""
    for q in QUESTIONS[:2]:
        plain, _, _ = run(program, q, **SETTINGS)
        backend = ScriptedBackend(heavy, seconds_per_token=PACE)
        stop = threading.Event()
        stopped = []

        def scheduler():
            while not stop.wait(0.004):
                stopped.append(backend.stop_speculative())

        t = threading.Thread(target=scheduler)
        t.start()
        try:
            got, _, _ = run(program, q, backend=backend, speculative=True, **SETTINGS)
        finally:
            stop.set()
            t.join()
        assert sum(stopped) > 0
        cut = [d for d in backend.draws if "/spec" in d.rid and d.finish_reason["type"] == "length"
               and d.finish_reason["length"] < d.max_tokens]
        assert cut   # some branches were stopped mid-step
        assert kept(got) == kept(plain)
        assert plain.tokens_generated == got.tokens_normal + got.tokens_reused


def test_truncate_mode_continues_a_stopped_branch_from_where_it_stopped():
    backend = ScriptedBackend(heavy, seconds_per_token=PACE)
    stop = threading.Event()

    def scheduler():
        while not stop.wait(0.004):
            backend.stop_speculative()

    t = threading.Thread(target=scheduler)
    t.start()
    try:
        got, _, _ = run(beam_search, "q1", backend=backend, speculative="truncate", **SETTINGS)
    finally:
        stop.set()
        t.join()
    spec = {d.rid: d for d in backend.draws if "/spec" in d.rid}
    stopped = [d for d in spec.values() if d.finish_reason["type"] == "length" and d.finish_reason["length"] < d.max_tokens]
    normal = [d for d in backend.draws if "/spec" not in d.rid]
    continued = 0
    for d in stopped:
        after = [n for n in normal if n.prefix == d.prefix + d.text and all(
            n.custom_params[k] == d.custom_params[k] for k in ("tts_depth", "tts_parent", "tts_ordinal"))]
        for n in after:   # a continuation: the same seed, the rest of the token limit
            assert n.draw == d.draw and n.max_tokens == d.max_tokens - d.finish_reason["length"]
            continued += 1
    assert continued > 0
    assert got.tokens_generated == got.tokens_normal + got.tokens_speculative


class Recorder:
    """Records each depth's candidates and what the program kept (wraps StepPipeline.expand)."""

    def __init__(self, monkeypatch):
        self.rounds = []
        self.candidates = {}
        original, run_depth = StepPipeline.expand, StepPipeline.run_depth

        def expand_and_record(pipe, kept_, depth):
            self.rounds.append((depth, self.candidates[depth], [(c.index, n) for c, n in kept_]))
            return original(pipe, kept_, depth)

        def run_and_record(pipe, beams, depth):
            self.candidates[depth] = cands = run_depth(pipe, beams, depth)
            return cands

        monkeypatch.setattr(StepPipeline, "expand", expand_and_record)
        monkeypatch.setattr(StepPipeline, "run_depth", run_and_record)


def test_truncate_mode_keeps_the_top_candidates_by_their_current_scores(monkeypatch):
    """R mode changes samples (children start from a cut of a sibling's branch), never the rule: at
    every depth the kept candidates are the N/M best open ones by their own step's scores, with the
    plain search's shares."""
    rec = Recorder(monkeypatch)
    n, m = SETTINGS["num_beams"], SETTINGS["beam_width"]
    truncated = 0
    for q in QUESTIONS:
        backend = ScriptedBackend(heavy, seconds_per_token=PACE)
        run(beam_search, q, backend=backend, speculative=Speculation(mode="truncate", ratio=0.5), **SETTINGS)
        spec = [d for d in backend.draws if "/spec" in d.rid]
        truncated += sum(1 for n in backend.draws if "/spec" not in n.rid and any(
            n.prefix.startswith(s.prefix) and 0 < len(n.prefix) - len(s.prefix) < len(s.text)
            and s.text.startswith(n.prefix[len(s.prefix):]) for s in spec))
    assert rec.rounds and truncated > 0
    for depth, cands, got in rec.rounds:
        open_ = [c for c in cands if not c.grown.finished]
        assert all(c.scores == [score(s) for s in c.path] for c in cands)   # the current path only
        values = [aggregate(c.scores, "last") for c in open_]
        ranked = top_k(values, n // m)
        assert got == list(zip([open_[r].index for r in ranked], expand(len(ranked), n)))


def test_speculative_requests_carry_their_class_parent_ordinal_and_the_childs_request(monkeypatch):
    """A branch is the request its child would send: the parent's text (and the delimiter when the
    parent's step closed), the child's seed and token limit; tagged speculative with its parent's
    candidate index and its ordinal; as many as the parent's speculative potential."""
    rec = Recorder(monkeypatch)
    backend = ScriptedBackend(heavy, seconds_per_token=PACE)
    q = "q2"
    run(beam_search, q, backend=backend, speculative=True, **SETTINGS)
    spec = [d for d in backend.draws if "/spec" in d.rid]
    assert spec
    by_depth = rec.candidates
    for d in spec:
        p = d.custom_params
        depth, parent, j = p["tts_depth"], p["tts_parent"], p["tts_ordinal"]
        assert p["tts_class"] == "speculative" and d.rid.startswith(f"tts/{p['tts_group']}/{depth}/spec{parent}/{j}/")
        c = by_depth[depth - 1][parent]
        assert d.draw == derive_seed("beam_search", 0, q, depth, parent, j)
        assert d.max_tokens == SETTINGS["step_tokens"]
        assert d.prefix == c.beam.state.text() + ("" if c.grown.continues else D)
        assert j < speculative_potential(c.beam.prior, SETTINGS["beam_width"])
    # a candidate's branches are its first children, at most its potential; the finished ones none
    for depth, cands in by_depth.items():
        for c in cands:
            got = sorted(d.custom_params["tts_ordinal"] for d in spec if d.custom_params["tts_depth"] == depth + 1
                         and d.custom_params["tts_parent"] == c.index)
            assert got == list(range(len(got)))
            assert len(got) <= (0 if c.grown.finished else speculative_potential(c.beam.prior, SETTINGS["beam_width"]))
    # the search's batch stays at its size: branches only take the slots finished steps freed
    assert backend.peak <= SETTINGS["num_beams"]


def slow_spec(prefix: str, draw: int | None) -> str:
    """Depth 0: beam i writes "s<i>" at once, beam 0 straggles (30 tokens); every second step is
    200 tokens long: pruned beams' branches are still running when selection is made."""
    if prefix.count(D) == 1:
        i = draw % 4
        return ("s0" + "x" * 28 if i == 0 else f"s{i}") + D
    return "y" * 199 + D


def test_pruned_branches_are_aborted_at_selection_and_nothing_is_left_running():
    backend = ScriptedBackend(slow_spec, seconds_per_token=0.005)
    q = next(q for q in (f"p{k}" for k in range(200))
             if sorted(derive_seed("beam_search", 0, q, 0, -1, i) % 4 for i in range(4)) == [0, 1, 2, 3])
    prm = ScriptedPRM(lambda s: {"s1": 0.9, "s2": 0.8}.get(s[:2], 0.1))
    got, _, _ = run(beam_search, q, backend=backend, prm=prm, num_beams=4, beam_width=2, max_depth=2,
                    step_tokens=256, speculative=True)
    assert backend.running() == 0
    spec = [d for d in backend.draws if "/spec" in d.rid]
    kept = [d for d in spec if d.prefix.endswith(("s1" + D, "s2" + D))]     # branches of the kept beams
    pruned = [d for d in spec if not d.prefix.endswith(("s1" + D, "s2" + D))]
    # the two pruned beams' branches (all of them) were aborted mid-step; the kept ones' ran to their end
    assert pruned and all(d.finish_reason["type"] == "abort" for d in pruned), \
        [(d.prefix[-8:], d.finish_reason, len(d.text)) for d in pruned]
    assert len(kept) == 2 and all(d.text == "y" * 199 and d.finish_reason["type"] == "stop" for d in kept)
    # the kept beams' branches were all taken over: what was wasted is what the aborted ones generated
    assert got.tokens_wasted == sum(len(d.text) for d in pruned)


@sgl.function
def one_step(s, step):
    s += "q" + D
    s += step


def test_a_request_made_before_an_abort_of_its_prefix_is_answered_aborted_and_never_generated():
    """The race behind a pruned branch that ran to its end: the pipeline starts a branch (its gen is
    made and queued on the fork's interpreter thread), selection aborts its prefix before that thread
    sent it, and the abort found nothing. Such a request is answered as aborted; one made after
    the abort (a rerun of the same group) and one under another prefix are generated."""
    backend = ScriptedBackend(lambda prefix, draw: "abc" + D)
    made = {name: sgl_tts.gen("x", max_tokens=8, stop=D, rid=rid)
            for name, rid in (("early", "tts/g/1/spec0/0/aa"), ("other", "tts/g/1/spec1/0/bb"))}
    assert backend.abort_prefix("tts/g/1/spec0/") == 0          # nothing running: nothing it could stop
    made["late"] = sgl_tts.gen("x", max_tokens=8, stop=D, rid="tts/g/1/spec0/0/cc")
    got = {}
    for name, step in made.items():     # run() returns before its thread has sent the gen: wait for each,
        got[name] = one_step.run(step=step, backend=backend)   # so the draws come in this order
        got[name].sync()
    assert {name: (st["x"], st.get_meta_info("x")["finish_reason"]["type"]) for name, st in got.items()} == \
        {"early": ("", "abort"), "other": ("abc", "stop"), "late": ("abc", "stop")}
    assert [(d.rid, d.text, d.finish_reason["type"]) for d in backend.draws] == [
        ("tts/g/1/spec0/0/aa", "", "abort"), ("tts/g/1/spec1/0/bb", "abc", "stop"), ("tts/g/1/spec0/0/cc", "abc", "stop")]


def test_lookahead_sends_each_speculated_pair_once_and_reuses_its_score():
    """Without overlap, one PRM call per depth; a candidate whose branch completed a whole step before
    the call is sent as one path: its step and the branch's (the pair); a kept child that took that
    branch over is never sent again, and its scores are the plain search's."""
    pairs = cached = 0
    for q in QUESTIONS:
        plain, plain_prm, _ = run(beam_search, q, **SETTINGS)
        got, prm, _ = run(beam_search, q, speculative=True, **SETTINGS)
        assert kept(got) == kept(plain)
        assert len(prm.calls) == len(plain_prm.calls)                  # one call per depth
        assert sum(len(c.steps_batch) for c in prm.calls) == got.prm_requests
        earlier_pairs: set = set()
        for depth, (call, want) in enumerate(zip(prm.calls, plain_prm.calls)):
            sent = [tuple(p) for p in call.steps_batch]
            wanted = [tuple(p) for p in want.steps_batch]
            longer = [p for p in sent if p not in wanted]                   # speculated pairs
            assert all(any(x[:len(p)] == p and len(x) > len(p) for p in wanted) for x in longer)
            pairs += len(longer)
            for p in map(tuple, want.steps_batch):   # every candidate the plain search verified here is
                if p in earlier_pairs:               # answered by an earlier pair, not sent again
                    cached += 1
                    assert p not in sent
                else:                                # or sent: alone or as the first part of its pairs
                    assert p in sent or any(x[:len(p)] == p for x in longer), p
            assert len(sent) <= len(want.steps_batch) + len(longer)
            earlier_pairs = set(longer)
        no_lookahead, prm2, _ = run(beam_search, q, speculative=Speculation(lookahead=False), **SETTINGS)
        assert kept(no_lookahead) == kept(plain)   # and the PRM sees exactly the plain search's calls
        assert [c.steps_batch for c in prm2.calls] == [c.steps_batch for c in plain_prm.calls]
    assert pairs > 0 and cached > 0


class LoggedPRM(ScriptedPRM):
    def __init__(self, log):
        super().__init__(score)
        self.log = log

    def score(self, question, steps_batch):
        self.log.append(("prm", time.monotonic()))
        return super().score(question, steps_batch)


def straggler(prefix: str, draw: int | None) -> str:
    if prefix.count(D) == 1:
        return ("a" * 60 if draw % 4 == 0 else "b") + D
    return "\\boxed{1}"


@pytest.mark.parametrize("overlap", [False, True])
def test_overlapped_verification_scores_finished_beams_while_a_straggler_generates(overlap):
    log: list = []
    backend = ScriptedBackend(straggler, seconds_per_token=0.01)
    q = next(q for q in (f"p{k}" for k in range(200))
             if sum(derive_seed("beam_search", 0, q, 0, -1, i) % 4 == 0 for i in range(4)) == 1)
    t0 = time.monotonic()
    got, prm, _ = run(beam_search, q, backend=backend, prm=LoggedPRM(log), num_beams=4, beam_width=2,
                      max_depth=2, overlap_verification=overlap)
    slow = next(d for d in backend.draws if d.text == "a" * 60)
    end_of_straggler = t0 + 61 * 0.01
    first = min(t for what, t in log)
    if overlap:   # the short beams are scored before the straggler ends, the straggler on its own after
        assert first < end_of_straggler - 0.3
        assert ["a" * 60] not in prm.calls[0].steps_batch and prm.calls[0].steps_batch
        assert any(call.steps_batch == [["a" * 60]] for call in prm.calls[1:])
    else:
        assert len(prm.calls) == 2 and first >= end_of_straggler - 0.05    # one batch per depth
    assert got.seconds_verifying >= 0 and got.seconds_generating > 0.5
    assert slow.finish_reason["matched"] == D


def distinct_heavy(prefix: str, draw: int | None) -> str:
    """``heavy``'s steps, each led by its sampling seed: no two beams' paths are equal, so a path
    names its beam (and a path without its last step names the parent)."""
    return f"{draw}:{heavy(prefix, draw)}"


def split_families(prm: ScriptedPRM) -> tuple[int, dict[int, list[tuple[str, ...]]]]:
    """(families scored, the families whose PRM requests went out in more than one call, by depth).
    A family: the paths scored below one parent path (every path of two or more steps, keyed by all
    its steps but the last; with no step cut, a path at depth d has d + 1 steps); the root's beams
    share only the question and are not a family."""
    calls_of: dict[tuple[str, ...], set[int]] = {}
    for k, call in enumerate(prm.calls):
        for path in call.steps_batch:
            if len(path) >= 2:
                calls_of.setdefault(tuple(path[:-1]), set()).add(k)
    split: dict[int, list[tuple[str, ...]]] = {}
    for parent, calls in calls_of.items():
        if len(calls) > 1:
            split.setdefault(len(parent), []).append(parent)
    return len(calls_of), split


def calls_made(records) -> dict[int, list[list[int]]]:
    """The PRM calls a search made, in the order it made them, by depth: each call's beams' parents
    (the pipeline's debug log; the calls run on a pool, so :attr:`ScriptedPRM.calls`, in the order
    they ran, can swap two made a moment apart)."""
    out: dict[int, list[list[int]]] = {}
    for r in records:
        if r.name == "sgl_tts.search.pipeline" and "makes a PRM call" in r.msg:
            _, depth, _, parents = r.args
            out.setdefault(depth, []).append(list(parents))
    return out


@pytest.mark.parametrize("program", [beam_search, dvts], ids=["beam_search", "dvts"])
def test_overlap_by_family_sends_each_family_in_one_prm_call(program, caplog):
    """By family, a family's PRM requests go in one call (issue 32: the PRM computes their shared path
    once), except the depth's last family: once only its beams generate, its members go as they are
    ready, and no other family's request is made after its first call at that depth. By beam, the same
    searches split several families of a depth over calls, as siblings' steps end apart (the check
    tells the two apart). The kept beams are the same."""
    settings = dict(SETTINGS, step_tokens=64)   # no step is cut
    several_split_by_beam = 0
    caplog.set_level(logging.DEBUG, logger="sgl_tts.search.pipeline")
    for q in QUESTIONS:
        by_beam, prm_by_beam, _ = run(program, q, backend=ScriptedBackend(distinct_heavy, seconds_per_token=PACE),
                                      overlap_verification=True, **settings)
        caplog.clear()
        by_family, prm, _ = run(program, q, backend=ScriptedBackend(distinct_heavy, seconds_per_token=PACE),
                                overlap_verification=True, overlap_by_family=True, **settings)
        assert kept(by_family) == kept(by_beam)
        families, split = split_families(prm)
        assert families >= 4 and all(len(parents) == 1 for parents in split.values()), (q, split)
        made = calls_made(caplog.records)
        assert sum(len(calls) for calls in made.values()) == len(prm.calls) and len(made) >= 3
        assert sum(len(p) for calls in made.values() for p in calls) == sum(len(c.steps_batch) for c in prm.calls)
        for depth, calls in made.items():
            parents_of = [{p for p in parents if p >= 0} for parents in calls]   # a root beam: no family
            split_here = {p for p in set().union(*parents_of) if sum(p in call for call in parents_of) > 1}
            assert len(split_here) <= 1, (q, depth, calls)
            for last in split_here:
                first = next(k for k, call in enumerate(parents_of) if last in call)
                assert set().union(*parents_of[first + 1:]) == {last}, (q, depth, calls)
        several_split_by_beam += sum(len(parents) > 1 for parents in split_families(prm_by_beam)[1].values())
    assert several_split_by_beam > 0


def test_families_release_a_family_when_its_last_sibling_is_ready_and_the_last_family_at_once():
    """Families, step by step, against the rule's definition: children of parents 0 (two) and 1
    (three) and a root beam (no parent); a candidate goes when its whole family is ready, a root beam
    at once, and once only one family still generates, its ready members go and later ones at once."""
    from sgl_tts.search.families import Families
    from sgl_tts.search.beams import Beam, Candidate

    beams = [Beam(None, parent=0), Beam(None, parent=0), Beam(None, parent=1), Beam(None, parent=1),
             Beam(None, parent=1), Beam(None)]
    c = [Candidate(i, b, None, None) for i, b in enumerate(beams)]
    fam = Families(beams)
    assert fam.release([c[2]], generating={0, 1, -1}) == []               # held: 3 and 4 still generate
    assert fam.release([c[5], c[1]], generating={0, 1}) == [c[5]]         # a root beam goes at once
    assert fam.holds(1) and fam.holds(2) and not fam.holds(5)
    assert fam.release([c[0]], generating={1}) == [c[0], c[1], c[2]]      # family 0 whole; 1 is the last
    assert fam.release([c[4]], generating={1}) == [c[4]]                  # ... so its members go at once
    assert fam.release([c[3]], generating=set()) == [c[3]]
    fam = Families(beams)
    assert fam.release([c[3], c[2]], generating={0, 1}) == []
    assert fam.release([c[4]], generating={0}) == [c[2], c[3], c[4]]      # whole, in beam order
    assert fam.release([], generating={0}) == []                          # (the last one: nothing held)


def test_overlap_by_family_needs_overlapped_verification():
    with pytest.raises(ValueError, match="overlap_by_family is a way of overlapped verification: it needs "
                                         "overlap_verification=True"):
        run(dvts, "q1", overlap_by_family=True, **SETTINGS)
    with pytest.raises(ValueError, match="by_family is a way of overlapped verification: give overlap=True"):
        OverlappedVerification.of(False, by_family=True)


def test_speculative_potential_follows_selectspec_bins():
    """B equal-width bins of [0, 1], C_1 the highest: a score in C_j may speculate B - j + 1 branches."""
    def by_definition(s, bins):
        s = min(1.0, max(0.0, s))
        for j in range(1, bins + 1):
            lo, hi = (bins - j) / bins, (bins - j + 1) / bins
            if lo < s <= hi or (j == bins and s == 0.0):
                return bins - j + 1
    for bins in (1, 2, 3, 4, 7):
        for s in [0.0, 1e-9, 0.25, 0.2500001, 0.5, 0.74, 0.75, 0.76, 0.99, 1.0, 1.5, -0.3] + \
                [k / 97 for k in range(98)]:
            assert speculative_potential(s, bins) == by_definition(s, bins), (s, bins)
    assert speculative_potential(None, 4) == 1     # a root beam has no score yet


def test_bad_policies_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="unknown speculation mode 'fast'"):
        Speculation(mode="fast")
    with pytest.raises(ValueError, match=r"unknown speculation 'fast'; choose one of \['exact', 'exact-no-lookahead', 'truncate', 'auto'\]"):
        Speculation.of("fast")
    # a name is its policy: the ablation's middle step differs from the full policy in LookAhead only
    assert Speculation.of("exact-no-lookahead") == Speculation(lookahead=False)
    assert Speculation.of("truncate") == Speculation(mode="truncate") and Speculation.of("exact") == Speculation()
    with pytest.raises(ValueError, match=r"truncation ratio R must lie in \[0, 1\], got 1.5"):
        Speculation(ratio=1.5)
    with pytest.raises(ValueError, match="bins must be a positive integer"):
        Speculation(bins=0)
    with pytest.raises(TypeError, match="speculative must be a bool"):
        Speculation.of(3)
    assert Speculation.of("truncate").mode == "truncate" and Speculation.of(False) is None
    with pytest.raises(ValueError, match="speculative and overlap_verification belong to the default"):
        run(beam_search, "q1", semantics="search-and-learn", speculative=True, num_beams=2, beam_width=2)


def test_local_backend_admits_speculative_requests_after_normal_ones():
    assert admission_priority(RequestFields(custom_params={"tts_class": "speculative"})) == pipeline_low()
    assert admission_priority(RequestFields(custom_params={"tts_class": "normal"})) == 0
    assert admission_priority(RequestFields()) == 0
    assert admission_priority(RequestFields(priority=5, custom_params={"tts_class": "speculative"})) == 5


def pipeline_low() -> int:
    from sgl_tts.backends.local import SPECULATIVE_PRIORITY
    assert SPECULATIVE_PRIORITY < 0
    return SPECULATIVE_PRIORITY


def test_the_scripted_backend_paces_aborts_and_stops():
    backend = ScriptedBackend(lambda p, d: "z" * 100, seconds_per_token=0.01)
    import sglang as sgl
    import sgl_tts

    @sgl.function
    def two(s):
        a, b = s.fork(2)
        a += sgl_tts.gen("x", max_tokens=200, rid="tts/g/0/spec1/0/a",
                         custom_params={"tts_group": "g", "tts_class": "speculative"})
        b += sgl_tts.gen("x", max_tokens=200, rid="tts/g/0/1/b")
        time.sleep(0.2)
        assert backend.stop_speculative() == 1 and backend.abort_prefix("tts/g/0/1/") == 1
        return a.get_meta_info("x")["finish_reason"], b.get_meta_info("x")["finish_reason"], a["x"], b["x"]

    ra, rb, ta, tb = two.run(backend=backend).ret_value
    assert ra["type"] == "length" and 10 <= ra["length"] < 100 and ta == "z" * ra["length"]
    assert rb["type"] == "abort" and 10 <= len(tb) < 100
    assert backend.running() == 0
