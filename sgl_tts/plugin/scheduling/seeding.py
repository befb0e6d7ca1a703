"""Seeded sampling (``--tts-seeded-sampling``): a request's ``sampling_seed`` decides its samples.

Search programs seed every sample (``sgl_tts.gen(seed=...)`` becomes ``sampling_params.sampling_seed``)
so that a search can be replayed. SGLang 0.5.15 builds the batch's seed tensor only under
``--enable-deterministic-inference``, which its CPU attention backends refuse, and otherwise drops
the seeds silently. With this flag, an AFTER hook on ``SamplingBatchInfo.from_schedule_batch`` fills
the tensor for every batch; SGLang's pytorch sampler then draws each token from
``murmur_hash(seed, position)`` (``multinomial_with_seed``): the same seed gives the same sample alone
or in any batch, across retractions too. A request without a seed gets a random one, drawn once and
kept on the request, so unseeded requests stay independent. Every batch gets the tensor (SGLang's
``merge_batch`` concatenates it only when both sides have one). Greedy requests are unaffected.

SGLang computes that hash with a Triton kernel, which has no CPU driver; for CPU tensors an AROUND
hook on ``multinomial_with_seed`` computes the same MurmurHash3 (x86_32 of the 16-byte key seed,
position, token id; seed 0) with torch integer ops, then SGLang's own Gumbel-max draw: the same
tokens the GPU kernel would pick for the same probabilities.
"""

from __future__ import annotations

import random
from typing import Any

ENABLED = False          # set in each scheduler process from its settings (plugin ``_scheduler_init``)
_SEED_ATTR = "sgl_tts_seed"
_rng = random.SystemRandom()


def seed_of(req: Any) -> int:
    """The request's own seed, else a random one drawn once for it."""
    seed = getattr(req.sampling_params, "sampling_seed", None)
    if seed is None:
        seed = getattr(req, _SEED_ATTR, None)
        if seed is None:
            seed = _rng.getrandbits(62)
            setattr(req, _SEED_ATTR, seed)
    return int(seed)


def seeded_batch_info(result, cls, batch, *args, **kwargs):
    """AFTER hook on ``SamplingBatchInfo.from_schedule_batch``."""
    if not ENABLED or result is None or result.sampling_seed is not None:
        return result
    import torch

    result.sampling_seed = torch.tensor([seed_of(r) for r in batch.reqs], dtype=torch.int64,
                                        device=batch.device)
    return result


_M32 = 0xFFFFFFFF


def _murmur_mix(h, k):
    """One MurmurHash3 x86_32 block step on int64 tensors holding uint32 values (products wrap in
    int64 but their low 32 bits, all that is kept, are exact)."""
    k = (k * 0xCC9E2D51) & _M32
    k = ((k << 15) | (k >> 17)) & _M32
    k = (k * 0x1B873593) & _M32
    h = h ^ k
    h = ((h << 13) | (h >> 19)) & _M32
    return (h * 5 + 0xE6546B64) & _M32


def murmur_hash32_torch(seed, positions, col_indices):
    """``sglang.srt.layers.utils.hash.murmur_hash32`` without Triton: an (n, m) int64 tensor of the
    32-bit hashes of (seed[i] low word, seed[i] high word, positions[i], col_indices[j])."""
    import torch

    seed = seed.to(torch.int64).view(-1, 1)
    lo, hi = seed & _M32, (seed >> 32) & _M32
    pos = positions.to(torch.int64).view(-1, 1) & _M32
    col = col_indices.to(torch.int64).view(1, -1) & _M32
    h = torch.zeros_like(lo)
    for k in (lo, hi, pos):
        h = _murmur_mix(h, k)
    h = _murmur_mix(h, col)
    h = h ^ 16   # the key's length in bytes
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def multinomial_with_seed(original, logprobs, seed, positions, *args, **kwargs):
    """AROUND hook on ``sglang.srt.layers.sampler.multinomial_with_seed``: CPU tensors take the
    torch hash (SGLang's own Gumbel-max draw otherwise unchanged); other devices SGLang's kernel."""
    if logprobs.device.type != "cpu":
        return original(logprobs, seed, positions, *args, **kwargs)
    import torch

    hashed = murmur_hash32_torch(seed, positions, torch.arange(logprobs.shape[1]))
    x = hashed.to(torch.float64) / torch.iinfo(torch.uint32).max
    x.log_().clamp_(min=torch.finfo(x.dtype).min).neg_()   # -log(x)
    x.log_().neg_()                                         # Gumbel noise -log(-log(x))
    x.add_(logprobs.to(torch.float64))
    return torch.argmax(x, dim=1, keepdim=True)


__all__ = ["ENABLED", "multinomial_with_seed", "murmur_hash32_torch", "seed_of", "seeded_batch_info"]
