"""DeepConf (``programs/deepconf.py``, issue 35) against a plain re-derivation of its definition on a
scripted generator with scripted token log-probabilities: token and group confidences, the four
sample confidences, the offline filter and weighted vote, the online threshold, stop points,
consensus and the aborts of the samples it drops; the options through ``RunConfig``; and ``sgl-tts
run --program deepconf`` on the embedded default (the CPU backend's real log-probabilities)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from programs.deepconf import (deepconf, group_confidences, kept, leader_share, quantile, stop_threshold,
                               stop_token, token_confidence, trace_confidence)
from sgl_tts.experiment import RunConfig, RunError
from sgl_tts.search import derive_seed
from sgl_tts.testing import ScriptedBackend

Q = "What is 6 times 7?"
HEAD = Q + "\n\n"


# ------------------------------------------------------------------- the definitions, by hand
def test_token_confidence_is_minus_the_mean_top_logprob():
    assert token_confidence([-0.5, -1.5, -4.0]) == pytest.approx(2.0)
    assert token_confidence([0.0]) == 0.0
    with pytest.raises(ValueError, match="at least one top log-probability"):
        token_confidence([])


def test_group_confidences_slide_a_full_window_and_a_short_sample_is_one_group():
    c = [1.0, 2.0, 3.0, 4.0, 0.0]
    assert group_confidences(c, 2) == pytest.approx([1.5, 2.5, 3.5, 2.0])
    assert group_confidences(c, 5) == pytest.approx([2.0])
    assert group_confidences(c, 9) == pytest.approx([2.0])     # fewer tokens than the window
    assert group_confidences([], 3) == []


def test_the_four_sample_confidences_by_hand():
    c = [4.0, 4.0, 1.0, 1.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 2.0]   # 12 tokens, window 2: 11 groups
    assert trace_confidence(c, 2, "lowest_group") == pytest.approx(1.0)
    # the lowest ceil(10% of 11) = 2 groups: 1.0 and 2.5 (and 2.5, 3.0 ... above)
    assert trace_confidence(c, 2, "bottom_10") == pytest.approx((1.0 + 2.5) / 2)
    assert trace_confidence(c, 2, "tail") == pytest.approx(3.0)
    assert trace_confidence(c, 2, "mean") == pytest.approx(40 / 12)
    assert trace_confidence([], 2, "mean") == 0.0
    with pytest.raises(ValueError, match="unknown confidence measure 'median'"):
        trace_confidence(c, 2, "median")


def test_kept_takes_the_ceiling_of_the_fraction_most_confident_ties_to_the_earlier():
    conf = [1.0, 3.0, 2.0, 3.0, 0.5]
    assert kept(conf, 0.1) == [1]            # ceil(0.5) = 1; the tie of 3.0 goes to sample 1
    assert kept(conf, 0.5) == [1, 2, 3]      # ceil(2.5) = 3, in sample order
    assert kept(conf, 0.4) == [1, 3]         # exactly 2
    assert kept(conf, 1.0) == [0, 1, 2, 3, 4]


def test_confidences_that_differ_by_batch_noise_tie_in_the_filter_and_the_vote():
    # samples 1 and 3 (and 2, chained through 3) are within 1e-4 of each other: one tie, to the earlier
    # samples, whichever of them the noise made larger; 0 is 2e-4 below 2: a real difference
    noisy = [3.0 - 3e-4, 3.0 - 2e-6, 3.0 - 8e-5, 3.0, 0.5]
    assert kept(noisy, 0.4) == [1, 2] and kept(noisy, 0.6) == [1, 2, 3]
    assert kept([3.0 - 2e-4, 3.0], 0.5) == [1]
    # the vote: 848 and 748 three samples each with confidences equal up to noise: the first seen wins,
    # not the noise; a real margin still decides
    from sgl_tts.search import vote

    answers = ["848", "788", "748", "848", "748", "748", "848"]
    weights = [15.042808, 15.042808, 15.042808, 15.042808, 15.042809, 15.042809, 15.042808]
    assert vote(answers, weights) == "748" and vote(answers, weights, 1e-4) == "848"
    assert vote(["a", "b"], [1.0, 1.0 + 2e-4], 1e-4) == "b"


def test_the_threshold_is_numpys_percentile_of_the_warmup():
    values = [2.3, 0.7, 1.9, 3.1, 2.8]
    for eta in (0.1, 0.5, 0.9, 1.0):
        assert stop_threshold(values, eta) == pytest.approx(np.percentile(values, 100 * (1 - eta)))
    assert quantile([5.0], 0.3) == 5.0


def test_a_sample_stops_at_the_first_full_window_below_the_threshold_after_what_was_checked():
    c = [3.0, 3.0, 1.0, 1.0, 3.0, 1.0, 1.0]
    assert stop_token(c, 2, 2.5) == 3          # (3 + 1) / 2 = 2.0 at t = 3
    assert stop_token(c, 2, 1.5) == 4          # (1 + 1) / 2 at t = 4
    assert stop_token(c, 2, 1.5, checked=4) == 7
    assert stop_token(c, 2, 0.5) is None
    assert stop_token([0.0], 2, 9.0) is None   # no full window yet: never stopped
    # float noise below the threshold (identical samples computed in different batches) is a tie
    assert stop_token([2.0, 2.0], 2, 2.0 + 5e-7) is None and stop_token([2.0, 2.0], 2, 2.0 + 2e-4) == 2


def test_leader_share_counts_only_samples_with_an_answer():
    assert leader_share(["a", "b", None, "a"], [1.0, 2.0, 5.0, 1.0]) == pytest.approx(0.5)
    assert leader_share([None], [1.0]) == 0.0


# ----------------------------------------------------------------- a scripted world of samples
class World:
    """Samples keyed by their seeds: sample ``i``'s text is ``TEXT[i]`` (one character per token, an
    end-of-sequence token after it), and every token of it has the top log-probabilities ``[-c] * 3``
    where ``c = CONF[i][position]`` (so its token confidence is ``c``)."""

    def __init__(self, texts, confs, seed=0):
        self.texts, self.confs = texts, confs
        self.first = {derive_seed("deepconf", seed, Q, i): i for i in range(len(texts))}
        self.first |= {derive_seed("deepconf", seed, Q, i, 0): i for i in range(len(texts))}

    def which(self, prefix, draw):
        gen = prefix[len(HEAD):]
        if not gen:
            return self.first[draw], 0
        return int(gen[1:gen.index(":")]), len(gen)

    def script(self, prefix, draw):
        i, done = self.which(prefix, draw)
        return self.texts[i][done:]

    def top_logprobs(self, prefix, continuation, index):
        gen = prefix[len(HEAD):]
        i = int((gen or continuation)[1:(gen or continuation).index(":")])
        return [-self.confs[i][len(gen) + index]] * 3


def sample(i, answer, length=24):
    return f"s{i}:" + "x" * (length - len(f"s{i}:") - len(f"\\boxed{{{answer}}}")) + f"\\boxed{{{answer}}}"


def profile(length, base, dip=None, at=6, width=4):
    """A confidence per token (``length`` text tokens and the end of sequence): ``base``, and
    ``dip`` over ``width`` tokens from ``at``."""
    c = [base] * (length + 1)
    if dip is not None:
        c[at:at + width] = [dip] * width
    return c


def token_confs(world, i):
    """Sample ``i``'s token confidences as the model gives them: every text token and the end of
    sequence."""
    return world.confs[i][:len(world.texts[i]) + 1]


def lowest_group(c, w):
    """DeepConf's lowest group confidence, by numpy: the least sliding-window mean."""
    c = np.asarray(c, dtype=float)
    if len(c) < w:
        return float(c.mean())
    return float(np.convolve(c, np.ones(w) / w, mode="valid").min())


