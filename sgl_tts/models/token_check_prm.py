"""A step-tag PRM built from a generator: it checks every written digit against the generator's
own prediction.

On the project's arithmetic task the generator is right greedily and its mistakes are sampling
slips: a digit it did not rank first. So a step is suspect exactly when some solution token so far
is one the generator would not have written. This module turns a Qwen2 generator folder into a
Qwen2 PRM folder (plain ``transformers`` / SGLang loading, Math-Shepherd reading: next-token
``+``/``-`` at each step tag) that computes, at every tag,

    share = mean over the solution tokens so far (step tags excluded) of
            sum over checked tokens t != written of clamp(logit[t] - logit[written], 0, 1)

where ``logit`` is the generator's next-token logit vector at the previous position and the written
token is one of the *checked* tokens (the digits; other tokens count 0). Zero means every checked
token was the generator's first choice (by a margin of 1 logit). The tag's log-odds of ``+`` are
``readout.bias - readout.slope * share``, a two-parameter readout fitted on graded samples
(:func:`fit_readout`, used by ``sgl-tts train-tiny``).

Why built rather than trained by gradient descent: the SGD-trained PRMs on this generator plateaued
at step AUC 0.72-0.86 (docs/TINY_MODELS.md); per-token checking needs the exact identity of the
written token next to the generator's logits of the previous position, which a 4-layer residual
stream no longer holds cleanly. The construction keeps both exactly:

- the hidden size grows by 32 *side* dimensions that the generator's layers neither read nor write
  (zero weights), and the generator's norm weights are scaled by sqrt(H0/H) so its layers compute
  what they computed before (the side dimensions hold at most two values of 1/256 during the
  generator's layers, a relative RMS change below 1e-4);
- the embedding puts a one-hot *code* of the checked tokens and of the step tag in the side
  dimensions;
- layer 0 (new, before the generator's layers): a head whose key is the step-tag code marks every
  position at or after the end of the prompt (the first step tag) -- the *solution flag*;
- the generator's layers;
- layer A: a head fixed on the previous position (rotary phases in its query bias) copies the
  generator's logits of the checked tokens there (values = output-embedding rows, the input norm =
  the generator's final norm); its value bias adds a large constant C to one side dimension, which
  makes every later RMS norm a near-constant scale, so later layers can use thresholds; the MLP
  computes the clamped margins above, one pair of SiLU units per (t, written) pair;
- layer B: a head whose key is 0 on flagged, non-tag positions and very negative elsewhere averages
  the per-token values over the solution so far: the share;
- the final norm and an untied output head read ``+``/``-`` from the share and the constant (every
  other token gets a fixed low logit).

Scales are powers of two where they must cancel exactly (bf16 weights keep them exact).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Sequence

import torch

CHECKED_DIGITS: tuple[str, ...] = tuple("0123456789")
SIDE_DIMS = 32
CONFIG_KEY = "sgl_tts_token_check_prm"

_CODE_SCALE = 2.0 ** -8      # value of a code / flag entry in the side dimensions
_CONST = 2.0 ** 16           # the constant added after the generator's layers
_NORM_UNIT = 2.0 ** -4       # norm weight of the constant dimension (all other scales follow)
_POS_GAIN = 320.0            # previous-position head: query amplitude per rotary frequency
_POS_FREQS = 6               # fastest rotary frequencies used to aim that head
_KEY_GAIN = 30.0             # score gap of the flag and averaging heads
_MARGIN_GAIN = 64.0          # SiLU slope of the clamped margins (per logit)
_MARGIN_WIDTH = 1.0          # margin (in logits) at which a competitor counts fully
_GATE = 4096.0               # gate offset that silences pairs whose written token differs
# (_GATE and _GATE + _MARGIN_GAIN * _MARGIN_WIDTH are exact in bf16; a rounded sum moved the clamp)
_OTHER_LOGIT = -30.0         # output logit of every token except the two labels


@dataclasses.dataclass(frozen=True)
class Readout:
    """Log-odds of the good label at a tag: ``bias - slope * share``."""

    bias: float = 0.0
    slope: float = 1.0


def _layout(h0: int, k: int) -> dict[str, list[int] | int]:
    side = iter(range(h0, h0 + SIDE_DIMS))
    lay = {"code": [next(side) for _ in range(k)], "tag_code": next(side), "flag": next(side),
           "logits": [next(side) for _ in range(k)], "const": next(side), "check": next(side),
           "share": next(side)}
    return lay


def _single_token(tok, text: str, what: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the {what} {text!r} must be a single token of the generator's tokenizer, "
                         f"got {len(ids)} tokens")
    return ids[0]


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What every construction stage needs: the generator's width ``h0`` and the PRM's ``h``, head dim
    ``d``, generator layers ``n``, checked tokens (``k`` of them, ids ``ids``), the side dimensions'
    layout, one norm unit ``u`` and the slowest rotary frequency's index ``slow``."""

    h0: int
    h: int
    d: int
    n: int
    ids: list[int]
    lay: dict
    u: float
    slow: int

    @property
    def k(self) -> int:
        return len(self.ids)


