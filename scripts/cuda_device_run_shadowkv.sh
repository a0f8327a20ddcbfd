#!/usr/bin/env bash
# Runs a ShadowKV CUDA bundle (scripts/cuda_bundle.sh build-cuda-skv .devrun/skv/shadowkv_cuda.tar.xz)
# on a GPU machine: the GPU tests, the ShadowKV kernels under compute-sanitizer, and the
# full-vs-ShadowKV bench (synthetic Llama-3-8B at 60K and 122K). Logs and JSON go to $OUT
# (default /tmp/shadowkv_out); a short summary is printed last. When the fast ShadowKV kernels
# fail their parity tests, the bench runs the first ones (--shadowkv-kernels 0) and says so.
# Usage: scripts/cuda_device_run_shadowkv.sh [tests] [sanitize] [bench] [smoke]
#   (default: tests bench)
#   smoke: the bench at 16K with 16 steps (a quick check before the long run)
#   bench-fp8: the same bench beside ShadowKV with FP8 values, and with FP8 values and landmarks
#     (device-resident values only: --no-host-values)
#   kernels: each decode kernel of one layer timed alone (tests/gpu/shadowkv_kernels_bench_test.cc;
#     the select's variants and the fast rebuild at 32, 64 and 128 gather slots per block)
#   tune: ShadowKV with FP8 values and landmarks at TUNE_CONTEXT (124928) and TUNE_BATCH (20),
#     once per setting of the step (TUNE_SETTINGS, "name:word word|name:...", a word being a
#     bench flag such as --split-share=40 or --coarse-select=0, or an environment variable;
#     default: the defaults, --no-split-rows, that and --coarse-select=0, --rebuild-slots=64)
#   profile: Nsight Compute on the first launches of the kernels matching PROFILE_KERNELS (a
#     '|'-separated list of name regexes; default the two register-basis rebuilds) in the kernel
#     bench, clocks left alone; PROFILE_BASE=mangled matches template arguments too
#   tp-alone: the tensor-parallel tests in a process of their own (TP_CONNECTIONS sets
#     CUDA_DEVICE_MAX_CONNECTIONS when given)
#   accept: the headline bench (full, ShadowKV and ShadowKV with FP8 values and landmarks at
#     60K and 122K, each at its best batch, device-resident values)
#   accept-host: the same with batches that add up to ACCEPT_HOST (4) sequences whose values are
#     in pinned host memory
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/shadowkv_out}
mkdir -p "$out"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests bench)
stage=/tmp/shadowkv_skv
. scripts/cuda_bundle_env.sh
unpack_cuda_bundle .devrun/skv/shadowkv_cuda.tar.xz "$stage" || exit 1
{
  echo "bundle commit: $(cat "$stage/COMMIT" 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
  grep -E "MemTotal|MemAvailable" /proc/meminfo
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

# The headline bench: full, ShadowKV and ShadowKV with FP8 values and landmarks at 60K and 122K,
# each at its best batch. Usage: accept_bench NAME TIMEOUT [flags on value placement...]
accept_bench() {
  local name=$1 limit=$2
  shift 2
  timeout "$limit" "$stage/bin/shadowkv" bench --device cuda --synthetic llama3-8b \
    --kv full,shadowkv,shadowkv:fp8_values=1:fp8_landmarks=1 \
    --context 61440,124928 --batch auto --gen 128 --prefill-chunk 4096 "$@" \
    ${kernel_flags[@]+"${kernel_flags[@]}"} --json "$out/$name.json" > "$out/$name.log" 2>&1
}
kernel_flags=()  # set by the tests step when the fast ShadowKV kernels fail there

declare -A status
for step in "${steps[@]}"; do
  start=$(date +%s)
  case "$step" in
    tests)
      # The tensor-parallel tests run in a process of their own (docs/TENSOR_PARALLEL.md, "Open":
      # a stop of the local split fails every later test of its process).
      timeout 240 "$stage/bin/shadowkv_gpu_tests" --gtest_output="json:$out/gpu_tests.json" \
        --gtest_filter='-CudaTensorParallelTest.*' > "$out/gpu_tests.log" 2>&1
      timeout 150 "$stage/bin/shadowkv_gpu_tests" --gtest_filter='CudaTensorParallelTest.*' \
        > "$out/gpu_tests_tp.log" 2>&1
      # A failure that poisons the CUDA context fails every later test of the process: the
      # kernel parity tests decide the bench's kernels only when they also fail on their own.
      if grep -qE "^\[  FAILED  \] Variants/CudaShadowKvKernelsTest\.[A-Za-z]+/Fast" "$out/gpu_tests.log" &&
         ! timeout 120 "$stage/bin/shadowkv_gpu_tests" --gtest_filter='Variants/CudaShadowKvKernelsTest.*' \
           > "$out/gpu_kernel_tests_alone.log" 2>&1; then
        kernel_flags=(--shadowkv-kernels 0)
        echo "fast ShadowKV kernels failed their tests: the bench runs the first ones" \
          | tee -a "$out/gpu_tests.log"
      fi
      ;;
    sanitize)
      timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 \
        "$stage/bin/shadowkv_gpu_tests" --gtest_filter='*CudaShadowKv*' > "$out/sanitizer.log" 2>&1
      ;;
    smoke)
      timeout 200 "$stage/bin/shadowkv" bench --device cuda --synthetic llama3-8b \
        --kv full,shadowkv --context 16384 --batch 4 --gen 16 --prefill-chunk 4096 \
        --json "$out/bench_smoke.json" > "$out/bench_smoke.log" 2>&1
      ;;
    bench)
      timeout 330 "$stage/bin/shadowkv" bench --device cuda --synthetic llama3-8b \
        --kv full,shadowkv --context 61440,124928 --batch auto --gen 128 --prefill-chunk 4096 \
        ${kernel_flags[@]+"${kernel_flags[@]}"} --json "$out/bench_shadowkv.json" > "$out/bench_shadowkv.log" 2>&1
      ;;
    bench-fp8)
      timeout 480 "$stage/bin/shadowkv" bench --device cuda --synthetic llama3-8b \
        --kv full,shadowkv,shadowkv:fp8_values=1,shadowkv:fp8_values=1:fp8_landmarks=1 \
        --context 61440,124928 --batch auto --gen 128 --prefill-chunk 4096 --no-host-values \
        ${kernel_flags[@]+"${kernel_flags[@]}"} --json "$out/bench_fp8.json" > "$out/bench_fp8.log" 2>&1
      ;;
    kernels)
      SKV_GPU_BENCH=1 timeout 120 "$stage/bin/shadowkv_gpu_tests" \
        --gtest_filter='CudaShadowKvKernelsBench.*' > "$out/kernels.log" 2>&1
      ;;
    tune)
      settings=${TUNE_SETTINGS:-"defaults:|no-split:--no-split-rows|radix8:--no-split-rows --coarse-select=0|slots64:--rebuild-slots=64"}
      IFS='|' read -r -a settings <<< "$settings"
      for setting in "${settings[@]}"; do
        name=${setting%%:*}
        variables=()
        flags=()
        for word in ${setting#*:}; do
          case $word in
            --*) flags+=("$word") ;;
            *) variables+=("$word") ;;
          esac
        done
        env ${variables[@]+"${variables[@]}"} timeout 150 "$stage/bin/shadowkv" bench \
          --device cuda --synthetic llama3-8b --kv shadowkv:fp8_values=1:fp8_landmarks=1 \
          --context "${TUNE_CONTEXT:-124928}" --batch "${TUNE_BATCH:-20}" --gen 128 \
          --prefill-chunk 4096 --no-host-values --json "$out/tune_$name.json" \
          ${flags[@]+"${flags[@]}"} > "$out/tune_$name.log" 2>&1
      done
      ;;
    profile)
      IFS='|' read -r -a kernels <<< "${PROFILE_KERNELS:-SkvRebuildRingKernelILb1ELi10ELi32E|SkvRebuildRegKernelILb1ELi10ELi32E}"
      for i in "${!kernels[@]}"; do
        SKV_GPU_BENCH=1 timeout 200 ncu --clock-control none \
          --kernel-name-base "${PROFILE_BASE:-function}" --kernel-name "regex:${kernels[$i]}" \
          --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
          --section WarpStateStats --section Occupancy --section LaunchStats \
          --section SchedulerStats --section SourceCounters \
          "$stage/bin/shadowkv_gpu_tests" --gtest_filter='CudaShadowKvKernelsBench.*' \
          > "$out/ncu_$i.txt" 2>&1
      done
      ;;
    tp-alone)
      # shellcheck disable=SC2086
      env ${TP_CONNECTIONS:+CUDA_DEVICE_MAX_CONNECTIONS=$TP_CONNECTIONS} timeout 150 \
        "$stage/bin/shadowkv_gpu_tests" --gtest_filter='CudaTensorParallelTest.*' \
        > "$out/tp_alone${TP_CONNECTIONS:+_$TP_CONNECTIONS}.log" 2>&1
      ;;
    accept-host) accept_bench bench_accept_host 560 --max-host-sequences "${ACCEPT_HOST:-4}" ;;
    accept) accept_bench bench_accept 420 --no-host-values ;;
    *) echo "unknown step $step"; continue ;;
  esac
  status[$step]="exit $? in $(( $(date +%s) - start )) s"