def weighted_vote(answers, weights):
    totals = {}
    for a, w in zip(answers, weights):
        totals[a] = totals.get(a, 0.0) + w
    return max(totals, key=lambda a: (totals[a], -answers.index(a)))


# answers 1, 1, 1, 2, 2, 3: majority 1; 2's confidences sum above 1's; 3 alone the most confident
OFFLINE_ANSWERS = ["1", "1", "1", "2", "2", "3"]
OFFLINE_BASES = [1.6, 1.7, 1.65, 2.5, 2.4, 3.6]
OFFLINE_DIPS = [1.5, 1.6, 1.55, 2.4, 2.3, 3.5]


def offline_world():
    texts = [sample(i, a) for i, a in enumerate(OFFLINE_ANSWERS)]
    return World(texts, [profile(24, b, d) for b, d in zip(OFFLINE_BASES, OFFLINE_DIPS)])


@pytest.mark.parametrize("keep_fraction, expected", [(0.1, "3"), (0.5, "2"), (1.0, "2")])
def test_offline_filters_the_most_confident_and_votes_by_confidence(keep_fraction, expected):
    world = offline_world()
    backend = ScriptedBackend(world.script, top_logprobs=world.top_logprobs)
    res = deepconf.run(question=Q, num_samples=6, deepconf_mode="offline", keep_fraction=keep_fraction, confidence_window=4,
                       confidence_top_k=3, backend=backend).ret_value
    # the re-derivation: numpy's windows, the top ceil(eta N) by confidence, their weighted vote
    conf = [lowest_group(token_confs(world, i), 4) for i in range(6)]
    keep = sorted(sorted(range(6), key=lambda i: -conf[i])[:math.ceil(keep_fraction * 6)])
    assert [t.score for t in res.trajectories] == pytest.approx(conf)
    assert res.answer == res.answers["confidence_filtered"] == expected
    assert expected == weighted_vote([OFFLINE_ANSWERS[i] for i in keep], [conf[i] for i in keep])
    assert res.answers["confidence_weighted"] == "2" and res.answers["majority"] == "1"
    assert res.tokens_generated == 6 * 25 and res.exit_reason is None and res.traces_stopped == 0
    # every request asked for the top 3 log-probabilities, once per sample, no stop string
    assert len(backend.draws) == 6 and all(d.stop == () and d.max_tokens == 256 for d in backend.draws)


