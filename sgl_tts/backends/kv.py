"""The CPU engine's memory: the running batch's KV in slabs with spare rows and columns (joins and
finishes change it in place), the LRU prefix cache of finished sequences' KV, and the attention
implementation the engine gives the model (grouped-KV decode without per-head copies)."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

if TYPE_CHECKING:
    from sgl_tts.backends.engine_request import _Request


ATTENTION = "sgl_tts_sdpa"


def _sdpa_gqa_decode(module, query, key, value, attention_mask, **kwargs):
    """Transformers' SDPA attention, except for one-token queries with grouped KV heads: those attend
    with the query heads folded onto their KV head instead of copying K and V per query head
    (transformers' ``repeat_kv`` whenever a mask is given). At 512 decoding rows that copy was
    hundreds of MB per step, mostly page-fault time; the result is the same attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or kv_heads == heads or kwargs.get("dropout", 0.0) or \
            (attention_mask is not None and attention_mask.shape[2] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rep = heads // kv_heads
    q = query.reshape(b, kv_heads, rep, dim)            # head h = kv * rep + r, as repeat_kv maps it
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"))
    return out.reshape(b, heads, 1, dim).transpose(1, 2).contiguous(), None


def use_engine_attention(model) -> None:
    """Switch a transformers model to :func:`_sdpa_gqa_decode` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _sdpa_gqa_decode)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)


class _SlabLayer(DynamicLayer):
    """A KV layer backed by buffers with spare rows and columns, so that the running batch changes
    in place: its ``rows`` rows occupy columns ``[start, start + length)`` of ``kbuf``/``vbuf``
    ([row capacity, kv heads, column capacity, head dim]); appending a token writes one column,
    a joining row writes into a spare row, a longer joining row moves ``start`` left into the
    spare columns there. Cells outside a row's valid columns hold finite stale values (zeros or
    an earlier row's KV) that the attention mask hides."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int, *,
                 rows: int | None = None, start: int = 0):
        super().__init__()
        self.kbuf, self.vbuf = keys, values
        self.rows = keys.shape[0] if rows is None else rows
        self.start, self.length = start, length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.refresh()

    def refresh(self) -> None:
        """Re-point ``keys``/``values`` at the live region after ``rows``/``start``/``length`` moved."""
        end = self.start + self.length
        self.keys = self.kbuf[:self.rows, :, self.start:end]
        self.values = self.vbuf[:self.rows, :, self.start:end]

    def update(self, key_states, value_states, *args, **kwargs):
        n = key_states.shape[-2]
        end = self.start + self.length
        if end + n > self.kbuf.shape[2]:
            cap = max(self.length + n, int(self.length * 1.5) + 16)
            self.kbuf = _regrid(self.kbuf, self.rows, self.start, self.length, cap)
            self.vbuf = _regrid(self.vbuf, self.rows, self.start, self.length, cap)
            self.start, end = 0, self.length
        self.kbuf[:self.rows, :, end:end + n] = key_states
        self.vbuf[:self.rows, :, end:end + n] = value_states
        self.length += n
        self.refresh()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0


def _regrid(buf: torch.Tensor, rows: int, start: int, length: int, cols: int) -> torch.Tensor:
    """A new buffer of ``cols`` columns (same row capacity) holding ``buf``'s live region at column 0."""
    new = buf.new_zeros(buf.shape[0], buf.shape[1], cols, buf.shape[3])
    new[:rows, :, :length] = buf[:rows, :, start:start + length]
    return new


class _Batch:
    """KV of the running requests: per layer a :class:`_SlabLayer`, rows left-padded to a common
    length (``valid`` says which columns of a row hold a real token)."""

    def __init__(self, layers: list[_SlabLayer], valid: torch.Tensor, reqs: list[_Request],
                 next_pos: torch.Tensor):
        self.layers = layers
        self.valid = valid            # bool [rows, length]: which columns hold a real token
        self.reqs = reqs
        self.next_pos = next_pos      # long [rows]: position id of the next fed token

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def cache(self) -> Cache:
        return Cache(layers=list(self.layers))

    def row_kv(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row i's KV with padding removed: per layer ([heads, n, dim], [heads, n, dim])."""
        cols = self.valid[i].nonzero().squeeze(1)
        return [(lay.keys[i].index_select(1, cols), lay.values[i].index_select(1, cols))
                for lay in self.layers]

    def can_take(self, new: "_Batch") -> bool:
        """Whether ``new``'s rows fit in this batch's spare rows and columns without reallocating."""
        lay = self.layers[0]
        return (lay.rows + len(new.reqs) <= lay.kbuf.shape[0]
                and new.length <= lay.start + lay.length)

    def take(self, new: "_Batch") -> None:
        """Append ``new``'s rows in place (:meth:`can_take` must hold): each is right-aligned with
        the running rows; a longer one moves the batch's first column left."""
        n0, n1, t = len(self.reqs), len(self.reqs) + len(new.reqs), new.length
        grow = max(0, t - self.length)
        for lay, nl in zip(self.layers, new.layers):
            end = lay.start + lay.length
            lay.kbuf[n0:n1, :, end - t:end] = nl.keys
            lay.vbuf[n0:n1, :, end - t:end] = nl.values
            lay.rows, lay.start, lay.length = n1, lay.start - grow, lay.length + grow
            lay.refresh()
        old = self.valid
        if grow:
            old = torch.cat([torch.zeros(n0, grow, dtype=torch.bool), old], dim=1)
        pad = torch.zeros(len(new.reqs), old.shape[1] - t, dtype=torch.bool)
        self.valid = torch.cat([old, torch.cat([pad, new.valid], dim=1)])
        self.reqs = self.reqs + new.reqs
        self.next_pos = torch.cat([self.next_pos, new.next_pos])


def _stack_rows(parts: Sequence[tuple[list[_SlabLayer], torch.Tensor]], *, row_capacity: int,
                slack: int, headroom: int):
    """Concatenate batches of rows into new buffers, left-padding each to the longest, with room for
    ``row_capacity`` rows in all, ``slack`` spare columns before the first and ``headroom`` after the
    last; returns (layers, valid)."""
    length = max(v.shape[1] for _, v in parts)
    rows = sum(v.shape[0] for _, v in parts)
    ref = parts[0][0]
    layers = []
    for li in range(len(ref)):
        kb = ref[li].kbuf
        k = kb.new_zeros(max(rows, row_capacity), kb.shape[1], slack + length + headroom, kb.shape[3])
        v = torch.zeros_like(k)
        r = 0
        end = slack + length
        for lays, valid in parts:
            n, t = valid.shape
            k[r:r + n, :, end - t:end] = lays[li].keys
            v[r:r + n, :, end - t:end] = lays[li].values
            r += n
        layers.append(_SlabLayer(k, v, length, rows=rows, start=slack))
    valid = torch.zeros(rows, length, dtype=torch.bool)
    r = 0
    for _, vmask in parts:
        n, t = vmask.shape
        valid[r:r + n, length - t:] = vmask
        r += n
    return layers, valid


class PrefixCache:
    """KV of recently seen token sequences, for reuse by requests that extend them.

    LRU, capped in bytes and in entries. A lookup finds the longest common prefix with any entry.
    Entries are indexed by a hash chain over their whole 16-token blocks, so a lookup compares
    tokens only with the entries that share its longest indexed block prefix (a linear scan over
    every entry remains only for prefixes shorter than one block); at hundreds of entries the scan
    alone was a fifth of the engine's time.
    """

    BLOCK = 16

    def __init__(self, max_bytes: int, max_entries: int = 512):
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.bytes = 0
        # key (the ids' bytes) -> (ids, kv, nbytes, block hash chain)
        self._entries: OrderedDict[bytes, tuple[np.ndarray, list, int, list[int]]] = OrderedDict()
        self._index: dict[int, dict[bytes, None]] = {}   # chain hash of m blocks -> entries with them

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def _chain(cls, ids: np.ndarray, blocks: int) -> list[int]:
        """hash(first block), hash(first two blocks), ...: ``blocks`` chained hashes."""
        out, h, b = [], 0, cls.BLOCK
        for m in range(blocks):
            h = hash((h, ids[m * b:(m + 1) * b].tobytes()))
            out.append(h)
        return out

    def lookup(self, ids: np.ndarray, limit: int):
        """Longest cached prefix of ``ids`` (at most ``limit`` tokens): (n, kv) with kv sliced to n."""
        cap = min(limit, len(ids))
        chain = self._chain(ids, cap // self.BLOCK)
        candidates: Iterable[bytes] = self._entries
        for h in reversed(chain):
            found = self._index.get(h)
            if found:
                candidates = list(found)   # every entry sharing more than this many tokens is here
                break
        best_n, best_key = 0, None
        for key in candidates:
            eids = self._entries[key][0]
            m = min(len(eids), cap)
            if m <= best_n:
                continue
            eq = eids[:m] == ids[:m]
            n = m if eq.all() else int(eq.argmin())
            if n > best_n:
                best_n, best_key = n, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        kv = self._entries[best_key][1]
        return best_n, [(k[:, :best_n], v[:, :best_n]) for k, v in kv]

    def insert(self, ids: np.ndarray, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self.max_bytes <= 0 or len(ids) == 0:
            return
        key = ids.tobytes()
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        nbytes = sum(k.numel() * k.element_size() * 2 for k, _ in kv)
        if nbytes > self.max_bytes:
            return
        # An entry that is a prefix of the new one is now redundant.
        for okey in [k for k in self._entries if len(k) <= len(key) and key.startswith(k)]:
            self._remove(okey)
        chain = self._chain(ids, len(ids) // self.BLOCK)
        self._entries[key] = (ids.copy(), [(k.contiguous(), v.contiguous()) for k, v in kv], nbytes, chain)
        for h in chain:
            self._index.setdefault(h, {})[key] = None
        self.bytes += nbytes
        while self.bytes > self.max_bytes or len(self._entries) > self.max_entries:
            self._remove(next(iter(self._entries)))

    def _remove(self, key: bytes) -> None:
        _, _, nbytes, chain = self._entries.pop(key)
        self.bytes -= nbytes
        for h in chain:
            holders = self._index[h]
            del holders[key]
            if not holders:
                del self._index[h]

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.bytes = 0


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a model with this config (its text config for a multimodal one)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return int(cfg.num_hidden_layers), int(heads), int(dim)


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes of K and V one token takes over all layers of a model with this config."""
    layers, heads, dim = kv_geometry(config)
    return 2 * layers * heads * dim * dtype_bytes


#: the longest row :func:`running_rows` plans for (a model's own limit when it is shorter)
PLANNED_ROW_TOKENS = 2048
MAX_RUNNING_ROWS = 1024


def running_rows(config, dtype_bytes: int, kv_budget_bytes: int, cap: int = MAX_RUNNING_ROWS) -> int:
    """How many requests may decode together: as many rows of the model's longest sequence (at most
    :data:`PLANNED_ROW_TOKENS`) as fit in ``kv_budget_bytes`` of KV, between 16 and ``cap`` (SGLang
    sizes its max running requests from its KV pool the same way)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    row = min(getattr(cfg, "max_position_embeddings", None) or PLANNED_ROW_TOKENS, PLANNED_ROW_TOKENS)
    rows = kv_budget_bytes // max(1, kv_bytes_per_token(config, dtype_bytes) * row)
    return int(min(cap, max(16, rows)))


__all__ = ["ATTENTION", "MAX_RUNNING_ROWS", "PLANNED_ROW_TOKENS", "PrefixCache", "kv_bytes_per_token", "kv_geometry",
           "running_rows", "use_engine_attention"]
