"""Query-aware sparse decode attention for SGLang's CPU servers (``--tts-sparse-attention``, seed 003).

A decode row whose context is at least ``--tts-sparse-dense-below`` tokens, and longer than its budget,
attends to a selection of its context (:mod:`sgl_tts.plugin.attention.sparse_decoding` has the math):

- ``sync``: the tokens with the most attention mass under the *current* query, chosen inside the step
  (the upper bound on selection quality; the choice waits for the query and reads every key);
- ``quest``: Quest's 16-token pages by their upper bound under the current query, inside the step;
- ``async`` (AsyncSpade): the tokens chosen for this step by the seed's "cache rank" (a process of its
  own, :mod:`sgl_tts.plugin.attention.sparse_worker`, or a thread: ``--tts-sparse-worker``) while the previous
  step was still computing, from the query predicted out of each row's recent queries; a step's
  sparse layers are one job. The step never waits for the cache rank: a row uses the newest
  selection that has finished (counted ``late`` when it is older than the previous step) with every
  token written since it was made, and a row with none attends densely (counted ``missing``).

Prefill, short rows, rows whose budget covers their context, and everything that is not plain causal
self-attention are dense, by :mod:`sgl_tts.plugin.attention.cpu_attention`'s ragged backend (this backend is that
one with the decode path replaced). With a budget that covers every context the output is dense
attention's (float rounding aside; ``tests/test_sparse_attention.py``).

:class:`SparseDecoder` holds everything but the SGLang class (queries, selections, the stand-down,
measure mode, counters; with ``--tts-metrics-file PATH`` the counters are rewritten to
``PATH.sparse.<pid>`` after every decode step; it reaches the worker through
:class:`~sgl_tts.plugin.attention.sparse_transport.WorkerTransport`) and works on SGLang's own tensors (the KV pools, ``req_to_token``, the rows' pool indices and
lengths), so tests drive it in-process with the same inputs a server gives it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Optional

from sgl_tts.plugin.attention.sparse_async import Answer, Entry, Job, QueryHistory, assemble, entries, new_rows
from sgl_tts.plugin.attention.sparse_counters import SparseCounters, StatsFile, add_to_mean, bucket_of
from sgl_tts.plugin.attention.sparse_payoff import SparsePayoff
from sgl_tts.plugin.attention.sparse_transport import WorkerTransport

if TYPE_CHECKING:
    import torch

    from sgl_tts.plugin.settings import SparseSettings

logger = logging.getLogger(__name__)

BACKEND_NAME = "sgl_tts_sparse"
#: decode steps between two counter lines in the server's log
LOG_EVERY = 500


class _Step:
    """What every layer of one decode step shares (found at its first layer): each row's budget, the
    rows that attend sparsely in the sparse layers (long enough, budget under the context, not stood
    down; a mask and their batch positions), how many were stood down, and (async) the flat pool rows
    of each row's tokens written since a choice was made, by (slot, made)."""

    __slots__ = ("lengths", "keep", "eligible", "rows", "stood_down", "new")

    def __init__(self, lengths, keep, eligible, rows, stood_down):
        self.lengths, self.keep, self.eligible, self.rows, self.stood_down = lengths, keep, eligible, rows, stood_down
        self.new: dict = {}


