"""Measure the PRM's slowdown beside generation (issue 33) on the shipped tiny pair, started here on
the CPU as the live tests start them; print each measurement as JSON.

    ./dev.sh run python tools/measure_verifier_slowdown.py [--times 2]

Each time measures afresh (a fresh cache folder): ``sgl_tts.launch.verifier_slowdown.slowdown_for_servers``
with its defaults (8 fresh 256-token PRM prompts alone, then beside 4 and 16 decoding generator rows).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from sgl_tts.launch.live_servers import LiveServer, LiveServers
from sgl_tts.launch.verifier_slowdown import slowdown_for_servers
from sgl_tts.models import shipped_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--times", type=int, default=2, help="fresh measurements (default 2)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sgl-tts-slowdown-"))
    specs = {"generator": LiveServer(str(shipped_model("generator")), policy="prefix-aware", kv_bytes=64 << 20),
             "prm": LiveServer(str(shipped_model("prm")), kv_bytes=64 << 20)}
    with LiveServers(specs, work / "servers") as servers:   # both stopped on the way out
        gen, prm = servers.url("generator"), servers.url("prm")
        for k in range(args.times):
            start = time.perf_counter()
            got = slowdown_for_servers(gen, prm, cache_dir=work / f"measure{k}")
            print(json.dumps({"points": [list(p) for p in got.slowdown.points], "per_row": got.slowdown.per_row,
                              "seconds": round(time.perf_counter() - start, 1), "date": got.date,
                              "machine": got.machine}))


if __name__ == "__main__":
    main()
