"""The speculation cost controller (issue 33, sgl_tts.search.speculation_cost): its decisions against
the rule's definition on scripted decode curves, and a controlled search that keeps exactly the
plain search's beams whether it speculates, stands down or stops branches at the barrier."""

from __future__ import annotations

import pytest

from programs.beam_search import beam_search
from programs.dvts import dvts
from sgl_tts.search.speculation import SPECULATION_PRESETS, Speculation
from sgl_tts.search.speculation_cost import (COSTS_MORE, NO_CURVE, SLOWS_VERIFIER, STARTED, VERIFIER_SHARES,
                                             SpeculationController, TakeOverChance)
from sgl_tts.server_costs import DecodeCurve, VerifierSlowdown
from test_speculation import QUESTIONS, SETTINGS, kept, run

FLAT = DecodeCurve.of([(1, 0.02), (64, 0.02)])            # memory-bound: a row costs nothing
THROUGH_ORIGIN = DecodeCurve.of([(1, 0.01), (64, 0.64)])  # every row costs 10 ms, no fixed cost


def affine(a: float, c: float) -> DecodeCurve:
    return DecodeCurve.of([(1, a + c), (2, a + 2 * c), (128, a + 128 * c)])


def test_a_curve_interpolates_between_its_points_and_extends_its_last_slope():
    curve = DecodeCurve.of([(1, 0.010), (4, 0.016), (16, 0.040)])
    assert curve.step(1) == 0.010 and curve.step(0) == 0.010          # below the first point: held
    assert curve.step(2) == pytest.approx(0.012) and curve.step(4) == pytest.approx(0.016)
    assert curve.step(10) == pytest.approx(0.028)                      # 0.016 + 6 * 0.002
    assert curve.step(20) == pytest.approx(0.048)                      # the last slope, 0.002 a row
    assert curve.marginal(4) == pytest.approx(0.002) and curve.per_row(16) == pytest.approx(0.0025)
    assert DecodeCurve.of([(8, 0.05)]).step(100) == 0.05               # one point: flat
    # a falling pair is noise: pooled to its mean, 0.03 s at batch 1.5, one point, so a flat curve
    assert DecodeCurve.of([(1, 0.05), (2, 0.01)]).step(10) == pytest.approx(0.03)
    with pytest.raises(ValueError, match="at least one"):
        DecodeCurve.of([])
    with pytest.raises(ValueError, match="must increase"):
        DecodeCurve.of([(4, 0.1), (4, 0.2)])
    with pytest.raises(ValueError, match=r"batches must be >= 1 and its seconds > 0"):
        DecodeCurve.of([(1, 0.0)])


def test_a_noisy_curve_whose_batch_16_timed_under_batch_8_reads_no_free_rows():
    """The true curve: 10 ms a step plus 1 ms a row (step(b) = 0.010 + 0.001 b), timed at 1 to 32 rows
    with batch 16 coming in 4 ms under batch 8 (noise). Read off the raw points, the rows from 8 to 16
    cost nothing (the slope there is negative, clipped to 0) and a branch with any chance of being
    taken over starts. The fit, worked by hand (centred isotonic regression): 8 and 16 are out of
    order, so they pool into one block, mean batch 12 and mean time (0.020 + 0.016) / 2 = 0.018; the
    other points already rise. Between batch 4 and that block a row costs (0.018 - 0.014) / (12 - 4)
    = 0.5 ms, beyond it (0.042 - 0.018) / (32 - 12) = 1.2 ms."""
    noisy = DecodeCurve.of([(1, 0.011), (2, 0.012), (4, 0.014), (8, 0.020), (16, 0.016), (32, 0.042)])
    # a branch taken over with chance 0.2 at the next depth's 8 rows: it saves 0.2 * step(8) / 8, with
    # step(8) = 0.014 + 0.0005 * 4 = 0.016 on the fit, i.e. 0.4 ms a step, and costs 0.5 ms: declined
    got = SpeculationController(noisy).decide(0.2, 8, 8)
    assert (got.start, got.reason) == (False, COSTS_MORE)
    assert got.saving == pytest.approx(0.0004) and got.cost == pytest.approx(0.0005)
    # as the true curve decides: 0.2 * (0.010 / 8 + 0.001) = 0.45 ms saved against 1 ms
    assert not SpeculationController(affine(0.010, 0.001)).decide(0.2, 8, 8).start
    want = [(1, 0.011), (2, 0.012), (4, 0.014), (12, 0.018), (32, 0.042)]
    assert [b for b, _ in noisy.fitted] == [b for b, _ in want]
    assert [s for _, s in noisy.fitted] == pytest.approx([s for _, s in want])
    assert noisy.points[3:5] == ((8, 0.020), (16, 0.016))    # what was measured stays as it was
    assert all(noisy.marginal(b) == pytest.approx(0.0005) for b in range(4, 12))
    assert all(noisy.marginal(b) == pytest.approx(0.0012) for b in range(12, 40))   # the last slope goes on
    assert noisy.step(16) == pytest.approx(0.018 + 4 * 0.0012) and noisy.step(1) == 0.011


