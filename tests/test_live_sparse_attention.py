"""``--tts-sparse-attention async`` (seed 003) in a live SGLang CPU server: the sparse backend is in
place of torch_native, finds the generator's rotary embedding, serves the tiny generator, and its
rows attend to about half their context with selections made beside the steps; the counters file
says so, and the answers are mostly the dense server's."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from live_http import post_all
from sgl_tts.tiny import task

pytestmark = [pytest.mark.server, pytest.mark.live_servers("extra")]


@pytest.fixture(scope="module")
def sparse(live):
    live.warm("generator_sparse", "generator")   # the two this module asks for start at once
    yield live
    live.stop("generator_sparse")   # one more CPU server: free its memory


def _greedy(url: str, texts: list[str]) -> list[str]:
    body = {"text": texts, "sampling_params": {"max_new_tokens": 96, "temperature": 0.0}}
    return [r["text"] for r in asyncio.run(post_all(url, [body]))[0]]


def test_the_sparse_backend_serves_the_generator_from_asynchronous_selections(sparse):
    url = sparse.url("generator_sparse")
    log = sparse.log_text("generator_sparse")
    assert "sparse decode attention" in log and "predicting in the rotary frame" in log
    # the SGLang internals the backend overrides were checked (the cache rank's pool ones too, or no start)
    assert ("sgl-tts: SGLang internals in place for --tts-cpu-attention ragged (or --tts-sparse-attention, "
            "built on it), --tts-sparse-attention\n") in log
    questions = [p.question + "\n\n" for p in task.test_split()[:16]]
    # the session's main generator (dense torch_native attention; the one most likely running already)
    got, dense = _greedy(url, questions), _greedy(sparse.url("generator"), questions)
    assert all(t.startswith("Step 1:") for t in got)
    # a half budget chosen one step ahead keeps most answers exactly (41 of 64 here on 2026-11-28;
    # selections broken in any way keep none: the prediction's frame wrong, or a row's tokens mixed up)
    assert sum(a == b for a, b in zip(got, dense)) >= 4
    time.sleep(0.5)   # the server writes its counters at most every 0.2 s (StatsFile)
    files = sorted(sparse.metrics_prefix("generator_sparse").parent.glob("generator_sparse.metrics.jsonl.sparse.*"))
    c = json.loads(files[-1].read_text())
    assert c["sparse_rows"] > 0 and c["selections"] > 0
    assert 0.45 < c["attended_tokens"] / c["context_tokens"] < 0.65
    # the first two layers attend densely; the others' choices mostly match the current query's
    assert sorted(c["overlap_sum"], key=int) == ["2", "3"]
    assert all(c["overlap_sum"][k] / c["overlap_count"][k] > 0.6 for k in c["overlap_sum"])