@pytest.mark.parametrize("measure", ["bottom_10", "tail", "mean"])
def test_offline_reads_the_measure_it_is_given(measure):
    world = offline_world()
    res = deepconf.run(question=Q, num_samples=6, deepconf_mode="offline", keep_fraction=0.5, confidence_window=4, confidence_top_k=3,
                       confidence_measure=measure, backend=ScriptedBackend(world.script, top_logprobs=world.top_logprobs)
                       ).ret_value
    for i, t in enumerate(res.trajectories):
        c = np.asarray(token_confs(world, i))
        groups = np.convolve(c, np.ones(4) / 4, mode="valid")
        want = {"bottom_10": np.sort(groups)[:math.ceil(0.1 * len(groups))].mean(), "tail": c[-4:].mean(),
                "mean": c.mean()}[measure]
        assert t.score == pytest.approx(want)


# online: warm-up of 3, threshold at the 0.5 quantile; then five samples, in chunks of 8 tokens
ONLINE_ANSWERS = ["1", "2", "2", "1", "2", "1", "2", "1"]
ONLINE_CONFS = [
    profile(24, 2.0), profile(24, 1.0), profile(24, 3.0),        # warm-up: s = 2.0
    profile(24, 2.5, 1.0, at=9),     # 3: dips below s in its second chunk: stopped (t = 12: window 9-12)
    profile(24, 2.1),                # 4: never below s: finishes, answer 2
    profile(24, 2.6, 1.9, at=2, width=1),   # 5: one low token; windows stay above 2.0: finishes
    profile(24, 1.5),                # 6: below s at its first full window (t = 4): stopped in chunk 0
    profile(24, 2.2),                # 7: finishes
]


def online_world(answers=ONLINE_ANSWERS):
    return World([sample(i, a) for i, a in enumerate(answers)], ONLINE_CONFS)


