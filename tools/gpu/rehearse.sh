#!/usr/bin/env bash
# Rehearse the GPU bring-up on this CPU machine before spending device time:
#   bash tools/gpu/rehearse.sh [PYTHON3.12]
# Makes a Python 3.12 environment holding the GPU machine's packages (tools/gpu/present.txt) at this
# environment's versions (a stand-in for the image), installs .wheelhouse/part-* through bringup.sh,
# imports the server's modules, and runs the benchmark / bring-up / plugin tests there. What it cannot
# show: anything that needs the GPU (sgl_kernel's ops need libcuda; with no GPU, sgl_kernel looks for
# its sm100 build, which the slim wheel drops -- Hopper loads sm90 -- so the rehearsal links it).
set -euo pipefail
PY312=${1:-python3.12}
SIM=${SGLANG_TTS_REHEARSAL:-/tmp/sgl-tts-gpu-rehearsal}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
[ -f .wheelhouse/part-00/manifest.json ] || { echo "rehearse: build the parts first: ./dev.sh run sgl-tts wheelhouse build" >&2; exit 2; }
./dev.sh run python - > "$SIM.pins" <<'PYEOF'
import importlib.metadata as md, re
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
present = {norm(x.split("#")[0].strip()) for x in open("tools/gpu/present.txt") if x.split("#")[0].strip()}
for d in md.distributions():
    n = norm(d.metadata["Name"])
    # transformers and tokenizers travel (ALWAYS in sgl_tts/wheelhouse.py): the image's versions clash
    if n in present and n not in ("pip", "setuptools", "wheel", "transformers", "tokenizers"):
        print(f"{n}=={d.version}")
PYEOF
if [ ! -x "$SIM/venv/bin/python" ]; then
  "$PY312" -m venv "$SIM/venv"
  PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= "$SIM/venv/bin/python" -m pip install -q -r "$SIM.pins"
fi
rm -rf "$SIM/store" "$SIM/site"
export SGLANG_TTS_WHEELHOUSE_STORE="$SIM/store" SGLANG_TTS_SITE="$SIM/site" PYTHON="$SIM/venv/bin/python"
for part in .wheelhouse/part-*; do bash tools/gpu/bringup.sh receive "$part"; done
SGLANG_TTS_BRINGUP_IMPORTS="sglang flashinfer sgl_tts.plugin" bash tools/gpu/bringup.sh install
ln -sfn sm90 "$SIM/site/sgl_kernel/sm100"
# the modules the wheelhouse was probed with (sgl_tts.wheelhouse.SERVER_MODULES), each in a fresh interpreter
for m in $(PYTHONPATH="$SIM/site" "$PYTHON" -c "from sgl_tts.wheelhouse import SERVER_MODULES; print(*SERVER_MODULES)"); do
  PYTHONPATH="$SIM/site" "$PYTHON" -W ignore -c "import importlib; importlib.import_module('$m')" && echo "[rehearse] import $m: ok"
done
PYTHONPATH="$SIM/site:$ROOT" "$PYTHON" -m pytest -q -p no:cacheprovider -p no:warnings \
  tests/test_bench_goodput.py tests/test_wheelhouse.py tests/test_scheduler_plugin.py tests/test_serve.py tests/test_memory.py
echo "[rehearse] OK: the parts install and import on Python 3.12 beside the machine's packages (CPU only)"
