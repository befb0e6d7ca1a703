#!/usr/bin/env bash
# One device call of the goodput benchmark (after tools/gpu/bringup.sh install, same warm machine):
#   bash tools/gpu/bench-call.sh [CONFIG] [SECONDS]
# CONFIG: 1.5b+1.5b (default: the acceptance run, n = 8 64 512), 1.5b+7b or 7b+1.5b. It resumes
# bench-out/CONFIG.jsonl, starts no search after SECONDS (default 420, so the call ends inside its 10
# minutes), and copies the records, report, plot and log to $OUT. Exit 3: work left, call again.
# The planner uses the fixed GPU profile (SGLANG_TTS_GPU, default H200), not --measure: a re-measured
# ceiling could change the plan between calls, and a resumed run must have the same settings.
# SGLANG_TTS_BENCH_EXTRA: more sgl-tts bench flags (word-split), e.g. "--models-dir DIR".
set -uo pipefail
eval "$(bash "$(dirname "$0")/bringup.sh" env)"
name=${1:-1.5b+1.5b}
case $name in
  1.5b+1.5b) args=(--generator qwen2.5-math-1.5b --prm skywork-prm-1.5b --gpu-memory "0.4*24GiB" --n 8 64 512 --problems 1) ;;
  # a 7B model's weights need more than half of 0.9 x 24 GB: the stock split gives it 70% / 75%
  1.5b+7b) args=(--generator qwen2.5-math-1.5b --prm math-shepherd-mistral-7b --gpu-memory "0.9*24GiB" --stock-split 0.3) ;;
  7b+1.5b) args=(--generator qwen2.5-7b --prm skywork-prm-1.5b --gpu-memory "0.9*24GiB" --stock-split 0.75) ;;
  *) echo "bench-call: unknown config $name (1.5b+1.5b, 1.5b+7b, 7b+1.5b)" >&2; exit 2 ;;
esac
mkdir -p bench-out
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "bench-out/$name.log" 2>&1
python3 -m sgl_tts.cli bench "${args[@]}" --gpu "${SGLANG_TTS_GPU:-H200}" --stop-after "${2:-420}" \
    --output "bench-out/$name.jsonl" --no-progress ${SGLANG_TTS_BENCH_EXTRA:-} 2>&1 | tee -a "bench-out/$name.log"
rc=${PIPESTATUS[0]}
for f in "bench-out/$name".{jsonl,md,summary.json,png,log}; do [ -f "$f" ] && cp "$f" "${OUT:-/tmp}/"; done
exit "$rc"