def test_online_stops_samples_below_the_warmup_threshold_at_the_chunk_that_crossed_it():
    world = online_world()
    backend = ScriptedBackend(world.script, top_logprobs=world.top_logprobs)
    res = deepconf.run(question=Q, num_samples=8, deepconf_mode="online", keep_fraction=0.5, confidence_window=4, confidence_top_k=3,
                       warmup_samples=3, consensus=1.0, chunk_tokens=8, backend=backend).ret_value
    warm = [lowest_group(token_confs(world, i), 4) for i in range(3)]
    s = float(np.percentile(warm, 50))
    assert s == pytest.approx(2.0)
    # the re-derivation: a sample stops at the first full window below s, having generated whole chunks
    tokens, finished = 0, []
    for i in range(8):
        c = token_confs(world, i)
        below = [t for t in range(4, len(c) + 1) if np.mean(c[t - 4:t]) < s] if i >= 3 else []
        tokens += min(len(c), 8 * math.ceil(below[0] / 8)) if below else len(c)
        if not below:
            finished.append(i)
    assert finished == [0, 1, 2, 4, 5, 7]
    assert res.tokens_generated == tokens == 6 * 25 + 16 + 8
    assert res.traces_stopped == 2 and res.exit_reason == "budget" and res.requests_aborted == 0
    assert [t.answer for t in res.trajectories] == [ONLINE_ANSWERS[i] for i in finished]
    voters = [i for i in finished if lowest_group(token_confs(world, i), 4) >= s]   # sample 1 is below s
    assert voters == [0, 2, 4, 5, 7]
    conf = {i: lowest_group(token_confs(world, i), 4) for i in finished}
    assert res.answer == weighted_vote([ONLINE_ANSWERS[i] for i in voters], [conf[i] for i in voters]) == "1"
    # majority over the finished: 1, 2, 2, 2, 1, 1 (a tie: the first seen); weighted: sample 1 (2,
    # confidence 1.0) votes too, 1 still leads
    assert res.answers["majority"] == "1" and res.answers["confidence_weighted"] == "1"
    # the warm-up's requests are whole samples; the others' first chunks are seeded by (sample, 0)
    firsts = {d.draw for d in backend.draws if d.prefix == HEAD}
    assert firsts == {derive_seed("deepconf", 0, Q, i) for i in range(3)} | {
        derive_seed("deepconf", 0, Q, i, 0) for i in range(3, 8)}
    # chunks of 8: five in round 0, four in round 1 (6 stopped), then 4, 5, 7 twice (25 tokens: 8 + 8 + 8 + 1)
    assert sorted(d.max_tokens for d in backend.draws) == [8] * 15 + [256] * 3


def test_online_warmup_samples_are_offlines_first_samples():
    world = online_world()
    on = deepconf.run(question=Q, num_samples=8, deepconf_mode="online", keep_fraction=0.5, confidence_window=4, confidence_top_k=3,
                      warmup_samples=3, consensus=1.0, chunk_tokens=8,
                      backend=ScriptedBackend(world.script, top_logprobs=world.top_logprobs)).ret_value
    off = deepconf.run(question=Q, num_samples=3, deepconf_mode="offline", confidence_window=4, confidence_top_k=3,
                       backend=ScriptedBackend(world.script, top_logprobs=world.top_logprobs)).ret_value
    assert [(t.text, t.score) for t in on.trajectories[:3]] == [(t.text, t.score) for t in off.trajectories]


def test_consensus_right_after_the_warmup_samples_nothing_more():
    # s = 2.0 (the 0.5 quantile of 2.0, 1.0, 3.0); the voters at or above it, samples 0 and 2, both
    # answer 1: the leader holds all the weight
    world = online_world(["1", "2", "1"] + ONLINE_ANSWERS[3:])
    backend = ScriptedBackend(world.script, top_logprobs=world.top_logprobs)
    res = deepconf.run(question=Q, num_samples=8, deepconf_mode="online", keep_fraction=0.5, confidence_window=4, confidence_top_k=3,
                       warmup_samples=3, consensus=0.95, chunk_tokens=8, backend=backend).ret_value
    assert res.exit_reason == "consensus" and res.answer == "1"
    assert res.traces_stopped == 5 and res.tokens_generated == 3 * 25 and len(backend.draws) == 3
    assert [t.answer for t in res.trajectories] == ["1", "2", "1"]
    # the same world with sample 2 answering 2 is not settled (share 2.0 / 5.0): it samples on
    assert deepconf.run(question=Q, num_samples=8, deepconf_mode="online", keep_fraction=0.5, confidence_window=4, confidence_top_k=3,
                        warmup_samples=3, consensus=0.95, chunk_tokens=8,
                        backend=ScriptedBackend(online_world().script, top_logprobs=online_world().top_logprobs)
                        ).ret_value.exit_reason == "budget"


