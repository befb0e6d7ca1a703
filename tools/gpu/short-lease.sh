#!/usr/bin/env bash
# The last call of the bring-up chain when a session holds the GPU for 15 minutes in all (one call of
# at most 10): install, smoke, the gpu-marked tests, then the goodput benchmark for what is left. Each
# phase is capped so that the call ends DEADLINE seconds after it began (default 560), and each
# phase's output is written under $OUT while it runs, so a phase cut short still leaves its log.
#   bash tools/gpu/bringup.sh receive .wheelhouse/part-02 && bash tools/gpu/short-lease.sh [DEADLINE]
# Files come back with '+' as '_' (1.5b_1.5b.jsonl). SGLANG_TTS_BENCH_EXTRA is passed on to bench-call.sh (e.g. "--n 8": one n, both sides).
set -uo pipefail
export PYTHONUNBUFFERED=1
deadline=${1:-560}
out=${OUT:-/tmp/sgl-tts-out}
mkdir -p "$out"
t0=$SECONDS
# cap WANT RESERVE: WANT seconds, or what is left before the deadline less RESERVE if that is less
cap() { local l=$(( deadline - (SECONDS - t0) - $2 )); (( l < $1 )) && echo $(( l > 0 ? l : 1 )) || echo "$1"; }
say() { echo "[short-lease +$((SECONDS - t0)) s] $*"; }

{ say install; bash tools/gpu/bringup.sh install; } 2>&1 | tee "$out/bringup.log" || exit 1
eval "$(bash tools/gpu/bringup.sh env)"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  say "smoke (at most $(cap 200 300) s)"
  timeout -k 10 "$(cap 200 300)" python3 -m sgl_tts.smoke --problems 2
  say "smoke exit $?"
} 2>&1 | tee -a "$out/bringup.log"
{
  say "gpu-marked tests (at most $(cap 200 150) s)"
  # the wheelhouse's smoke test is the smoke above
  timeout -k 10 "$(cap 200 150)" python3 -m pytest -m gpu -p no:cacheprovider -q -rA --timeout 120 \
      tests/test_gpu.py tests/test_memory.py tests/test_reward_head.py
  say "tests exit $?"
} 2>&1 | tee "$out/gpu-tests.log"
limit=$(cap 600 15)
say "goodput benchmark: no search starts after $(( limit - 60 )) s, stopped at $limit s"
# timeout signals the benchmark's whole process group: SIGTERM stops both servers (bench/command.py)
mkdir -p /tmp/bench-call-out
OUT=/tmp/bench-call-out timeout -k 10 "$limit" bash tools/gpu/bench-call.sh 1.5b+1.5b $(( limit - 60 > 1 ? limit - 60 : 1 ))
say "benchmark exit $?"
# $OUT takes letters, digits, '.', '_' and '-' in a name: 1.5b+1.5b.jsonl comes back as 1.5b_1.5b.jsonl
for f in bench-out/1.5b+1.5b.*; do [ -f "$f" ] && cp "$f" "$out/$(basename "$f" | tr + _)"; done
exit 0