def test_the_fit_pools_until_the_blocks_rise_and_keeps_a_rising_or_flat_curve_as_it_is():
    # 2 rises, then 4 and 8 fall under it: 2 and 4 pool to 0.035 (still over 8's 0.02), then with 8
    # to (0.04 + 0.03 + 0.02) / 3 = 0.03 at batch (2 + 4 + 8) / 3 = 14 / 3; 1 and 16 stand alone
    pooled = DecodeCurve.of([(1, 0.01), (2, 0.04), (4, 0.03), (8, 0.02), (16, 0.06)])
    assert [b for b, _ in pooled.fitted] == pytest.approx([1, 14 / 3, 16])
    assert [s for _, s in pooled.fitted] == pytest.approx([0.01, 0.03, 0.06])
    for curve in (FLAT, THROUGH_ORIGIN, DecodeCurve.of([(1, 0.02), (4, 0.02), (64, 0.62)])):
        assert curve.fitted == curve.points        # already non-decreasing: equal neighbours stay apart
    assert FLAT.marginal(10) == 0.0 and DecodeCurve.of([(1, 0.02), (4, 0.02), (64, 0.62)]).marginal(2) == 0.0


def test_a_curve_is_read_off_a_measured_cpu_profile_at_one_context():
    from sgl_tts.launch.cpu_profile import CpuProfile

    prof = CpuProfile("tiny", "key", "machine", "cpu", 2, "0.5.15", "2026-11-27", {}, (1, 4, 16), (128, 512), 16,
                      ((0.1, 0.4), (0.4, 1.6), (1.6, 6.4)), ((0.010, 0.012), (0.016, 0.024), (0.040, 0.072)))
    curve = DecodeCurve.from_profile(prof, 320)   # halfway between the contexts
    assert curve.points == ((1, pytest.approx(0.011)), (4, pytest.approx(0.020)), (16, pytest.approx(0.056)))
    assert SpeculationController(curve).decide(0.5, 4, 8).reason == COSTS_MORE   # 0.5 * 0.032 / 8 = 0.002 < 0.003


def test_a_flat_curve_speculates_a_curve_through_the_origin_never():
    flat, linear = SpeculationController(FLAT), SpeculationController(THROUGH_ORIGIN)
    for p in (0.01, 0.25, 0.5, 1.0):
        for running in (1, 7, 63):
            assert flat.decide(p, running, 8).start
            got = linear.decide(p, running, 8)
            # p * c > c needs p > 1: a sure take-over only ties, and a tie does not start
            assert not got.start and got.reason == COSTS_MORE
            assert got.saving == pytest.approx(p * 0.01) and got.cost == pytest.approx(0.01)
    assert not flat.decide(0.0, 1, 8).start                            # no chance: nothing to save


@pytest.mark.parametrize("a, c", [(0.02, 0.001), (0.005, 0.002), (0.1, 0.0001), (0.0, 0.003)])
def test_a_fixed_cost_per_step_speculates_exactly_while_p_times_a_over_n_plus_c_exceeds_c(a, c):
    """step(b) = a + c b: a branch's token saves p (a + c n) / n at the next depth's batch n and costs
    c per step it runs (the module's rule, re-derived here for this curve)."""
    ctl = SpeculationController(affine(a, c))
    for p in (0.1, 0.25, 0.5, 0.75, 1.0):
        for n in (1, 2, 8, 64):
            for running in (1, 4, 32):
                want = p * (a / n + c) > c * (1 + 1e-9) + 1e-15
                got = ctl.decide(p, running, n)
                assert got.start == want, (p, n, running)
                assert got.reason == (STARTED if want else COSTS_MORE)


def test_the_take_over_chance_starts_at_selectspecs_reading_and_learns_each_bins_keep_rate():
    chance = TakeOverChance(4)
    assert [chance.chance(m) for m in (1, 2, 4)] == [0.25, 0.5, 1.0]   # nothing seen: potential / bins
    for potential, kept in ((4, True), (4, False), (1, False), (1, False)):
        chance.observe(potential, kept)
    # (kept + base) / (seen + 1), base = 1 kept of 4 seen
    assert chance.chance(4) == pytest.approx((1 + 0.25) / 3)
    assert chance.chance(1) == pytest.approx(0.25 / 3)
    assert chance.chance(2) == pytest.approx(0.25)                      # unseen: the overall rate