def settling_backend():
    """Sample 3 ends early and settles the vote; samples 4..7 are long and paced (0.05 s a token).
    Warm-up: s = 2.0; voters 0 (1), 1 (2), 2 (2): 2 leads with 4/6 < 0.7. Sample 3 answers 1 with
    confidence 10: 1 holds 12/16 = 0.75 >= 0.7."""
    texts = [sample(0, "1"), sample(1, "2"), sample(2, "2"), sample(3, "1", length=12)] + [
        sample(i, "1", length=40) for i in range(4, 8)]
    confs = [profile(24, 2.0)] * 3 + [profile(12, 10.0)] + [profile(40, 2.5)] * 4
    world = World(texts, confs)
    return ScriptedBackend(world.script, top_logprobs=world.top_logprobs, seconds_per_token=0.05)


@pytest.mark.parametrize("chunk_tokens, most", [(32, 32), (0, 41)])
def test_consensus_aborts_the_later_samples(chunk_tokens, most):
    """Sample 3's text ends early; samples 4..7 run slowly (in 32-token chunks, or whole with the stop
    inside generation). Once 3 finishes the vote is settled, so their requests are aborted on the
    backend (one abort of the group's depth-0 prefix) and answer with the tokens they had."""
    backend = settling_backend()
    res = deepconf.run(question=Q, num_samples=8, deepconf_mode="online", keep_fraction=0.5, confidence_window=4, confidence_top_k=3,
                       warmup_samples=3, consensus=0.7, chunk_tokens=chunk_tokens, search_group="dc-mid",
                       backend=backend).ret_value
    assert res.exit_reason == "consensus" and res.answer == "1"
    assert res.traces_stopped == 4 and res.requests_aborted == 4
    aborted = [d for d in backend.draws if d.finish_reason.get("type") == "abort"]
    assert len(aborted) == 4 and all(d.rid.startswith("tts/dc-mid/0/") for d in aborted)
    # each aborted request had generated fewer than it could (a chunk's 32, a whole sample's 41); nothing
    # is left running
    assert 3 * 25 + 13 <= res.tokens_generated < 3 * 25 + 13 + 4 * most
    assert backend.running() == 0
    assert [t.answer for t in res.trajectories] == ["1", "2", "2", "1"]


