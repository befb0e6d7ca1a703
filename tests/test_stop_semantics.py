"""Stop handling equals SGLang 0.5.15's server, checked against SGLang's own code.

SGLang's ``Req.update_finish_state`` decides when a request ends; its detokenizer's
``trim_matched_stop`` shapes the returned text. Both run here on CPU on random token streams, next to
sgl-tts' ``finish_reason``/``output_text``, and must agree on the step, the reason and the text.
"""

from __future__ import annotations

import itertools
import random
import types

import pytest
from sglang.srt.managers.detokenizer_manager import DetokenizerManager
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.hf_transformers_utils import get_tokenizer
from transformers import AutoTokenizer

from sgl_tts.backends.engine import SamplingSpec, finish_reason, output_text, stop_window

EOS = 256  # <|endoftext|> of the tiny tokenizer


@pytest.fixture(scope="module")
def tokenizers(tiny_model_path):
    return get_tokenizer(str(tiny_model_path)), AutoTokenizer.from_pretrained(tiny_model_path)


def sglang_run(tok, ids, max_new, stop, stop_ids, ignore_eos, no_stop_trim):
    sp = SamplingParams(max_new_tokens=max_new, stop=list(stop) or None,
                        stop_token_ids=list(stop_ids) or None, ignore_eos=ignore_eos,
                        no_stop_trim=no_stop_trim)
    sp.normalize(tok)
    req = Req("r", "", [1, 2, 3], sp, eos_token_ids={EOS}, vocab_size=len(tok))
    req.tokenizer = tok
    for step, t in enumerate(ids):
        req.output_ids.append(t)
        req.update_finish_state()
        if req.finished():
            reason = req.finished_reason.to_json()
            detok = types.SimpleNamespace(is_tool_call_parser_gpt_oss=False)
            out_ids = DetokenizerManager.trim_matched_stop(
                detok, list(req.output_ids_through_stop), reason, no_stop_trim)
            text = tok.decode(out_ids, skip_special_tokens=True)
            text = DetokenizerManager.trim_matched_stop(detok, text, reason, no_stop_trim)
            return step, reason, text
    return None, None, None


def ours_run(tok, ids, max_new, stop, stop_ids, ignore_eos, no_stop_trim):
    spec = SamplingSpec(max_new_tokens=max_new, stop=tuple(stop), stop_token_ids=frozenset(stop_ids),
                        ignore_eos=ignore_eos, no_stop_trim=no_stop_trim)
    window = stop_window(stop, tok) if stop else 0
    out = []
    for step, t in enumerate(ids):
        out.append(t)
        reason = finish_reason(out, spec, tok, frozenset({EOS}), window)
        if reason is not None:
            return step, reason, output_text(out, reason, spec, tok)
    return None, None, None


def test_tokenizers_agree(tokenizers):
    sgl_tok, hf_tok = tokenizers
    for text in ["Step 1: 3+4=7\n\nStep 2: 7*5=35", "a b\n\n<|im_end|>x", "héllo"]:
        assert sgl_tok.encode(text) == hf_tok.encode(text)


STOP_SETS = [(), ("\n\n",), ("ab", "b\n"), ("x y",), ("<|im_end|>",), ("a",),
             ("ax",), ("<|endoftext|>",)]  # the last two can complete on a stop/EOS token


@pytest.mark.parametrize("stop", STOP_SETS, ids=lambda s: repr(s))
def test_random_streams_match_sglang(tokenizers, stop):
    sgl_tok, hf_tok = tokenizers
    alphabet = [hf_tok.convert_tokens_to_ids(c) for c in ["a", "b", "x", "y", "Ġ", "Ċ"]]
    alphabet += [EOS, 258]  # <|endoftext|>, <|im_end|>
    x_id = alphabet[2]
    rng = random.Random(f"stops-{stop}")
    checked = finished = 0
    for stop_ids, ignore_eos, no_stop_trim in itertools.product([(), (x_id,)], [False, True],
                                                                 [False, True]):
        for _ in range(60):
            ids = [rng.choice(alphabet) for _ in range(rng.randint(1, 14))]
            max_new = rng.randint(1, 12)
            args = (ids, max_new, stop, stop_ids, ignore_eos, no_stop_trim)
            expected = sglang_run(sgl_tok, *args)
            assert ours_run(hf_tok, *args) == expected, args
            checked += 1
            finished += expected[0] is not None
    assert checked == 480 and finished > 300  # most streams end inside the window


def test_stop_string_spanning_tokens_is_cut_at_first_occurrence(tokenizers):
    _, tok = tokenizers
    ids = tok.encode("ab\n") + tok.encode("\ncd")
    step, reason, text = ours_run(tok, ids, 50, ("\n\n",), (), False, False)
    assert (step, reason, text) == (3, {"type": "stop", "matched": "\n\n"}, "ab")
    assert ours_run(tok, ids, 50, ("\n\n",), (), False, True)[2] == "ab\n\n"


def test_length_finish_keeps_a_stop_string_in_the_last_token(tokenizers):
    _, tok = tokenizers
    ids = tok.encode("ab\n\n")
    # SGLang checks the length limit first: a stop string completed by the last allowed token stays.
    assert ours_run(tok, ids, 4, ("\n\n",), (), False, False) == (
        3, {"type": "length", "length": 4}, "ab\n\n")


def test_the_scripted_double_finishes_as_sglang_does(tokenizers):
    """``sgl_tts.testing.continuation`` (what ScriptedBackend answers) against SGLang's own
    ``Req.update_finish_state`` and detokenizer trimming, one character per token (the tiny tokenizer
    has a token for each of these characters) and the end-of-sequence token after the text: the same
    text, finish reason and token count, the token limit checked before stop strings and EOS."""
    from sgl_tts.testing import continuation

    sgl_tok, hf_tok = tokenizers
    chars = {c: hf_tok.convert_tokens_to_ids(t) for c, t in [("a", "a"), ("b", "b"), (" ", "Ġ"), ("\n", "Ċ")]}
    rng = random.Random("scripted-double")
    kinds = set()
    for _ in range(400):
        full = "".join(rng.choice("ab \n") for _ in range(rng.randint(0, 9)))
        stop = rng.choice([(), ("\n\n",), ("ab", "b\n"), ("a",)])
        limit = rng.randint(1, 11)
        step, reason, text = sglang_run(sgl_tok, [chars[c] for c in full] + [EOS], limit, stop, (), False, False)
        ours = continuation(full, stop, limit, eos_token_id=EOS)
        assert ours == (text, reason, step + 1), (full, stop, limit)
        kinds.add((reason["type"], isinstance(reason.get("matched"), int)))
        if reason["type"] == "length" and any(full[:limit].endswith(s) for s in stop):
            kinds.add("stop string on the last allowed token")
    assert kinds == {("length", False), ("stop", False), ("stop", True), "stop string on the last allowed token"}
