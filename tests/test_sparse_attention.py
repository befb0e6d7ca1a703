"""The sparse decode path (``sgl_tts.plugin.attention.sparse_attention.SparseDecoder``) on SGLang-shaped inputs: a
KV pool with each row's context at scattered slots, ``req_to_token``, pool indices and lengths, as the
server's attention backend gives them. Expected outputs are re-derived by hand from the definitions
(``test_sparse_decoding``'s plain-Python helpers): which rows are dense, which tokens each sparse row
attends to (sync: the current query's; async: the query predicted from the row's recorded queries one
step earlier, widened to the sinks and the current recent tokens), and the attention over them; and
the asynchronous step never waits for a late selection, it uses the last finished one and counts it."""

from __future__ import annotations

import contextlib
import math
import threading
import time

import pytest
import torch

from sgl_tts.plugin.attention import cpu_attention
from sgl_tts.plugin.settings import SparseSettings
from sgl_tts.plugin.attention.sparse_attention import SparseDecoder
from sgl_tts.plugin.attention.sparse_transport import WorkerTransport
from test_sparse_decoding import _attention_by_hand, _mass_by_hand, _predict_by_hand, _select_by_hand

HEADS, KV, DIM = 4, 2, 8
SCALE = DIM ** -0.5


def sparse_settings(*args, **kw) -> SparseSettings:
    """SparseSettings with the stand-down off unless asked: these tests check what sparse attention
    computes, at contexts far too short for it to pay."""
    return SparseSettings(*args, **{"stand_down": "off", **kw})


class Pool:
    """A KV pool and a request table the way SGLang lays them out: slot ``s``'s context is at pool
    entries ``req_to_token[s, :length]``, scattered."""

    def __init__(self, lengths, seed=0, slots=8, capacity=512):
        self.g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(capacity, KV, DIM, generator=self.g, dtype=torch.float64)
        self.v = torch.randn(capacity, KV, DIM, generator=self.g, dtype=torch.float64)
        self.free = torch.randperm(capacity, generator=self.g).tolist()
        self.req_to_token = torch.zeros(slots, capacity, dtype=torch.long)
        self.slots = torch.tensor([5, 1, 6, 3][:len(lengths)])
        self.lengths = torch.tensor(lengths)
        for s, n in zip(self.slots.tolist(), lengths):
            self.req_to_token[s, :n] = torch.tensor([self.free.pop() for _ in range(n)])

    def grow(self):
        """Each row gets one more token (its KV written at a new scattered entry)."""
        for s, n in zip(self.slots.tolist(), self.lengths.tolist()):
            self.req_to_token[s, n] = self.free.pop()
        self.lengths = self.lengths + 1

    def context(self, row):
        s, n = int(self.slots[row]), int(self.lengths[row])
        idx = self.req_to_token[s, :n].tolist()
        return [self.k[i].tolist() for i in idx], [self.v[i].tolist() for i in idx]

    def run(self, decoder, query, layer=0):
        out = torch.full_like(query, float("nan"))

        def dense(rows):
            part = out.new_empty((len(rows),) + tuple(out.shape[1:]))
            cpu_attention.decode_rows(query[rows], part, self.k, self.v, self.req_to_token, self.slots[rows],
                                      self.lengths[rows], scale=SCALE, enable_gqa=True)
            out[rows] = part

        decoder.decode(layer, query, out, self.k, self.v, self.req_to_token, self.slots, self.lengths, SCALE, dense)
        return out


def _keep(settings, length):
    b = settings.budget
    want = math.ceil(length * b) if isinstance(b, float) else b
    return min(max(want, settings.sink + settings.recent), length)