def test_consensus_on_a_later_sample_drops_an_earlier_one_whose_chunk_ended_at_its_limit():
    """Issue 62: in round 1 the vote settles on sample 5, the second sample still running; sample 3,
    read before it, ended its chunk at the chunk's token limit. It is dropped (nothing in flight, its
    chunk read once), 6 and 7 (read after) are dropped with their chunks aborted, so every sample is a
    trajectory, stopped or dropped. Warm-up: s = 2.0; voters 0 (1), 1 (2), 2 (2): 2 leads with 4/6 <
    0.7. Round 0: 4 stops (confidence 1.5), the others run on. Round 1: 3, 6, 7 (40 tokens) end
    their second chunk at 8 tokens; 5 (13 tokens, confidence 10, answer 1) ends: 1 holds 12/16."""
    texts = [sample(0, "1"), sample(1, "2"), sample(2, "2"), sample(3, "2", length=40), sample(4, "1"),
             sample(5, "1", length=12), sample(6, "2", length=40), sample(7, "2", length=40)]
    confs = [profile(24, 2.0)] * 3 + [profile(40, 2.5), profile(24, 1.5), profile(12, 10.0)] + [profile(40, 2.5)] * 2
    world = World(texts, confs)
    backend = ScriptedBackend(world.script, top_logprobs=world.top_logprobs)
    res = deepconf.run(question=Q, num_samples=8, deepconf_mode="online", keep_fraction=0.5, confidence_window=4, confidence_top_k=3,
                       warmup_samples=3, consensus=0.7, chunk_tokens=8, search_group="dc-late",
                       backend=backend).ret_value
    assert res.exit_reason == "consensus" and res.answer == "1"
    # each sample's requests: (chunk, how it ended, tokens of text); none of round 2
    chunks = {}
    for d in sorted(backend.draws, key=lambda d: d.custom_params["tts_depth"]):
        chunks.setdefault(d.custom_params["tts_beam"], []).append((d.custom_params["tts_depth"],
                                                                   d.finish_reason["type"], len(d.text)))
    assert {i: chunks[i] for i in (3, 4, 5)} == {3: [(0, "length", 8), (1, "length", 8)], 4: [(0, "length", 8)],
                                                 5: [(0, "length", 8), (1, "stop", 4)]}
    late = [chunks[i][1] for i in (6, 7)]   # answered whole, or aborted before they were sent
    assert all(chunks[i][0] == (0, "length", 8) and len(chunks[i]) == 2 for i in (6, 7))
    assert all(c in ((1, "length", 8), (1, "abort", 0)) for c in late)
    # the states: finished 0, 1, 2, 5; stopped 4 (the only one whose tokens have a window below s);
    # dropped 3, 6, 7: the accounting holds
    assert [t.text.split(":")[0] for t in res.trajectories] == ["s0", "s1", "s2", "s5"]
    below = [i for i in range(3, 8) if lowest_group(world.confs[i][:sum(c[2] for c in chunks[i])], 4) < 2.0]
    assert below == [4]
    assert res.traces_stopped == 4 and len(res.trajectories) + res.traces_stopped == 8
    # only 6's and 7's chunks can have been aborted; 3's was read once: its 16 tokens counted once
    assert res.requests_aborted == sum(c[1] == "abort" for c in late)
    assert res.tokens_generated == 3 * 25 + 16 + 8 + 13 + 2 * 8 + sum(c[2] for c in late)


def test_the_same_seed_gives_the_same_run():
    world = online_world()
    runs = [deepconf.run(question=Q, num_samples=8, deepconf_mode="online", keep_fraction=0.5, confidence_window=4, confidence_top_k=3,
                         warmup_samples=3, consensus=1.0, chunk_tokens=8,
                         backend=ScriptedBackend(world.script, top_logprobs=world.top_logprobs)).ret_value
            for _ in range(2)]
    a, b = runs
    assert (a.answers, a.tokens_generated, [(t.text, t.score) for t in a.trajectories]) == \
           (b.answers, b.tokens_generated, [(t.text, t.score) for t in b.trajectories])


# online with the stop inside generation (chunk_tokens 0, the default): ConfidenceStop
def test_online_stops_each_sample_at_its_token_inside_one_request():
    world = online_world()
    backend = ScriptedBackend(world.script, top_logprobs=world.top_logprobs)
    res = deepconf.run(question=Q, num_samples=8, deepconf_mode="online", keep_fraction=0.5, confidence_window=4, confidence_top_k=3,
                       warmup_samples=3, consensus=1.0, backend=backend).ret_value
    s = float(np.percentile([lowest_group(token_confs(world, i), 4) for i in range(3)], 50))
    # the re-derivation: a sample's token t + 1 is the end of sequence once the window ending at t is
    # below s (it has t + 1 tokens); a sample whose only low window ends at its last token keeps them all
    tokens, finished = 0, []
    for i in range(8):
        c = token_confs(world, i)
        below = [t for t in range(4, len(c) + 1) if np.mean(c[t - 4:t]) < s] if i >= 3 else []
        tokens += min(below[0] + 1, len(c)) if below else len(c)
        if not below:
            finished.append(i)
    assert finished == [0, 1, 2, 4, 5, 7]
    assert res.tokens_generated == tokens == 6 * 25 + 12 + 5   # 3 stops at t = 11, 6 at t = 4
    assert res.traces_stopped == 2 and res.exit_reason == "budget"
    assert [t.answer for t in res.trajectories] == [ONLINE_ANSWERS[i] for i in finished]
    assert res.answer == "1" and res.answers["majority"] == "1"
    # one request per sample, each with its whole-sample seed (the samples are offline's); the rest
    # carry the rule the processor applies, at the warm-up's threshold
    assert len(backend.draws) == 8 and {d.max_tokens for d in backend.draws} == {256}
    assert {d.draw for d in backend.draws} == {derive_seed("deepconf", 0, Q, i) for i in range(8)}
    rules = [(d.custom_params or {}).get("tts_confidence_stop") for d in backend.draws]
    assert sorted(rules, key=bool)[:3] == [None] * 3
    assert [r for r in rules if r] == [{"threshold": s, "window": 4, "top_k": 3, "temperature": 0.8}] * 5
    stopped = sorted((d.text, d.finish_reason["type"]) for d in backend.draws if len(d.text) < 24)
    assert stopped == [("s3:" + "x" * 8, "stop"), ("s6:x", "stop")]   # t tokens of text, then the end


