"""Ragged attention for SGLang's CPU servers (``--tts-cpu-attention ragged``).

SGLang 0.5.15 serves on the CPU with its ``torch_native`` attention backend, which runs one
``scaled_dot_product_attention`` call per sequence and, in an extend, computes attention for *every*
position of the sequence (cached prefix included) and throws the prefix's rows away. A tree search
sends each beam step as a new request whose prompt is all cached but a token or two, so every step
pays a full ``L x L`` attention per layer: about four decode rows' worth on the tiny generator
(``docs/benchmarks/LOG.md``, "The frontend").

This backend is the same class with those two loops replaced:

- **decode rows** (a decode batch, and every one-token extend) are sorted by context length and run
  in buckets of similar length (longest at most :data:`BUCKET_RATIO` x the shortest, at most
  :data:`MAX_GATHER_ELEMENTS` gathered key elements), one call per bucket, the shorter rows masked;
- **longer extends** attend with their new tokens only, under a causal mask offset by the cached
  prefix.

What it computes is attention by its definition, as ``torch_native`` does; the results agree to float
rounding (a different summation order), not bit for bit, so a server with it can sample a different
token where two are within rounding of each other. It is off by default; sides that must sample
exactly what stock SGLang samples (``sgl-tts bench``'s equivalence check) leave it off. Cross
attention, encoder lengths and sliding windows go to ``torch_native``'s own code unchanged.

The backend is registered in SGLang's attention registry as :data:`BACKEND_NAME`; the plugin's hook on
``ModelRunner._get_attention_backend_from_str`` (:mod:`sgl_tts.plugin.attention.backend_choice`) builds it where
the server asked for ``torch_native`` and the flag is on (``--attention-backend`` only accepts SGLang's
own names).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple, Optional

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

BACKEND_NAME = "sgl_tts_ragged"

# A bucket's longest row is at most this many times its shortest: the padding it computes is bounded
# by 30% of the bucket's work, and a batch of similar lengths (a search's beams) is a handful of calls.
BUCKET_RATIO = 1.3
# Key elements gathered for one call (the values as many again): 2M = 8 MiB of float32 each, one row of
# 16k context on the tiny model. Larger calls fall off a cliff on the CPU: on the 2-core Xeon
# (2026-11-29, float32, kv 2 x 64) 4 rows of 16k took 52 ms per layer in one call of 16M elements and
# 31 ms in calls of 2M, 32 rows of 1k 30 against 15, and no shape measured slower with the smaller cap.
MAX_GATHER_ELEMENTS = 1 << 21


def scaled_dot_product_attention(*args, **kwargs):
    """torch's, imported on first use: importing the plugin package loads no torch (the launcher
    process needs none; ``tests/test_layering.py``)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    return sdpa(*args, **kwargs)


def gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache[index]`` for a pool ``[tokens, heads, dim]`` and an index of any shape: one
    ``index_select`` over flattened rows, several times faster on the CPU than advanced indexing
    with a 2-D index (which goes through the general index kernel)."""
    rows = cache.reshape(cache.shape[0], -1).index_select(0, index.reshape(-1))
    return rows.view(*index.shape, *cache.shape[1:])


class Bucket(NamedTuple):
    """Rows of similar context length that attend in one call: their places in the batch, the pool
    slots of their contexts (``[rows, longest]``) and the mask of the shorter ones (``None``: all as
    long as the longest)."""

    rows: "torch.Tensor"
    index: "torch.Tensor"
    mask: "Optional[torch.Tensor]"


def per_token_elements(cache: torch.Tensor) -> int:
    """Elements one token takes in a pool ``[tokens, heads, dim]`` (the gather cap counts these)."""
    return int(cache.shape[1]) * int(cache.shape[2])


def plan_rows(req_to_token: torch.Tensor, row_pool_indices: torch.Tensor, lengths: torch.Tensor,
              per_token: int) -> list[Bucket]:
    """The buckets of :func:`decode_rows`: rows sorted by context length, each bucket's longest row at
    most :data:`BUCKET_RATIO` times its shortest and its keys at most :data:`MAX_GATHER_ELEMENTS`
    elements (``per_token``: kv heads x head dim)."""
    import torch

    rows = int(lengths.shape[0])
    order = torch.argsort(lengths)
    sorted_lengths = lengths[order].tolist()
    buckets: list[Bucket] = []
    start = 0
    while start < rows:
        shortest = sorted_lengths[start]
        end = start + 1
        while (end < rows and sorted_lengths[end] <= shortest * BUCKET_RATIO
               and (end + 1 - start) * sorted_lengths[end] * per_token <= MAX_GATHER_ELEMENTS):
            end += 1
        chosen = order[start:end]
        longest = sorted_lengths[end - 1]
        mask = None
        if shortest != longest:
            visible = torch.arange(longest, device=lengths.device)[None, :] < lengths[chosen][:, None]
            mask = visible[:, None, None, :]
        # only the rows' first `longest` slots: a table row is as long as the model's context
        buckets.append(Bucket(chosen, req_to_token[row_pool_indices[chosen], :longest], mask))
        start = end
    return buckets


def attend_rows(query: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                buckets: list[Bucket], *, scale: Optional[float] = None, enable_gqa: bool = False) -> None:
    """One ``scaled_dot_product_attention`` per bucket (see :func:`decode_rows`)."""
    for bucket in buckets:
        keys = gather(k_cache, bucket.index).transpose(1, 2)      # [rows, kv_heads, longest, dim]
        values = gather(v_cache, bucket.index).transpose(1, 2)
        q = query[bucket.rows].unsqueeze(2)                        # [rows, heads, 1, dim]
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        out[bucket.rows] = scaled_dot_product_attention(q, keys, values, attn_mask=bucket.mask, scale=scale,
                                                        enable_gqa=enable_gqa).squeeze(2)


def decode_rows(query: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                req_to_token: torch.Tensor, row_pool_indices: torch.Tensor, lengths: torch.Tensor, *,
                scale: Optional[float] = None, enable_gqa: bool = False,
                buckets: Optional[list[Bucket]] = None) -> None:
    """Attention of one query per row over that row's first ``lengths[i]`` cached tokens.

    Args:
        query: ``[rows, heads, head_dim]``; the row's query is the last position of its context.
        out: ``[rows, heads, v_head_dim]``, written in place.
        k_cache, v_cache: the layer's pools, ``[pool tokens, kv_heads, dim]``.
        req_to_token, row_pool_indices: row i's context tokens sit at pool slots
            ``req_to_token[row_pool_indices[i], :lengths[i]]``, in order.
        lengths: ``[rows]``: each row's context length (at least 1).
        buckets: :func:`plan_rows` of these rows, if the caller has it (every layer of one forward
            pass has the same).
    """
    if int(lengths.shape[0]) == 0:
        return
    if buckets is None:
        buckets = plan_rows(req_to_token, row_pool_indices, lengths, per_token_elements(k_cache))
    attend_rows(query, out, k_cache, v_cache, buckets, scale=scale, enable_gqa=enable_gqa)


class ExtendPlan(NamedTuple):
    """:func:`extend`'s work: where the one-token extends' queries sit and their buckets, and per
    longer extend (query start, new tokens, its pool slots, its mask or ``None`` for plain causal)."""

    single_positions: "Optional[torch.Tensor]"
    single_buckets: list
    longer: list


def plan_extend(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor, per_token: int) -> ExtendPlan:
    import torch

    new = extend_seq_lens.tolist()
    starts = [0] * len(new)
    for i in range(1, len(new)):
        starts[i] = starts[i - 1] + new[i - 1]
    single = [i for i, n in enumerate(new) if n == 1]
    positions, buckets = None, []
    if single:
        chosen = torch.tensor(single, dtype=torch.long)
        positions = torch.tensor([starts[i] for i in single], dtype=torch.long)
        buckets = plan_rows(req_to_token, req_pool_indices[chosen], seq_lens[chosen], per_token)
    prefixes, totals = extend_prefix_lens.tolist(), seq_lens.tolist()
    longer = []
    for i, n in enumerate(new):
        if n <= 1:
            continue
        total, prefix = totals[i], prefixes[i]
        mask = None
        if prefix:
            # new token j sits at position prefix + j and sees positions 0..prefix + j
            mask = (torch.arange(total, device=seq_lens.device)[None, :]
                    <= prefix + torch.arange(n, device=seq_lens.device)[:, None])
        longer.append((starts[i], n, req_to_token[req_pool_indices[i], :total], mask))
    return ExtendPlan(positions, buckets, longer)


def extend(query: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
           extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor, *,
           scale: Optional[float] = None, enable_gqa: bool = False, plan: Optional[ExtendPlan] = None) -> None:
    """Causal attention of each sequence's new tokens over its whole context (cached prefix + new).

    ``query``/``out`` hold the sequences' new tokens one sequence after another
    (``[sum(extend_seq_lens), heads, dim]``); sequence ``i`` has ``seq_lens[i]`` tokens in all, the
    last ``extend_seq_lens[i]`` of them new, and its pool indices in ``req_to_token[req_pool_indices[i]]``.
    ``plan``: :func:`plan_extend` of these arguments, if the caller has it.
    """
    if plan is None:
        plan = plan_extend(req_to_token, req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens,
                           per_token_elements(k_cache))
    if plan.single_positions is not None:
        rows_out = out.new_empty((len(plan.single_positions),) + tuple(out.shape[1:]))
        attend_rows(query[plan.single_positions], rows_out, k_cache, v_cache, plan.single_buckets, scale=scale,
                    enable_gqa=enable_gqa)
        out[plan.single_positions] = rows_out
    for start, n, index, mask in plan.longer:
        keys = gather(k_cache, index).transpose(0, 1).unsqueeze(0)       # [1, kv_heads, total, dim]
        values = gather(v_cache, index).transpose(0, 1).unsqueeze(0)
        q = query[start:start + n].transpose(0, 1).unsqueeze(0)           # [1, heads, n, dim]
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        result = scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=enable_gqa)
        out[start:start + n] = result.squeeze(0).transpose(0, 1)


class PlanCache:
    """The plan of the forward pass under way, made at its first layer and used by the others.

    Keyed by the batch tensors themselves and their version counters (every in-place write bumps
    one): a decode step that grows ``seq_lens`` in place, or writes a new slot into
    ``req_to_token``, makes a new plan. The cache holds the tensors it is keyed by, so their ids
    cannot be reused by other tensors while it does."""

    def __init__(self):
        self.key = None
        self.held = None
        self.plan = None

    def get(self, tensors: tuple, extra: tuple, make):
        key = tuple((id(t), t._version) for t in tensors) + extra
        if key != self.key:
            self.plan, self.key, self.held = make(), key, tensors
        return self.plan


def backend_class():
    """:class:`RaggedAttnBackend`, built on first use (it subclasses SGLang's ``TorchNativeAttnBackend``,
    so importing this module does not import SGLang)."""
    global _BACKEND_CLASS
    if _BACKEND_CLASS is None:
        _BACKEND_CLASS = _make_backend_class()
    return _BACKEND_CLASS


_BACKEND_CLASS = None


def _plain(encoder_lens, is_cross_attn, causal, sliding_window_size) -> bool:
    """Whether a call is the plain causal self-attention this module batches."""
    return (encoder_lens is None and not is_cross_attn and causal
            and (sliding_window_size is None or sliding_window_size <= -1))


def _make_backend_class():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    class RaggedAttnBackend(TorchNativeAttnBackend):
        """``torch_native`` with its per-sequence loops batched (:mod:`sgl_tts.plugin.attention.cpu_attention`)."""

        def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                     seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens=None,
                                     scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                                     sliding_window_size=None):
            if not _plain(encoder_lens, is_cross_attn, causal, sliding_window_size):
                return super()._run_sdpa_forward_extend(
                    query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                    is_cross_attn, sliding_window_size)
            per_token = per_token_elements(k_cache)
            plan = self._plan_cache("extend").get(
                (req_to_token, req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens), (per_token,),
                lambda: plan_extend(req_to_token, req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens,
                                    per_token))
            extend(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                   extend_prefix_lens, extend_seq_lens, scale=scaling, enable_gqa=enable_gqa, plan=plan)
            return output

        def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                     seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
                                     causal=False, is_cross_attn=False, sliding_window_size=None):
            # SGLang passes causal=False for decode: one query at the end of its context sees it all
            if not _plain(encoder_lens, is_cross_attn, True, sliding_window_size):
                return super()._run_sdpa_forward_decode(
                    query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size)
            per_token = per_token_elements(k_cache)
            buckets = self._plan_cache("decode").get(
                (req_to_token, req_pool_indices, seq_lens), (per_token,),
                lambda: plan_rows(req_to_token, req_pool_indices, seq_lens, per_token))
            decode_rows(query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        scale=scaling, enable_gqa=enable_gqa, buckets=buckets)
            return output

        def _plan_cache(self, mode: str) -> PlanCache:
            caches = self.__dict__.setdefault("_sgl_tts_plans", {})
            return caches.setdefault(mode, PlanCache())

    return RaggedAttnBackend


def register_backend() -> None:
    """Register :data:`BACKEND_NAME` in SGLang's attention registry (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(lambda runner: backend_class()(runner))


__all__ = ["BACKEND_NAME", "BUCKET_RATIO", "MAX_GATHER_ELEMENTS", "Bucket", "ExtendPlan", "PlanCache",
           "attend_rows", "backend_class", "decode_rows", "extend", "gather",
           "per_token_elements", "plan_extend", "plan_rows", "register_backend"]
