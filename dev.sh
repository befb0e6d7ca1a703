#!/usr/bin/env bash
# sgl-tts developer entry point: installs what is missing, then runs one job.
#
#   ./dev.sh demo [ARGS]   run the main job (`sgl-tts demo`) on the embedded default
#   ./dev.sh test [ARGS]   run the test suite (pytest ARGS)
#   ./dev.sh run CMD ...   run any command inside the environment
#   ./dev.sh path          print the environment's folder
#
# The heavy environment (sglang==0.5.15 with its CUDA torch, ~11 GB) lives outside the clone, in
# ${SGLANG_TTS_CACHE:-~/.cache/sgl-tts}/venv-<key>, where <key> hashes requirements/lock.txt (top-level
# pins), requirements/constraints.txt (every package's exact version) and the Python version: repeat
# runs reuse it, a change of pins builds a new one, and a fresh machine builds it once.
# Needs Linux x86_64 with python3 -m venv (Debian/Ubuntu: python3-venv), flock and sha256sum.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${SGLANG_TTS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/sgl-tts}
lock="$root/requirements/lock.txt"
constraints="$root/requirements/constraints.txt"

log() { printf '[dev.sh] %s\n' "$*" >&2; }

find_python() {
  local cand
  for cand in ${PYTHON:-} python3.13 python3.12 python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  log "error: Python >= 3.11 not found; install it or set PYTHON=/path/to/python3.11"
  exit 2
}

py=$(find_python)
pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
key=$( (cat "$lock" "$constraints"; echo "python=$pyver") | sha256sum | cut -c1-16)
venv="$cache/venv-$key"

# This machine's pip configuration prefers a local CPU torch wheel (find-links) and local mirrors that
# conflict with sglang's pins; install from the package index alone so the resolver takes the pins.
pip_clean() { PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_EXTRA_INDEX_URL= "$venv/bin/python" -m pip "$@"; }

build_env() {
  mkdir -p "$cache"
  exec 9>"$cache/.lock-$key"
  flock 9                                   # one builder at a time per key
  if [[ ! -f "$venv/.complete" ]]; then
    log "building the environment in $venv (first run: several minutes, ~11 GB)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    pip_clean install -q --upgrade pip
    pip_clean install --progress-bar off -r "$lock" -c "$constraints"
    prune_installed
    cp "$lock" "$constraints" "$venv/"
    touch "$venv/.complete"
    log "environment ready"
  fi
  # Release the lock: a flock taken again through another descriptor (prune_env's) would wait on
  # this one forever (a fresh machine's first `./dev.sh demo` hung after "environment ready").
  exec 9>&-
}

# Installed by the pins but left out: jsonschema imports rfc3987-syntax only inside
# suppress(ImportError) (IRI format checks, which nothing here asks for; jupyter-events pulls it in),
# and building its Lark grammar at import cost every SGLang process 4.3 s of CPU on this 2-core
# machine (-X importtime, 2026-11-27): a live server is three such processes. Removed from an
# environment built before this list too (the venv key hashes only the pins).
PRUNE=(rfc3987-syntax)

installed() { compgen -G "$venv/lib/python*/site-packages/${1//-/_}-*.dist-info" >/dev/null; }

# Uninstall what PRUNE names (the caller holds the build lock).
prune_installed() {
  local name
  for name in "${PRUNE[@]}"; do
    if installed "$name"; then pip_clean uninstall -q -y "$name" >&2; fi
  done
}

# An environment built before PRUNE listed a package: prune it once, under the build lock.
prune_env() {
  local name
  for name in "${PRUNE[@]}"; do
    if installed "$name"; then
      exec 9>"$cache/.lock-$key"
      flock 9
      prune_installed
      exec 9>&-
      return
    fi
  done
}

install_project() {
  # Editable install of this clone (for the `sgl-tts` script and entry points); skipped when the
  # environment already points here and pyproject.toml is unchanged.
  local stamp="$venv/.project" want
  want="$root $(sha256sum "$root/pyproject.toml" | cut -c1-16)"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] &&
     "$venv/bin/python" -c 'import sgl_tts' >/dev/null 2>&1; then
    return
  fi
  if ! pip_clean install -q --no-deps --no-build-isolation -e "$root" >"$venv/.project.log" 2>&1; then
    cat "$venv/.project.log" >&2
    log "error: could not install this clone into $venv"
    exit 1
  fi
  echo "$want" >"$stamp"
}

[[ -f "$venv/.complete" ]] || build_env
prune_env
install_project

cmd=${1:-}
[[ $# -gt 0 ]] && shift
export PATH="$venv/bin:$PATH"
# Import this clone even if another clone shares the environment.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
case "$cmd" in
  demo) exec "$venv/bin/sgl-tts" demo "$@" ;;
  test)
    cd "$root"
    set +e
    "$venv/bin/python" -m pytest "$@"
    rc=$?
    if [[ $rc -eq 5 ]]; then log "error: pytest collected no tests"; exit 1; fi
    exit $rc ;;
  run) exec "$@" ;;
  path) echo "$venv" ;;
  *) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