def test_a_backend_without_logprobs_is_named():
    world = online_world()
    with pytest.raises(RuntimeError, match="DeepConf needs token log-probabilities"):
        deepconf.run(question=Q, num_samples=2, deepconf_mode="offline", backend=ScriptedBackend(world.script)).ret_value


# ----------------------------------------------------------------------- options and the run
@pytest.mark.parametrize("settings, message, named", [
    (dict(deepconf_mode="both"), "unknown DeepConf mode 'both'; choose one of ['online', 'offline']",
     "deepconf_mode"),
    (dict(keep_fraction=0.0), "keep_fraction must be in (0, 1], got 0.0", "keep_fraction"),
    (dict(consensus=1.5), "consensus must be in (0, 1], got 1.5", "consensus"),
    (dict(confidence_window=0), "DeepConf's confidence_window must be a positive integer, got 0", "confidence_window"),
    (dict(confidence_measure="tail"), "online DeepConf stops a sample on its running group confidence",
     "confidence_measure"),
    (dict(confidence_measure="median", deepconf_mode="offline"), "unknown confidence measure 'median'",
     "confidence_measure"),
])
def test_bad_options_are_refused_by_the_run_with_the_programs_words(settings, message, named):
    with pytest.raises(RunError) as err:
        RunConfig(program="deepconf", prm="none", **settings).validate()
    assert message in str(err.value) and named in err.value.settings
    with pytest.raises(ValueError, match=re.escape(message)):
        deepconf.run(question=Q, **_arguments(settings), backend=ScriptedBackend(lambda p, d: "x")).ret_value


def _arguments(settings):
    return dict(settings)   # the program's parameters are the run's setting names


def test_another_programs_run_refuses_deepconfs_settings():
    with pytest.raises(RunError, match="keep_fraction: settings of program deepconf"):
        RunConfig(program="best_of_n", keep_fraction=0.1).validate()


def test_sgl_tts_run_program_deepconf_on_the_embedded_default(tmp_path):
    from sgl_tts.cli.run import main

    out = tmp_path / "dc.jsonl"
    assert main(["--program", "deepconf", "--n", "6", "--warmup-samples", "2", "--limit", "3", "--no-progress",
                 "--output", str(out)]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3
    for r in records:
        assert r["exit_reason"] in ("consensus", "budget")
        # the CPU backend's real log-probabilities: positive confidences, one per finished sample
        assert r["trajectories"] and all(t["score"] > 0 for t in r["trajectories"])
        assert len(r["trajectories"]) + r.get("traces_stopped", 0) == 6
        assert r["tokens_generated"] >= sum(t["tokens"] for t in r["trajectories"])


def test_serve_search_reads_deepconfs_settings_from_the_body_and_refuses_bad_ones():
    from sgl_tts.serving.api import APIError, parse_request

    messages = [{"role": "user", "content": Q}]
    c = parse_request({"model": "deepconf:8", "messages": messages, "deepconf_mode": "offline", "keep_fraction": 0.1,
                       "confidence_measure": "tail", "max_tokens": 64}).config
    assert (c.program, c.n, c.deepconf_mode, c.keep_fraction, c.confidence_measure, c.max_tokens) == \
           ("deepconf", 8, "offline", 0.1, "tail", 64)
    assert c.program_arguments(Q, None)["confidence_measure"] == "tail" and not c.uses_prm
    with pytest.raises(APIError, match="online DeepConf stops a sample on its running group confidence"):
        parse_request({"model": "deepconf", "messages": messages, "confidence_measure": "mean"})
