"""``sgl-tts smoke``: the shortest proof that SGLang, the plugin and a program work together.

On a GPU (``--device cuda``, the default) it starts one SGLang server with the shipped tiny generator
and the sgl-tts plugin (``--tts-policy prefix-aware``, metrics to a file); the tiny PRM scores on this
machine through transformers. On the CPU (``--device cpu``) it starts both tiny models as SGLang
servers the way ``sgl-tts serve --device cpu`` does, and the PRM scores through its server. Then it
runs PRM beam search through the endpoint backend on a few test problems, checks that the plugin saw
the search's requests, and prints the timings and ``OK``; any failure prints the reason and exits 1.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from sgl_tts.bench.goodput_settings import DEFAULT_SERVER_ARGS
from sgl_tts.plugin.settings import TTSSettings
from sgl_tts.launch.serve import launch_command


def server_command(model: str, port: int, metrics: str, mem_fraction: float, server_args: str,
                   python: str = sys.executable, max_batch: int = 8) -> list[str]:
    # CUDA graphs only for the batch sizes the search can have: SGLang captures 36 sizes up to 256
    # by default, and on the H200 (2026-11-26) the first capture alone took 21.6 s of a server start
    return launch_command(model, host="127.0.0.1", port=port, python=python,
                          flags=["--mem-fraction-static", str(mem_fraction), "--cuda-graph-max-bs-decode", str(max_batch)],
                          plugin=TTSSettings("prefix-aware", metrics_file=metrics), extra=shlex.split(server_args))


@dataclasses.dataclass(frozen=True)
class SmokeSettings:
    """What ``sgl-tts smoke`` runs: where (``device``: ``cuda`` or ``cpu``), on which ports, how many
    problems and beams, and the GPU server's memory fraction and extra flags."""

    device: str = "cuda"
    port: int = 30000
    prm_port: int = 30001   # with device cpu: the PRM server's port
    problems: int = 4
    beams: int = 8
    mem_fraction: float = 0.2
    server_args: str = DEFAULT_SERVER_ARGS
    health_timeout: float = 900.0


def smoke_specs(s: SmokeSettings, gen: Path, prm_path: Path, metrics: str) -> list:
    """The servers: on the CPU the tiny generator (plugin on) and PRM as ``sgl-tts serve --device cpu``
    starts them; on CUDA the tiny generator alone (the PRM runs in this process)."""
    if s.device == "cpu":
        from sgl_tts.launch.cpu_serving import CPU_ENV, cpu_pair_flags
        from sgl_tts.launch.serve import build_specs

        return build_specs(str(gen), str(prm_path), cpu_pair_flags(gen, prm_path, "256MiB"), host="127.0.0.1",
                           ports={"generator": s.port, "prm": s.prm_port}, first="generator",
                           plugin=TTSSettings("prefix-aware", metrics_file=metrics, seeded_sampling=True),
                           env=dict(CPU_ENV))
    from sgl_tts.launch.serve import ServerSpec

    return [ServerSpec("generator", server_command(str(gen), s.port, metrics, s.mem_fraction,
                                                   s.server_args, max_batch=s.beams),
                       f"http://127.0.0.1:{s.port}/health")]


def run_searches(s: SmokeSettings, prm_path: Path, timings: dict[str, float]) -> dict[str, int]:
    """Beam search on ``--problems`` test problems against the running generator (group ``smoke-<i>``),
    timing the first and the mean search; returns how many were right and the tokens generated."""
    from sgl_tts.backends import LocalBackend, SGLangEndpoint
    from sgl_tts.experiment import RunConfig, program_function
    from sgl_tts.prm import StepTagPRM
    from sgl_tts.tiny import task

    endpoint = SGLangEndpoint(f"http://127.0.0.1:{s.port}")
    prm = StepTagPRM(SGLangEndpoint(f"http://127.0.0.1:{s.prm_port}") if s.device == "cpu"
                     else LocalBackend(str(prm_path)))
    cfg = RunConfig(program="beam_search", n=s.beams, beam_width=2, max_depth=12)   # as `sgl-tts run` gives it
    beam_search = program_function(cfg.program)
    problems = task.test_split()[:s.problems]
    right, tokens, per = 0, 0, []
    for i, p in enumerate(problems):
        t0 = time.perf_counter()
        state = beam_search.run(**cfg.program_arguments(p.question, prm), search_group=f"smoke-{i}",
                                backend=endpoint)
        if state.error() is not None:
            raise RuntimeError(f"problem {i}: {state.error()}")
        res = state.ret_value
        per.append(time.perf_counter() - t0)
        right += res.answer == str(p.answer)
        tokens += res.tokens_generated
    timings["first search (s)"] = per[0]
    timings["mean search (s)"] = sum(per) / len(per)
    return {"right": right, "problems": len(problems), "tokens": tokens}


def plugin_requests(metrics: str) -> int:
    """How many of the smoke searches' requests the plugin logged as admitted (its prefill records,
    with the searches' request ids; each scheduler process writes <metrics>.<pid>)."""
    from sgl_tts.plugin.scheduling.metrics import read_records, scheduler_files
    from sgl_tts.protocol import GROUP_PREFIX

    return sum(str(r["rid"]).startswith(GROUP_PREFIX + "smoke-")
               for rec in read_records(scheduler_files(metrics))
               if rec.get("event") == "prefill" for r in rec.get("requests", []))


def run_smoke(s: SmokeSettings, specs: Sequence, prm_path: Path) -> tuple[dict[str, float], dict[str, int]]:
    """Start the servers, run the searches, stop the servers: the timings (server start, first and mean
    search) and the outcome (:func:`run_searches`). ``ServerFailed`` / ``RuntimeError`` /
    ``ConnectionError`` when something fails."""
    from sgl_tts.launch.serve import run_servers

    timings: dict[str, float] = {}
    outcome: dict[str, int] = {}
    stop = threading.Event()
    t_start = time.perf_counter()

    def work(servers) -> None:
        try:
            timings["server start (s)"] = time.perf_counter() - t_start
            outcome.update(run_searches(s, prm_path, timings))
        finally:
            stop.set()

    run_servers(specs, health_timeout=s.health_timeout, on_ready=work, stop_event=stop)
    return timings, outcome


__all__ = ["SmokeSettings", "plugin_requests", "run_searches", "run_smoke", "server_command", "smoke_specs"]