def test_without_a_curve_nothing_starts_and_the_reason_says_so():
    got = SpeculationController(None).decide(1.0, 1, 8)
    assert (got.start, got.reason) == (False, NO_CURVE)
    with pytest.raises(ValueError, match=r"take_chance must lie in \[0, 1\], got 1.5"):
        SpeculationController(FLAT).decide(1.5, 1, 8)


def test_branches_stop_at_the_barrier_only_where_the_verifier_shares_a_device_rows_cost_time_on():
    assert not SpeculationController(THROUGH_ORIGIN).stop_at_barrier()          # the PRM elsewhere
    assert SpeculationController(THROUGH_ORIGIN, verifier_shares_device=True).stop_at_barrier()
    assert not SpeculationController(FLAT, verifier_shares_device=True).stop_at_barrier()
    assert SpeculationController(None, verifier_shares_device=True).stop_at_barrier()   # unknown: stop
    assert SPECULATION_PRESETS["auto"] == Speculation(controlled=True, measure_curve=True)


@pytest.mark.parametrize("program", [beam_search, dvts], ids=["beam_search", "dvts"])
def test_a_controlled_search_keeps_the_plain_searchs_beams_whatever_it_decides(program):
    """The same trajectories and answers as the plain search on the heavy-tailed scripted program:
    speculating on a flat curve (branches started and reused), standing down on a curve through the
    origin and without a curve (nothing speculative generated, every branch declined with its
    reason), and stopping running branches at the barrier where the verifier shares the device."""
    started = stopped = 0
    for q in QUESTIONS:
        plain, _, _ = run(program, q, **SETTINGS)
        flat, _, backend = run(program, q, speculative=Speculation(controlled=True, curve=FLAT), **SETTINGS)
        assert kept(flat) == kept(plain) and flat.answers == plain.answers and backend.running() == 0
        assert flat.branches_declined == 0 and flat.stood_down == {}
        assert plain.tokens_generated == flat.tokens_normal + flat.tokens_reused
        started += flat.branches_started
        for policy, reason in ((Speculation(controlled=True, curve=THROUGH_ORIGIN), COSTS_MORE),
                               (Speculation(controlled=True), NO_CURVE)):
            got, _, backend = run(program, q, speculative=policy, **SETTINGS)
            assert kept(got) == kept(plain) and got.answers == plain.answers and backend.running() == 0
            assert got.tokens_speculative == 0 and got.branches_started == 0
            assert got.branches_declined > 0 and got.stood_down == {reason: got.branches_declined}
            assert got.tokens_generated == plain.tokens_generated
        # flat up to 4 rows, then every row costs: speculates at this search's small batches, and
        # the verifier shares the device, so what still runs at a barrier is stopped
        knee = DecodeCurve.of([(1, 0.02), (4, 0.02), (64, 0.62)])
        shared = Speculation(controlled=True, curve=knee, verifier_shares_device=True)
        got, _, backend = run(program, q, speculative=shared, **SETTINGS)
        assert kept(got) == kept(plain) and got.answers == plain.answers and backend.running() == 0
        assert plain.tokens_generated == got.tokens_normal + got.tokens_reused
        stopped += got.branches_stopped
    assert started > 0 and stopped > 0


@pytest.mark.parametrize("program", [beam_search, dvts], ids=["beam_search", "dvts"])
def test_auto_on_a_backend_that_is_no_server_is_refused_before_a_request_naming_how_to_give_a_curve(program):
    from sgl_tts.testing import ScriptedBackend, ScriptedPRM
    from test_speculation import PACE, heavy, score

    backend = ScriptedBackend(heavy, seconds_per_token=PACE)
    with pytest.raises(ValueError) as err:
        program.run(question=QUESTIONS[0], prm=ScriptedPRM(score), backend=backend, speculative="auto", **SETTINGS)
    assert str(err.value) == (
        "speculative='auto' decides on the generator's measured decode curve, and its backend (ScriptedBackend) "
        "is not an SGLang server to measure one on: give the curve, speculative=Speculation(controlled=True, "
        "curve=DecodeCurve.of([(batch, seconds), ...])) or DecodeCurve.load(path) of a JSON file with points: "
        "[[batch, seconds], ...] (sgl-tts run: speculation_curve: FILE), or generate on a server "
        "(sgl_tts.connect(url))")
    assert backend.draws == [] and backend.running() == 0      # refused before the first request
    # a curve given, or none on purpose (Speculation(controlled=True): the searches say why), runs
    got, _, _ = run(program, QUESTIONS[0], speculative=Speculation(controlled=True, curve=FLAT), **SETTINGS)
    assert got.branches_started > 0
    with pytest.raises(ValueError, match="measure_curve is a setting of the cost controller: give controlled=True"):
        Speculation(measure_curve=True)


