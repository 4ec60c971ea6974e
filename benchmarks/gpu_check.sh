#!/usr/bin/env bash
# The single-GPU checks, in one go, each step bounded in time and independent of the others:
#   1. paraplan calibrate (full sweep) -> DIR/profile.yaml and DIR/calibration.json
#   2. benchmarks/gpu_closed_loop.py   -> DIR/closed_loop.json (executor-measured vs predicted)
#   3. benchmarks/bench_executor.py    -> the executor's MFU
#   4. benchmarks/gpu_grouped_experts.py --kernels -> DIR/grouped_experts.json (the executor's MoE experts:
#      grouped against per-expert GEMMs, and the grouped GEMM kernels against the GEMM model)
# Logs go to DIR/*.log, the machine's description to DIR/env.txt, with an 8192^3 bf16 GEMM's rate
# before and after the steps (a GPU that slows down when hot or at its power limit shows here),
# and the clocks and power every 2 s to DIR/dmon.log.
#
#   bash benchmarks/gpu_check.sh DIR
set -u
dir=${1:?usage: gpu_check.sh OUTPUT_DIR}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)  # absolute: the steps run from the repository's root
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit,temperature.gpu \
    --format=csv 2>&1
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
} >"$dir/env.txt" 2>&1

gemm_rate() {  # the mean of 20 back-to-back 8192^3 bf16 products on random data, after 3 warm-ups
  $py -c "
import torch
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda.synchronize(); s.record()
for _ in range(20): a @ b
e.record(); e.synchronize()
print('$1: bf16 8192^3 %.1f TFLOP/s' % (2 * 8192**3 * 20 / s.elapsed_time(e) / 1e9))" >>"$dir/env.txt" 2>&1
}
gemm_rate before
cat "$dir/env.txt"
nvidia-smi dmon -s pucv -d 2 >"$dir/dmon.log" 2>&1 &
dmon=$!
trap 'kill $dmon 2>/dev/null' EXIT

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
profile=""
[ -f "$dir/profile.yaml" ] && profile="--profile $dir/profile.yaml"
# shellcheck disable=SC2086  # $profile is empty or two words
step closed_loop "${CLOSED_LOOP_S:-220}" $py benchmarks/gpu_closed_loop.py $profile --out "$dir/closed_loop.json"
step bench_executor "${BENCH_S:-70}" $py benchmarks/bench_executor.py
gpu_profile=""
[ -f "$dir/profile.yaml" ] && gpu_profile="--gpu-profile $dir/profile.yaml"
# shellcheck disable=SC2086
step grouped_experts "${EXPERTS_S:-90}" $py benchmarks/gpu_grouped_experts.py --kernels $gpu_profile \
  --out "$dir/grouped_experts.json"
gemm_rate after
tail -n 1 "$dir/env.txt"