def _expected(pool, query, row, positions_per_kv):
    """The row's output, flattened over heads: each head's attention over its KV head's positions."""
    keys, values = pool.context(row)
    out = []
    for h in range(HEADS):
        ps = positions_per_kv[h // (HEADS // KV)]
        out += _attention_by_hand(query[row, h].tolist(), [keys[p][h // 2] for p in ps],
                                  [values[p][h // 2] for p in ps], SCALE)
    return out


def _dense_positions(pool, row):
    return [list(range(int(pool.lengths[row])))] * KV


@pytest.mark.parametrize("mode", ["sync", "quest"])
def test_sync_rows_attend_to_what_the_current_query_selects_and_short_rows_are_dense(mode):
    s = sparse_settings(mode, budget=0.5, sink=2, recent=3, dense_below=40, dense_layers=0)
    pool = Pool([70, 39, 120, 44], seed=1)
    query = torch.randn(4, HEADS, DIM, generator=pool.g, dtype=torch.float64)
    dec = SparseDecoder(s)
    got = pool.run(dec, query)
    for row in range(4):
        n = int(pool.lengths[row])
        keys, _ = pool.context(row)
        if n < s.dense_below:
            want_pos = _dense_positions(pool, row)
        elif mode == "sync":
            mass = _mass_by_hand(query[row].tolist(), [[k[kv] for k in keys] for kv in range(KV)], n, HEADS, KV,
                                 SCALE)
            want_pos = [_select_by_hand(mass[kv], n, _keep(s, n), s.sink, s.recent) for kv in range(KV)]
        else:
            want_pos = [_quest_by_hand(query[row], keys, n, kv, _keep(s, n), s) for kv in range(KV)]
        assert got[row].flatten().tolist() == pytest.approx(_expected(pool, query, row, want_pos), rel=1e-9), row
    assert (dec.counters.sparse_rows, dec.counters.dense_rows) == (3, 1)
    assert dec.counters.attended_tokens < dec.counters.context_tokens


def _quest_by_hand(q, keys, n, kv, keep, s, page=16):
    pages = -(-n // page)
    bound = []
    for p in range(pages):
        ks = [k[kv] for k in keys[p * page:min((p + 1) * page, n)]]
        low, high = [min(c) for c in zip(*ks)], [max(c) for c in zip(*ks)]
        bound.append(max(sum(max(x * lo, x * hi) for x, lo, hi in zip(q[h].tolist(), low, high))
                         for h in (2 * kv, 2 * kv + 1)))
    forced = sorted({p // page for p in range(n) if p < s.sink or p >= n - s.recent})
    others = sorted((p for p in range(pages) if p not in forced), key=lambda p: (-bound[p], p))
    chosen = sorted(forced + others[:max(0, keep // page - len(forced))])
    return [p * page + i for p in chosen for i in range(page) if p * page + i < n]


def test_the_first_layers_attend_densely():
    s = sparse_settings("sync", budget=0.5, sink=2, recent=3, dense_below=40, dense_layers=2)
    pool = Pool([70, 120], seed=6)
    query = torch.randn(2, HEADS, DIM, generator=pool.g, dtype=torch.float64)
    dec = SparseDecoder(s)
    for layer in (0, 1):
        got = pool.run(dec, query, layer=layer)
        for row in range(2):
            assert got[row].flatten().tolist() == pytest.approx(_expected(pool, query, row, _dense_positions(pool, row)),
                                                                rel=1e-9)
    assert (dec.counters.sparse_rows, dec.counters.dense_rows) == (0, 4)
    pool.run(dec, query, layer=2)
    assert dec.counters.sparse_rows == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_attention_seconds_are_counted_by_kind_and_context_bucket(mode):
    """Dense layers' and sparse layers' seconds and context tokens, apart, in the bucket of the rows'
    mean context (the power of two at or below it); a row left dense in a sparse layer counts as dense."""
    s = sparse_settings(mode, budget=0.5, sink=2, recent=3, dense_below=40, dense_layers=1, worker="thread")
    pool = Pool([45, 60, 30], seed=8)
    dec = SparseDecoder(s, threaded=False).bind(8)
    if mode == "async":
        dec.record_extend(1, torch.randn(135, HEADS, DIM, generator=pool.g, dtype=torch.float64), pool.slots,
                          pool.lengths, pool.lengths)
    for step in range(2):   # async: the first step's sparse layer chooses for the second
        for layer in (0, 1):
            pool.run(dec, torch.randn(3, HEADS, DIM, generator=pool.g, dtype=torch.float64), layer=layer)
        if step == 0:
            pool.grow()
    c = dec.counters
    if mode == "sync":   # two steps: layer 0 dense (135 then 138 tokens, mean 45-46: bucket 32); layer 1
        # sparse for 45 and 60 (mean 52-53: 32), dense for 30 (then 31: 16)
        assert c.dense_tokens == {"32": 135 + 138, "16": 30 + 31} and c.sparse_tokens == {"32": 105 + 107}
    else:                # async: step 1's layer 1 has no selection yet: all three rows dense (bucket 32)
        assert c.dense_tokens == {"32": 135 + 138 + 135, "16": 31} and c.sparse_tokens == {"32": 107}
    assert all(v > 0 for v in [*c.dense_seconds.values(), *c.sparse_seconds.values()])
    assert set(c.per_token()) == {16, 32} and c.per_token()[16][1] is None and c.per_token()[32][1] > 0
    dec.close()


def test_the_counters_file_is_written_off_the_step_at_most_five_times_a_second(tmp_path):
    """The decoder marks its counters changed at each step's top layer; a thread writes them (whole,
    by rename) soon after, at most every 0.2 s however many steps mark meanwhile, and an idle decoder
    writes nothing more. Writing in the step cost ~0.4 ms a step."""
    import json

    path = tmp_path / "stats.json"
    s = sparse_settings("sync", budget=0.5, sink=2, recent=3, dense_below=40, dense_layers=1)
    pool = Pool([45, 60], seed=3)
    dec = SparseDecoder(s, threaded=False, stats_path=str(path)).bind(8)
    writes = []
    real_write = dec._stats.write
    dec._stats.write = lambda: (writes.append(time.monotonic()), real_write())
    t0 = time.monotonic()
    for step in range(30):
        for layer in (0, 1):
            pool.run(dec, torch.randn(2, HEADS, DIM, generator=pool.g, dtype=torch.float64), layer=layer)
        pool.grow()
    time.sleep(1.0)   # the last marks are written within 0.2 s of the rate limit's end
    spent = time.monotonic() - t0
    got = json.loads(path.read_text())
    assert got["sparse_rows"] == dec.counters.sparse_rows == 60 and got["dense_rows"] == dec.counters.dense_rows
    assert 1 <= len(writes) <= spent / 0.2 + 1
    assert all(b - a >= 0.19 for a, b in zip(writes, writes[1:]))
    idle = len(writes)
    time.sleep(0.5)
    assert len(writes) == idle and not (tmp_path / "stats.json.tmp").exists()
    dec.close()


def test_a_budget_that_covers_every_context_is_dense_attention():
    s = sparse_settings("sync", budget=100_000, dense_below=1, dense_layers=0)
    pool = Pool([70, 9, 120], seed=2)
    query = torch.randn(3, HEADS, DIM, generator=pool.g, dtype=torch.float64)
    dec = SparseDecoder(s)
    got = pool.run(dec, query)
    for row in range(3):
        assert got[row].flatten().tolist() == pytest.approx(_expected(pool, query, row, _dense_positions(pool, row)), rel=1e-9)
    assert dec.counters.sparse_rows == 0


def _grouped(q):
    """A query [heads, dim] as the regression's per-KV-head features (the group's heads concatenated)."""
    return [sum((q[kv * 2 + r].tolist() for r in range(2)), []) for kv in range(KV)]


ROPE_BASE = 10000.0


def _rotary_table(positions: int) -> "Rotary":  # noqa: F821
    """A neox rotary embedding over the whole head (SGLang's ``cos_sin_cache`` layout: cosines, then sines)."""
    from sgl_tts.plugin.attention.sparse_decoding import Rotary

    freq = 1.0 / ROPE_BASE ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * freq[None, :]
    return Rotary(torch.cat([angles.cos(), angles.sin()], dim=-1), DIM, True)


def _turn_by_hand(q, position):
    """Query heads ``q`` [heads][dim] (lists) turned by ``position`` (negative: back) as neox rotary turns
    them: pair (i, i + DIM/2) by angle ``position * base^(-2i/DIM)``."""
    out = []
    for head in q:
        x1, x2 = head[:DIM // 2], head[DIM // 2:]
        angles = [position * ROPE_BASE ** (-2 * i / DIM) for i in range(DIM // 2)]
        out.append([a * math.cos(t) - b * math.sin(t) for a, b, t in zip(x1, x2, angles)]
                   + [b * math.cos(t) + a * math.sin(t) for a, b, t in zip(x1, x2, angles)])
    return out


@pytest.mark.parametrize("worker,layers,rotary", [
    ("inline", (0,), False), ("thread", (0,), False), ("process", (0,), False), ("inline", (0, 1, 2), False),
    ("thread", (0, 1, 2), False), ("process", (0, 1, 2), False), ("inline", (0,), True), ("process", (0, 1), True)])
def test_async_rows_attend_to_the_tokens_the_predicted_query_chose_one_step_earlier(worker, layers, rotary):
    # with several sparse layers each layer predicts from its own queries (one job per step for all); the
    # choice runs in the step (inline), in a thread, or in the cache rank process over shared key pools;
    # with a rotary embedding each recorded query is turned back from its position before the regression
    # and the prediction is turned to the next position
    s = sparse_settings("async", budget=0.5, windows=(2, 4), sink=2, recent=3, dense_below=50, dense_layers=0,
                       worker="thread" if worker == "inline" else worker)
    pool = Pool([45, 60, 30], seed=3)
    dec = SparseDecoder(s, threaded=worker != "inline", rotary=_rotary_table(128) if rotary else None).bind(8)
    if worker == "process":
        pool.k.share_memory_()
        dec.start_cache_rank({layer: pool.k for layer in layers}, pool.req_to_token)
    # the prefill: each row's last (up to 5 = history) prompt queries are recorded, per layer
    prompt_q = {layer: [torch.randn(int(n), HEADS, DIM, generator=pool.g, dtype=torch.float64) for n in pool.lengths]
                for layer in layers}
    for layer in layers:
        dec.record_extend(layer, torch.cat(prompt_q[layer]), pool.slots, pool.lengths, pool.lengths)
    # per layer and row: the recorded queries with their positions
    history = {layer: [[(q, int(n) - len(pq[-s.history:]) + j) for j, q in enumerate(pq[-s.history:])]
                       for pq, n in zip(prompt_q[layer], pool.lengths)] for layer in layers}
    made = {layer: [None] * 3 for layer in layers}   # the previous step's selection per row: positions per kv
    for step in range(6):
        pool.grow()
        before = (dec.counters.missing, dec.counters.sparse_rows)
        queries = {layer: torch.randn(3, HEADS, DIM, generator=pool.g, dtype=torch.float64) for layer in layers}
        got = {layer: pool.run(dec, queries[layer], layer=layer) for layer in layers}
        assert dec.wait_idle(10)       # the worker's choice for the next step is in before it starts
        missing = sparse = 0
        for layer in layers:
            query = queries[layer]
            for row in range(3):
                n = int(pool.lengths[row])
                if n < s.dense_below or made[layer][row] is None:
                    want_pos = _dense_positions(pool, row)
                    missing += n >= s.dense_below
                else:
                    sparse += 1
                    forced = [p for p in range(n) if p < s.sink or p >= n - s.recent]
                    want_pos = [sorted(set(made[layer][row][kv]) | set(forced)) for kv in range(KV)]
                assert got[layer][row].flatten().tolist() == pytest.approx(
                    _expected(pool, query, row, want_pos), rel=1e-9), (step, layer, row)
            # this step's choice for the next one, by hand: predicted query, its mass over [0, n), the
            # budget of n + 1 less the next token (which the recent ones keep)
            for row in range(3):
                n = int(pool.lengths[row])
                history[layer][row] = (history[layer][row] + [(query[row], n - 1)])[-s.history:]
                if n + 1 < s.dense_below:
                    made[layer][row] = None
                    continue
                framed = [torch.tensor(_turn_by_hand(q.tolist(), -p)) if rotary else q for q, p in history[layer][row]]
                feats = [[_grouped(q)[kv] for q in framed] for kv in range(KV)]
                pred = [_predict_by_hand(feats[kv], s.windows, s.ridge) for kv in range(KV)]
                pred_q = [pred[h // 2][(h % 2) * DIM:(h % 2 + 1) * DIM] for h in range(HEADS)]
                pred_q = torch.tensor(_turn_by_hand(pred_q, n) if rotary else pred_q)
                keys, _ = pool.context(row)
                mass = _mass_by_hand(pred_q.tolist(), [[k[kv] for k in keys] for kv in range(KV)], n, HEADS, KV,
                                     SCALE)
                made[layer][row] = [_select_by_hand(mass[kv], n, _keep(s, n + 1) - 1, s.sink, s.recent - 1)
                                    for kv in range(KV)]
        assert (dec.counters.missing - before[0], dec.counters.sparse_rows - before[1]) == (missing, sparse)
    assert dec.counters.sparse_rows > 0 and dec.counters.late == 0
    if worker != "inline":   # the first step a job per layer (its top layer not known yet), then one per step
        assert (dec.transport.rank.given if worker == "process" else dec.transport.given) == len(layers) + 5
    dec.close()


class GatedTransport(WorkerTransport):
    """The worker takes each job only when the test opens the gate: a cache rank that falls behind."""

    def __init__(self, *args, **kwargs):
        self.gate = threading.Semaphore(0)
        super().__init__(*args, **kwargs)

    def run(self, job):
        self.gate.acquire()
        super().run(job)


class GatedDecoder(SparseDecoder):
    transport_class = GatedTransport


def test_the_async_step_never_waits_for_a_late_selection_and_counts_it():
    s = sparse_settings("async", budget=0.5, windows=(2,), sink=1, recent=2, dense_below=20, dense_layers=0,
                       worker="thread")
    pool = Pool([30, 30], seed=4)
    dec = GatedDecoder(s).bind(8)
    try:
        dec.record_extend(0, torch.randn(60, HEADS, DIM, dtype=torch.float64), pool.slots, pool.lengths, pool.lengths)
        pool.grow()
        pool.run(dec, torch.randn(2, HEADS, DIM, dtype=torch.float64))     # no selection yet: dense, missing
        assert (dec.counters.missing, dec.counters.sparse_rows) == (2, 0)
        dec.transport.gate.release()                                                  # the worker finishes that job
        assert dec.wait_idle(10)
        pool.grow()
        pool.run(dec, torch.randn(2, HEADS, DIM, dtype=torch.float64))     # fresh selection: sparse, not late
        assert (dec.counters.sparse_rows, dec.counters.late) == (2, 0)
        # the worker is held: the next steps do not wait, they use the selection made two steps back
        for step in range(2):
            pool.grow()
            out = pool.run(dec, torch.randn(2, HEADS, DIM, dtype=torch.float64))
            assert not torch.isnan(out).any()
        assert (dec.counters.sparse_rows, dec.counters.late) == (6, 4)
    finally:
        for _ in range(8):
            dec.transport.gate.release()
        dec.close()


def test_the_step_never_waits_for_a_stopped_cache_rank_process_and_survives_its_death():
    import os
    import signal

    s = sparse_settings("async", budget=0.5, windows=(2,), sink=1, recent=2, dense_below=20, dense_layers=0)
    pool = Pool([30, 30], seed=4)
    pool.k.share_memory_()
    dec = SparseDecoder(s).bind(8).start_cache_rank({0: pool.k}, pool.req_to_token)
    pid = dec.transport.rank.process.pid
    try:
        dec.record_extend(0, torch.randn(60, HEADS, DIM, dtype=torch.float64), pool.slots, pool.lengths, pool.lengths)
        pool.grow()
        pool.run(dec, torch.randn(2, HEADS, DIM, dtype=torch.float64))     # no selection yet: dense, missing
        assert dec.wait_idle(30)
        pool.grow()
        pool.run(dec, torch.randn(2, HEADS, DIM, dtype=torch.float64))     # fresh selection: sparse, not late
        assert (dec.counters.sparse_rows, dec.counters.late, dec.counters.missing) == (2, 0, 2)
        assert dec.wait_idle(30)                                           # the next step's choice is in
        t0 = time.monotonic()
        assert dec.wait_idle(30) and time.monotonic() - t0 < 1             # nothing owed: no wait
        os.kill(pid, signal.SIGSTOP)                                       # then the cache rank falls behind
        for step in range(3):                                              # the steps go on without it:
            pool.grow()                                                    # on time, then late twice
            assert not torch.isnan(pool.run(dec, torch.randn(2, HEADS, DIM, dtype=torch.float64))).any()
        assert (dec.counters.sparse_rows, dec.counters.late) == (8, 4)
        os.kill(pid, signal.SIGCONT)
        assert dec.wait_idle(30)                                           # its answers were still taken
        os.kill(pid, signal.SIGKILL)
        dec.transport.rank.process.join(10)
        for step in range(3):          # a dead cache rank: the worker thread takes over, rows stay sparse
            pool.grow()
            out = pool.run(dec, torch.randn(2, HEADS, DIM, dtype=torch.float64))
            assert not torch.isnan(out).any()
            assert dec.wait_idle(30)
        assert dec.transport.rank is None and dec.transport.thread is not None and dec.counters.sparse_rows == 14
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        dec.close()


def test_a_cache_rank_not_ready_in_time_is_stopped_and_a_thread_chooses(monkeypatch, caplog):
    # the server goes on only once the process is ready (else a server's first requests can pass while
    # it still imports: no selection at all); one that cannot start in time leaves the choice to a thread
    import functools
    import logging

    from sgl_tts.plugin.attention import sparse_worker

    s = sparse_settings("async", budget=0.5, windows=(2,), sink=1, recent=2, dense_below=20, dense_layers=0)
    pool = Pool([30, 30], seed=4)
    pool.k.share_memory_()
    rank = sparse_worker.CacheRank(s, {0: pool.k}, pool.req_to_token)
    assert rank.ready_seconds > 0 and rank.process.is_alive()
    rank.close()
    with pytest.raises(RuntimeError, match="did not start within 0 s"):
        sparse_worker.CacheRank(s, {0: pool.k}, pool.req_to_token, ready_timeout=0.0)
    monkeypatch.setattr(sparse_worker, "CacheRank", functools.partial(sparse_worker.CacheRank, ready_timeout=0.0))
    with caplog.at_level(logging.ERROR, logger="sgl_tts.plugin.attention.sparse_attention"):
        dec = SparseDecoder(s).bind(8).start_cache_rank({0: pool.k}, pool.req_to_token)
    try:
        assert dec.transport.rank is None and dec.transport.thread is not None
        assert "did not start within 0 s; choosing in a thread of the scheduler" in caplog.text
        dec.record_extend(0, torch.randn(60, HEADS, DIM, dtype=torch.float64), pool.slots, pool.lengths, pool.lengths)
        for _ in range(2):
            pool.grow()
            pool.run(dec, torch.randn(2, HEADS, DIM, dtype=torch.float64))
            assert dec.wait_idle(30)
        assert (dec.counters.missing, dec.counters.sparse_rows) == (2, 2)
    finally:
        dec.close()


def test_the_cache_rank_takes_jobs_while_its_big_answers_wait_unread():
    # answers larger than a pipe's buffer: the scheduler's sends must not wait on the process, which is
    # itself waiting to send an answer nobody reads yet (one duplex pipe deadlocked)
    from sgl_tts.plugin.attention.sparse_async import Job
    from sgl_tts.plugin.attention.sparse_worker import PIPE_BYTES, CacheRank, answer_of

    s = sparse_settings("async", budget=0.5, windows=(2,), sink=1, recent=2, dense_below=20, dense_layers=0)
    n, rows = 200_000, 2
    keys = torch.randn(n + 8, KV, DIM)
    keys.share_memory_()
    req_to_token = torch.zeros(8, n + 8, dtype=torch.int32)
    req_to_token[5, :n] = torch.arange(n)
    req_to_token[1, :n] = torch.arange(n).flip(0)
    rank = CacheRank(s, {0: keys}, req_to_token)
    assert req_to_token.is_shared()          # moved in place: the process reads the server's own table
    import fcntl

    with open("/proc/sys/fs/pipe-max-size") as f:     # the job pipe holds a whole job (1 MiB, as allowed)
        assert fcntl.fcntl(rank.jobs.fileno(), fcntl.F_GETPIPE_SZ) == min(PIPE_BYTES, int(f.read()))
    ring = torch.randn(1, rows, s.history, HEADS, DIM)
    available = torch.full((1, rows), s.history)
    sent = threading.Event()

    def send_three():
        for _ in range(3):     # each answer 1.6 MB
            rank.submit(Job([0], [5, 1], [1, 1], torch.tensor([n, n]), ring, available, SCALE, [keys], req_to_token))
        sent.set()

    try:
        threading.Thread(target=send_three, daemon=True).start()
        assert sent.wait(60), "the scheduler's send waited on the cache rank"
        got = list(rank.answers(wait=True))
        assert rank.finished == 3 and 1 <= len(got) <= 3 and all(a["error"] is None for a in got)
        answer = answer_of(got[-1])
        k = math.ceil((n + 1) * 0.5) - 1
        assert answer.rows.shape == (rows, KV, k) and answer.counts == [k, k]
        # flat pool rows: token slot * KV + head; slot 1's context is the pool backwards
        tokens, heads = answer.rows // KV, answer.rows % KV
        assert (heads == torch.arange(KV)[None, :, None]).all()
        assert tokens[0].min() >= 0 and tokens[0].max() < n and tokens[1].max() < n
        assert int(tokens[0, 0, 0]) == 0 and int(tokens[1, 0, 0]) == n - 1     # the sink: position 0
    finally:
        rank.close()


def test_a_selection_is_used_with_every_token_written_since_it_was_made():
    # rows of slots 5 and 1: a selection made at length 40 used at 41 (on time) and one made at 30 used at 37
    # (late by 6 steps, more than `recent`): each attends to its chosen positions and to every position
    # from the length it was made at to the current one
    from sgl_tts.plugin.attention.sparse_async import Entry

    s = sparse_settings("async", budget=0.5, sink=2, recent=3, dense_below=10, dense_layers=0, measure=True)
    pool = Pool([41, 37], seed=9)
    dec = SparseDecoder(s, threaded=False).bind(8)
    chosen = {5: [[0, 1, 7, 20, 37, 38, 39], [0, 1, 3, 38, 39, 2, 4]], 1: [[0, 1, 28, 29, 10, 11], [0, 1, 5, 6, 28, 29]]}
    made = {5: 40, 1: 30}
    for slot, per_kv in chosen.items():
        pos = torch.tensor(per_kv)
        rows = pool.req_to_token[slot][pos] * KV + torch.arange(KV)[:, None]
        dec._selected.setdefault(0, {})[slot] = Entry(0, made[slot], rows, pos, None)
    dec._step_of(0, pool.lengths)
    rows, index, mask, sel, _ = dec._finished_selections(0, pool.slots, torch.tensor([0, 1]), pool.lengths,
                                                         pool.req_to_token, KV)
    assert rows.tolist() == [0, 1] and (dec.counters.late, dec.counters.missing) == (1, 0)
    # row 0 attends 7 + 1 tokens per head, row 1 6 + 7: padded, and the mask says which are real
    assert index.shape == (2, KV, 13) and mask is not None and mask.sum(-1).tolist() == [[8, 8], [13, 13]]
    for r, (slot, n) in enumerate([(5, 41), (1, 37)]):
        position_of = {int(t): p for p, t in enumerate(pool.req_to_token[slot, :n].tolist())}
        for kv in range(KV):
            want = set(chosen[slot][kv]) | set(range(made[slot], n))
            real = index[r, kv][mask[r, kv]]
            assert (real % KV == kv).all()
            got = [position_of[int(t)] for t in (real // KV).tolist()]
            assert sorted(got) == sorted(want) and len(got) == len(set(got)), (slot, kv)
            assert sorted(sel.positions[r, kv][sel.mask[r, kv]].tolist()) == sorted(want)


def test_a_slot_refilled_by_another_request_drops_the_old_selection():
    s = sparse_settings("async", budget=0.5, windows=(2,), sink=1, recent=2, dense_below=20, dense_layers=0)
    pool = Pool([30], seed=5)
    dec = SparseDecoder(s, threaded=False).bind(8)
    dec.record_extend(0, torch.randn(30, HEADS, DIM, dtype=torch.float64), pool.slots, pool.lengths, pool.lengths)
    pool.grow()
    pool.run(dec, torch.randn(1, HEADS, DIM, dtype=torch.float64))
    pool.grow()
    pool.run(dec, torch.randn(1, HEADS, DIM, dtype=torch.float64))
    assert dec.counters.sparse_rows == 1
    # a new request takes the slot (a prefill of it): the selection made for the old one is not used
    dec.record_extend(0, torch.randn(32, HEADS, DIM, dtype=torch.float64), pool.slots, pool.lengths, pool.lengths)
    pool.grow()
    pool.run(dec, torch.randn(1, HEADS, DIM, dtype=torch.float64))
    assert (dec.counters.sparse_rows, dec.counters.missing) == (1, 2)


def test_a_row_history_restarts_when_its_next_query_does_not_continue_it():
    from sgl_tts.plugin.attention.sparse_async import QueryHistory

    hist = QueryHistory(4, 3, HEADS, DIM, torch.float64, "cpu")
    slots = torch.tensor([2])
    qs = [torch.full((1, HEADS, DIM), float(i), dtype=torch.float64) for i in range(5)]
    for i, length in enumerate([10, 11, 12, 13]):
        hist.append(slots, qs[i], torch.tensor([length]))
    assert int(hist.available[2]) == 3 and hist.ordered(slots)[0, :, 0, 0].tolist() == [1.0, 2.0, 3.0]
    hist.append(slots, qs[4], torch.tensor([20]))      # not 14: another context, one query known
    assert int(hist.available[2]) == 1 and float(hist.ordered(slots)[0, -1, 0, 0]) == 4.0


def test_measure_counts_the_overlap_with_the_current_querys_choice():
    s = sparse_settings("quest", budget=0.5, sink=2, recent=3, dense_below=40, dense_layers=0, measure=True)
    pool = Pool([70, 120], seed=7)
    query = torch.randn(2, HEADS, DIM, generator=pool.g, dtype=torch.float64)
    dec = SparseDecoder(s)
    pool.run(dec, query, layer=3)
    want = []
    for row in range(2):
        n = int(pool.lengths[row])
        keys, _ = pool.context(row)
        mass = _mass_by_hand(query[row].tolist(), [[k[kv] for k in keys] for kv in range(KV)], n, HEADS, KV, SCALE)
        for kv in range(KV):
            best = _select_by_hand(mass[kv], n, _keep(s, n), s.sink, s.recent)
            pages = _quest_by_hand(query[row], keys, n, kv, _keep(s, n), s)
            want.append(len(set(best) & set(pages)) / len(best))
    assert dec.counters.overlap() == {3: pytest.approx(sum(want) / len(want))}
    assert dec.counters.overlap_count == {3: 4} and dec.counters.selections == 2


def _cosine_by_hand(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a)) / math.sqrt(sum(y * y for y in b))


def test_measure_compares_the_predicted_and_the_previous_query_with_the_true_one():
    # rows 0 and 1 sparse from the start; row 2 reaches dense_below (50) at step 3; before step 3 row 1's
    # slot is refilled by another request (a new epoch: neither its prediction nor its last query carries over)
    s = sparse_settings("async", budget=0.5, windows=(2, 3), sink=1, recent=2, dense_below=50, dense_layers=1,
                       measure=True)
    pool = Pool([55, 60, 46], seed=11)
    dec = SparseDecoder(s, threaded=False).bind(8)
    prompt_q = [torch.randn(int(n), HEADS, DIM, generator=pool.g, dtype=torch.float64) for n in pool.lengths]
    for layer in (0, 1):
        dec.record_extend(layer, torch.cat(prompt_q), pool.slots, pool.lengths, pool.lengths)
    history = [list(pq[-s.history:]) for pq in prompt_q]
    predicted, previous = [None] * 3, [None] * 3     # per row: the by-hand prediction for the next step, last query
    cos, prev_cos, prev_overlap = [], [], []
    for step in range(6):
        if step == 3:                                 # row 1's slot gets a new 63-token request
            fresh = torch.randn(int(pool.lengths[1]), HEADS, DIM, generator=pool.g, dtype=torch.float64)
            for layer in (0, 1):
                dec.record_extend(layer, fresh, pool.slots[1:2], pool.lengths[1:2], pool.lengths[1:2])
            history[1], predicted[1], previous[1] = list(fresh[-s.history:]), None, None
        pool.grow()
        query = torch.randn(3, HEADS, DIM, generator=pool.g, dtype=torch.float64)
        pool.run(dec, query, layer=0)                 # dense layer: measures nothing
        pool.run(dec, query, layer=1)
        for row in range(3):
            n = int(pool.lengths[row])
            if n >= s.dense_below:
                if predicted[row] is not None:
                    cos += [_cosine_by_hand(predicted[row][kv], _grouped(query[row])[kv]) for kv in range(KV)]
                if previous[row] is not None:
                    prev_cos += [_cosine_by_hand(_grouped(previous[row])[kv], _grouped(query[row])[kv])
                                 for kv in range(KV)]
                    keys, _ = pool.context(row)
                    by_kv = [[k[kv] for k in keys] for kv in range(KV)]
                    now = _mass_by_hand(query[row].tolist(), by_kv, n, HEADS, KV, SCALE)
                    then = _mass_by_hand(previous[row].tolist(), by_kv, n, HEADS, KV, SCALE)
                    for kv in range(KV):
                        best = _select_by_hand(now[kv], n, _keep(s, n), s.sink, s.recent)
                        stale = _select_by_hand(then[kv], n, _keep(s, n), s.sink, s.recent)
                        prev_overlap.append(len(set(best) & set(stale)) / len(best))
            previous[row] = query[row]
            history[row] = (history[row] + [query[row]])[-s.history:]
            feats = [[_grouped(q)[kv] for q in history[row]] for kv in range(KV)]
            predicted[row] = ([_predict_by_hand(feats[kv], s.windows, s.ridge) for kv in range(KV)]
                              if n + 1 >= s.dense_below else None)
    c = dec.counters
    assert c.cosine_count == {1: len(cos)} and c.previous_cosine_count == {1: len(prev_cos)}
    # rows 0, 1, 2 on time at steps 1-5, 1-2 and 4-5, 3-5; a previous query at the same steps
    assert len(cos) == len(prev_cos) == KV * (5 + 4 + 3)
    assert c.cosine() == {1: pytest.approx(sum(cos) / len(cos), rel=1e-9)}
    assert c.previous_cosine() == {1: pytest.approx(sum(prev_cos) / len(prev_cos), rel=1e-9)}
    assert c.previous_overlap() == {1: pytest.approx(sum(prev_overlap) / len(prev_overlap), rel=1e-9)}
    assert c.previous_overlap_count == {1: KV * 12} and 0 < c.previous_overlap()[1] < 1


def test_the_sparse_flags_reach_server_args_and_the_environment_and_bad_values_are_named(monkeypatch):
    import os

    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    from sgl_tts.plugin.settings import TTSSettings

    # prepare_server_args writes these into os.environ itself: registered first, so they are gone after the test
    for var in ("SGLANG_TTS_SPARSE", "SGLANG_TTS_POLICY", "SGLANG_TTS_CPU_ATTENTION", "SGLANG_TTS_DEDUP_TOKENS",
                "SGLANG_TTS_MAX_WAIT", "SGLANG_TTS_LOCALITY_RULES", "SGLANG_TTS_METRICS_FILE",
                "SGLANG_TTS_SEEDED_SAMPLING"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    load_plugins()      # the plugin's flags on SGLang's parser, through its entry point
    sa = prepare_server_args(["--model-path", "dummy", "--tts-sparse-attention", "async", "--tts-sparse-budget", "96",
                              "--tts-sparse-windows", "8,2", "--tts-sparse-dense-below", "512", "--tts-sparse-measure"])
    want = SparseSettings("async", budget=96, windows=(2, 8), dense_below=512, measure=True)
    assert sa.tts_sparse == want and TTSSettings.of(sa).sparse == want
    assert SparseSettings.from_json(os.environ["SGLANG_TTS_SPARSE"]) == want
    assert TTSSettings(sparse=want).args() == ["--tts-sparse-attention", "async", "--tts-sparse-budget", "96",
                                               "--tts-sparse-windows", "2,8", "--tts-sparse-dense-below", "512",
                                               "--tts-sparse-measure"]
    assert prepare_server_args(["--model-path", "dummy", "--tts-sparse-budget", "0.25"]).tts_sparse.budget == 0.25
    off = prepare_server_args(["--model-path", "dummy", "--tts-sparse-attention", "sync", "--tts-sparse-stand-down",
                               "off"]).tts_sparse
    assert off.stand_down == "off" and want.stand_down == "auto" and off.args()[-2:] == ["--tts-sparse-stand-down", "off"]
    with pytest.raises(ValueError, match="--tts-sparse-stand-down must be one of auto, off, got 'sometimes'"):
        SparseSettings("sync", stand_down="sometimes")
    with pytest.raises(ValueError, match=r"--tts-sparse-budget 8 is smaller than the tokens always kept "
                                         r"\(--tts-sparse-sink 4 \+ --tts-sparse-recent 16\)"):
        prepare_server_args(["--model-path", "dummy", "--tts-sparse-attention", "sync", "--tts-sparse-budget", "8"])
    with pytest.raises(ValueError, match="--tts-sparse-budget must be a number of tokens"):
        SparseSettings("sync", budget=1.5)
    with pytest.raises(ValueError, match="SGLANG_TTS_SPARSE is not a sparse-attention setting"):
        SparseSettings.from_json('{"mode": "sideways"}')


def test_the_payoff_stands_a_bucket_down_where_sparse_measured_slower_and_probes_it_again():
    """Per context bucket, by its definition: no decision before ``samples`` timings of each side; a
    bucket where sparse's seconds per token are no lower than dense's runs dense, except one probe
    step of sparse every ``probe_every`` steps since sparse last ran, whose selections async asks for
    ``lead`` steps ahead; a faster sparse runs sparse; with no dense layers, a sparse bucket is
    timed dense until it has its samples, then every ``probe_every`` steps."""
    from sgl_tts.plugin.attention.sparse_payoff import SparsePayoff

    p = SparsePayoff(probe_every=5, samples=2, smoothing=0.5, lead=2)
    p.new_step({1024, 4096}, dense_layers=2)
    assert p.sparse(1024) and p.sparse(4096) and p.pays(1024) is None
    for _ in range(2):      # step 1: 1024 sparse 2.0 s/token, dense 1.0; 4096 sparse 1.0, dense 3.0
        p.record("dense", 1024, 1000, 1000.0)
        p.record("sparse", 1024, 1000, 2000.0)
        p.record("dense", 4096, 1000, 3000.0)
        p.record("sparse", 4096, 1000, 1000.0)
    assert p.pays(1024) is False and p.pays(4096) is True
    plan = []
    for step in range(2, 9):
        p.new_step({1024, 4096}, dense_layers=2)
        if p.sparse(1024):   # the step's timings, then (async, after them) whether to hand jobs
            p.record("sparse", 1024, 1000, 2000.0)
        plan.append((step, p.sparse(1024), p.wants_selection(1024)))
        assert p.sparse(4096) and p.wants_selection(4096)
    # sparse last ran at step 1: steps 2-5 dense, 6 (5 steps on) a probe, then dense again; the probe's
    # selection is asked for in the lead = 2 steps before it
    assert plan == [(2, False, False), (3, False, False), (4, False, True), (5, False, True), (6, True, False),
                    (7, False, False), (8, False, False)]
    assert p.stood_down_steps == 6
    p.record("sparse", 1024, 1000, 0.0)            # the load changed: the average falls to 1.0, not below
    assert p.rate("sparse", 1024) == 1000.0 / 1000 * 1.0 and p.pays(1024) is False
    p.record("sparse", 1024, 1000, 0.0)            # 0.5 < dense's 1.0: it pays again
    assert p.pays(1024) is True

    q = SparsePayoff(probe_every=4, samples=2)     # no dense layers: dense is probed
    got = []
    for step in range(1, 10):
        q.new_step({2048}, dense_layers=0)
        got.append(q.sparse(2048))
        q.record("sparse", 2048, 100, 0.5) if q.sparse(2048) else q.record("dense", 2048, 100, 1.0)
    # two sparse steps (its samples), two dense (theirs), then sparse (it pays) but dense again 4 steps
    # after the last dense one
    assert got == [True, True, False, False, True, True, True, False, True]
    with pytest.raises(ValueError, match="probe_every >= 2"):
        SparsePayoff(probe_every=1)


def test_a_stood_down_row_attends_densely_in_every_layer_and_is_counted():
    """The decoder follows its payoff: rows of a bucket where sparse measured slower attend densely
    in the sparse layers too (the by-hand dense output) and count as stood down; a bucket that pays
    stays sparse; with the stand-down off, no row stands down."""
    s = sparse_settings("sync", budget=0.5, sink=2, recent=3, dense_below=40, dense_layers=1, stand_down="auto")
    pool = Pool([45, 70], seed=9)       # buckets 32 and 64
    dec = SparseDecoder(s)
    for _ in range(3):
        dec.payoff.record("dense", 32, 100, 1.0)
        dec.payoff.record("sparse", 32, 100, 2.0)
        dec.payoff.record("dense", 64, 100, 2.0)
        dec.payoff.record("sparse", 64, 100, 1.0)
    query = torch.randn(2, HEADS, DIM, generator=pool.g, dtype=torch.float64)
    pool.run(dec, query, layer=0)
    got = pool.run(dec, query, layer=1)
    assert got[0].flatten().tolist() == pytest.approx(_expected(pool, query, 0, _dense_positions(pool, 0)), rel=1e-9)
    assert got[1].flatten().tolist() != pytest.approx(_expected(pool, query, 1, _dense_positions(pool, 1)), rel=1e-9)
    assert (dec.counters.stood_down, dec.counters.sparse_rows) == (1, 1)
    off = SparseDecoder(sparse_settings("sync", budget=0.5, sink=2, recent=3, dense_below=40, dense_layers=1))
    assert off.payoff is None
    pool.run(off, query, layer=0)
    pool.run(off, query, layer=1)
    assert (off.counters.stood_down, off.counters.sparse_rows) == (0, 2)


def test_async_hands_no_job_for_a_stood_down_row_until_just_before_its_probe():
    """Async with the stand-down: a stood-down bucket's rows attend densely and no choice is made for
    them, except in the ``lead`` steps before its probe step, which then attends to that choice."""
    from sgl_tts.plugin.attention.sparse_payoff import SparsePayoff

    s = sparse_settings("async", budget=0.5, windows=(2,), sink=1, recent=2, dense_below=40, dense_layers=1,
                        stand_down="auto")
    pool = Pool([40, 50], seed=10)                  # bucket 32, as are their next lengths
    dec = SparseDecoder(s, threaded=False).bind(8)
    dec.payoff = SparsePayoff(probe_every=4, samples=1, lead=1)
    dec.payoff.record("dense", 32, 100, 1.0)        # sparse measured slower (at step 0)
    dec.payoff.record("sparse", 32, 100, 2.0)
    dec.record_extend(1, torch.randn(105, HEADS, DIM, generator=pool.g, dtype=torch.float64), pool.slots,
                      pool.lengths, pool.lengths)
    seen = []
    for step in range(1, 6):
        before = (dec.counters.selections, dec.counters.sparse_rows)
        for layer in (0, 1):
            pool.run(dec, torch.randn(2, HEADS, DIM, generator=pool.g, dtype=torch.float64), layer=layer)
        seen.append((step, dec.counters.selections - before[0], dec.counters.sparse_rows - before[1]))
        pool.grow()
    # steps 1-2 dense, no choice; 3 (one step before the probe) chooses for both rows; 4 is the probe:
    # sparse over step 3's choice, after which (sparse just ran) nothing is chosen; 5 dense again
    assert seen == [(1, 0, 0), (2, 0, 0), (3, 2, 0), (4, 0, 2), (5, 0, 0)]
    assert dec.counters.stood_down == 2 * 4
