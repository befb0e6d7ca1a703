"""The demo's DeepConf online row alone, timed, with the garbage collector's share (docs/benchmarks/LOG.md).

Runs ``deepconf`` (online, N = 16, the embedded default's settings) on the first ``--problems`` test
problems through SGLang's ``run_batch`` on :class:`sgl_tts.LocalBackend`, as ``sgl-tts demo`` does, and
prints one JSON line: seconds, accuracy, tokens per problem, samples stopped, the engine's requests and
decode steps, and the collections by generation with their seconds (``gc.callbacks``).

Usage (inside the environment, from the repository root)::

    python benchmarks/deepconf_row.py --problems 50
"""

from __future__ import annotations

import argparse
import gc
import json
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problems", type=int, default=50)
    p.add_argument("--n", type=int, default=16)
    args = p.parse_args()

    import sgl_tts
    from sgl_tts.experiment import RunConfig, program_function
    from sgl_tts.models import shipped_model
    from sgl_tts.tiny import task

    collections = {"count": [0, 0, 0], "seconds": [0.0, 0.0, 0.0]}
    started: dict[int, float] = {}

    def on_gc(phase: str, info: dict) -> None:
        g = info["generation"]
        if phase == "start":
            started[g] = time.perf_counter()
        elif g in started:
            collections["count"][g] += 1
            collections["seconds"][g] += time.perf_counter() - started.pop(g)

    gen = sgl_tts.LocalBackend(shipped_model("generator"), seed=0)
    problems = task.test_split()[:args.problems]
    cfg = RunConfig(program="deepconf", n=args.n, temperature=0.8, seed=0, max_tokens=256, prm="none",
                    deepconf_mode="online")
    arguments = [cfg.program_arguments(q.question, None) for q in problems]
    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    try:
        results = [r.ret_value for r in program_function("deepconf").run_batch(arguments, backend=gen,
                                                                                 progress_bar=False)]
        seconds = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(on_gc)
        gen.shutdown()
    print(json.dumps({
        "seconds": round(seconds, 2),
        "accuracy": sum(r.answer == str(q.answer) for q, r in zip(problems, results)) / len(problems),
        "tokens_per_problem": round(sum(r.tokens_generated for r in results) / len(problems), 2),
        "samples_stopped": sum(r.traces_stopped for r in results),
        "requests": gen.engine.stats.requests, "decode_steps": gen.engine.stats.decode_forwards,
        "gc": {"count": collections["count"], "seconds": [round(x, 2) for x in collections["seconds"]]},
    }))


if __name__ == "__main__":
    main()