# ------------------------------------------------------------- the verifier's measured slowdown
def test_the_slowdown_per_row_is_the_least_squares_slope_through_the_origin():
    # s fits seconds / alone - 1 = s * rows: sum(rows * y) / sum(rows^2)
    assert VerifierSlowdown.of([(0, 1.0), (4, 1.8), (16, 4.2)]).per_row == pytest.approx(0.2)   # exactly linear
    # y = 0.1 at rows 2 and 4: (2 * 0.1 + 4 * 0.1) / (4 + 16) = 0.03
    assert VerifierSlowdown.of([(0, 2.0), (2, 2.2), (4, 2.2)]).per_row == pytest.approx(0.03)
    assert VerifierSlowdown.of([(0, 1.0), (4, 0.9)]).per_row == 0.0    # faster beside generation: noise, 0
    assert VerifierSlowdown.of([(0, 1.0), (4, 0.9)]).alone == 1.0
    with pytest.raises(ValueError, match=r"needs the PRM alone \(0 rows\)"):
        VerifierSlowdown.of([(1, 1.0), (4, 2.0)])
    with pytest.raises(ValueError, match="needs the PRM alone"):
        VerifierSlowdown.of([(0, 1.0)])
    with pytest.raises(ValueError, match="rows must increase"):
        VerifierSlowdown.of([(0, 1.0), (4, 2.0), (4, 3.0)])
    with pytest.raises(ValueError, match="seconds > 0"):
        VerifierSlowdown.of([(0, 0.0), (4, 2.0)])


def test_a_branch_keeps_running_at_the_barrier_iff_its_saving_exceeds_the_verifiers_loss():
    """keep iff p * step(n) / n > s * step(b), on a curve where every row costs 10 ms (step(b) =
    0.01 b) and a verifier that takes 20% longer per generator row (s = 0.2)."""
    slow = VerifierSlowdown.of([(0, 1.0), (4, 1.8), (16, 4.2)])
    ctl = SpeculationController(THROUGH_ORIGIN, verifier_shares_device=True, slowdown=slow)
    got = ctl.keep_at_barrier(1.0, 1, 16)      # saves 1 * 0.01; costs 0.2 * 0.01 = 0.002
    assert (got.start, got.reason) == (True, STARTED)
    assert got.saving == pytest.approx(0.01) and got.cost == pytest.approx(0.002)
    got = ctl.keep_at_barrier(1.0, 8, 16)      # costs 0.2 * 0.08 = 0.016 > 0.01
    assert (got.start, got.reason) == (False, SLOWS_VERIFIER) and got.cost == pytest.approx(0.016)
    assert not ctl.keep_at_barrier(0.1, 1, 16).start   # saves 0.001 < 0.002
    assert not ctl.keep_at_barrier(0.2, 1, 16).start   # 0.002 against 0.002: a tie stops
    # a verifier that does not slow down, or one elsewhere: nothing stops
    unslowed = VerifierSlowdown.of([(0, 1.0), (8, 1.0)])
    for keep in (SpeculationController(THROUGH_ORIGIN, verifier_shares_device=True, slowdown=unslowed),
                 SpeculationController(THROUGH_ORIGIN, slowdown=slow)):
        assert not keep.stop_at_barrier() and keep.keep_at_barrier(0.0, 64, 16).start
    # shared, nothing measured: every branch stops (the rule before the measurement), and says why
    got = SpeculationController(THROUGH_ORIGIN, verifier_shares_device=True).keep_at_barrier(1.0, 1, 16)
    assert (got.start, got.reason) == (False, VERIFIER_SHARES)
    got = SpeculationController(None, verifier_shares_device=True, slowdown=slow).keep_at_barrier(1.0, 1, 16)
    assert (got.start, got.reason) == (False, NO_CURVE)
    with pytest.raises(ValueError, match=r"take_chance must lie in \[0, 1\], got -0.5"):
        ctl.keep_at_barrier(-0.5, 1, 16)


