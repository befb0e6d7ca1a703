#!/usr/bin/env bash
# The last call of the bring-up chain when a session holds the GPU for 15 minutes in all (one call of
# at most 10 after the parts): install, then the PHASES asked for, in that order (default: smoke tests
# bench), each capped so that the call ends DEADLINE seconds after it began (default 560). Every phase writes its
# log under $OUT while it runs, so a phase cut short still leaves its log.
#   bash tools/gpu/bringup.sh receive .wheelhouse/part-02 && bash tools/gpu/short-lease.sh 570 [PHASES]
# What one lease costs (H200, 2026-11-26, docs/gpu-bringup-log.md): ~50 s for the three parts, ~40 s
# to install, byte-compile and import, then ~48 s per SGLang server start (~100 s for the first, whose
# CUDA-graph capture compiles Triton's kernels); the goodput benchmark starts four servers per run.
# So one lease does the benchmark at n = 8 and 64 on two sides, or smoke + tests.
# JIT caches (sglang's tvm-ffi kernels, triton's) come back as $OUT/jit-cache.tgz; carried back as
# .gpu-cache/jit-cache.tgz (git-ignored) they spare the next machine the compiles.
# Files come back with '+' as '_' (1.5b_1.5b.jsonl). SGLANG_TTS_BENCH_EXTRA goes on to bench-call.sh
# (e.g. "--n 8": one n, both sides).
set -uo pipefail
export PYTHONUNBUFFERED=1
deadline=${1:-560}
shift || true
phases=" ${*:-smoke tests bench} "
out=${OUT:-/tmp/sgl-tts-out}
mkdir -p "$out"
t0=$SECONDS
# cap WANT RESERVE: WANT seconds, or what is left before the deadline less RESERVE if that is less
cap() { local l=$(( deadline - (SECONDS - t0) - $2 )); (( l < $1 )) && echo $(( l > 1 ? l : 1 )) || echo "$1"; }
say() { echo "[short-lease +$((SECONDS - t0)) s] $*"; }

if [ -f .gpu-cache/jit-cache.tgz ]; then
  mkdir -p ~/.cache ~/.triton && tar -xzf .gpu-cache/jit-cache.tgz -C ~ && say "JIT caches unpacked"
fi
{ say install; SGLANG_TTS_IMPORTTIME=/tmp/importtime.txt bash tools/gpu/bringup.sh install; } 2>&1 \
    | tee "$out/bringup.log" || exit 1
eval "$(bash tools/gpu/bringup.sh env)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$out/bringup.log"

smoke() {
  local c; c=$(cap 240 60)
  say "smoke (at most $c s)"
  timeout -k 10 "$c" python3 -m sgl_tts.cli smoke --problems 2 --health-timeout $(( c > 60 ? c - 30 : c ))
  say "smoke exit $?"
}
tests() {
  local c; c=$(cap 400 30)
  say "gpu-marked tests (at most $c s; the wheelhouse's smoke test is the smoke above)"
  # a per-test timeout under the cap, and each failure's traceback printed as it fails
  # (SGLANG_TTS_FAILURES_AT_ONCE, tests/conftest.py): pytest prints them only in its summary, which the
  # cap may cut off (2026-11-27: two failures came back without their reasons)
  SGLANG_TTS_FAILURES_AT_ONCE=1 timeout -k 10 "$c" python3 -m pytest -m gpu -p no:cacheprovider -v --tb=short \
      --timeout $(( c / 2 > 200 ? 200 : c / 2 )) tests/test_gpu.py tests/test_memory.py tests/test_reward_head.py
  say "tests exit $?"
}
bench() {
  local limit starts
  limit=$(cap 600 25)
  starts=$(( limit > 61 ? limit - 60 : 1 ))
  say "goodput benchmark: no search starts after $starts s, stopped at $limit s"
  mkdir -p /tmp/bench-call-out
  # timeout signals the benchmark's whole process group: SIGTERM stops both servers (bench/command.py)
  OUT=/tmp/bench-call-out timeout -k 10 "$limit" bash tools/gpu/bench-call.sh 1.5b+1.5b "$starts"
  say "benchmark exit $?"
  # $OUT takes letters, digits, '.', '_' and '-' in a name; the plot and summary are rebuilt here
  # from the records (sgl-tts bench ... --report-only)
  for f in bench-out/1.5b+1.5b.{jsonl,md,log,plugin-metrics.jsonl}; do
    [ -f "$f" ] && cp "$f" "$out/$(basename "$f" | tr + _)"
  done
}
# the phases run in the order given (e.g. "bench tests": the benchmark first, the tests in what is left)
for phase in $phases; do
  case $phase in
    smoke) smoke 2>&1 | tee -a "$out/bringup.log" ;;
    tests) tests 2>&1 | tee "$out/gpu-tests.log" ;;
    bench) bench ;;
    *) say "unknown phase $phase (smoke, tests, bench)" ;;
  esac
done
tar -czf /tmp/jit-cache.tgz -C ~ $(cd ~ && ls -d .cache/tvm-ffi .triton/cache 2>/dev/null) 2>/dev/null \
    && [ "$(stat -c %s /tmp/jit-cache.tgz)" -lt 16000000 ] && cp /tmp/jit-cache.tgz "$out/" \
    && say "JIT caches packed: $(du -h /tmp/jit-cache.tgz | cut -f1)"
exit 0
