"""A continuous-batching generation engine for Hugging Face causal LMs on the CPU.

One engine thread owns the model. Callers (the SGLang interpreter's fork threads) submit requests and
block on a future; the engine admits whatever has arrived, prefills it in one forward pass (shared
prompt prefixes computed once), then decodes every running request together, one token per step, and
retires requests as they finish. New requests join between steps, so a 64-way fork costs one decode
forward per token, not 64.

What a request asks and returns, with SGLang's meanings, is in :mod:`sgl_tts.backends.semantics`;
the running batch's KV slabs, the prefix cache and the attention over them in
:mod:`sgl_tts.backends.kv`. Their names are importable from here as before.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections import deque
from typing import Any, Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache

from sgl_tts.backends.kv import (  # noqa: F401 - _Batch, _SlabLayer, _stack_rows, _sdpa_gqa_decode: tests
    ATTENTION,
    PrefixCache,
    _Batch,
    _sdpa_gqa_decode,
    _SlabLayer,
    _stack_rows,
    kv_geometry,
    use_engine_attention,
)
from sgl_tts.backends.semantics import (  # noqa: F401 - re-exported: the names' home before the split
    Completion,
    LogitProcessors,
    LogprobSpec,
    SamplingSpec,
    UnsupportedFeatureError,
    check_request,
    finish_reason,
    output_text,
    sample,
    stop_window,
    top_logprobs,
)

from sgl_tts.backends.engine_request import EngineStats, _Request  # noqa: F401 - EngineStats: re-exported

logger = logging.getLogger(__name__)


class BatchEngine:
    """Owns a causal LM and serves generation requests from many threads in shared batches.

    Args:
        model: a transformers causal LM (``AutoModelForCausalLM``), already on its device.
        tokenizer: its tokenizer.
        max_running: most requests decoded together; more wait in line.
        prefix_cache_bytes: memory for KV of finished sequences and prompts (0 disables reuse).
        gather_window_s: after the first request of an idle spell arrives, keep collecting for as long
            as more arrive within this window (a fork's siblings arrive within microseconds).
        min_shared_prefix: a prompt prefix shared by this many tokens of concurrent requests is
            prefilled once for all of them.
        threads: torch intra-op threads of the engine thread (``None``: torch's default). One is
            the default: small models gain little from more, and two engines (generator + PRM) or
            any other torch work on a small machine then do not oversubscribe the cores, which
            slowed decoding ~7x in a measurement on 2 cores.
    """

    def __init__(self, model, tokenizer, *, max_running: int = 256,
                 prefix_cache_bytes: int = 256 << 20, gather_window_s: float = 0.004,
                 min_shared_prefix: int = 8, seed: int | None = None, threads: int | None = 1):
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1 (or None), got {threads}")
        self.threads = threads
        self.model = model
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.gather_window_s = gather_window_s
        self.min_shared_prefix = min_shared_prefix
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.stats = EngineStats()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.eos_ids = self._eos_token_ids()
        # SGLang's min_new_tokens penalizer blocks stop_token_ids and the tokenizer's EOS only.
        self.min_tokens_blocked = frozenset(
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._rng = torch.Generator()
        self._rng.manual_seed(seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "little"))
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._waiting: deque[_Request] = deque()
        self._admitting: list[_Request] = []  # taken from the line, not yet running or finished
        self._batch: _Batch | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._flush = False
        self._processors = LogitProcessors()
        self._thread = threading.Thread(target=self._loop, name="sgl-tts-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------------- public
    def submit(self, input_ids: Sequence[int], sampling: SamplingSpec,
               logprobs: LogprobSpec | None = None, *, rid: str | None = None,
               score_positions: tuple[Sequence[int], Sequence[int]] | None = None,
               priority: int = 0, logit_processor: tuple[str, dict | None] | None = None) -> concurrent.futures.Future:
        """Queue a request; the future resolves to a :class:`Completion`.

        ``score_positions=(positions, token_ids)`` additionally returns, in
        ``meta_info["next_token_logprobs"]``, log P(next token = id | tokens[: p + 1]) for every
        position p and id, as a ``len(positions) x len(token_ids)`` list of lists. When more
        requests wait than can run, higher ``priority`` is admitted first (FIFO among equals).
        ``logit_processor=(processor, custom_params)``: an SGLang custom logit processor
        (``CustomLogitProcessor.to_str()``) applied to this request's logits before each token is
        sampled, as SGLang's sampler does (after min_new_tokens, before the temperature), with its
        ``custom_params`` plus ``__req__`` (the request: ``origin_input_ids``, ``output_ids``,
        ``eos_token_ids``).
        """
        if self._closed:
            raise RuntimeError("the engine is closed")
        ids, lp, sp = check_request(input_ids, sampling, logprobs, score_positions,
                                    vocab_size=self.vocab_size, max_positions=self.max_positions)
        req = _Request(rid or uuid.uuid4().hex, ids, sampling, lp, sp, int(priority))
        if logit_processor is not None:
            req.processor = logit_processor[0]
            self._processors.load(req.processor)   # a processor that does not load fails here, in the caller
            req.custom_params = dict(logit_processor[1] or {}) | {"__req__": req}
            req.eos_token_ids = self.eos_ids
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._queue.put(req)
        return req.future

    def generate(self, input_ids: Sequence[int], sampling: SamplingSpec,
                 logprobs: LogprobSpec | None = None, **kw) -> Completion:
        """Blocking :meth:`submit`."""
        return self.submit(input_ids, sampling, logprobs, **kw).result()

    def flush_prefix_cache(self) -> None:
        """Drop every cached prefix (takes effect before the engine's next step)."""
        self._flush = True

    @property
    def native_thread_id(self) -> int | None:
        """The OS thread id of the engine thread (the model's CPU time is this thread's), e.g. to
        tell the engine's CPU from its callers' with ``psutil.Process().threads()``."""
        return self._thread.native_id

    def close(self) -> None:
        """Stop the engine; every request not finished yet fails with "the engine was closed"."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------------------ scheduling
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # per OS thread: the caller's setting is untouched
        while True:
            try:
                if not self._collect():
                    break
                if self._flush:
                    self._flush = False
                    self.prefix_cache.clear()
                if self._waiting:
                    self._admit()
                if self._batch is not None:
                    self._decode_step()
            except Exception as exc:  # noqa: BLE001 - fail the affected requests, keep serving
                logger.exception("engine step failed")
                self._fail_all(exc)
        # Closed: nothing can be queued any more (submit checks under the lock), so drain and fail.
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._waiting.append(item)
        self._fail_all(RuntimeError("the engine was closed"))

    def _collect(self) -> bool:
        """Move arrived requests into the waiting line; block when there is nothing to do."""
        idle = self._batch is None and not self._waiting
        try:
            if idle:
                item = self._queue.get()
                if item is None:
                    return False
                self._waiting.append(item)
                deadline = time.perf_counter() + 10 * self.gather_window_s
                while time.perf_counter() < deadline:
                    item = self._queue.get(timeout=self.gather_window_s)
                    if item is None:
                        return False
                    self._waiting.append(item)
            while True:
                item = self._queue.get_nowait()
                if item is None:
                    return False
                self._waiting.append(item)
        except queue.Empty:
            return True

    def _fail_all(self, exc: BaseException) -> None:
        reqs = list(self._waiting) + self._admitting + (self._batch.reqs if self._batch else [])
        self._waiting.clear()
        self._admitting = []
        self._batch = None
        for r in reqs:
            if not r.future.done():
                r.future.set_exception(exc)

    # ------------------------------------------------------------------------------- prefill
    def _admit(self) -> None:
        running = len(self._batch.reqs) if self._batch else 0
        free = self.max_running - running
        if free <= 0:
            return
        if len(self._waiting) > free:
            ordered = sorted(self._waiting, key=lambda r: -r.priority)  # stable: FIFO among equals
            take, rest = ordered[:free], ordered[free:]
            self._waiting = deque(sorted(rest, key=lambda r: r.created))
        else:
            take = list(self._waiting)
            self._waiting.clear()
        self.stats.requests += len(take)
        self._admitting = take
        self._share_prefixes(take)
        # Bound the prefill's activation memory: chunks of at most ~8k padded tokens.
        take.sort(key=lambda r: len(r.input_ids))
        chunk: list[_Request] = []
        for r in take:
            width = max([len(x.input_ids) for x in chunk] + [len(r.input_ids)])
            if chunk and width * (len(chunk) + 1) > 8192:
                self._prefill(chunk)
                chunk = []
            chunk.append(r)
        if chunk:
            self._prefill(chunk)
        self._admitting = []

    def _share_prefixes(self, reqs: list[_Request]) -> None:
        """Prefill, once, each long prompt prefix that several new requests share."""
        if len(reqs) < 2 or self.prefix_cache.max_bytes <= 0:
            return
        order = sorted(reqs, key=lambda r: r.input_ids)
        groups: list[list[_Request]] = [[order[0]]]
        for r in order[1:]:
            prev = groups[-1][-1]
            if common_prefix_len(prev.input_ids, r.input_ids) >= self.min_shared_prefix:
                groups[-1].append(r)
            else:
                groups.append([r])
        for g in groups:
            if len(g) < 2:
                continue
            n = min(common_prefix_len(g[0].input_ids, g[-1].input_ids), min(r.reuse_limit() for r in g))
            ids = np.asarray(g[0].input_ids[:n], dtype=np.int64)
            hit, _ = self.prefix_cache.lookup(ids, n)
            if n - hit >= self.min_shared_prefix:
                probe = _Request("prefix", g[0].input_ids[:n], SamplingSpec(max_new_tokens=0),
                                 LogprobSpec(), None)
                self._prefill([probe], cache_only=True)

    def _prefill(self, reqs: list[_Request], cache_only: bool = False) -> None:
        slabs, past_valid = self._past_kv(reqs)
        past_len = past_valid.shape[1]
        suffixes = [r.input_ids[r.cached_tokens:] for r in reqs]
        slen = max(len(s) for s in suffixes)
        b = len(reqs)

        input_ids = torch.full((b, slen), self.pad_id, dtype=torch.long)
        in_valid = torch.zeros(b, slen, dtype=torch.bool)
        positions = torch.zeros(b, slen, dtype=torch.long)
        for i, (r, s) in enumerate(zip(reqs, suffixes)):
            input_ids[i, slen - len(s):] = torch.tensor(s, dtype=torch.long)
            in_valid[i, slen - len(s):] = True
            positions[i, slen - len(s):] = torch.arange(r.cached_tokens, r.cached_tokens + len(s))

        # Attention: real queries see valid past columns and earlier valid input columns; padding
        # queries see only themselves (keeps every softmax row finite).
        causal = torch.tril(torch.ones(slen, slen, dtype=torch.bool))
        allow_in = (causal[None] & in_valid[:, None, :]) | torch.eye(slen, dtype=torch.bool)[None]
        allow_past = past_valid[:, None, :].expand(b, slen, past_len) & in_valid[:, :, None]
        allow = torch.cat([allow_past, allow_in], dim=2)
        mask = self._additive(allow)[:, None]

        # Which columns need logits: the last one, plus rows asked for logprobs / scores.
        keep = {slen - 1}
        for r in reqs:
            off = slen - len(r.input_ids)  # column of prompt position p is p + off
            keep.update(p + off for p in r.needed_rows())
        keep_cols = sorted(keep)

        cache = Cache(layers=slabs)
        out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=positions.to(self.device), past_key_values=cache,
                         use_cache=True, logits_to_keep=torch.tensor(keep_cols, device=self.device))
        logits = out.logits.float()  # [b, len(keep_cols), vocab]
        col_index = {c: j for j, c in enumerate(keep_cols)}
        self.stats.prefill_forwards += 1
        self.stats.prefill_tokens += int(in_valid.sum())
        self.stats.cached_tokens += sum(r.cached_tokens for r in reqs)
        valid = torch.cat([past_valid, in_valid], dim=1)
        batch = _Batch(slabs, valid, reqs, torch.tensor([len(r.input_ids) for r in reqs]))

        self._remember_prompts(reqs, batch)
        if cache_only:
            return

        keep_rows = []
        last = logits[:, col_index[slen - 1]]
        for i, r in enumerate(reqs):
            off = slen - len(r.input_ids)
            self._record_input_logprobs(r, logits[i], col_index, off)
            if r.sampling.max_new_tokens == 0:
                r.finish_reason = {"type": "length", "length": 0}
                self._finish(r)
            else:
                keep_rows.append(i)
        if not keep_rows:
            return
        idx = torch.tensor(keep_rows)
        self._append_tokens([reqs[i] for i in keep_rows], last[idx])
        alive = [i for i in keep_rows if reqs[i].finish_reason is None]
        for i in keep_rows:
            if reqs[i].finish_reason is not None:
                self._finish(reqs[i], batch, i)
        if alive:
            self._merge(batch, alive)

    def _past_kv(self, reqs: list[_Request]) -> tuple[list[_SlabLayer], torch.Tensor]:
        """Look every request up in the prefix cache (setting its ``cached_tokens``) and lay the hits'
        KV out left-padded to the longest hit, with room for the uncached suffixes: the slabs the
        prefill forward appends to, and which past columns are real."""
        hits = []
        for r in reqs:
            n, kv = self.prefix_cache.lookup(np.asarray(r.input_ids, dtype=np.int64), r.reuse_limit())
            r.cached_tokens = n
            hits.append(kv)
        past_len = max(r.cached_tokens for r in reqs)
        slen = max(len(r.input_ids) - r.cached_tokens for r in reqs)
        b = len(reqs)
        past_valid = torch.zeros(b, past_len, dtype=torch.bool)
        for i, r in enumerate(reqs):
            past_valid[i, past_len - r.cached_tokens:] = True
        if not past_len:
            return [_SlabLayer(*self._empty_kv(b, slen + 8), 0) for _ in range(self._num_layers())], past_valid
        slabs = []
        for li in range(self._num_layers()):
            k = v = None
            for i, kv in enumerate(hits):
                if kv is None:
                    continue
                kk, vv = kv[li]
                if k is None:
                    k = kk.new_zeros(b, kk.shape[0], past_len + slen + 8, kk.shape[2])
                    v = torch.zeros_like(k)
                n = kk.shape[1]
                k[i, :, past_len - n:past_len] = kk
                v[i, :, past_len - n:past_len] = vv
            slabs.append(_SlabLayer(k, v, past_len))
        return slabs, past_valid

    def _remember_prompts(self, reqs: list[_Request], batch: _Batch) -> None:
        """Cache each distinct prompt's KV (beyond what came from the cache) for later requests that
        extend it."""
        seen = set()
        for i, r in enumerate(reqs):
            key = tuple(r.input_ids)
            if len(key) > r.cached_tokens and key not in seen:
                seen.add(key)
                self.prefix_cache.insert(np.asarray(key, dtype=np.int64),
                                         [(k[:, :len(key)], v[:, :len(key)]) for k, v in batch.row_kv(i)])

    def _record_input_logprobs(self, r: _Request, logits: torch.Tensor, col_index: dict, off: int):
        lp = r.logprobs
        if r.score_positions is not None:
            pos, tids = r.score_positions
            rows = torch.stack([logits[col_index[p + off]] for p in pos]).log_softmax(-1)
            r.scores = rows[:, list(tids)].numpy() if tids else np.zeros((len(pos), 0))
        if not lp.return_logprob:
            return
        start = r.input_start()
        n = len(r.input_ids) - start
        if n <= 0:
            return
        r.in_lp = [None]
        r.in_top = [None]
        r.in_ids_lp = [None]
        if n > 1:
            rows = torch.stack([logits[col_index[p + off]] for p in range(start, len(r.input_ids) - 1)])
            lps = rows.log_softmax(-1)
            nxt = torch.tensor(r.input_ids[start + 1:])
            r.in_lp += lps.gather(1, nxt[:, None]).squeeze(1).tolist()
            if lp.top_logprobs_num > 0:
                r.in_top += top_logprobs(lps, lp.top_logprobs_num)
            if lp.token_ids_logprob:
                r.in_ids_lp += lps[:, list(lp.token_ids_logprob)].tolist()

    def _merge(self, new: _Batch, rows: list[int]) -> None:
        if len(rows) != len(new.reqs):
            new = self._select_rows(new, rows)
        if self._batch is None:
            self._batch = new
        elif self._batch.can_take(new):
            self.stats.joined_running += len(new.reqs)
            self._batch.take(new)
        else:
            # Copy everything once into buffers with spare rows (up to max_running) and spare
            # columns on both sides, so the joins after this one write in place. Reallocating the
            # whole batch at every join cost up to half the engine's time at 256 rows, mostly in
            # page faults on the fresh buffers.
            old = self._batch
            self.stats.joined_running += len(new.reqs)
            self.stats.kv_reallocations += 1
            total = len(old.reqs) + len(new.reqs)
            length = max(old.length, new.length)
            layers, valid = _stack_rows([(old.layers, old.valid), (new.layers, new.valid)],
                                        row_capacity=min(self.max_running, total + max(16, total // 2)),
                                        slack=32 + length // 4, headroom=32)
            self._batch = _Batch(layers, valid, old.reqs + new.reqs, torch.cat([old.next_pos, new.next_pos]))
        self.stats.max_running = max(self.stats.max_running, len(self._batch.reqs))

    @staticmethod
    def _select_rows(batch: _Batch, rows: list[int]) -> _Batch:
        idx = torch.tensor(rows)
        valid = batch.valid[idx]
        cols = valid.any(0).nonzero()
        first = int(cols[0]) if len(cols) else valid.shape[1]
        valid = valid[:, first:]
        layers = []
        for lay in batch.layers:
            k = lay.keys[idx][:, :, first:].contiguous()
            v = lay.values[idx][:, :, first:].contiguous()
            layers.append(_SlabLayer(k, v, lay.length - first))
        return _Batch(layers, valid, [batch.reqs[i] for i in rows], batch.next_pos[idx])

    @staticmethod
    def _drop_rows(batch: _Batch, dead: list[int]) -> _Batch | None:
        """Remove finished rows in place: the last live rows move into the holes (a few row copies
        instead of reallocating every layer's KV at each finish, which dominated large batches),
        and leading columns that no live row uses any more are given up (``start`` moves right)."""
        b = len(batch.reqs)
        n = b - len(dead)
        if n == 0:
            return None
        gone = set(dead)
        holes = [i for i in dead if i < n]
        movers = [i for i in range(n, b) if i not in gone]
        if holes:
            src, dst = torch.tensor(movers), torch.tensor(holes)
            for lay in batch.layers:
                s, e = lay.start, lay.start + lay.length
                lay.kbuf[dst, :, s:e] = lay.kbuf[src, :, s:e]
                lay.vbuf[dst, :, s:e] = lay.vbuf[src, :, s:e]
            batch.valid[dst] = batch.valid[src]
            batch.next_pos[dst] = batch.next_pos[src]
            for h, m in zip(holes, movers):
                batch.reqs[h] = batch.reqs[m]
        del batch.reqs[n:]
        batch.valid = batch.valid[:n]
        batch.next_pos = batch.next_pos[:n]
        used = batch.valid.any(0).nonzero()
        first = int(used[0]) if len(used) else 0
        batch.valid = batch.valid[:, first:]
        for lay in batch.layers:
            lay.rows = n
            lay.start, lay.length = lay.start + first, lay.length - first
            lay.refresh()
        return batch

    # -------------------------------------------------------------------------------- decode
    def _decode_step(self) -> None:
        batch = self._batch
        b = len(batch.reqs)
        input_ids = torch.tensor([[r.output_ids[-1]] for r in batch.reqs], dtype=torch.long)
        valid = torch.cat([batch.valid, torch.ones(b, 1, dtype=torch.bool)], dim=1)
        mask = self._additive(valid)[:, None, None, :]
        out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                         position_ids=batch.next_pos[:, None].to(self.device),
                         past_key_values=batch.cache(), use_cache=True)
        batch.valid = valid
        batch.next_pos = batch.next_pos + 1
        self.stats.decode_forwards += 1
        self.stats.decode_tokens += b
        self._append_tokens(batch.reqs, out.logits[:, -1].float())
        done = [i for i, r in enumerate(batch.reqs) if r.finish_reason is not None]
        if not done:
            return
        for i in done:
            self._finish(batch.reqs[i], batch, i)
        self._batch = self._drop_rows(batch, done)

    # ------------------------------------------------------------------------------ sampling
    def _append_tokens(self, reqs: list[_Request], logits: torch.Tensor) -> None:
        """Sample one token per request from ``logits`` [n, vocab], record logprobs, check stops."""
        n = len(reqs)
        for i, r in enumerate(reqs):
            s = r.sampling
            if len(r.output_ids) < s.min_new_tokens:
                blocked = list(s.stop_token_ids | self.min_tokens_blocked)
                logits[i, blocked] = float("-inf")
        self._processors.apply([(r.processor, r.custom_params) for r in reqs], logits)
        temps = torch.tensor([1.0 if r.sampling.greedy else r.sampling.temperature for r in reqs])
        scaled = logits / temps[:, None]
        tokens = torch.empty(n, dtype=torch.long)
        greedy = [i for i, r in enumerate(reqs) if r.sampling.greedy]
        if greedy:
            g = torch.tensor(greedy)
            tokens[g] = scaled[g].argmax(-1)
        sampled = [i for i, r in enumerate(reqs) if not r.sampling.greedy]
        if sampled:
            draws = torch.stack([torch.rand((), generator=reqs[i].generator or self._rng) for i in sampled])
            tokens[torch.tensor(sampled)] = sample(scaled[sampled], [reqs[i].sampling for i in sampled], draws)
        wanting = [i for i, r in enumerate(reqs) if r.logprobs.return_logprob]
        chosen: dict[int, float] = {}
        tops: dict[int, tuple[list[float], list[int]]] = {}
        if wanting:
            # one gather and one top-k per distinct k for every row that asked (not a tensor op per row)
            # clamped as SGLang's sampler does: a masked token (a processor's, min_new_tokens') reads finfo.min
            logprobs = scaled.log_softmax(-1).clamp_(min=torch.finfo(scaled.dtype).min)
            rows = torch.tensor(wanting)
            chosen = dict(zip(wanting, logprobs[rows].gather(1, tokens[rows][:, None]).squeeze(1).tolist()))
            for k in {reqs[i].logprobs.top_logprobs_num for i in wanting} - {0}:
                ask = [i for i in wanting if reqs[i].logprobs.top_logprobs_num == k]
                vals, ids = logprobs[torch.tensor(ask)].topk(min(k, logprobs.shape[-1]), dim=-1)
                # (values, ids) per row, as tuples: the garbage collector stops tracking tuples of numbers,
                # and these live until the request finishes (lists here made the full collections of a
                # DeepConf run cost seconds: ~20 tracked objects per generated token)
                tops.update(zip(ask, zip(map(tuple, vals.tolist()), map(tuple, ids.tolist()))))
        for i, r in enumerate(reqs):
            t = int(tokens[i])
            r.output_ids.append(t)
            lp = r.logprobs
            if lp.return_logprob:
                r.out_lp.append(chosen[i])
                if lp.top_logprobs_num > 0:
                    r.out_top.append(tops[i])
                if lp.token_ids_logprob:
                    r.out_ids_lp.append(logprobs[i, list(lp.token_ids_logprob)].tolist())
            self._check_finished(r)

    def _check_finished(self, r: _Request) -> None:
        if r.sampling.stop and not r.stop_window:
            r.stop_window = stop_window(r.sampling.stop, self.tokenizer)
        r.finish_reason = finish_reason(r.output_ids, r.sampling, self.tokenizer, self.eos_ids,
                                        r.stop_window)

    # -------------------------------------------------------------------------------- finish
    def _finish(self, r: _Request, batch: _Batch | None = None, row: int | None = None) -> None:
        s = r.sampling
        if batch is not None and len(r.output_ids) > 1:
            # KV now covers the prompt and all output tokens but the last (never fed back).
            seq = np.asarray(r.input_ids + r.output_ids[:-1], dtype=np.int64)
            self.prefix_cache.insert(seq, batch.row_kv(row))
        text = output_text(r.output_ids, r.finish_reason, s, self.tokenizer)
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": r.finish_reason,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": len(r.output_ids),
            "cached_tokens": r.cached_tokens,
            "e2e_latency": time.perf_counter() - r.created,
        }
        lp = r.logprobs
        if lp.return_logprob:
            start = r.input_start()
            txt = self._token_text if lp.return_text_in_logprobs else (lambda _t: None)
            meta["input_token_logprobs"] = [
                [v, t, txt(t)] for v, t in zip(r.in_lp, r.input_ids[start:])]
            meta["output_token_logprobs"] = [
                [v, t, txt(t)] for v, t in zip(r.out_lp, r.output_ids)]
            if lp.top_logprobs_num > 0:
                meta["input_top_logprobs"] = [
                    None if e is None else [[v, t, txt(t)] for v, t in e] for e in r.in_top]
                # k entries per generated token, each a (logprob, id, text) tuple (SGLang's JSON has
                # lists; read-only here, and untracked by the garbage collector), no call per entry when
                # no text is asked for
                meta["output_top_logprobs"] = (
                    [[(v, t, txt(t)) for v, t in zip(*e)] for e in r.out_top] if lp.return_text_in_logprobs
                    else [[(v, t, None) for v, t in zip(*e)] for e in r.out_top])
            if lp.token_ids_logprob:
                tids = lp.token_ids_logprob
                meta["input_token_ids_logprobs"] = [
                    None if e is None else [[v, t, txt(t)] for v, t in zip(e, tids)]
                    for e in r.in_ids_lp]
                meta["output_token_ids_logprobs"] = [
                    [[v, t, txt(t)] for v, t in zip(e, tids)] for e in r.out_ids_lp]
        if r.scores is not None:
            meta["next_token_logprobs"] = r.scores.tolist()
        if not r.future.done():
            r.future.set_result(Completion(text, list(r.output_ids), meta))

    def _token_text(self, t: int) -> str:
        return self.tokenizer.decode([t])

    # --------------------------------------------------------------------------------- utils
    def _num_layers(self) -> int:
        return kv_geometry(self.model.config)[0]

    def _empty_kv(self, b: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, heads, dim = kv_geometry(self.model.config)
        k = torch.zeros(b, heads, cap, dim, dtype=self.dtype, device=self.device)
        return k, torch.zeros_like(k)

    def _additive(self, allow: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=self.dtype)
        neg = torch.tensor(torch.finfo(self.dtype).min, dtype=self.dtype)
        return torch.where(allow, zero, neg)

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(x) for x in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading items ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
