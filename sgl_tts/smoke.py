"""``sgl-tts smoke``: the shortest proof that SGLang, the plugin and a program work together.

On a GPU (``--device cuda``, the default) it starts one SGLang server with the shipped tiny generator
and the sgl-tts plugin (``--tts-policy prefix-aware``, metrics to a file); the tiny PRM scores on this
machine through transformers. On the CPU (``--device cpu``) it starts both tiny models as SGLang
servers the way ``sgl-tts serve --device cpu`` does, and the PRM scores through its server. Then it
runs PRM beam search through the endpoint backend on a few test problems, checks that the plugin saw
the search's requests, and prints the timings and ``OK``; any failure prints the reason and exits 1.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

from sgl_tts.bench.goodput import DEFAULT_SERVER_ARGS
from sgl_tts.plugin.settings import TTSSettings
from sgl_tts.launch.serve import launch_command


def server_command(model: str, port: int, metrics: str, mem_fraction: float, server_args: str,
                   python: str = sys.executable, max_batch: int = 8) -> list[str]:
    # CUDA graphs only for the batch sizes the search can have: SGLang captures 36 sizes up to 256
    # by default, and on the H200 (2026-11-26) the first capture alone took 21.6 s of a server start
    return launch_command(model, host="127.0.0.1", port=port, python=python,
                          flags=["--mem-fraction-static", str(mem_fraction), "--cuda-graph-max-bs-decode", str(max_batch)],
                          plugin=TTSSettings("prefix-aware", metrics_file=metrics), extra=shlex.split(server_args))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sgl-tts smoke", description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: generator and PRM as CPU SGLang servers (sgl-tts serve --device cpu)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--prm-port", type=int, default=30001, help="with --device cpu: the PRM server's port")
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--beams", type=int, default=8)
    ap.add_argument("--mem-fraction", type=float, default=0.2, help="--mem-fraction-static (default 0.2)")
    ap.add_argument("--server-args", default=DEFAULT_SERVER_ARGS)
    ap.add_argument("--health-timeout", type=float, default=900.0)
    ap.add_argument("--dry-run", action="store_true", help="print the server command and exit")
    return ap


def smoke_specs(args: argparse.Namespace, gen: Path, prm_path: Path, metrics: str) -> list:
    """The servers: on the CPU the tiny generator (plugin on) and PRM as ``sgl-tts serve --device cpu``
    starts them; on CUDA the tiny generator alone (the PRM runs in this process)."""
    if args.device == "cpu":
        from sgl_tts.launch.cpu_serving import CPU_ENV, cpu_pair_flags
        from sgl_tts.launch.serve import build_specs

        return build_specs(str(gen), str(prm_path), cpu_pair_flags(gen, prm_path, "256MiB"), host="127.0.0.1",
                           ports={"generator": args.port, "prm": args.prm_port}, first="generator",
                           plugin=TTSSettings("prefix-aware", metrics_file=metrics, seeded_sampling=True),
                           env=dict(CPU_ENV))
    from sgl_tts.launch.serve import ServerSpec

    return [ServerSpec("generator", server_command(str(gen), args.port, metrics, args.mem_fraction,
                                                   args.server_args, max_batch=args.beams),
                       f"http://127.0.0.1:{args.port}/health")]


def run_searches(args: argparse.Namespace, prm_path: Path, timings: dict[str, float]) -> dict[str, int]:
    """Beam search on ``--problems`` test problems against the running generator (group ``smoke-<i>``),
    timing the first and the mean search; returns how many were right and the tokens generated."""
    from programs.beam_search import beam_search
    from sgl_tts.tiny import task
    from sgl_tts.backends import LocalBackend, SGLangEndpoint
    from sgl_tts.prm import StepTagPRM

    endpoint = SGLangEndpoint(f"http://127.0.0.1:{args.port}")
    prm = StepTagPRM(SGLangEndpoint(f"http://127.0.0.1:{args.prm_port}") if args.device == "cpu"
                     else LocalBackend(str(prm_path)))
    problems = task.test_split()[:args.problems]
    right, tokens, per = 0, 0, []
    for i, p in enumerate(problems):
        t0 = time.perf_counter()
        state = beam_search.run(question=p.question, prm=prm, num_beams=args.beams, beam_width=2,
                                max_depth=12, search_group=f"smoke-{i}", backend=endpoint)
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
    from sgl_tts.plugin.metrics import read_records, scheduler_files
    from sgl_tts.protocol import GROUP_PREFIX

    return sum(str(r["rid"]).startswith(GROUP_PREFIX + "smoke-")
               for rec in read_records(scheduler_files(metrics))
               if rec.get("event") == "prefill" for r in rec.get("requests", []))


def main(argv: Sequence[str] | None = None) -> int:
    from sgl_tts.models import shipped_model

    args = build_parser().parse_args(argv)
    gen, prm_path = shipped_model("generator"), shipped_model("prm")
    if gen is None or prm_path is None:
        print("sgl-tts smoke: error: this install ships no tiny models (sgl_tts/models/data)", file=sys.stderr)
        return 1
    if args.problems < 1 or args.beams < 2:
        print("sgl-tts smoke: error: need --problems >= 1 and --beams >= 2", file=sys.stderr)
        return 1
    metrics = str(Path(tempfile.mkdtemp(prefix="sgl-tts-smoke-")) / "plugin-metrics.jsonl")
    specs = smoke_specs(args, gen, prm_path, metrics)
    from sgl_tts.launch.serve import ServerFailed, print_commands, run_servers

    if args.dry_run:
        print_commands(specs)
        return 0

    timings: dict[str, float] = {}
    outcome: dict[str, int] = {}
    stop = threading.Event()
    t_start = time.perf_counter()

    def work(servers) -> None:
        try:
            timings["server start (s)"] = time.perf_counter() - t_start
            outcome.update(run_searches(args, prm_path, timings))
        finally:
            stop.set()

    try:
        run_servers(specs, health_timeout=args.health_timeout, on_ready=work, stop_event=stop)
    except (ServerFailed, RuntimeError, ConnectionError) as exc:
        print(f"sgl-tts smoke: FAILED: {exc}", file=sys.stderr)
        return 1
    smoke_rids = plugin_requests(metrics)
    if smoke_rids == 0:
        print(f"sgl-tts smoke: FAILED: the plugin logged none of the search's requests in {metrics}.* "
              f"(is the sgl-tts plugin installed where the server runs?)", file=sys.stderr)
        return 1
    for k, v in timings.items():
        print(f"{k}: {v:.2f}")
    print(f"beam search N={args.beams}: {outcome['right']}/{outcome['problems']} right, "
          f"{outcome['tokens']} tokens generated; the plugin admitted {smoke_rids} of its requests ({metrics})")
    print("OK")
    return 0
