#!/usr/bin/env bash
# SGLang bring-up on a lent GPU machine (torch there, no SGLang, no network). Runs THERE, from the
# repository root, in a chain of device calls made back to back (the machine stays warm 30 s):
#   bash tools/gpu/bringup.sh receive .wheelhouse/part-00      # one call per part (carry that folder)
#   bash tools/gpu/bringup.sh receive .wheelhouse/part-NN && bash tools/gpu/bringup.sh install \
#       && bash tools/gpu/bringup.sh smoke                     # the last call
# Later calls in the same warm machine: eval "$(bash tools/gpu/bringup.sh env)".
# Parts made here by `sgl-tts wheelhouse build`; docs/GPU_BRINGUP.md has the whole story and a log.
set -euo pipefail

STORE=${SGLANG_TTS_WHEELHOUSE_STORE:-/tmp/sgl-tts-wheelhouse}
SITE=${SGLANG_TTS_SITE:-/tmp/site}
PY=${PYTHON:-python3}
IMPORTS=${SGLANG_TTS_BRINGUP_IMPORTS:-sglang sgl_kernel flashinfer sgl_tts.plugin sglang.srt.entrypoints.http_server}

say() { echo "[bringup $(date +%T)] $*"; }

receive() {
  local dir=$1
  [ -f "$dir/manifest.json" ] || { echo "bringup: $dir holds no manifest.json (carry a part folder)" >&2; exit 2; }
  mkdir -p "$STORE"
  cp "$dir"/wheels.tar.* "$dir/manifest.json" "$STORE/"
  local want have
  want=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['parts'])" "$STORE/manifest.json")
  have=$(ls "$STORE"/wheels.tar.* | wc -l)
  say "received $(basename "$dir"): $have of $want parts in $STORE"
}

install() {
  local t0=$SECONDS want have
  [ -f "$STORE/manifest.json" ] || { echo "bringup: nothing received in $STORE" >&2; exit 2; }
  want=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['parts'])" "$STORE/manifest.json")
  have=$(ls "$STORE"/wheels.tar.* | wc -l)
  if [ "$have" != "$want" ]; then
    echo "bringup: $have of $want parts received; missing: $(cd "$STORE" && for k in $(seq -f %02g 0 $((want-1))); do [ -f wheels.tar.$k ] || printf 'part-%s ' $k; done)" >&2
    exit 3
  fi
  cat $(ls "$STORE"/wheels.tar.* | sort) > "$STORE/wheels.tar"
  "$PY" - "$STORE" <<'EOF'
import hashlib, json, sys
store = sys.argv[1]
m = json.load(open(f"{store}/manifest.json"))
h = hashlib.sha256(open(f"{store}/wheels.tar", "rb").read()).hexdigest()
if h != m["sha256"]:
    sys.exit(f"bringup: the reassembled tar's sha256 {h} is not the manifest's {m['sha256']}: a part is damaged")
EOF
  rm -rf "$STORE/wheels" && mkdir -p "$STORE/wheels"   # no wheel of an earlier wheelhouse
  tar -xf "$STORE/wheels.tar" -C "$STORE/wheels"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$STORE"/wheels/*.whl
  say "installed $(ls "$STORE"/wheels/*.whl | wc -l) wheels into $SITE in $((SECONDS - t0)) s"
  # Byte-compile everything at once, on every core: on the H200 (2026-11-26) each process imported
  # sglang from source again (21-30 s per process, ~4 s here), as if no .pyc were ever written; a
  # .pyc written by compileall is read even where writing them is turned off (PYTHONDONTWRITEBYTECODE).
  local tc=$SECONDS
  "$PY" -c 'import os, sys
print("[bringup] python", sys.version.split()[0], "dont_write_bytecode:", sys.dont_write_bytecode, "pycache_prefix:",
      sys.pycache_prefix, "PYTHONDONTWRITEBYTECODE:", os.environ.get("PYTHONDONTWRITEBYTECODE"), "cpus:", os.cpu_count())'
  "$PY" -m compileall -q -j 0 "$SITE" > /dev/null 2>&1 || true
  say "byte-compiled $SITE in $((SECONDS - tc)) s"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"
  # One process imports them in turn, each time being what that module adds to those before it (on
  # the H200, 2026-11-26, a process per module spent 81 s importing sglang again and again). With
  # SGLANG_TTS_IMPORTTIME=FILE, python's -X importtime report goes to FILE and the 25 slowest
  # imports (cumulative) are printed.
  local check='import importlib, sys, time
for name in sys.argv[1:]:
    t = time.perf_counter()
    importlib.import_module(name)
    print(f"[bringup] import {name}: {time.perf_counter() - t:.1f} s", flush=True)
import sglang, torch
print(f"[bringup] sglang {sglang.__version__}, torch {torch.__version__}, cuda {torch.cuda.is_available()}")'
  if [ -z "${SGLANG_TTS_IMPORTTIME:-}" ]; then
    "$PY" -c "$check" $IMPORTS
  else
    local rc=0
    "$PY" -X importtime -c "$check" $IMPORTS 2> "$SGLANG_TTS_IMPORTTIME" || rc=$?
    grep -v '^import time:' "$SGLANG_TTS_IMPORTTIME" >&2 || true
    echo "[bringup] slowest imports (cumulative us | module):"
    grep '^import time:' "$SGLANG_TTS_IMPORTTIME" | awk -F'|' '$2 ~ /[0-9]/ {print $2 "|" $3}' | sort -rn | sed -n 1,25p   # not head: under pipefail sort's SIGPIPE failed the install (H200, 2026-11-26)
    return $rc
  fi
}

env_lines() {
  echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH} PATH=$SITE/bin:\$PATH"
}

case "${1:-}" in
  receive) receive "${2:?bringup: receive needs a part folder}" ;;
  install) install ;;
  env) env_lines ;;
  smoke) shift; eval "$(env_lines)"; "$PY" -m sgl_tts.smoke "$@" ;;
  *) echo "usage: bringup.sh receive PART_DIR | install | env | smoke [ARGS]" >&2; exit 2 ;;
esac