@pytest.mark.parametrize("program", [beam_search, dvts], ids=["beam_search", "dvts"])
def test_at_the_barrier_a_measured_slowdown_decides_which_branches_stop_and_beams_stay_the_same(program):
    """With the verifier on the device: a slowdown too small to matter lets every branch run on
    through the verification; a large one stops them (reason counted); the kept beams are the plain
    search's either way."""
    knee = DecodeCurve.of([(1, 0.02), (4, 0.02), (64, 0.62)])
    small = VerifierSlowdown.of([(0, 1.0), (64, 1.0 + 1e-9)])
    large = VerifierSlowdown.of([(0, 1.0), (1, 11.0)])
    stopped = {"small": 0, "large": 0}
    for q in QUESTIONS:
        plain, _, _ = run(program, q, **SETTINGS)
        for name, slowdown in (("small", small), ("large", large)):
            policy = Speculation(controlled=True, curve=knee, verifier_shares_device=True, slowdown=slowdown)
            got, _, backend = run(program, q, speculative=policy, **SETTINGS)
            assert kept(got) == kept(plain) and got.answers == plain.answers and backend.running() == 0
            assert plain.tokens_generated == got.tokens_normal + got.tokens_reused
            assert got.stood_down.get(SLOWS_VERIFIER, 0) == got.branches_stopped
            stopped[name] += got.branches_stopped
    assert stopped["small"] == 0 and stopped["large"] > 0


# ------------------------------------------------- the generator's batch: the other searches' rows
def test_rows_in_flight_counts_each_owners_rows_and_gives_back_the_others_sum():
    from sgl_tts.search.speculation_cost import RowsInFlight, rows_in_flight

    rows = RowsInFlight()
    assert rows.publish("a", 3) == 0 and rows.publish("b", 5) == 3 and rows.others("a") == 5
    assert rows.publish("a", 1) == 5 and rows.others("b") == 1 and rows.others("c") == 6
    rows.leave("b")
    assert rows.others("a") == 0 and rows.others("c") == 1
    assert rows.publish("a", 0) == 0 and rows.others("c") == 0
    with pytest.raises(ValueError, match="rows must be >= 0, got -1"):
        rows.publish("a", -1)
    assert rows_in_flight("http://gen:1") is rows_in_flight("http://gen:1")
    assert rows_in_flight("http://gen:1") is not rows_in_flight("http://gen:2")


def test_a_controlled_search_judges_branches_at_the_generators_batch_with_the_other_searches_rows():
    """Flat up to 4 rows, then 10 ms a row: alone the search speculates at its small batches; with
    another search's 60 rows on the same generator every branch is past the knee and declined. The
    kept beams are the plain search's either way."""
    from sgl_tts.search.speculation_cost import rows_in_flight
    from sgl_tts.testing import ScriptedBackend
    from test_speculation import PACE, heavy

    knee = DecodeCurve.of([(1, 0.02), (4, 0.02), (64, 0.62)])
    policy = Speculation(controlled=True, curve=knee)
    q = QUESTIONS[0]
    plain, _, _ = run(beam_search, q, **SETTINGS)
    alone, _, _ = run(beam_search, q, speculative=policy, **SETTINGS)
    assert kept(alone) == kept(plain) and alone.branches_started > 0
    backend = ScriptedBackend(heavy, seconds_per_token=PACE)
    table = rows_in_flight(("backend", id(backend)))
    table.publish("another search", 60)
    try:
        loaded, _, _ = run(beam_search, q, backend=backend, speculative=policy, **SETTINGS)
    finally:
        table.leave("another search")
    assert kept(loaded) == kept(plain) and loaded.branches_started == 0
    assert loaded.branches_declined > 0 and loaded.stood_down == {COSTS_MORE: loaded.branches_declined}
    assert table.others("probe") == 0   # the search left the table when it ended


def test_a_controlled_search_publishes_its_rows_while_they_generate_and_leaves_when_it_ends():
    import threading

    from sgl_tts.search.speculation_cost import rows_in_flight
    from sgl_tts.testing import ScriptedBackend
    from test_speculation import PACE, heavy

    backend = ScriptedBackend(heavy, seconds_per_token=PACE)
    table = rows_in_flight(("backend", id(backend)))
    backend.pause()
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("got", run(
        beam_search, QUESTIONS[0], backend=backend, speculative=Speculation(controlled=True, curve=FLAT), **SETTINGS)))
    t.start()
    try:
        assert backend.wait_held(SETTINGS["num_beams"], timeout=30)
        assert table.others("probe") == SETTINGS["num_beams"]   # the first depth: every beam's step
    finally:
        backend.resume()
        t.join(60)
    assert not t.is_alive() and out["got"][0].branches_started > 0 and table.others("probe") == 0
