"""Benchmark: K PRM beam searches (N = 16, width 4) in flight at once on the CPU backend, as `sgl-tts
demo` runs them (SGLang's ``run_batch``), with the embedded tiny generator and PRM.

Prints one line: wall seconds, generated tokens, the process's user and system CPU, the CPU of the
two model engines' threads, the client's CPU (the rest) per 1,000 generated tokens, the most threads
alive at once (sampled every 0.2 s) and the first answers (equal on both sides of a comparison: the
samples are seeded). Run it from two checkouts to compare them side by side, e.g.

    ./dev.sh run python benchmarks/concurrent_beam_search.py 50 auto   # all 50 in flight (the demo)
    ./dev.sh run python benchmarks/concurrent_beam_search.py 50 8      # eight at a time

(`PYTHONPATH=<other checkout> <venv>/bin/python benchmarks/concurrent_beam_search.py 50 auto` for the
other side; docs/benchmarks/LOG.md, "Waiting without polling", has the figures.)
"""

from __future__ import annotations

import resource
import sys
import threading
import time

import psutil

from programs.beam_search import beam_search
from sgl_tts import LocalBackend
from sgl_tts.tiny import task
from sgl_tts.models import shipped_model
from sgl_tts.prm import StepTagPRM


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: concurrent_beam_search.py SEARCHES THREADS   (THREADS: a number or auto)")
    count, threads = int(argv[0]), argv[1]
    threads = threads if threads == "auto" else int(threads)
    generator, prm_backend = LocalBackend(shipped_model("generator")), LocalBackend(shipped_model("prm"))
    prm = StepTagPRM(prm_backend)
    args = [dict(question=p.question, prm=prm, num_beams=16, beam_width=4, step_tokens=64, sampling_temperature=0.8,
                 aggregation="last", seed=0) for p in task.test_split()[:count]]
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            peak[0] = max(peak[0], threading.active_count())

    threading.Thread(target=sample, daemon=True).start()
    proc = psutil.Process()
    engines = {be.engine.native_thread_id for be in (generator, prm_backend)}

    def engine_cpu() -> float:
        return sum(t.user_time + t.system_time for t in proc.threads() if t.id in engines)

    r0, e0, t0 = resource.getrusage(resource.RUSAGE_SELF), engine_cpu(), time.perf_counter()
    states = beam_search.run_batch(args, backend=generator, num_threads=threads)
    wall, r1, e1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF), engine_cpu()
    stop.set()
    tokens = sum(s.ret_value.tokens_generated for s in states)
    user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    print(f"K={count} threads={threads}: wall {wall:.1f} s, tokens {tokens}, user {user:.1f} s, sys {system:.1f} s, "
          f"engine cpu {e1 - e0:.1f} s, client cpu/1k tokens {(user + system - (e1 - e0)) / tokens * 1000:.3f} s, "
          f"peak threads {peak[0]}, answers {[s.ret_value.answer for s in states][:5]}")


if __name__ == "__main__":
    main(sys.argv[1:])