done

echo "==== summary"
for step in "${steps[@]}"; do echo "$step: ${status[$step]:-not run}"; done
[ -f "$out/gpu_tests.log" ] && grep -E "^\[  (PASSED|FAILED|SKIPPED) |\[ parity|tests from .* ran|^\[  FAILED" "$out/gpu_tests.log" | head -40
[ -f "$out/gpu_tests.log" ] && grep -B2 -A8 "Failure" "$out/gpu_tests.log" | head -60
[ -f "$out/gpu_tests_tp.log" ] && grep -E "^\[  (PASSED|FAILED|SKIPPED) |tests from .* ran" "$out/gpu_tests_tp.log" | head -20
[ -f "$out/sanitizer.log" ] && grep -E "ERROR SUMMARY|Invalid|error" "$out/sanitizer.log" | head -20
[ -f "$out/bench_smoke.log" ] && cat "$out/bench_smoke.log"
[ -f "$out/bench_shadowkv.log" ] && cat "$out/bench_shadowkv.log"
[ -f "$out/bench_fp8.log" ] && cat "$out/bench_fp8.log"
[ -f "$out/kernels.log" ] && grep -E "\[ kernels \]|FAILED|rror" "$out/kernels.log"
for log in "$out"/tune_*.log; do
  [ -f "$log" ] && echo "$(basename "$log"):" && grep -E "^shadowkv|^ +[0-9]+ +[0-9]+ +[0-9]+/|rror" "$log"
done
for log in "$out"/ncu_*.txt; do
  [ -f "$log" ] && grep -E "Skv|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Stall|Warp Cycles Per Issued|Issued Warp|No Eligible|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|==ERR|==PROF==" "$log" | head -60
done
for log in "$out"/tp_alone*.log; do
  [ -f "$log" ] && echo "$(basename "$log"):" && grep -E "^\[  (PASSED|FAILED) |tests from .* ran|trap|Failure" "$log" | head -20
done
[ -f "$out/bench_accept.log" ] && cat "$out/bench_accept.log"
[ -f "$out/bench_accept_host.log" ] && cat "$out/bench_accept_host.log"
exit 0
