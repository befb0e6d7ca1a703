"""Query-aware sparse decoding (seed 003, AsyncSpade) as plain torch functions.

A decode step attends with one query per row over the row's whole context; here it attends over a
selected subset of that context instead. Everything works per layer on a batch of rows:

- :func:`predict_next_query`: the next step's query from the recent ones (the seed's temporal-regressive
  prediction). For each window size ``w`` in ``windows``, ridge regression expresses the newest query
  as a weighted sum of the ``w`` queries before it; the weights are softmax-normalised and applied to
  the window shifted by one (the ``w`` newest queries), and the candidates of all window sizes are
  averaged (the seed's "assembled regression with average pooling").
- :func:`rotate`: a rotary embedding's rotation (SGLang's ``RotaryEmbedding``, from its own
  ``cos_sin_cache``) and its inverse, so that queries can be predicted in the rotary frame (below).
- :func:`token_scores` and :func:`select_tokens`: token-level top-k under a token budget, by a query's
  attention mass, always keeping the first ``sink`` and the last ``recent`` positions.
- :func:`page_scores` and :func:`select_pages`: Quest's page-level selection (pages of 16 tokens, the
  upper bound ``sum_d max(q_d min_d, q_d max_d)`` of a page's dot products), the seed's baseline.
- :func:`sparse_attention`: the attention of each row's query over its selected tokens.
- :func:`overlap_ratio`: the seed's Eq. 1, how much two selections of equal size agree.

Choices where the seed's text leaves them open (each is a setting or documented here):

- **Regression per KV head.** A KV head's group of query heads is one feature vector (the group's
  heads concatenated), so one set of weights per row, layer and KV head; with one query head per KV
  head this is per head.
- **The ridge term is relative**: ``ridge * trace(X X^T) / w`` for the window ``X`` (``w`` queries),
  so one setting fits every layer and model whatever the queries' scale. It also keeps the ``w x w``
  system solvable when the window's queries are linearly dependent.
- **Too little history**: window sizes needing more than the available queries are skipped; with
  none left (fewer than two queries), the prediction is the newest query itself.
- **Attention mass for a KV head** is the sum over its query heads of each head's softmax attention
  weight on the token, so top-k keeps the tokens that carry the most of the group's attention.
- **Always kept**: the first ``sink`` positions (attention sinks) and the last ``recent`` ones, which
  include the tokens written after an asynchronous selection was made. They count in the budget.
- **Quest with grouped heads**: a page's bound for a KV head is the largest of its query heads'
  bounds (a page any head of the group may need is kept).
- **The rotary frame (our addition, ``--tts-sparse-frame rotary``, the default).** Queries reach
  attention rotated by their position, so a head that looks a fixed distance back has a query that
  turns a little every step; a softmax-weighted mean of the recent rotated queries is a convex
  combination, it cannot turn ahead, and its choice lags one position behind (on the tiny generator,
  whose heads copy digits at fixed offsets, that lag missed the token each step needed and every
  answer went wrong). So the recent queries are un-rotated to position 0, regressed and combined
  there, and the prediction is rotated to the next position. ``query`` is the seed's literal
  reading (regression on the rotated queries); models without a known rotary embedding use it.
- **Ties** go to the earlier position (a stable sort), so a selection is reproducible.

torch is imported inside the functions: importing the plugin package loads no torch (the launcher
process needs none; ``tests/test_layering.py``).

Shapes: ``rows`` sequences, ``heads`` query heads, ``kv_heads`` KV heads, ``dim`` head dimension,
``n`` positions (the longest context; shorter rows are masked by ``lengths``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Sequence

if TYPE_CHECKING:
    import torch

#: Quest's page size in the seed's comparison.
QUEST_PAGE = 16


class Rotary(NamedTuple):
    """A rotary embedding as SGLang's ``RotaryEmbedding`` applies it: ``cos_sin`` ``[positions,
    rotary_dim]`` (cosines, then sines, of each position's angles; its ``cos_sin_cache``), the leading
    ``rotary_dim`` dimensions of a head rotated, in halves (``neox``) or in interleaved pairs."""

    cos_sin: torch.Tensor
    rotary_dim: int
    neox: bool


def rotate(x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, *, inverse: bool = False) -> torch.Tensor:
    """``x`` ``[rows, heads, dim]`` rotated to ``positions`` ``[rows]`` (``inverse``: rotated back from
    them to position 0), as SGLang's ``RotaryEmbedding.forward_native`` rotates queries."""
    import torch

    rd = rotary.rotary_dim
    cos, sin = rotary.cos_sin.index_select(0, positions).to(x.dtype).chunk(2, dim=-1)    # [rows, rd/2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if inverse:
        sin = -sin
    part = x[..., :rd]
    if rotary.neox:
        x1, x2 = part.chunk(2, dim=-1)
        turned = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        turned = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((turned, x[..., rd:]), dim=-1)


def ridge_weights(window: torch.Tensor, target: torch.Tensor, ridge: float) -> torch.Tensor:
    """Softmax-normalised ridge weights expressing ``target`` by the rows of ``window``.

    ``window`` ``[..., w, f]`` (oldest first) and ``target`` ``[..., f]``: solves
    ``(X X^T + lam I) a = X y`` with ``lam = ridge * trace(X X^T) / w`` and returns ``softmax(a)``
    ``[..., w]``."""
    import torch

    x = window.double()
    gram = x @ x.transpose(-1, -2)                                    # [..., w, w]
    w = gram.shape[-1]
    lam = ridge * gram.diagonal(dim1=-2, dim2=-1).sum(-1) / w          # [...]
    lam = torch.where(lam > 0, lam, torch.ones_like(lam))              # an all-zero window: any weights
    system = gram + lam[..., None, None] * torch.eye(w, dtype=x.dtype, device=x.device)
    rhs = (x @ target.double()[..., :, None])                          # [..., w, 1]
    a = torch.linalg.solve(system, rhs).squeeze(-1)
    return torch.softmax(a, dim=-1).to(window.dtype)


def predict_next_query(history: torch.Tensor, windows: Sequence[int], ridge: float,
                       available: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The next query from ``history`` ``[rows, kv_heads, h, f]`` (the last ``h`` queries, oldest
    first, a KV head's query heads concatenated into ``f``).

    For each ``w`` in ``windows`` with ``w + 1 <= available``: weights from :func:`ridge_weights` of
    the ``w`` queries before the newest against the newest, applied to the ``w`` newest; the mean of
    these candidates. ``available`` ``[rows]``: how many of the ``h`` slots hold real queries (the
    newest ``available``; default all); a row with no usable window predicts its newest query."""
    import torch

    rows, kv_heads, h, f = history.shape
    if available is None:
        available = torch.full((rows,), h, dtype=torch.long, device=history.device)
    total = torch.zeros(rows, kv_heads, f, dtype=history.dtype, device=history.device)
    count = torch.zeros(rows, dtype=history.dtype, device=history.device)
    for w in sorted(set(int(x) for x in windows)):
        if w < 1 or w + 1 > h:
            continue
        use = available >= w + 1
        if not bool(use.any()):
            continue
        sel = use.nonzero().squeeze(1)
        past = history[sel, :, h - w - 1:h - 1]                        # [r, kv, w, f]
        newest = history[sel, :, h - 1]                                 # [r, kv, f]
        a = ridge_weights(past, newest, ridge)                          # [r, kv, w]
        shifted = history[sel, :, h - w:h]                              # [r, kv, w, f]
        total[sel] += (a[..., None] * shifted).sum(-2)
        count[sel] += 1
    out = history[:, :, h - 1].clone()
    has = count > 0
    out[has] = total[has] / count[has][:, None, None]
    return out


def _valid(lengths: torch.Tensor, n: int) -> torch.Tensor:
    import torch

    return torch.arange(n, device=lengths.device)[None, :] < lengths[:, None]    # [rows, n]


def token_scores(query: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor,
                 scale: Optional[float] = None) -> torch.Tensor:
    """Each position's attention mass for each KV head: ``[rows, kv_heads, n]``.

    ``query`` ``[rows, heads, dim]``, ``keys`` ``[rows, kv_heads, n, dim]``: per query head, the
    softmax over the row's first ``lengths`` positions of ``scale * q . k`` (default scale
    ``dim ** -0.5``), summed over the heads of each KV head's group; 0 past a row's length."""
    import torch

    rows, heads, dim = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    rep = heads // kv_heads
    scale = dim ** -0.5 if scale is None else scale
    q = query.reshape(rows, kv_heads, rep, dim)
    logits = (q @ keys.transpose(-1, -2)) * scale                      # [rows, kv, rep, n]
    valid = _valid(lengths, n)[:, None, None, :]
    logits = logits.masked_fill(~valid, float("-inf"))
    return torch.softmax(logits, dim=-1).sum(2)


def budgets(lengths: torch.Tensor, budget: float, *, sink: int, recent: int) -> torch.Tensor:
    """Tokens each row keeps: ``budget`` tokens (an int >= 1) or that fraction of the row's context
    (a float in (0, 1), rounded up), at least ``sink + recent`` and at most the context."""
    import torch

    if isinstance(budget, float) and 0 < budget < 1:
        want = torch.ceil(lengths.double() * budget).long()
    else:
        want = torch.full_like(lengths, int(budget))
    return torch.minimum(torch.clamp(want, min=sink + recent), lengths)


class Selection(NamedTuple):
    """Selected positions per row and KV head, ``[rows, kv_heads, k]`` (ascending, padded at the end)
    and which of them are real (``mask``, same shape)."""

    positions: torch.Tensor
    mask: torch.Tensor


def always_kept(lengths: torch.Tensor, n: int, sink: int, recent: int) -> torch.Tensor:
    """``[rows, n]``: the positions every selection keeps, the first ``sink`` and the last ``recent``
    of each row's ``lengths`` (none past a row's length)."""
    import torch

    pos = torch.arange(n, device=lengths.device)[None, :]
    return ((pos < sink) | (pos >= lengths[:, None] - recent)) & (pos < lengths[:, None])


def select_tokens(scores: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor, *, sink: int,
                  recent: int) -> Selection:
    """Per row and KV head, ``keep[row]`` positions: the first ``sink`` and last ``recent``
    positions, then the highest ``scores`` (``[rows, kv_heads, n]``) among the others (ties to the
    earlier position); every position when ``keep`` covers the context.

    No sort of the context: a selection (``kthvalue``, 2-3x cheaper than a top-k of half the context
    here) finds each row's ``keep``-th value, every position above it is kept and the earliest of those
    equal to it fill the rest (what a stable sort would keep)."""
    import torch

    rows, kv_heads, n = scores.shape
    valid = _valid(lengths, n)[:, None, :]
    forced = always_kept(lengths, n, sink, recent)[:, None, :]
    # half-precision scores are widened (exactly); float32 and float64 are ranked as they are
    rank = scores if scores.dtype in (torch.float32, torch.float64) else scores.float()
    rank = rank.masked_fill(forced, float("inf")).masked_fill(~valid, float("-inf"))
    if rows == 0 or int(keep.max()) == 0:
        empty = torch.zeros(rows, kv_heads, 0, dtype=torch.long, device=scores.device)
        return Selection(empty, empty.bool())
    # each row's keep-th largest value: the (n - keep + 1)-th smallest, a selection, not a sort (the
    # -inf past a row's length are the smallest); rows of one budget at once
    threshold = torch.empty(rows, kv_heads, 1, dtype=rank.dtype, device=rank.device)
    for want in keep.unique().tolist():
        at = (keep == want).nonzero().squeeze(1)
        if want > 0:
            threshold[at] = torch.kthvalue(rank[at], n - want + 1, dim=-1, keepdim=True).values
        else:
            threshold[at] = float("inf")
    above = rank > threshold
    equal = rank == threshold
    need = keep[:, None, None] - above.sum(-1, keepdim=True)
    chosen = above | (equal & (torch.cumsum(equal, -1) <= need))
    return selection_from_mask(chosen)


def page_scores(query: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor,
                page: int = QUEST_PAGE) -> torch.Tensor:
    """Quest's upper bound of each page's dot products, per KV head: ``[rows, kv_heads, pages]``.

    A page is ``page`` consecutive positions; its elementwise min and max key (over its positions
    within the row's length) bound ``q . k`` by ``sum_d max(q_d min_d, q_d max_d)``; the bound of a KV
    head is the largest of its query heads'. Pages past a row's length score ``-inf``."""
    import torch

    rows, heads, dim = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    rep = heads // kv_heads
    pages = -(-n // page)
    padded = keys.new_zeros(rows, kv_heads, pages * page, dim)
    padded[:, :, :n] = keys
    valid = _valid(lengths, pages * page)[:, None, :, None]
    big = torch.finfo(keys.dtype).max
    low = padded.masked_fill(~valid, big).view(rows, kv_heads, pages, page, dim).amin(3)
    high = padded.masked_fill(~valid, -big).view(rows, kv_heads, pages, page, dim).amax(3)
    q = query.reshape(rows, kv_heads, rep, 1, dim)
    bound = torch.maximum(q * low[:, :, None], q * high[:, :, None]).sum(-1)    # [rows, kv, rep, pages]
    bound = bound.amax(2)
    used = torch.arange(pages, device=lengths.device)[None, :] * page < lengths[:, None]
    return bound.masked_fill(~used[:, None, :], float("-inf"))


def select_pages(bounds: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor, *, sink: int, recent: int,
                 page: int = QUEST_PAGE) -> Selection:
    """Quest's selection as positions: whole pages by ``bounds`` (``[rows, kv_heads, pages]``, from
    :func:`page_scores`), the pages holding the first ``sink`` and last ``recent`` positions first,
    then the highest bounds, as many pages as ``keep[row] // page`` (at least those forced); every
    position when ``keep`` covers the context."""
    import torch

    rows, kv_heads, pages = bounds.shape
    n = pages * page
    pos = torch.arange(n, device=lengths.device)
    forced = always_kept(lengths, n, sink, recent).view(rows, pages, page).any(-1)                          # [rows, pages]
    used = pos[::page][None, :] < lengths[:, None]
    rank = bounds.double().masked_fill(forced[:, None, :], float("inf")).masked_fill(~used[:, None, :],
                                                                                     float("-inf"))
    order = torch.sort(rank, dim=-1, descending=True, stable=True).indices
    want = torch.maximum(keep // page, forced.sum(-1))
    whole = keep >= lengths
    want = torch.where(whole, used.sum(-1), want)
    k = int(want.max()) if rows else 0
    chosen = order[..., :k]                                                       # [rows, kv, k pages]
    take = torch.arange(k, device=bounds.device)[None, None, :] < want[:, None, None]
    key = torch.where(take, chosen, torch.full_like(chosen, pages))
    chosen = torch.sort(key, dim=-1).values                                       # ascending pages
    page_ok = chosen < pages
    positions = chosen[..., None] * page + torch.arange(page, device=bounds.device)
    mask = page_ok[..., None] & (positions < lengths[:, None, None, None])
    positions = positions.flatten(2)
    mask = mask.flatten(2)
    return Selection(torch.where(mask, positions, torch.zeros_like(positions)), mask)


def gather_heads(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """An SGLang KV pool ``[pool tokens, kv_heads, dim]`` at slots ``index`` ``[rows, n]``, laid out
    ``[rows, kv_heads, n, dim]`` by the gather itself: one head's keys contiguous, as the scores' matrix
    product wants them (gathering ``[rows, n, kv_heads, dim]`` and transposing copied the whole context
    a second time, strided: 60 ms of a 16k x 8-row job here)."""
    kv_heads = cache.shape[1]
    return gather_selected_pool(cache, index[:, None, :].expand(-1, kv_heads, -1))


def gather_selected_pool(cache: torch.Tensor, pool_index: torch.Tensor) -> torch.Tensor:
    """An SGLang KV pool ``[pool tokens, kv_heads, dim]`` read at per-head slots ``pool_index``
    ``[rows, kv_heads, k]``: ``[rows, kv_heads, k, dim]`` (KV head ``h`` of slot ``pool_index[r, h, j]``)."""
    picked = cache.reshape(-1, cache.shape[-1]).index_select(0, flat_rows(pool_index).reshape(-1))
    return picked.view(*pool_index.shape, cache.shape[-1])


def flat_rows(pool_index: torch.Tensor) -> torch.Tensor:
    """Per-head pool slots ``[rows, kv_heads, k]`` as rows of the pool viewed ``[tokens * kv_heads, dim]``
    (``slot * kv_heads + head``), same shape."""
    import torch

    kv_heads = pool_index.shape[1]
    return pool_index * kv_heads + torch.arange(kv_heads, device=pool_index.device)[None, :, None]


def gather_flat_kv(k_cache: torch.Tensor, v_cache: torch.Tensor,
                   index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's key and value pools ``[pool tokens, kv_heads, dim]`` read at flat pool rows ``index``
    ``[rows, kv_heads, k]`` (:func:`flat_rows`; int32 or int64): ``[rows, kv_heads, k, dim]`` each."""
    flat = index.reshape(-1)
    keys = k_cache.reshape(-1, k_cache.shape[-1]).index_select(0, flat)
    values = v_cache.reshape(-1, v_cache.shape[-1]).index_select(0, flat)
    return keys.view(*index.shape, -1), values.view(*index.shape, -1)


def selection_from_mask(chosen: torch.Tensor) -> Selection:
    """The positions where ``chosen`` ``[rows, kv_heads, n]`` is true, ascending, as a :class:`Selection`
    (compacted by a running count, not sorted)."""
    import torch

    rows, kv_heads, n = chosen.shape
    counts = chosen.sum(-1)
    k = int(counts.max()) if chosen.numel() else 0
    slot = torch.where(chosen, torch.cumsum(chosen, -1) - 1, torch.full_like(chosen, k, dtype=torch.long))
    positions = torch.zeros(rows, kv_heads, k + 1, dtype=torch.long, device=chosen.device)
    positions.scatter_(-1, slot, torch.arange(n, device=chosen.device).expand(rows, kv_heads, n))
    positions = positions[..., :k]
    mask = torch.arange(k, device=chosen.device)[None, None, :] < counts[..., None]
    return Selection(torch.where(mask, positions, torch.zeros_like(positions)), mask)


def sparse_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Optional[torch.Tensor],
                     scale: Optional[float] = None) -> torch.Tensor:
    """Attention of ``query`` ``[rows, heads, dim]`` over selected ``keys``/``values``
    ``[rows, kv_heads, k, dim]`` where ``mask`` ``[rows, kv_heads, k]`` is true (``None``: all of them):
    ``[rows, heads, dim]``. Query head ``h`` reads KV head ``h // (heads // kv_heads)``."""
    import torch

    rows, heads, dim = query.shape
    kv_heads = keys.shape[1]
    rep = heads // kv_heads
    q = query.reshape(rows, kv_heads, rep, dim)
    bias = None
    if mask is not None and not bool(mask.all()):   # rows of different sizes (a mask makes the CPU's kernel ~1.7x slower)
        bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
        bias = bias[:, :, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale)
    return out.reshape(rows, heads, values.shape[-1])