class SparseDecoder:
    """The sparse decode path of one model runner (see the module docstring): each step's plan (which
    rows attend sparsely, the stand-down), its selections, measure mode and counters; ``async`` jobs go
    to the worker through :attr:`transport` (a :attr:`transport_class`)."""

    #: how jobs reach the worker (a subclass may hand them otherwise)
    transport_class = WorkerTransport

    def __init__(self, settings: "SparseSettings", *, threaded: bool = True, stats_path: Optional[str] = None,
                 rotary=None):
        self.s = settings
        self._slots = 0           # pool slots (rows of req_to_token): :meth:`bind`
        #: the model's rotary embedding (:class:`~sgl_tts.plugin.attention.sparse_decoding.Rotary`), if known: with
        #: ``frame="rotary"`` queries are predicted with their rotation removed
        self.rotary = rotary
        self.counters = SparseCounters()
        self._stats = StatsFile(self.counters, stats_path) if stats_path else None
        self._top_layer = -1
        self._last_layer = -1
        self._step: Optional[_Step] = None
        self._history: dict[int, QueryHistory] = {}
        self._epoch: dict[int, int] = {}
        #: async: layer -> slot -> the newest finished choice (:class:`~sgl_tts.plugin.attention.sparse_async.Entry`)
        self._selected: dict[int, dict[int, Entry]] = {}
        # measure: layer -> slot -> (epoch, length, the step's query [heads, dim])
        self._previous: dict[int, dict[int, tuple]] = {}
        self._steps = 0
        self._step_tokens = (-1, 0)   # (step, its rows' context tokens)
        #: where sparse pays, from this decoder's own timings (``None``: ``stand_down="off"``)
        self.payoff = SparsePayoff() if settings.stand_down == "auto" and settings.mode != "off" else None
        self._standing = None         # this step's rows that sparse attention stands down for (a bool mask)
        # async: this step's layers waiting to be handed to the worker as one job: (layer, history, key
        # pool), and the rows they are for (slots, lengths, scale, req_to_token)
        self._pending: list = []
        self._pending_rows = None
        #: the worker's transport: the cache rank process, a thread, or inline
        self.transport = self.transport_class(settings, self.counters, self._store, threaded=threaded)

    def start_cache_rank(self, k_caches: dict, req_to_token: torch.Tensor) -> "SparseDecoder":
        """``async`` with ``worker="process"``: start the cache rank process
        (:meth:`WorkerTransport.start_cache_rank`); until then jobs run as ``threaded`` said."""
        self.transport.start_cache_rank(k_caches, req_to_token)
        return self

    # --------------------------------------------------------------------------------- extend
    def record_extend(self, layer: int, query: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                      extend_seq_lens: torch.Tensor) -> None:
        """After a prefill/extend: each sequence's slot starts a new epoch, its history the newest of its
        new tokens' queries (``query`` [tokens, heads, dim], sequence after sequence)."""
        if self.s.mode != "async" or layer < self.s.dense_layers:
            if layer == 0:
                for slot in slots.tolist():
                    self._epoch[slot] = self._epoch.get(slot, 0) + 1
            return
        hist = self._history_for(layer, query)
        start = 0
        for slot, total, new in zip(slots.tolist(), seq_lens.tolist(), extend_seq_lens.tolist()):
            if layer == 0:
                self._epoch[slot] = self._epoch.get(slot, 0) + 1
            kept = min(new, hist.h)
            hist.reset(slot, query[start + new - kept:start + new], total)
            self._selected.setdefault(layer, {}).pop(slot, None)
            start += new

    def _history_for(self, layer: int, query: torch.Tensor) -> QueryHistory:
        hist = self._history.get(layer)
        if hist is None:
            hist = self._history[layer] = QueryHistory(self._slots, self.s.history, query.shape[1], query.shape[2],
                                                       query.dtype, query.device)
        return hist

    @property
    def rotary_frame(self) -> bool:
        return self.s.frame == "rotary" and self.rotary is not None

    def bind(self, slots: int) -> "SparseDecoder":
        """How many pool slots (rows of ``req_to_token``) the server has."""
        self._slots = slots
        return self

    # --------------------------------------------------------------------------------- decode
    def decode(self, layer: int, query: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, req_to_token: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor,
               scale: Optional[float], dense) -> None:
        """One layer's decode attention for every row; ``dense(rows)`` attends ``rows`` (a long tensor of
        batch positions) densely into ``out``."""
        import torch

        from sgl_tts.plugin.attention import sparse_decoding as sd

        s = self.s
        if layer == 0:
            self._steps += 1
            if self._steps % LOG_EVERY == 0:
                logger.info(self.counters.line())
        t0 = time.perf_counter()
        step = self._step_of(layer, lengths)
        c = self.counters
        rows = step.rows if layer >= s.dense_layers else step.rows[:0]
        if layer >= s.dense_layers:
            c.stood_down += step.stood_down
        selection = predicted = mask = None
        if len(rows):
            if s.mode == "async":
                self.transport.collect()
                rows, index, mask, selection, predicted = self._finished_selections(layer, slots, rows, lengths,
                                                                                     req_to_token, k_cache.shape[1])
            else:
                selection = self._select_now(query[rows], k_cache, req_to_token, slots[rows], lengths[rows],
                                             step.keep[rows], scale)
                pool = torch.gather(req_to_token[slots[rows]], 1, selection.positions.flatten(1))
                index = sd.flat_rows(pool.view_as(selection.positions))
                mask = None if bool(selection.mask.all()) else selection.mask
        dense_rows = torch.ones(len(lengths), dtype=torch.bool)
        dense_rows[rows] = False
        dense_idx = dense_rows.nonzero().squeeze(1)
        c.dense_rows += len(dense_idx)
        spent = time.perf_counter() - t0          # the sparse rows' share so far: finding their selections
        if len(dense_idx):
            t1 = time.perf_counter()
            dense(dense_idx)
            self._timed("dense", self._tokens(lengths, dense_idx), len(dense_idx), time.perf_counter() - t1)
        t1 = time.perf_counter()
        if len(rows):
            c.sparse_rows += len(rows)
            c.context_tokens += int(lengths[rows].sum()) * int(index.shape[1])
            c.attended_tokens += int(index.numel()) if mask is None else int(mask.sum())
            keys, values = sd.gather_flat_kv(k_cache, v_cache, index)
            if keys.dtype != query.dtype:
                keys, values = keys.to(query.dtype), values.to(query.dtype)
            out[rows] = sd.sparse_attention(query[rows], keys, values, mask, scale)
            spent += time.perf_counter() - t1
            if s.measure:
                self._measure(layer, selection, query[rows], k_cache, req_to_token, slots[rows], lengths[rows],
                              step.keep[rows], scale)
                if predicted:   # on-time rows: their prediction was of this very query
                    at = list(predicted)
                    add_to_mean(c.cosine_sum, c.cosine_count, layer, sd.group_cosine(
                        torch.stack([predicted[i] for i in at]), query[rows[at]], selection.mask.shape[1]))
        if s.measure and layer >= s.dense_layers:
            self._measure_previous(layer, query, k_cache, req_to_token, slots, lengths, step.eligible, step.keep,
                                   scale)
        self._top_layer = max(self._top_layer, layer)
        if s.mode == "async":
            t1 = time.perf_counter()
            self._after_step(layer, query, k_cache, req_to_token, slots, lengths, scale)
            spent += time.perf_counter() - t1
        if len(rows):
            self._timed("sparse", self._tokens(lengths, rows), len(rows), spent)
        if self._stats is not None and layer == self._top_layer:
            self._stats.mark()

    def _step_of(self, layer: int, lengths: torch.Tensor) -> _Step:
        """This step's :class:`_Step`: found at the first layer of a step (a layer no higher than the last
        one seen, or other rows' lengths), then reused by its other layers."""
        import torch

        from sgl_tts.plugin.attention import sparse_decoding as sd

        step = self._step
        if step is not None and layer > self._last_layer and step.lengths is lengths:
            self._last_layer = layer
            return step
        self._last_layer = layer
        s = self.s
        keep = sd.budgets(lengths, s.budget, sink=s.sink, recent=s.recent)
        eligible = (lengths >= s.dense_below) & (keep < lengths)
        if self.payoff is not None:
            self._plan_step(lengths, eligible)
        stood_down = 0
        rows = eligible
        if self._standing is not None:
            stood_down = int((eligible & self._standing).sum())
            rows = eligible & ~self._standing
        self._step = _Step(lengths, keep, rows, rows.nonzero().squeeze(1), stood_down)
        return self._step

    def _plan_step(self, lengths: torch.Tensor, eligible: torch.Tensor) -> None:
        """At a step's first layer: which buckets attend sparsely this step (:class:`SparsePayoff`)."""
        import torch

        at = eligible.nonzero().squeeze(1).tolist()
        buckets = [bucket_of(n) for n in lengths[at].tolist()]
        self.payoff.new_step(set(buckets), self.s.dense_layers)
        down = [i for i, b in zip(at, buckets) if not self.payoff.sparse(b)]
        self._standing = None
        if down:
            self._standing = torch.zeros(len(lengths), dtype=torch.bool)
            self._standing[down] = True

    def _timed(self, kind: str, tokens: int, rows: int, seconds: float) -> None:
        """One layer's attention of ``rows`` rows (``tokens`` context tokens): counted and, with the
        stand-down, weighed (both in the bucket of the rows' mean context)."""
        bucket = bucket_of(tokens // rows)
        self.counters.time(kind, bucket, tokens, seconds)
        if self.payoff is not None:
            self.payoff.record(kind, bucket, tokens, seconds)

    def _tokens(self, lengths: torch.Tensor, rows: torch.Tensor) -> int:
        """The context tokens of ``rows``; every row's total read once a step (every layer has it)."""
        if len(rows) == len(lengths):
            if self._step_tokens[0] != self._steps:
                self._step_tokens = (self._steps, int(lengths.sum()))
            return self._step_tokens[1]
        return int(lengths[rows].sum())

    def _measure(self, layer, selection, query, k_cache, req_to_token, slots, lengths, keep, scale) -> None:
        """``measure``: the overlap of ``selection`` with the current query's token-level choice."""
        from sgl_tts.plugin.attention import sparse_decoding as sd

        # the reference is always token-level, whatever the mode
        best = self._select_now(query, k_cache, req_to_token, slots, lengths, keep, scale, mode="sync", count=False)
        c = self.counters
        add_to_mean(c.overlap_sum, c.overlap_count, layer, sd.overlap_ratio(best, selection))

    def _measure_previous(self, layer, query, k_cache, req_to_token, slots, lengths, eligible, keep, scale) -> None:
        """``measure``: for each eligible row with a previous step's query (one position earlier in the
        same context), that query's cosine with the current one and its token-level choice's overlap
        with the current query's; then this step's queries are kept for the next."""
        import torch

        from sgl_tts.plugin.attention import sparse_decoding as sd

        kept = self._previous.setdefault(layer, {})
        pairs = [i for i in eligible.nonzero().squeeze(1).tolist()
                 if kept.get(int(slots[i]), (None, -1))[1] == int(lengths[i]) - 1
                 and kept[int(slots[i])][0] == self._epoch.get(int(slots[i]), 0)]
        if pairs:
            before = torch.stack([kept[int(slots[i])][2] for i in pairs])
            c = self.counters
            add_to_mean(c.previous_cosine_sum, c.previous_cosine_count, layer,
                 sd.group_cosine(before, query[pairs], k_cache.shape[1]))
            at = (slots[pairs], lengths[pairs], keep[pairs])
            stale = self._select_now(before, k_cache, req_to_token, *at, scale, mode="sync", count=False)
            best = self._select_now(query[pairs], k_cache, req_to_token, *at, scale, mode="sync", count=False)
            add_to_mean(c.previous_overlap_sum, c.previous_overlap_count, layer, sd.overlap_ratio(best, stale))
        for i, slot in enumerate(slots.tolist()):
            kept[slot] = (self._epoch.get(slot, 0), int(lengths[i]), query[i].clone())

    def _select_now(self, query, k_cache, req_to_token, slots, lengths, keep, scale, mode=None, count=True):
        """``sync``/``quest`` (``mode``, default the setting's): the selection from the current query,
        inside the step."""
        from sgl_tts.plugin.attention import sparse_decoding as sd

        t0 = time.perf_counter()
        n = int(lengths.max())
        keys = sd.gather_heads(k_cache, req_to_token[slots, :n])            # [rows, kv, n, dim]
        if keys.dtype != query.dtype:
            keys = keys.to(query.dtype)
        if (mode or self.s.mode) == "quest":
            bounds = sd.page_scores(query, keys, lengths)
            selection = sd.select_pages(bounds, lengths, keep, sink=self.s.sink, recent=self.s.recent)
        else:
            scores = sd.token_scores(query, keys, lengths, scale)
            selection = sd.select_tokens(scores, lengths, keep, sink=self.s.sink, recent=self.s.recent)
        if count:
            self.counters.selections += len(lengths)
            self.counters.selection_seconds += time.perf_counter() - t0
        return selection

    def _finished_selections(self, layer, slots, rows, lengths, req_to_token, kv):
        """``async``: the rows among ``rows`` that have a finished choice of their current epoch, and what
        they attend to: that choice's pool rows with those of every token written since it was made
        (``index`` ``[rows, kv, k]``, ``mask`` or ``None`` when every row is as long; see
        :func:`~sgl_tts.plugin.attention.sparse_async.assemble`). The choice kept the sinks and the recent tokens of the
        context it was made for (one fewer: the next position is new), so this covers the current
        sinks and recent tokens too, without a pass over the context. Under measure also the same as
        context positions (a :class:`~sgl_tts.plugin.attention.sparse_decoding.Selection`) and the predicted
        queries of the on-time rows, by their place in the returned rows."""
        import torch

        from sgl_tts.plugin.attention import sparse_decoding as sd

        table = self._selected.get(layer, {})
        new = self._step.new
        have, picks, parts = [], [], []
        for i, slot, n in zip(rows.tolist(), slots[rows].tolist(), lengths[rows].tolist()):
            got = table.get(slot)
            if got is None or got.epoch != self._epoch.get(slot, 0) or got.made >= n:
                self.counters.missing += 1
                continue
            if got.made < n - 1:
                self.counters.late += 1
            fresh = new.get((slot, got.made))
            if fresh is None:
                fresh = new[(slot, got.made)] = new_rows(req_to_token, slot, got.made, n, kv, got.rows.dtype)
            have.append(i)
            picks.append(got)
            parts.append(torch.cat((got.rows, fresh), dim=1))
        if not have:
            return rows[:0], None, None, None, None
        index, mask = assemble(parts)
        rows = torch.tensor(have, dtype=torch.long)
        if not self.s.measure:
            return rows, index, mask, None, None
        k = int(index.shape[2])
        positions = torch.zeros(len(have), kv, k, dtype=torch.long)
        full = torch.zeros(len(have), kv, k, dtype=torch.bool)
        for r, (got, n) in enumerate(zip(picks, lengths[rows].tolist())):
            chosen = got.positions.shape[1]
            positions[r, :, :chosen] = got.positions
            positions[r, :, chosen:chosen + n - got.made] = torch.arange(got.made, n)
            full[r, :, :chosen + n - got.made] = True
        predicted = {r: p.query for r, (p, n) in enumerate(zip(picks, lengths[rows].tolist())) if p.made == n - 1}
        return rows, index, mask, sd.Selection(torch.where(full, positions, torch.zeros_like(positions)), full), predicted

    def _after_step(self, layer, query, k_cache, req_to_token, slots, lengths, scale) -> None:
        """``async``: record the step's queries; at the step's top layer, hand the rows near or past
        ``dense_below`` to the worker, which chooses their next step's tokens for every sparse layer
        in one job (during the first step the top layer is not known yet: a job per layer)."""
        import torch

        if layer < self.s.dense_layers:
            return
        if self._pending and layer <= self._pending[-1][0]:   # a new step, the last one's not handed yet
            self._hand_pending()
        hist = self._history_for(layer, query)
        hist.append(slots, query, lengths)
        near = (lengths + 1 >= self.s.dense_below).nonzero().squeeze(1)
        if self.payoff is not None and len(near):   # a stood-down bucket's rows only ahead of its probe
            near = near[torch.tensor([self.payoff.wants_selection(bucket_of(n + 1)) for n in lengths[near].tolist()],
                                     dtype=torch.bool)]
        if len(near):
            if not self._pending:
                self._pending_rows = (slots[near], lengths[near].clone(), scale, req_to_token)
            self._pending.append((layer, hist, k_cache))
        if layer == self._top_layer and self._pending:
            self._hand_pending()

    def _hand_pending(self) -> None:
        import torch

        layers, histories, k_caches = zip(*self._pending)
        sl, lengths, scale, req_to_token = self._pending_rows
        self._pending = []
        slot_list = sl.tolist()
        job = Job(list(layers), slot_list, [self._epoch.get(x, 0) for x in slot_list], lengths,
                  torch.stack([h.q[sl] for h in histories]), torch.stack([h.available[sl] for h in histories]),
                  scale, list(k_caches), req_to_token, self.rotary if self.rotary_frame else None)
        self.transport.hand(job)

    # --------------------------------------------------------------------------------- answers
    def _store(self, answer: Answer) -> None:
        """A finished choice, kept per layer and row for the row's next step."""
        for layer, slot, entry in entries(answer):
            self._selected.setdefault(layer, {})[slot] = entry
        self.counters.selections += len(answer.layers) * len(answer.slots)
        self.counters.selection_seconds += answer.seconds

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Tests and benchmarks: until the worker has finished (or dropped as superseded) every job given
        so far; false if ``timeout`` passed first."""
        return self.transport.wait_idle(timeout)

    def close(self) -> None:
        self.transport.close()


def backend_class():
    """:class:`SparseAttnBackend`, built on first use (it subclasses the ragged backend, itself SGLang's
    ``TorchNativeAttnBackend``)."""
    global _BACKEND_CLASS
    if _BACKEND_CLASS is None:
        _BACKEND_CLASS = _make_backend_class()
    return _BACKEND_CLASS


_BACKEND_CLASS = None


def _make_backend_class():
    from sgl_tts.plugin import internals
    from sgl_tts.plugin.attention import cpu_attention
    from sgl_tts.plugin.settings import TTSSettings

    class SparseAttnBackend(cpu_attention.backend_class()):
        """The ragged backend with query-aware sparse decode attention (:mod:`sgl_tts.plugin.attention.sparse_attention`)."""

        def __init__(self, model_runner):
            super().__init__(model_runner)
            internals.check_object(self, internals.SPARSE)
            settings = TTSSettings.of(model_runner.server_args)
            stats = f"{settings.metrics_file}.sparse.{os.getpid()}" if settings.metrics_file else None
            self.sparse = SparseDecoder(settings.sparse, stats_path=stats).bind(
                int(self.req_to_token_pool.req_to_token.shape[0]))
            sp = settings.sparse
            if sp.mode == "async" and sp.worker == "process":
                from sgl_tts.plugin.attention.sparse_worker import share_key_pools

                kv_pool = model_runner.token_to_kv_pool
                internals.check_object(kv_pool, internals.SPARSE_PROCESS)   # before anything moves
                first = kv_pool.start_layer
                layers = [i for i in range(first, first + kv_pool.layer_num) if i >= sp.dense_layers]
                self.sparse.start_cache_rank(share_key_pools(kv_pool, layers), self.req_to_token_pool.req_to_token)
            self._layer_id = 0
            self._runner = model_runner
            self._rope = None

        def _refresh_rotary(self):
            """The model's rotary embedding, found once, read each pass (SGLang may grow its cache)."""
            if self._rope is None:
                self._rope = find_rotary(getattr(self._runner, "model", None)) or False
                logger.info("sgl-tts sparse attention: %s", "predicting in the rotary frame" if self._rope
                            else "no rotary embedding found: predicting on the queries as they are")
            if self._rope:
                from sgl_tts.plugin.attention.sparse_decoding import Rotary

                self.sparse.rotary = Rotary(self._rope.cos_sin_cache, int(self._rope.rotary_dim),
                                            bool(self._rope.is_neox_style))

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if layer.layer_id == 0:
                self._refresh_rotary()
            o = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
            if not layer.is_cross_attention and forward_batch.extend_seq_lens is not None:
                self.sparse.record_extend(layer.layer_id, q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                                          forward_batch.req_pool_indices, forward_batch.seq_lens,
                                          forward_batch.extend_seq_lens)
            return o

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            self._layer_id = layer.layer_id
            if layer.layer_id == 0:
                self._refresh_rotary()
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)

        def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                     seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
                                     causal=False, is_cross_attn=False, sliding_window_size=None):
            if not cpu_attention._plain(encoder_lens, is_cross_attn, True, sliding_window_size):
                return super()._run_sdpa_forward_decode(
                    query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, encoder_lens,
                    scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)

            def dense(rows):
                part = output.new_empty((len(rows),) + tuple(output.shape[1:]))
                cpu_attention.decode_rows(query[rows], part, k_cache, v_cache, req_to_token,
                                          req_pool_indices[rows], seq_lens[rows], scale=scaling,
                                          enable_gqa=enable_gqa)
                output[rows] = part

            self.sparse.decode(self._layer_id, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                               seq_lens, scaling, dense)
            return output

    return SparseAttnBackend


def find_rotary(model):
    """The one rotary embedding of ``model`` (an SGLang model) that rotates by absolute position the way
    SGLang's base ``RotaryEmbedding`` does, or ``None`` (none, several different ones, or a kind that
    rotates otherwise, such as multimodal rope)."""
    if model is None:
        return None
    import torch
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    found = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    if not found or any(type(m).forward_native is not RotaryEmbedding.forward_native for m in found):
        return None
    first = found[0]
    if any(not torch.equal(m.cos_sin_cache, first.cos_sin_cache) for m in found[1:]):
        return None
    return first


def register_backend() -> None:
    """Register :data:`BACKEND_NAME` in SGLang's attention registry (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(lambda runner: backend_class()(runner))


__all__ = ["BACKEND_NAME", "SparseCounters", "SparseDecoder", "backend_class", "find_rotary", "register_backend"]
