#!/usr/bin/env bash
# Profiles the ShadowKV selection kernels with Nsight Compute on a GPU machine: the kernel bench
# of the GPU tests (CudaShadowKvKernelsBench, one timed launch each) under `ncu`, then the
# report's details (speed of light, occupancy, warp stalls, memory) and, per kernel, the SASS
# with its stall samples, as CSV in $OUT. Run from the repository root after
# scripts/cuda_device_run_accuracy.sh has unpacked the bundle (or give the test binary).
# Usage: dev/cuda/profile_kernels.sh [KERNEL_REGEX] [GTEST_FILTER] [TEST_BINARY]
set -uo pipefail
regex=${1:-SkvSelectFast|SkvExactScoreFast|SkvRerankSelect|SkvScoreTc}
filter=${2:-*RerankKernelTimes*}
binary=${3:-/tmp/shadowkv_accuracy/bin/shadowkv_gpu_tests}
out=${OUT:-/tmp/shadowkv_out}
mkdir -p "$out"
. scripts/cuda_bundle_env.sh
[ -d /tmp/shadowkv_accuracy/lib ] && export LD_LIBRARY_PATH="/tmp/shadowkv_accuracy/lib:${LD_LIBRARY_PATH:-}"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu on this machine"; exit 1; }
report="$out/kernels"
SKV_GPU_BENCH=1 SKV_BENCH_REPEATS=1 timeout "${LIMIT:-300}" "$ncu" --set full \
  --kernel-name "regex:$regex" --export "$report" --force-overwrite \
  "$binary" --gtest_filter="$filter" > "$out/ncu_run.log" 2>&1
echo "ncu: exit $? ($(grep -c '==PROF==' "$out/ncu_run.log") profiler lines)"
"$ncu" --import "$report.ncu-rep" --page details --csv > "$out/ncu_details.csv" 2>&1
"$ncu" --import "$report.ncu-rep" --page source --csv --print-source sass \
  > "$out/ncu_source.csv" 2>&1
ls -la "$out"
