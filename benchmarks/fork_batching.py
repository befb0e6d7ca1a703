"""Benchmark: 64 forks x 32 new tokens on LocalBackend, batched vs 64 sequential calls.

Both sides run through SGLang's real interpreter on the same LocalBackend and model (a tiny Qwen2 of
the shape the project's tiny generator uses: hidden 256, 4 layers, 4 heads of dim 64, 2 KV heads):

* batched: one program forks 64 branches and generates 32 tokens in each (one seed per branch);
* sequential: 64 programs, one after another, each generating 32 tokens (same seeds).

The sequential side is also measured with the engine's request-gathering window set to 0, so the
window (which helps forks arrive together) cannot inflate the baseline. Each configuration is run
``--repeats`` times after a warm-up; the median is reported. Results go to a JSON file and a
Markdown table that name the machine, the command and the date.

    ./dev.sh run python benchmarks/fork_batching.py --out docs/benchmarks/fork_batching
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sglang as sgl
import torch

import sgl_tts
from sgl_tts.models import TinyModelSpec, build_tiny_model

GENERATOR_SHAPE = TinyModelSpec(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2)
PROMPT = "Problem: compute ((3+4)*5)-6. Solve it step by step.\n\n"


@sgl.function
def forked(s, width, tokens):
    s += PROMPT
    branches = s.fork(width)
    branches += lambda i: sgl_tts.gen("x", max_tokens=tokens, ignore_eos=True, temperature=0.8, seed=i)
    branches.join()


@sgl.function
def single(s, index, tokens):
    s += PROMPT
    s += sgl_tts.gen("x", max_tokens=tokens, ignore_eos=True, temperature=0.8, seed=index)


def time_batched(backend, width, tokens):
    t = time.perf_counter()
    state = forked.run(width=width, tokens=tokens, backend=backend)
    state.sync()
    assert state.error() is None and len(state["x"]) == width
    return time.perf_counter() - t, state["x"]


def time_sequential(backend, width, tokens):
    t = time.perf_counter()
    texts = []
    for i in range(width):
        state = single.run(index=i, tokens=tokens, backend=backend)
        state.sync()
        assert state.error() is None
        texts.append(state["x"])
    return time.perf_counter() - t, texts


def machine() -> dict:
    from sgl_tts.machine import cpu_model

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "sglang": sgl.__version__, "platform": platform.platform()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "generator-shape", GENERATOR_SHAPE, seed=0)
        rows = {}
        for name, kwargs, fn in [
            ("batched (fork)", {}, time_batched),
            ("sequential", {}, time_sequential),
            ("sequential, gather window 0", {"gather_window_ms": 0}, time_sequential),
        ]:
            backend = sgl_tts.LocalBackend(path, seed=0, **kwargs)
            try:
                fn(backend, 4, args.tokens)  # warm-up
                times, texts = [], None
                for _ in range(args.repeats):
                    sec, texts = fn(backend, args.width, args.tokens)
                    times.append(sec)
                rows[name] = {"median_s": statistics.median(times), "all_s": times, "texts": texts}
            finally:
                backend.shutdown()
            print(f"{name:>30}: median {rows[name]['median_s']:.3f}s  runs {['%.3f' % t for t in times]}",
                  flush=True)

    same = rows["batched (fork)"]["texts"] == rows["sequential"]["texts"]
    base = rows["batched (fork)"]["median_s"]
    result = {
        "benchmark": "fork_batching", "width": args.width, "new_tokens": args.tokens,
        "repeats": args.repeats, "model": "tiny Qwen2, hidden 256, 4 layers, 4x64 heads, 2 KV heads, fp32",
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or None,
        "machine": machine(),
        "same_texts_batched_vs_sequential": same,
        "results": {k: {"median_s": round(v["median_s"], 4), "all_s": [round(t, 4) for t in v["all_s"]],
                        "speedup_of_batched": round(v["median_s"] / base, 2)} for k, v in rows.items()},
    }
    print(json.dumps(result["results"], indent=1))
    print(f"batched texts equal sequential texts: {same}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        m = result["machine"]
        lines = [
            f"# Fork batching on LocalBackend: {args.width} forks x {args.tokens} new tokens",
            "",
            f"- date: {result['date']}; commit {result['git']}",
            f"- machine: {m['cpu']}, {m['cores']} cores (torch threads {m['torch_threads']}), "
            f"Python {m['python']}, torch {m['torch']}, sglang {m['sglang']}",
            f"- model: {result['model']} (random weights; `ignore_eos`, so every branch makes "
            f"exactly {args.tokens} tokens)",
            f"- command: `./dev.sh run {result['command']}`",
            f"- median of {args.repeats} runs after a warm-up",
            "",
            "| configuration | median seconds | runs | batched is faster by |",
            "| --- | ---: | --- | ---: |",
        ]
        for k, v in result["results"].items():
            lines.append(f"| {k} | {v['median_s']:.3f} | {', '.join('%.3f' % t for t in v['all_s'])} "
                         f"| {v['speedup_of_batched']:.1f}x |")
        lines += ["", f"Batched and sequential runs produced identical texts (same per-branch seeds): "
                      f"{'yes' if same else 'no'}.", ""]
        out.with_suffix(".md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