def overlap_ratio(a: Selection, b: Selection) -> torch.Tensor:
    """The seed's Eq. 1 per row and KV head: ``|A & B| / |A|`` for selections of equal size."""
    import torch

    n = int(max(a.positions.max(), b.positions.max())) + 1 if a.positions.numel() else 1
    rows, kv_heads, _ = a.positions.shape
    onehot_a = torch.zeros(rows, kv_heads, n + 1, dtype=torch.bool, device=a.positions.device)
    onehot_b = torch.zeros_like(onehot_a)
    onehot_a.scatter_(2, torch.where(a.mask, a.positions, torch.full_like(a.positions, n)), True)
    onehot_b.scatter_(2, torch.where(b.mask, b.positions, torch.full_like(b.positions, n)), True)
    both = (onehot_a & onehot_b)[..., :n].sum(-1).double()
    return both / a.mask.sum(-1).clamp(min=1).double()


class KeyMirror:
    """The cache rank's own float32 (or float64) copy of each row's keys, per layer, grown by the tokens written
    since its last job (seed 003's cache rank likewise holds its copy of the cache): a job then reads
    a context's keys without gathering the whole context from the pool and widening it to float32,
    1.5 ms of a layer's 3.4 ms at 16k context here. The price is memory: twice the bytes of the
    mirrored rows' bf16 keys.

    A row's copy is rebuilt when its epoch (a new request in the slot) or its pool slots differ from
    what was copied; :meth:`keep_only` drops the rows a job no longer holds."""

    def __init__(self):
        # (layer, slot) -> [epoch, pool slots copied (int32 [capacity]), keys [kv, capacity, dim], filled]
        self._rows: dict[tuple[int, int], list] = {}

    def keys(self, layer: int, slot: int, epoch: int, k_cache: torch.Tensor, index: torch.Tensor,
             length: int) -> torch.Tensor:
        """Row ``slot``'s first ``length`` keys of ``layer`` (pool ``k_cache``, context slots ``index``),
        ``[kv_heads, length, dim]``, half-precision keys widened to float32: what is copied already, then
        the new tokens."""
        import torch

        got = self._rows.get((layer, slot))
        if (got is None or got[0] != epoch or got[3] > length
                or not torch.equal(got[1][:got[3]], index[:got[3]].to(torch.int32))):
            wide = k_cache.dtype if k_cache.dtype in (torch.float32, torch.float64) else torch.float32
            got = [epoch, torch.empty(0, dtype=torch.int32),
                   k_cache.new_empty((k_cache.shape[1], 0, k_cache.shape[2]), dtype=wide), 0]
        _, copied, keys, filled = got
        if keys.shape[1] < length:        # grow by a quarter at least: a row grows a token per step
            cap = max(length, keys.shape[1] * 5 // 4 + 64)
            wider = keys.new_empty((keys.shape[0], cap, keys.shape[2]))
            wider[:, :filled] = keys[:, :filled]
            more = torch.empty(cap, dtype=torch.int32)
            more[:filled] = copied[:filled]
            keys, copied = wider, more
        if filled < length:
            new = index[filled:length].long()
            keys[:, filled:length] = k_cache.index_select(0, new).transpose(0, 1)
            copied[filled:length] = new.to(torch.int32)
        self._rows[(layer, slot)] = [epoch, copied, keys, length]
        return keys[:, :length]

    def source(self, layers: Sequence[int], slots: Sequence[int], epochs: Sequence[int],
               k_caches: Sequence[torch.Tensor], index: torch.Tensor) -> Callable[[int, int, int], torch.Tensor]:
        """:func:`choose_next`'s ``keys_of`` for one job (its layers, rows, pools and context slots); the
        rows of those layers that the job does not hold are forgotten."""
        self.keep_only(layers, slots)
        return lambda i, r, length: self.keys(layers[i], slots[r], epochs[r], k_caches[i], index[r], length)

    def keep_only(self, layers: Sequence[int], slots: Sequence[int]) -> None:
        """Forget the rows of ``layers`` not among ``slots``."""
        held, wanted = set(layers), set(slots)
        for key in [k for k in self._rows if k[0] in held and k[1] not in wanted]:
            del self._rows[key]

    @property
    def tokens(self) -> int:
        """Tokens copied, over every layer and row."""
        return sum(row[3] for row in self._rows.values())


def choose_next(history: torch.Tensor, available: torch.Tensor, lengths: torch.Tensor, index: torch.Tensor,
                k_caches: Sequence[torch.Tensor], scale: Optional[float], *, windows: Sequence[int], ridge: float,
                budget: float, sink: int, recent: int, rotary: Optional["Rotary"] = None,
                keys_of: Optional[Callable[[int, int, int], torch.Tensor]] = None
                ) -> tuple[torch.Tensor, Selection]:
    """The asynchronous choice for the next step of the same rows in several layers (the cache rank's
    job): each row's next query predicted from its recent ones (one regression over every layer),
    its context's attention mass under it (each layer's keys), and the tokens kept under the next
    step's budget (one choice over every layer).

    ``history`` ``[layers, rows, h, heads, dim]`` and ``available`` ``[layers, rows]`` (see
    :func:`predict_next_query`; in the rotary frame when ``rotary`` is given: the prediction is then
    turned to its position, the context's length); ``lengths`` ``[rows]`` the contexts' lengths (the
    next query's position); ``index`` ``[rows, >= max length]`` each context's slots in the pools
    ``k_caches`` (one per layer, ``[slots, kv_heads, dim]``). The next step's context is one longer
    and its newest position is always among the recent ones, so each row keeps its budget at
    ``length + 1`` less one, with one recent token fewer. ``keys_of(layer, row, length)``, if given,
    is where a row's keys come from instead (``[kv_heads, length, dim]``: a :class:`KeyMirror`'s).
    Returns the predicted queries ``[layers, rows, heads, dim]`` and the selection
    ``[layers * rows, kv_heads, k]`` (layer-major)."""
    import torch

    layers, rows, h, heads, dim = history.shape
    kv = k_caches[0].shape[1]
    rep = heads // kv
    grouped = history.reshape(layers * rows, h, kv, rep * dim).transpose(1, 2)       # [L*rows, kv, h, f]
    predicted = predict_next_query(grouped, windows, ridge, available.reshape(-1))
    query = predicted.reshape(layers * rows, kv, rep, dim).reshape(layers, rows, heads, dim)
    if rotary is not None:
        query = rotate(query.reshape(layers * rows, heads, dim), lengths.repeat(layers),
                       rotary).reshape(layers, rows, heads, dim)
    n = int(lengths.max())
    scores = []
    for i, k_cache in enumerate(k_caches):      # one layer's keys at a time: [rows, kv, n, dim]
        if keys_of is not None:                 # row by row: no padded copy of the rows' keys
            layer_scores = query.new_zeros(rows, kv, n)
            for r, length in enumerate(lengths.tolist()):
                keys = keys_of(i, r, length)[None].to(query.dtype)
                layer_scores[r, :, :length] = token_scores(query[i, r:r + 1], keys, lengths[r:r + 1], scale)[0]
            scores.append(layer_scores)
            continue
        keys = gather_heads(k_cache, index[:, :n])
        if keys.dtype != query.dtype:
            keys = keys.to(query.dtype)
        scores.append(token_scores(query[i], keys, lengths, scale))
    every = lengths.repeat(layers)
    keep = budgets(every + 1, budget, sink=sink, recent=recent)
    selection = select_tokens(torch.cat(scores), every, torch.clamp(keep - 1, min=1), sink=sink,
                              recent=max(0, recent - 1))
    return query, selection


def group_cosine(a: torch.Tensor, b: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Cosine similarity of queries ``a`` and ``b`` [rows, heads, dim] per row and KV head, each KV
    head's query heads taken as one vector (the features the prediction regresses on) -> [rows, kv]."""
    import torch

    rows = a.shape[0]
    a, b = a.reshape(rows, kv_heads, -1).double(), b.reshape(rows, kv_heads, -1).double()
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


__all__ = ["KeyMirror", "QUEST_PAGE", "Rotary", "Selection", "always_kept", "rotate", "budgets", "gather_heads",
           "choose_next", "flat_rows", "gather_flat_kv", "gather_selected_pool", "group_cosine",
           "overlap_ratio",
           "page_scores", "predict_next_query", "ridge_weights", "select_pages", "select_tokens",
           "selection_from_mask", "sparse_attention", "token_scores"]
