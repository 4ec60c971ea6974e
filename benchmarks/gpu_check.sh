#!/usr/bin/env bash
# The single-GPU checks, in one go, each step bounded in time and independent of the others:
#   1. paraplan calibrate (full sweep) -> DIR/profile.yaml and DIR/calibration.json
#   2. benchmarks/gpu_closed_loop.py   -> DIR/closed_loop.json (executor-measured vs predicted)
#   3. benchmarks/bench_executor.py    -> the executor's MFU
# Logs go to DIR/*.log, the machine's description to DIR/env.txt.
#
#   bash benchmarks/gpu_check.sh DIR
set -u
dir=${1:?usage: gpu_check.sh OUTPUT_DIR}
mkdir -p "$dir"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit,temperature.gpu \
    --format=csv 2>&1
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
} >"$dir/env.txt" 2>&1
cat "$dir/env.txt"

step() {  # step NAME SECONDS CMD...: run CMD under a time limit, log to DIR/NAME.log, report its status
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$dir/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  tail -n 40 "$dir/$name.log"
}

step calibrate "${CALIBRATE_S:-270}" $py -m paraplan calibrate --out "$dir/profile.yaml" \
  --report "$dir/calibration.json" --no-progress
profile=()
[ -f "$dir/profile.yaml" ] && profile=(--profile "$dir/profile.yaml")
step closed_loop "${CLOSED_LOOP_S:-220}" $py benchmarks/gpu_closed_loop.py "${profile[@]}" --out "$dir/closed_loop.json"
step bench_executor "${BENCH_S:-70}" $py benchmarks/bench_executor.py
