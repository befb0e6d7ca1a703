"""Seed 003's sparse decoding functions (``sgl_tts.plugin.attention.sparse_decoding``) against their definitions,
re-derived here element by element in plain Python (numpy only to solve the small ridge system):
next-query prediction, attention mass, token top-k with sinks and recent tokens, Quest's page bounds
and pages, the attention over a selection, and the overlap ratio."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from sgl_tts.plugin.attention.sparse_decoding import (KeyMirror, Selection, budgets, choose_next, flat_rows,
                                                      gather_flat_kv, overlap_ratio, page_scores, predict_next_query,
                                                      ridge_weights, select_pages, select_tokens, sparse_attention,
                                                      token_scores)


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [v / sum(e) for v in e]


def _dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def _ridge_by_hand(window, target, ridge):
    """min_a |sum_i a_i x_i - y|^2 + lam |a|^2, lam = ridge * mean_i |x_i|^2; then softmax(a)."""
    w = len(window)
    gram = [[_dot(window[i], window[j]) for j in range(w)] for i in range(w)]
    lam = ridge * sum(gram[i][i] for i in range(w)) / w
    a = np.linalg.solve(np.array(gram) + lam * np.eye(w), np.array([_dot(x, target) for x in window]))
    return _softmax(list(a))


def _predict_by_hand(history, windows, ridge):
    """The newest query regressed on the w before it; the weights applied to the w newest; mean over w."""
    candidates = []
    for w in windows:
        if w + 1 > len(history):
            continue
        a = _ridge_by_hand(history[-w - 1:-1], history[-1], ridge)
        shifted = history[-w:]
        candidates.append([sum(a[i] * shifted[i][d] for i in range(w)) for d in range(len(history[0]))])
    if not candidates:
        return list(history[-1])
    return [sum(c[d] for c in candidates) / len(candidates) for d in range(len(history[0]))]


def test_ridge_weights_are_the_softmax_of_the_regularised_least_squares_solution():
    g = torch.Generator().manual_seed(0)
    window, target = torch.randn(5, 12, generator=g), torch.randn(12, generator=g)
    got = ridge_weights(window, target, 0.1)
    want = _ridge_by_hand(window.tolist(), target.tolist(), 0.1)
    assert got.tolist() == pytest.approx(want, rel=1e-5)
    assert float(got.sum()) == pytest.approx(1.0)


def test_a_target_inside_the_window_gets_the_largest_weight():
    # the newest query equal to one of the window's: with little ridge that query's weight leads
    g = torch.Generator().manual_seed(1)
    window = torch.randn(4, 32, generator=g)
    weights = ridge_weights(window, window[2].clone(), 1e-4)
    assert int(weights.argmax()) == 2


def test_next_query_prediction_matches_the_definition_with_short_histories():
    g = torch.Generator().manual_seed(2)
    rows, kv_heads, h, f = 4, 2, 9, 6
    history = torch.randn(rows, kv_heads, h, f, generator=g, dtype=torch.float64)
    available = torch.tensor([9, 5, 2, 1])
    windows, ridge = (2, 4, 8), 0.05
    got = predict_next_query(history, windows, ridge, available)
    for r in range(rows):
        for kv in range(kv_heads):
            real = history[r, kv, h - int(available[r]):].tolist()    # only the newest `available` are real
            want = _predict_by_hand(real, windows, ridge)
            assert got[r, kv].tolist() == pytest.approx(want, rel=1e-6, abs=1e-9), (r, kv)
    # one query (or none usable): the prediction is the newest query itself
    assert torch.equal(got[3], history[3, :, -1])


def test_the_prediction_is_a_convex_combination_of_the_newest_queries():
    # softmax-normalised weights: the prediction stays inside the window (it interpolates, never
    # extrapolates; a query moving along a line is predicted behind it, as the seed's Eq. 3-5 define)
    g = torch.Generator().manual_seed(7)
    history = torch.randn(3, 2, 9, 10, generator=g, dtype=torch.float64)
    pred = predict_next_query(history, (2, 4, 8), 1e-2)
    newest = history[:, :, -8:]
    assert bool((pred >= newest.amin(2) - 1e-12).all()) and bool((pred <= newest.amax(2) + 1e-12).all())
    base, step = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    line = torch.stack([base + t * step for t in range(9)])[None, None]
    moved = predict_next_query(line, (4,), 1e-3)[0, 0] - base
    assert 5 < float(moved @ step / (step @ step)) < 8   # between the window's t = 5 and t = 8


def _mass_by_hand(query, keys, length, heads, kv_heads, scale):
    rep = heads // kv_heads
    out = []
    for kv in range(kv_heads):
        total = [0.0] * length
        for r in range(rep):
            q = query[kv * rep + r]
            p = _softmax([scale * _dot(q, keys[kv][j]) for j in range(length)])
            total = [t + x for t, x in zip(total, p)]
        out.append(total)
    return out


def test_token_scores_are_each_kv_heads_summed_attention_weights():
    g = torch.Generator().manual_seed(3)
    rows, heads, kv_heads, n, dim = 3, 4, 2, 11, 8
    query, keys = torch.randn(rows, heads, dim, generator=g), torch.randn(rows, kv_heads, n, dim, generator=g)
    lengths = torch.tensor([11, 7, 1])
    got = token_scores(query, keys, lengths)
    for r in range(rows):
        want = _mass_by_hand(query[r].tolist(), keys[r].tolist(), int(lengths[r]), heads, kv_heads, dim ** -0.5)
        for kv in range(kv_heads):
            assert got[r, kv, :int(lengths[r])].tolist() == pytest.approx(want[kv], rel=1e-5)
            assert got[r, kv, int(lengths[r]):].tolist() == [0.0] * (n - int(lengths[r]))


def _select_by_hand(scores, length, keep, sink, recent):
    """Sinks and recent positions, then the best others (ties: earlier first); ascending."""
    forced = [p for p in range(length) if p < sink or p >= length - recent]
    others = sorted((p for p in range(length) if p not in forced), key=lambda p: (-scores[p], p))
    return sorted(forced + others[:max(0, keep - len(forced))])


@pytest.mark.parametrize("seed", range(6))
def test_token_selection_keeps_sinks_recent_and_the_highest_scores(seed):
    rnd = random.Random(seed)
    rows, kv_heads, n = 5, 2, 40
    lengths = [rnd.randint(1, n) for _ in range(rows)]
    # coarse scores: many ties, so the tie rule is exercised
    scores = torch.tensor([[[float(rnd.randint(0, 5)) for _ in range(n)] for _ in range(kv_heads)]
                           for _ in range(rows)])
    sink, recent = 2, 3
    keep = budgets(torch.tensor(lengths), 0.4 if seed % 2 else 12, sink=sink, recent=recent)
    sel = select_tokens(scores, torch.tensor(lengths), keep, sink=sink, recent=recent)
    for r in range(rows):
        want_keep = min(max(math.ceil(lengths[r] * 0.4) if seed % 2 else 12, sink + recent), lengths[r])
        assert int(keep[r]) == want_keep
        for kv in range(kv_heads):
            got = sel.positions[r, kv][sel.mask[r, kv]].tolist()
            assert got == _select_by_hand(scores[r, kv].tolist(), lengths[r], want_keep, sink, recent), (r, kv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_token_selection_ranks_half_precision_and_double_scores_exactly(dtype):
    """Scores in any float type are ranked by their own values (half types widened without rounding,
    doubles not narrowed): two doubles 1e-12 apart, equal in float32, are told apart."""
    rnd = random.Random(7)
    n, sink, recent = 30, 1, 2
    values = [rnd.choice([0.25, 0.5, 0.75, 1.0, 1.5]) for _ in range(n)]
    if dtype == torch.float64:
        values[10], values[20] = 3.0, 3.0 + 1e-12    # 20 must win a budget of one free slot
    scores = torch.tensor([[values]], dtype=dtype)
    lengths, keep = torch.tensor([n]), torch.tensor([sink + recent + 1])
    sel = select_tokens(scores, lengths, keep, sink=sink, recent=recent)
    want = _select_by_hand([float(v) for v in scores[0, 0]], n, sink + recent + 1, sink, recent)
    assert sel.positions[0, 0][sel.mask[0, 0]].tolist() == want
    if dtype == torch.float64:
        assert want == [0, 20, 28, 29]


def test_gathering_keys_and_values_together_reads_each_head_at_its_own_slots():
    g = torch.Generator().manual_seed(9)
    k_pool, v_pool = torch.randn(20, 3, 4, generator=g), torch.randn(20, 3, 4, generator=g)
    index = torch.randint(0, 20, (2, 3, 5), generator=g)
    keys, values = gather_flat_kv(k_pool, v_pool, flat_rows(index))
    for r in range(2):
        for h in range(3):
            for j in range(5):
                assert torch.equal(keys[r, h, j], k_pool[index[r, h, j], h])
                assert torch.equal(values[r, h, j], v_pool[index[r, h, j], h])


def test_a_budget_that_covers_the_context_keeps_every_position():
    lengths = torch.tensor([5, 9])
    keep = budgets(lengths, 64, sink=1, recent=2)
    sel = select_tokens(torch.rand(2, 1, 9), lengths, keep, sink=1, recent=2)
    assert sel.positions[0, 0][sel.mask[0, 0]].tolist() == [0, 1, 2, 3, 4]
    assert sel.positions[1, 0][sel.mask[1, 0]].tolist() == list(range(9))


def _bound_by_hand(query, keys, length, heads, kv_heads, page):
    rep = heads // kv_heads
    pages = -(-length // page)
    out = []
    for kv in range(kv_heads):
        per_page = []
        for p in range(pages):
            ks = keys[kv][p * page:min((p + 1) * page, length)]
            low = [min(k[d] for k in ks) for d in range(len(ks[0]))]
            high = [max(k[d] for k in ks) for d in range(len(ks[0]))]
            per_page.append(max(sum(max(q[d] * low[d], q[d] * high[d]) for d in range(len(q)))
                                for q in query[kv * rep:(kv + 1) * rep]))
        out.append(per_page)
    return out


def test_quest_page_bounds_and_pages_follow_the_definition():
    g = torch.Generator().manual_seed(4)
    rows, heads, kv_heads, n, dim, page = 3, 4, 2, 37, 6, 8
    query, keys = torch.randn(rows, heads, dim, generator=g), torch.randn(rows, kv_heads, n, dim, generator=g)
    lengths = torch.tensor([37, 20, 8])
    bounds = page_scores(query, keys, lengths, page)
    for r in range(rows):
        want = _bound_by_hand(query[r].tolist(), keys[r].tolist(), int(lengths[r]), heads, kv_heads, page)
        for kv in range(kv_heads):
            got = bounds[r, kv].tolist()
            assert got[:len(want[kv])] == pytest.approx(want[kv], rel=1e-5)
            assert all(v == float("-inf") for v in got[len(want[kv]):])
        # a page's bound is at least every dot product in it
        for kv in range(kv_heads):
            for j in range(int(lengths[r])):
                best = max(_dot(query[r, h].tolist(), keys[r, kv, j].tolist()) for h in (2 * kv, 2 * kv + 1))
                assert bounds[r, kv, j // page] >= best - 1e-5
    keep = torch.tensor([24, 16, 64])
    sel = select_pages(bounds, lengths, keep, sink=1, recent=2, page=page)
    for r in range(rows):
        length = int(lengths[r])
        pages = -(-length // page)
        forced = sorted({0} | {p // page for p in range(max(0, length - 2), length)})
        for kv in range(kv_heads):
            if int(keep[r]) >= length:
                chosen = list(range(pages))
            else:
                others = sorted((p for p in range(pages) if p not in forced),
                                key=lambda p: (-bounds[r, kv, p].item(), p))
                chosen = sorted(forced + others[:max(0, int(keep[r]) // page - len(forced))])
            want = [p * page + i for p in chosen for i in range(page) if p * page + i < length]
            assert sel.positions[r, kv][sel.mask[r, kv]].tolist() == want, (r, kv)


def _attention_by_hand(q, keys, values, scale):
    p = _softmax([scale * _dot(q, k) for k in keys])
    return [sum(p[j] * values[j][d] for j in range(len(keys))) for d in range(len(values[0]))]


def gather_selected(keys, selection):
    """``keys`` ``[rows, kv_heads, n, dim]`` at the selected positions: ``[rows, kv_heads, k, dim]``."""
    return keys.gather(2, selection.positions[..., None].expand(-1, -1, -1, keys.shape[-1]))


@pytest.mark.parametrize("ragged", [True, False], ids=["rows-of-different-sizes", "every-slot-real"])
def test_sparse_attention_attends_over_the_selected_tokens_only(ragged):
    """With padding (a mask) and without (every slot real: the path that passes no mask)."""
    g = torch.Generator().manual_seed(5)
    rows, heads, kv_heads, n, dim = 2, 4, 2, 12, 5
    query = torch.randn(rows, heads, dim, generator=g, dtype=torch.float64)
    keys = torch.randn(rows, kv_heads, n, dim, generator=g, dtype=torch.float64)
    values = torch.randn(rows, kv_heads, n, dim, generator=g, dtype=torch.float64)
    positions = torch.tensor([[[0, 3, 7, 0], [1, 2, 11, 5]], [[4, 9, 0, 0], [0, 6, 8, 10]]])
    mask = torch.tensor([[[1, 1, 1, 0], [1, 1, 1, 1]], [[1, 1, 0, 0], [1, 1, 1, 1]]], dtype=torch.bool)
    if not ragged:
        positions = torch.tensor([[[0, 3, 7, 9], [1, 2, 11, 5]], [[4, 9, 1, 2], [0, 6, 8, 10]]])
        mask = torch.ones_like(mask)
    sel = Selection(positions, mask)
    got = sparse_attention(query, gather_selected(keys, sel), gather_selected(values, sel), mask)
    for r in range(rows):
        for h in range(heads):
            kv = h // 2
            ps = [int(p) for p, m in zip(positions[r, kv], mask[r, kv]) if m]
            want = _attention_by_hand(query[r, h].tolist(), [keys[r, kv, p].tolist() for p in ps],
                                      [values[r, kv, p].tolist() for p in ps], dim ** -0.5)
            assert got[r, h].tolist() == pytest.approx(want, rel=1e-9)


def test_every_token_selected_is_dense_attention():
    g = torch.Generator().manual_seed(6)
    rows, heads, kv_heads, n, dim = 3, 4, 2, 30, 16
    query = torch.randn(rows, heads, dim, generator=g)
    keys, values = torch.randn(rows, kv_heads, n, dim, generator=g), torch.randn(rows, kv_heads, n, dim, generator=g)
    lengths = torch.tensor([30, 30, 30])
    keep = budgets(lengths, 30, sink=2, recent=4)
    sel = select_tokens(token_scores(query, keys, lengths), lengths, keep, sink=2, recent=4)
    got = sparse_attention(query, gather_selected(keys, sel), gather_selected(values, sel), sel.mask)
    dense = torch.nn.functional.scaled_dot_product_attention(query[:, :, None], keys, values,
                                                             enable_gqa=True).squeeze(2)
    assert torch.allclose(got, dense, atol=1e-6)


def test_overlap_ratio_counts_the_shared_positions():
    a = Selection(torch.tensor([[[0, 2, 5, 7]]]), torch.ones(1, 1, 4, dtype=torch.bool))
    b = Selection(torch.tensor([[[2, 3, 7, 9]]]), torch.ones(1, 1, 4, dtype=torch.bool))
    assert overlap_ratio(a, b).tolist() == [[0.5]]
    assert overlap_ratio(a, a).tolist() == [[1.0]]


@pytest.mark.parametrize("neox", [True, False])
def test_rotate_is_sglangs_rotary_embedding_and_its_inverse_undoes_it(neox, monkeypatch):
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding, base as rope_base
    from sglang.srt.server_args import ServerArgs, get_global_server_args, set_global_server_args_for_scheduler

    from sgl_tts.plugin.attention.sparse_attention import find_rotary

    try:
        get_global_server_args()
    except ValueError:   # what a CPU scheduler process holds (its layers read it when built)
        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=1,
                                                        attention_backend="torch_native"))
    # the platform a CPU server detects from SGLANG_USE_CPU_ENGINE at import (this process has none)
    monkeypatch.setattr(rope_base, "_is_cpu", True)
    from sgl_tts.plugin.attention.sparse_decoding import Rotary, rotate

    rope = RotaryEmbedding(head_size=16, rotary_dim=12, max_position_embeddings=64, base=10000,
                           is_neox_style=neox, dtype=torch.float32)
    g = torch.Generator().manual_seed(8)
    q, k = torch.randn(5, 3 * 16, generator=g), torch.randn(5, 16, generator=g)
    positions = torch.tensor([0, 3, 17, 40, 63])
    want, _ = rope.forward_native(positions, q.clone(), k.clone())
    rotary = Rotary(rope.cos_sin_cache, 12, neox)
    got = rotate(q.view(5, 3, 16), positions, rotary)
    assert torch.allclose(got.reshape(5, -1), want, atol=1e-6)
    assert torch.allclose(rotate(got, positions, rotary, inverse=True), q.view(5, 3, 16), atol=1e-5)
    # a query that is the same vector rotated to each position is one query in the rotary frame
    base = torch.randn(1, 3, 16, generator=g).expand(5, 3, 16)
    back = rotate(rotate(base, positions, rotary), positions, rotary, inverse=True)
    assert torch.allclose(back, base, atol=1e-5)
    # the model's rotary embedding is found where there is one, and only one kind of it
    model = torch.nn.ModuleList([torch.nn.Linear(2, 2), rope])
    assert find_rotary(model) is rope
    other = RotaryEmbedding(head_size=16, rotary_dim=12, max_position_embeddings=64, base=500, is_neox_style=neox,
                            dtype=torch.float32)
    assert find_rotary(torch.nn.ModuleList([rope, other])) is None
    assert find_rotary(torch.nn.Linear(2, 2)) is None


def test_the_key_mirror_copies_only_new_tokens_and_rebuilds_a_row_that_changed():
    """A row's keys come from the mirror's copy plus the tokens written since: a key changed in the pool
    at a position already copied is not read again (the copy is incremental), a new position is; a new
    epoch, other pool slots or a shorter context rebuild the row from the pool; rows a job no longer
    holds are dropped. bf16 pools are widened to float32."""
    g = torch.Generator().manual_seed(11)
    pool = torch.randn(40, 2, 3, generator=g).to(torch.bfloat16)
    index = torch.randperm(40, generator=g)[:30].to(torch.int32)
    mirror = KeyMirror()

    def want(n):
        return pool.float()[index[:n].long()].transpose(0, 1)

    got = mirror.keys(0, 5, 1, pool, index, 10)
    assert got.dtype == torch.float32 and got.shape == (2, 10, 3) and torch.equal(got, want(10))
    stale = want(10)[:, 3].clone()
    pool[index[3]] += 1.0                          # an old position changes: the mirror keeps its copy
    pool[index[12]] += 1.0                         # a new one: read when the row grows to it
    got = mirror.keys(0, 5, 1, pool, index, 13)
    assert torch.equal(got[:, 3], stale) and torch.equal(got[:, 10:], want(13)[:, 10:])
    assert torch.equal(mirror.keys(0, 5, 2, pool, index, 13), want(13))            # a new epoch: rebuilt
    pool[index[0]] -= 1.0
    other = index.clone()
    other[0] = int(index[29])                                                        # another slot at 0
    assert torch.equal(mirror.keys(0, 5, 2, pool, other, 13)[:, 0], pool.float()[other[0].long()])
    assert torch.equal(mirror.keys(0, 5, 2, pool, other, 8), pool.float()[other[:8].long()].transpose(0, 1))
    mirror.keys(1, 5, 2, pool, index, 4)
    mirror.keys(0, 6, 1, pool, index, 6)
    assert mirror.tokens == 8 + 4 + 6
    mirror.keep_only([0], [6])                     # layer 0 keeps slot 6 only; layer 1 is another job's
    assert mirror.tokens == 4 + 6


def test_the_choice_from_mirrored_keys_is_the_choice_from_the_pool():
    """choose_next over a KeyMirror equals choose_next over the pool, step after step, rows of different
    lengths growing and one row's slot taken by a new request."""
    g = torch.Generator().manual_seed(12)
    layers, kv, heads, dim, h = 2, 2, 4, 8, 6
    # float64: the two ways sum in another order, and no near-tie within that rounding should decide
    pools = [torch.randn(400, kv, dim, generator=g, dtype=torch.float64) for _ in range(layers)]
    free = torch.randperm(400, generator=g)     # live rows never share a slot they write
    index, free = free[:360].view(3, 120).clone(), free[360:]
    lengths, epochs = torch.tensor([40, 57, 33]), [1, 1, 1]
    mirror = KeyMirror()
    for step in range(5):
        if step == 3:      # row 1: a new request (another epoch) in the same slot, other pool slots
            mine = torch.cat([index[1], free])
            epochs[1], index[1] = 2, mine[torch.randperm(len(mine), generator=g)[:120]]
        history = torch.randn(layers, 3, h, heads, dim, generator=g, dtype=torch.float64)
        available = torch.full((layers, 3), h)
        args = (history, available, lengths, index, pools, None)
        kw = dict(windows=(2, 4), ridge=0.01, budget=0.5, sink=2, recent=3)
        plain = choose_next(*args, **kw)
        mirrored = choose_next(*args, **kw, keys_of=mirror.source([0, 1], [7, 8, 9], epochs, pools, index))
        assert torch.equal(plain[1].positions, mirrored[1].positions), step
        assert torch.equal(plain[1].mask, mirrored[1].mask) and torch.equal(plain[0], mirrored[0])
        lengths = lengths + torch.tensor([1, 2, 1])
        for p in pools:    # the tokens the step wrote
            p[index[torch.arange(3), lengths - 1]] = torch.randn(3, kv, dim, generator=g, dtype=torch.float64)