def build_token_check_prm(generator: str | Path, out: str | Path, *, readout: Readout = Readout(),
                          checked: Sequence[str] = CHECKED_DIGITS, tag: str = "\n\n",
                          good: str = "+", bad: str = "-") -> Path:
    """Write the token-check PRM for the Qwen2 generator folder ``generator`` into ``out`` (bf16
    safetensors, untied output head, the generator's tokenizer). See the module docstring."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    gen = AutoModelForCausalLM.from_pretrained(generator, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(generator)
    gc = gen.config
    theta = _check_generator(gc, checked)
    ids = [_single_token(tok, t, "checked token") for t in checked]
    tag_id = _single_token(tok, tag, "step tag")
    good_id, bad_id = _single_token(tok, good, "good label"), _single_token(tok, bad, "bad label")
    h0, n = gc.hidden_size, gc.num_hidden_layers
    h = h0 + SIDE_DIMS
    d = gc.head_dim or gc.hidden_size // gc.num_attention_heads
    # u: what a norm after the constant makes of one unit (not a power of 2); slow: the slowest
    # rotary frequency, whose rotation stays < 0.07 rad over 512 positions
    shape = _Shape(h0, h, d, n, ids, _layout(h0, len(ids)), math.sqrt(h) * _NORM_UNIT, d // 2 - 1)
    cfg = Qwen2Config(**{**gc.to_dict(), "hidden_size": h, "num_hidden_layers": n + 3,
                         "tie_word_embeddings": False, "layer_types": ["full_attention"] * (n + 3)})
    cfg.architectures = ["Qwen2ForCausalLM"]
    setattr(cfg, CONFIG_KEY, {"generator_layers": [1, n], "checked": list(checked), "tag": tag,
                              "good": good, "bad": bad, "readout": dataclasses.asdict(readout)})
    src = gen.state_dict()
    sd = {name: torch.zeros_like(v) for name, v in Qwen2ForCausalLM(cfg).state_dict().items()}
    _copy_generator(sd, src, shape, tag_id)
    _tag_flag_layer(sd, src["model.embed_tokens.weight"][tag_id], shape)
    _check_layer(sd, src, gen.get_output_embeddings().weight.detach(), shape, theta)
    _share_layer(sd, shape)
    _readout_head(sd, shape, readout, good_id, bad_id)

    model = Qwen2ForCausalLM(cfg)
    model.load_state_dict(sd)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _check_generator(gc, checked: Sequence[str]) -> float:
    """Refuse a generator the construction cannot take; its rotary base."""
    if gc.model_type != "qwen2":
        raise ValueError(f"the token-check PRM is built from a Qwen2 generator, got {gc.model_type!r}")
    if len(set(checked)) != len(checked) or not checked:
        raise ValueError(f"checked tokens must be distinct and non-empty, got {list(checked)}")
    k = len(checked)
    d = gc.head_dim or gc.hidden_size // gc.num_attention_heads
    if 2 * k + 5 > SIDE_DIMS:
        raise ValueError(f"{k} checked tokens need {2 * k + 5} side dimensions, have {SIDE_DIMS}")
    if 2 * k * (k - 1) > gc.intermediate_size:
        raise ValueError(f"{k} checked tokens need {2 * k * (k - 1)} MLP units, the generator's "
                         f"intermediate size is {gc.intermediate_size}")
    if d < 2 * _POS_FREQS:
        raise ValueError(f"head dim {d} is too small (need {2 * _POS_FREQS})")
    rope = getattr(gc, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"only default rotary embeddings are supported, got {rope.get('rope_type')!r}")
    return float(rope.get("rope_theta", getattr(gc, "rope_theta", 10000.0)))


def _copy_generator(sd: dict, src: dict, sh: _Shape, tag_id: int) -> None:
    """Embeddings (plus the checked tokens' and the tag's codes) and the generator's layers, shifted by
    one, reading and writing only the first h0 dimensions."""
    sd["model.embed_tokens.weight"][:, :sh.h0] = src["model.embed_tokens.weight"]
    for j, t in enumerate(sh.ids):
        sd["model.embed_tokens.weight"][t, sh.lay["code"][j]] = _CODE_SCALE
    sd["model.embed_tokens.weight"][tag_id, sh.lay["tag_code"]] = _CODE_SCALE
    rescale = math.sqrt(sh.h0 / sh.h)
    for i in range(sh.n):
        s, t = f"model.layers.{i}.", f"model.layers.{i + 1}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                     "mlp.up_proj"):
            sd[t + name + ".weight"][:, :sh.h0] = src[s + name + ".weight"]
            if name.startswith("self_attn"):
                sd[t + name + ".bias"][:] = src[s + name + ".bias"]
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            sd[t + name + ".weight"][:sh.h0] = src[s + name + ".weight"]
        for name in ("input_layernorm", "post_attention_layernorm"):
            sd[t + name + ".weight"][:sh.h0] = src[s + name + ".weight"] * rescale


def _tag_flag_layer(sd: dict, tag_embedding: torch.Tensor, sh: _Shape) -> None:
    """Layer 0: flag = "a step tag occurred at or before this position" (the prompt ends with one)."""
    p, lay, d = "model.layers.0.", sh.lay, sh.d
    sd[p + "input_layernorm.weight"][:] = 1.0
    sd[p + "post_attention_layernorm.weight"][:] = 1.0
    tag_rms = math.sqrt((float((tag_embedding ** 2).sum()) + _CODE_SCALE ** 2) / sh.h)
    tag_norm = _CODE_SCALE / tag_rms  # the tag code after layer 0's input norm
    sd[p + "self_attn.q_proj.bias"][sh.slow] = 1.0
    sd[p + "self_attn.k_proj.weight"][sh.slow, lay["tag_code"]] = math.sqrt(d) * _KEY_GAIN / tag_norm
    sd[p + "self_attn.v_proj.weight"][0, lay["tag_code"]] = 1.0 / tag_norm
    sd[p + "self_attn.o_proj.weight"][lay["flag"], 0] = _CODE_SCALE


def _check_layer(sd: dict, src: dict, unembed: torch.Tensor, sh: _Shape, theta: float) -> None:
    """Layer A: copy the previous position's logits of the checked tokens and add the constant; its
    MLP checks whether the written token's logit was within the margin of the best competitor's."""
    a, d, k, lay, u = f"model.layers.{sh.n + 1}.", sh.d, sh.k, sh.lay, sh.u
    code, logits, const = lay["code"], lay["logits"], lay["const"]
    sd[a + "input_layernorm.weight"][:sh.h0] = src["model.norm.weight"] * math.sqrt(sh.h0 / sh.h)
    freqs = theta ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    for f in range(_POS_FREQS):  # score sum_f A cos((i - j - 1) theta_f): peaks at j = i - 1
        sd[a + "self_attn.q_proj.bias"][f] = _POS_GAIN * math.cos(freqs[f])
        sd[a + "self_attn.q_proj.bias"][f + d // 2] = -_POS_GAIN * math.sin(freqs[f])
        sd[a + "self_attn.k_proj.bias"][f] = 1.0
    for j, t in enumerate(sh.ids):
        sd[a + "self_attn.v_proj.weight"][j, :sh.h0] = unembed[t]
        sd[a + "self_attn.o_proj.weight"][logits[j], j] = 1.0
    sd[a + "self_attn.v_proj.bias"][k] = _CONST
    sd[a + "self_attn.o_proj.weight"][const, k] = 1.0
    # After this norm (RMS ~ C / sqrt(h)): const -> u, logits -> u * logits, code -> u * one-hot,
    # with the same u = sqrt(h) * _NORM_UNIT for all, so thresholds against const are exact.
    w = sd[a + "post_attention_layernorm.weight"]
    w[const], w[logits], w[code] = _NORM_UNIT, _NORM_UNIT * _CONST, _NORM_UNIT * _CONST / _CODE_SCALE
    unit = 0
    for wi in range(k):          # the written token
        for ti in range(k):      # a competitor
            if ti == wi:
                continue
            for offset, sign in ((0.0, 1.0), (-_MARGIN_GAIN * _MARGIN_WIDTH, -1.0)):
                # silu(g (l_t - l_w) + G (written - 1)) - silu(... - g w) ~ g clamp(l_t - l_w, 0, w)
                gate = sd[a + "mlp.gate_proj.weight"][unit]
                gate[logits[ti]] += _MARGIN_GAIN
                gate[logits[wi]] -= _MARGIN_GAIN
                gate[code[wi]] += _GATE
                gate[const] += -_GATE + offset
                sd[a + "mlp.up_proj.weight"][unit, const] = 1.0  # = u after the norm
                down = sign / (_MARGIN_GAIN * _MARGIN_WIDTH * u * u)  # up_proj gave u, the gate u
                sd[a + "mlp.down_proj.weight"][lay["check"], unit] = down
                unit += 1


def _share_layer(sd: dict, sh: _Shape) -> None:
    """Layer B: the share = mean of the per-token check over flagged, non-tag positions."""
    b, lay, d = f"model.layers.{sh.n + 2}.", sh.lay, sh.d
    const = lay["const"]
    w = sd[b + "input_layernorm.weight"]
    w[const], w[lay["check"]] = _NORM_UNIT, _NORM_UNIT * _CONST
    w[lay["flag"]] = w[lay["tag_code"]] = _NORM_UNIT * _CONST / _CODE_SCALE
    sd[b + "post_attention_layernorm.weight"][:] = 1.0
    sd[b + "self_attn.q_proj.bias"][sh.slow] = 1.0
    key = sd[b + "self_attn.k_proj.weight"][sh.slow]
    key[const], key[lay["flag"]], key[lay["tag_code"]] = (-math.sqrt(d) * _KEY_GAIN, math.sqrt(d) * _KEY_GAIN,
                                                          -math.sqrt(d) * _KEY_GAIN)
    sd[b + "self_attn.v_proj.weight"][0, lay["check"]] = 1.0 / sh.u  # the norm scaled the check by u
    sd[b + "self_attn.o_proj.weight"][lay["share"], 0] = 1.0


def _readout_head(sd: dict, sh: _Shape, readout: Readout, good_id: int, bad_id: int) -> None:
    """Output: only the two labels carry information."""
    const, u = sh.lay["const"], sh.u
    w = sd["model.norm.weight"]
    w[const], w[sh.lay["share"]] = _NORM_UNIT, _NORM_UNIT * _CONST
    head = sd["lm_head.weight"]
    head[:, const] = _OTHER_LOGIT / u
    head[good_id, const] = readout.bias / u
    head[bad_id, const] = 0.0
    head[bad_id, sh.lay["share"]] = readout.slope / u


def fit_readout(shares: Sequence[float], labels: Sequence[int], *, l2: float = 1e-3,
                iterations: int = 50) -> Readout:
    """Logistic regression of "correct so far" labels on the share (Newton's method), as a
    :class:`Readout`. Needs both labels present."""
    x = torch.tensor(shares, dtype=torch.float64)
    y = torch.tensor(labels, dtype=torch.float64)
    if len(x) != len(y) or not len(x):
        raise ValueError(f"need as many labels as shares (got {len(x)} and {len(y)}), at least one")
    if y.min() == y.max():
        raise ValueError("need both correct and incorrect steps to fit a readout")
    feats = torch.stack([torch.ones_like(x), -x], dim=1)
    beta = torch.zeros(2, dtype=torch.float64)
    for _ in range(iterations):
        p = torch.sigmoid(feats @ beta)
        grad = feats.T @ (p - y) + l2 * beta
        hess = feats.T @ (feats * (p * (1 - p))[:, None]) + l2 * torch.eye(2, dtype=torch.float64)
        step = torch.linalg.solve(hess, grad)
        beta -= step
        if step.abs().max() < 1e-10:
            break
    return Readout(bias=float(beta[0]), slope=float(beta[1]))


__all__ = ["CHECKED_DIGITS", "CONFIG_KEY", "Readout", "build_token_check_prm", "fit_readout"]
