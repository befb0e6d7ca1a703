"""``sgl-tts smoke``: the shortest proof that SGLang, the plugin and a program work together
(:func:`sgl_tts.smoke.run_smoke`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    from sgl_tts import smoke

    d = smoke.SmokeSettings()
    ap = argparse.ArgumentParser(prog="sgl-tts smoke", description=smoke.__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=d.device,
                    help="cpu: generator and PRM as CPU SGLang servers (sgl-tts serve --device cpu)")
    ap.add_argument("--port", type=int, default=d.port)
    ap.add_argument("--prm-port", type=int, default=d.prm_port, help="with --device cpu: the PRM server's port")
    ap.add_argument("--problems", type=int, default=d.problems)
    ap.add_argument("--beams", type=int, default=d.beams)
    ap.add_argument("--mem-fraction", type=float, default=d.mem_fraction, help="--mem-fraction-static (default 0.2)")
    ap.add_argument("--server-args", default=d.server_args)
    ap.add_argument("--health-timeout", type=float, default=d.health_timeout)
    ap.add_argument("--dry-run", action="store_true", help="print the server command and exit")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    from sgl_tts.launch.serve import ServerFailed, print_commands
    from sgl_tts.models import shipped_model
    from sgl_tts.smoke import SmokeSettings, plugin_requests, run_smoke, smoke_specs

    args = build_parser().parse_args(argv)
    s = SmokeSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SmokeSettings)})
    gen, prm_path = shipped_model("generator"), shipped_model("prm")
    if gen is None or prm_path is None:
        print("sgl-tts smoke: error: this install ships no tiny models (sgl_tts/models/data)", file=sys.stderr)
        return 1
    if s.problems < 1 or s.beams < 2:
        print("sgl-tts smoke: error: need --problems >= 1 and --beams >= 2", file=sys.stderr)
        return 1
    metrics = str(Path(tempfile.mkdtemp(prefix="sgl-tts-smoke-")) / "plugin-metrics.jsonl")
    specs = smoke_specs(s, gen, prm_path, metrics)
    if args.dry_run:
        print_commands(specs)
        return 0
    try:
        timings, outcome = run_smoke(s, specs, prm_path)
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
    print(f"beam search N={s.beams}: {outcome['right']}/{outcome['problems']} right, "
          f"{outcome['tokens']} tokens generated; the plugin admitted {smoke_rids} of its requests ({metrics})")
    print("OK")
    return 0
