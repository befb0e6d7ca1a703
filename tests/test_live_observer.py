"""The plugin observe-only (``SGLANG_TTS_OBSERVE_ONLY=1``, what ``sgl-tts bench`` runs its stock sides
with) on a live CPU server: stock scheduling, and the observer's counters on ``/metrics`` as the bench
reads them (:mod:`sgl_tts.bench.server_counters`), checked against what the server itself answered.

One server (the shipped tiny generator, a 1024-token KV pool, ``--enable-metrics``, the observer's
JSONL file too): one start (~30-60 s on 2 busy cores) and a few seconds of requests."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from live_groups import ServerGroups
from sgl_tts.bench.server_counters import BLOCK_TOKENS, delta, parse_counters, recomputed_prompt_tokens

pytestmark = pytest.mark.live_servers("own")   # stops the session's servers (observed)

LIVE_KV_TOKENS = 1024   # the generator's context is 512 tokens; float32 KV: 4096 bytes a token


@pytest.fixture(scope="module")
def observed(tmp_path_factory, live):
    """A real CPU server, the plugin loaded observe-only, with --enable-metrics and the observer's
    JSONL file; the session's idle servers stopped to make room."""
    from sgl_tts.launch.live_servers import OBSERVE_ONLY, LiveServer
    from sgl_tts.models import shipped_model

    spec = LiveServer(str(shipped_model("generator")), policy=OBSERVE_ONLY, metrics=True,
                      kv_bytes=LIVE_KV_TOKENS * 4096, extra=("--enable-metrics",))
    live.stop(*live.running())
    servers = ServerGroups({"observed": {"observed": spec}}, tmp_path_factory.mktemp("live-observer"))
    yield servers   # started on first use, stopped without SGLang's 5 s of crash diagnostics
    servers.stop_all()


def _generate(url: str, text: str, new: int) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as res:
        return json.loads(res.read())["meta_info"]


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=60) as res:
        return res.read().decode()


def _sglang_passes(text: str) -> dict[str, float]:
    """SGLang's own forward passes by mode (``sglang:cuda_graph_passes_total``, counted on the CPU too):
    one per batch the scheduler formed."""
    out = {"prefill": 0.0, "decode": 0.0}
    for line in text.splitlines():
        if line.startswith("sglang:cuda_graph_passes_total{"):
            head, _, value = line.rpartition(" ")
            mode = head.split('mode="', 1)[1].split('"', 1)[0]
            out["prefill" if mode.startswith("prefill") else "decode"] += float(value)
    return out


@pytest.mark.server
@pytest.mark.timeout(300)
def test_observe_only_counts_rounds_and_recomputed_blocks_on_a_stock_server(observed):
    """Three distinct ~420-token prompts, one after another, on a 1024-token pool: the third evicts
    the first, which then comes back. The observer must count what the server answered: the prompt
    tokens it prefilled (prompt - cached, per ``meta_info``), the first prompt's whole 16-token blocks
    past its cached part as recomputed, one prefill round per request and one decode round per new
    token (the overlap scheduler forms one more decode round than a request needs before it sees the
    finish), the same rounds SGLang's own pass counter saw."""
    from sgl_tts.backends import SGLangEndpoint

    url = observed.url("observed")
    assert "sgl-tts: observe-only (SGLANG_TTS_OBSERVE_ONLY=1): stock scheduling" in observed.log_text("observed")
    text0 = _metrics(url)
    before, passes0 = parse_counters(text0), _sglang_passes(text0)
    assert before["prefill_rounds"] >= 1 and before["recomputed_blocks"] == 0   # the start-up's warm-up request
    prompts = [f"Case {k}: " + " ".join(f"{i}+{k}={i + k};" for i in range(10 + k, 70 + k))[:410] for k in range(3)]
    sent = [(p, 1) for p in prompts] + [(prompts[0], 1), ("Count to ten: one two", 6)]
    metas = [_generate(url, text, new) for text, new in sent]
    text1 = _metrics(url)
    got, passes1 = delta(before, parse_counters(text1)), _sglang_passes(text1)

    again = metas[3]
    assert again["prompt_tokens"] == metas[0]["prompt_tokens"] > 400
    if again["cached_tokens"] >= again["prompt_tokens"] // 2:
        pytest.fail(f"the first prompt was not evicted ({metas}): the test saw no thrashing")
    expected_blocks = again["prompt_tokens"] // BLOCK_TOKENS - again["cached_tokens"] // BLOCK_TOKENS
    assert got["recomputed_blocks"] == expected_blocks
    assert recomputed_prompt_tokens(got) == BLOCK_TOKENS * expected_blocks
    assert got["prefill_computed_tokens"] == sum(m["prompt_tokens"] - m["cached_tokens"] for m in metas)
    assert got["evicted_tokens"] > 0
    assert (got["prefill_rounds"], got["decode_rounds"]) == (len(sent), sum(new for _, new in sent))
    assert (got["prefill_rounds"], got["decode_rounds"]) == (passes1["prefill"] - passes0["prefill"],
                                                          passes1["decode"] - passes0["decode"])
    assert 0 < got["prefill_round_seconds"] < 10 and 0 < got["decode_round_seconds"] < 10

    # the JSONL file has the same rounds (the batch records' round timer)
    time.sleep(1.5)   # flushed about every second
    records = observed.metrics_records("observed")
    assert records[0]["event"] == "start" and records[0]["policy"] == "observe-only"
    rounds = [r["round"] for r in records if r["event"] == "batch"]
    assert (rounds.count("prefill"), rounds.count("decode")) == (before["prefill_rounds"] + len(sent),
                                                                 before["decode_rounds"] + got["decode_rounds"])
    # no scheduling hook: the class-change hook is not there, SGLang answers with its bare flag
    with pytest.raises(RuntimeError, match="answered False to tts_set_class: is the sgl-tts plugin loaded there"):
        SGLangEndpoint(url).set_class("g", "boosted")


@pytest.mark.server
@pytest.mark.timeout(300)
def test_a_flushed_cache_makes_the_next_prefill_fresh_not_recomputed(observed):
    """``sgl-tts bench`` runs several sides on one start of the servers and empties their radix caches
    between two sides (SGLang's ``/flush_cache``): the prompt prefilled again after the flush is the
    cold start of a new side, not thrashing. Without the observer's flush hook every block of it would
    count as recomputed (its blocks were seen before)."""
    from sgl_tts.bench.command import flush_caches

    url = observed.url("observed")
    prompt = "Flush: " + " ".join(f"{i}*2={2 * i};" for i in range(40, 100))[:400]
    first = _generate(url, prompt, 1)
    before = parse_counters(_metrics(url))
    flush_caches({"observed": url})
    again = _generate(url, prompt, 1)
    got = delta(before, parse_counters(_metrics(url)))
    assert first["prompt_tokens"] == again["prompt_tokens"] > 100
    assert again["cached_tokens"] == 0   # the flush emptied the radix cache: all of it computed again
    assert got["prefill_computed_tokens"] == again["prompt_tokens"]
    assert got["recomputed_blocks"] == 0
    time.sleep(1.5)   # the JSONL file is flushed about every second
    assert any(r["event"] == "flush" for r in observed.metrics_records("observed"))
