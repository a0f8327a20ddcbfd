#!/usr/bin/env bash
# Runs a CUDA bundle made by scripts/cuda_bundle.sh on a GPU machine: the GPU tests, the same
# under compute-sanitizer, the CUDA bench (synthetic Llama-3-8B) and the PyTorch SDPA anchor.
# Logs and JSON go to $OUT (default /tmp/shadowkv_out); a short summary is printed last.
# micro: the kernel micro-benchmarks (decode attention split counts against the read probe,
# prefill attention, GEMMs) from the GPU test binary with SKV_GPU_BENCH=1.
# tp: the tensor-parallel tests and a Llama-3-8B bench split in two (docs/TENSOR_PARALLEL.md).
# tp-scale: Llama-3-8B on 1 and 2 GPUs and the 70B shape on 2, at 122K and 244K, up to 280 s
#   each: more than one call allows, so pick cases with TP_SCALE_CASES (e.g. llama3-8b:2) and
#   TP_SCALE_CONTEXTS (e.g. "124928"); TP_SCALE_KV (default full,shadowkv) and TP_SCALE_TIMEOUT
#   (seconds per bench, default 280) for the 70B shape at 244K.
# tp-probe: traced runs of the open two-GPU stop (see the step).
# tp-repeat: the same case untraced, TP_REPEAT times, with host stacks if it stops.
# serve: `shadowkv serve --device cuda` end to end, one GPU and split in two (after tests).
# Usage: scripts/cuda_device_run.sh [tests] [sanitize] [micro] [bench] [tp] [tp-scale] [tp-probe]
#        [tp-repeat] [serve] [anchor]
#        (default: tests sanitize bench anchor)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/shadowkv_out}
mkdir -p "$out"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests sanitize bench anchor)
stage=/tmp/shadowkv_cuda
. scripts/cuda_bundle_env.sh
unpack_cuda_bundle .devrun/shadowkv_cuda.tar.xz "$stage" || exit 1
{
  echo "bundle commit: $(cat "$stage/COMMIT" 2>/dev/null)"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  ldd "$stage/bin/shadowkv_gpu_tests" | grep -E "not found|cuda|cublas"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

declare -A status
for step in "${steps[@]}"; do
  start=$(date +%s)
  case "$step" in
    tests)
      timeout 300 "$stage/bin/shadowkv_gpu_tests" --gtest_output="json:$out/gpu_tests.json" \
        > "$out/gpu_tests.log" 2>&1
      ;;
    sanitize)
      # memcheck over every kernel test; racecheck over the shared-memory kernels. Not the
      # tensor-parallel tests: their ranks' all-reduce kernels wait for each other across
      # streams, which needs the kernels to run concurrently.
      { timeout 240 compute-sanitizer --tool memcheck --error-exitcode 9 \
          "$stage/bin/shadowkv_gpu_tests" --gtest_filter="${SKV_MEMCHECK_FILTER:-Cuda*Test.*-CudaModelParityTest.*:CudaTensorParallelTest.*}" &&
        timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 \
          "$stage/bin/shadowkv_gpu_tests" \
          --gtest_filter="${SKV_RACECHECK_FILTER:-CudaPrefillAttentionTest.FreshPromptLlama3Shape:CudaDecodeAttentionTest.Llama3ShapeManySplits:CudaRmsNormTest.*:CudaSamplingTest.GreedyMatchesCpuArgmax}"; \
      } > "$out/sanitizer.log" 2>&1
      ;;
    micro)
      SKV_GPU_BENCH=1 timeout 240 "$stage/bin/shadowkv_gpu_tests" --gtest_filter='*Bench*' \
        > "$out/micro.log" 2>&1
      ;;
    bench)
      timeout 420 "$stage/bin/shadowkv" bench --device cuda --synthetic llama3-8b --kv full \
        --context 32768,61440,124928 --batch auto --gen 128 --prefill-chunk 4096 \
        --json "$out/bench_cuda.json" > "$out/bench_cuda.log" 2>&1
      ;;
    tp)
      # Tensor parallelism: its tests, then Llama-3-8B split in two, on one GPU through the
      # local communicator (ranks share the GPU: this shows the split runs, not how it scales)
      # and, where there are two GPUs or more, over GPUs 0 and 1 through NCCL.
      # Each test in a process of its own: a deadlocked all-reduce traps and poisons the CUDA
      # context, which would fail every later test of the same process. Modules load eagerly
      # and every stream gets its own hardware queue, so that no rank's kernel can wait behind
      # another rank's spinning all-reduce (docs/TENSOR_PARALLEL.md, the x2 runs).
      # SHADOWKV_TP_TRACE=1 in the environment logs every rank's tasks and all-reduces.
      export CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 NCCL_NVLS_ENABLE=0
      : > "$out/tp_tests.log"
      for test in $("$stage/bin/shadowkv_gpu_tests" --gtest_list_tests \
                      --gtest_filter='CudaTensorParallelTest*.*' | awk '/^[^ ]/ {s=$1} /^  / {print s $1}'); do
        timeout 120 "$stage/bin/shadowkv_gpu_tests" --gtest_filter="$test" >> "$out/tp_tests.log" 2>&1
        echo "$test: exit $?" >> "$out/tp_tests.log"
      done
      tp_args=(bench --device cuda --synthetic llama3-8b --kv full,shadowkv --context 32768
               --batch auto --max-batch 16 --gen 64 --prefill-chunk 4096 --tensor-parallel 2)
      timeout 300 "$stage/bin/shadowkv" "${tp_args[@]}" --tp-local \
        --json "$out/bench_tp_local.json" > "$out/bench_tp.log" 2>&1
      if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
        timeout 300 "$stage/bin/shadowkv" "${tp_args[@]}" \
          --json "$out/bench_tp_nccl.json" >> "$out/bench_tp.log" 2>&1
      fi
      ;;
    tp-scale)
      # The issue's scaling runs (two GPUs or more): Llama-3-8B on one GPU and split in two, and
      # the 70B shape split in two, full attention and ShadowKV at 122K and 244K, each at its
      # best batch. One bench per process and per limit, so that one stuck case costs only its own.
      export CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0
      IFS=, read -ra cases <<< "${TP_SCALE_CASES:-llama3-8b:1,llama3-8b:2,llama3-70b:2}"
      for run in "${cases[@]}"; do
        set -- ${run/:/ }
        for context in ${TP_SCALE_CONTEXTS:-124928 249856}; do
          label="scale_${1}_tp${2}_${context}${TP_SCALE_KV:+_${TP_SCALE_KV//,/_}}"
          timeout "${TP_SCALE_TIMEOUT:-280}" "$stage/bin/shadowkv" bench --device cuda \
            --synthetic "$1" --kv "${TP_SCALE_KV:-full,shadowkv}" \
            --no-host-values --context "$context" --batch auto --gen 64 --prefill-chunk 4096 \
            --tensor-parallel "$2" \
            --json "$out/$label.json" > "$out/$label.log" 2>&1
          echo "$label: exit $?" >> "$out/bench_tp.log"
          grep -E "^(full|shadowkv) " "$out/$label.log" >> "$out/bench_tp.log"
        done
      done
      ;;
    tp-probe)
      # The open two-GPU stop (docs/TENSOR_PARALLEL.md): Llama-3-8B full attention at 122K with
      # 16 sequences over NCCL stops in its first prefill chunk. Three runs, 60 s each, traced:
      # as found; after an 8K case has run first in the same process (kernels and NCCL warmed
      # with memory to spare); and with every launch synchronous (the host then stops in the
      # launch of the kernel that does not finish). Per rank: all-reduces issued, last event.
      # A 20 s step timeout (far above one prefill chunk) turns a stop into the group's error.
      export CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0 SHADOWKV_TP_TRACE=1
      export SHADOWKV_TP_STEP_TIMEOUT_S=${SHADOWKV_TP_STEP_TIMEOUT_S:-20}
      probe_args=(bench --device cuda --synthetic llama3-8b --kv full --batch auto --gen 16
                  --prefill-chunk 4096 --tensor-parallel 2)
      for variant in "as-found:124928" "warmed:8192,124928" "blocking:124928"; do
        name=${variant%%:*}
        launch_blocking=0; [ "$name" = blocking ] && launch_blocking=1
        CUDA_LAUNCH_BLOCKING=$launch_blocking timeout 60 "$stage/bin/shadowkv" "${probe_args[@]}" \
          --context "${variant#*:}" > "$out/tp_probe_$name.log" 2>&1
        echo "tp-probe $name: exit $?" >> "$out/tp_probe.log"
        grep -E "^full |error|timed out|abort" "$out/tp_probe_$name.log" | grep -v "rank [01]:" |
          head -5 >> "$out/tp_probe.log"
        for rank in 0 1; do
          echo "  rank $rank: $(grep -c "rank $rank: nccl all-reduce" "$out/tp_probe_$name.log") all-reduces; last: $(grep "rank $rank:" "$out/tp_probe_$name.log" | tail -1)" >> "$out/tp_probe.log"
        done
      done
      ;;
    tp-repeat)
      # The open two-GPU stop, as found and untraced, TP_REPEAT times (default 4): Llama-3-8B full
      # attention at 122K, 16 sequences over NCCL. A 20 s step timeout turns a stop into an error
      # that names each rank's issued all-reduces and writes the host stack of every rank
      # thread that had not returned (resolve with addr2line on the same binary).
      export CUDA_MODULE_LOADING=EAGER NCCL_NVLS_ENABLE=0
      export SHADOWKV_TP_STEP_TIMEOUT_S=${SHADOWKV_TP_STEP_TIMEOUT_S:-20}
      : > "$out/tp_repeat.log"
      for i in $(seq "${TP_REPEAT:-4}"); do
        timeout 90 "$stage/bin/shadowkv" bench --device cuda --synthetic llama3-8b --kv full \
          --context 124928 --batch auto --gen 16 --prefill-chunk 4096 --tensor-parallel 2 \
          > "$out/tp_repeat_$i.log" 2>&1
        echo "tp-repeat $i: exit $?" >> "$out/tp_repeat.log"
        grep -E "^full |timed out|had not returned|stack|^/|^\./|^.*\(\+0x" "$out/tp_repeat_$i.log" |
          head -80 >> "$out/tp_repeat.log"
      done
      ;;
    serve)
      # `shadowkv serve --device cuda` end to end (tests/gpu/serve_check.py) on the tiny random
      # model the GPU tests write, full attention and ShadowKV, on one GPU and split in two
      # (over NCCL where there are two GPUs, else through the local communicator).
      model=$(ls -t /tmp/tiny_gpu_serving_*.gguf 2>/dev/null | head -1)
      if [ -z "$model" ]; then
        "$stage/bin/shadowkv_gpu_tests" --gtest_filter='CudaServingTest.Refuses*' > /dev/null 2>&1
        model=$(ls -t /tmp/tiny_gpu_serving_*.gguf 2>/dev/null | head -1)
      fi
      split=(--tensor-parallel 2)
      [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ] || split+=(--tp-local)
      : > "$out/serve.log"
      for kv in full shadowkv; do
        for tp in one split; do
          args=(--device cuda --kv "$kv" --budget 128 --max-batch 4 --max-seqs 3 --prefill-chunk 64)
          [ $tp = split ] && args+=("${split[@]}")
          echo "== serve $kv $tp: ${args[*]}" >> "$out/serve.log"
          PYTHONUNBUFFERED=1 timeout 240 python3 tests/gpu/serve_check.py "$stage/bin/shadowkv" \
            "$model" "${args[@]}" >> "$out/serve.log" 2>&1
          echo "serve $kv $tp: exit $?" >> "$out/serve.log"
        done
        # Random weights (serve --synthetic), the pool and batch sized from the GPU's memory.
        args=(--device cuda --kv "$kv" --budget 128 --prefill-chunk 64)
        echo "== serve $kv synthetic, pool from memory: ${args[*]}" >> "$out/serve.log"
        PYTHONUNBUFFERED=1 timeout 240 python3 tests/gpu/serve_check.py "$stage/bin/shadowkv" \
          synthetic:smollm2-135m "${args[@]}" >> "$out/serve.log" 2>&1
        echo "serve $kv synthetic: exit $?" >> "$out/serve.log"
      done
      ;;
    anchor)
      PYTHONUNBUFFERED=1 timeout 420 python3 bench/pytorch_sdpa_anchor.py \
        --contexts 61440,124928 --prefill 32768,124928 > "$out/anchor.log" 2>&1  # JSON last
      ;;
    *) echo "unknown step $step"; continue ;;
  esac
  status[$step]="exit $? in $(( $(date +%s) - start )) s"
done

echo "==== summary"
for step in "${steps[@]}"; do echo "$step: ${status[$step]:-not run}"; done
[ -f "$out/gpu_tests.log" ] && grep -E "^\[  (PASSED|FAILED|SKIPPED) |\[ parity|tests from .* ran" "$out/gpu_tests.log" | head -40
[ -f "$out/gpu_tests.log" ] && grep -B2 -A8 "Failure" "$out/gpu_tests.log" | head -60
[ -f "$out/sanitizer.log" ] && grep -E "ERROR SUMMARY|Invalid|Race|error" "$out/sanitizer.log" | head -20
if [ -f "$out/micro.log" ]; then
  grep -E "^\[bench\]" "$out/micro.log" | grep -v " variant " | grep -v " splits "
  grep -E "^\[bench\].*(auto)" "$out/micro.log"
  grep -E "^\[bench\] (prefill|gemm)" "$out/micro.log"
  grep -E "^picked:" "$out/micro.log"
  echo "fastest decode configurations:"
  grep -E "^\[bench\].* variant .* GB/s" "$out/micro.log" | sort -t= -k2 -n -r | head -8
fi
[ -f "$out/bench_cuda.log" ] && cat "$out/bench_cuda.log"
[ -f "$out/tp_tests.log" ] && grep -E "^\[  (PASSED|FAILED|SKIPPED) |\[ parity|Failure|: exit " "$out/tp_tests.log"
[ -f "$out/bench_tp.log" ] && cat "$out/bench_tp.log"
[ -f "$out/tp_probe.log" ] && cat "$out/tp_probe.log"
[ -f "$out/tp_repeat.log" ] && cat "$out/tp_repeat.log"
[ -f "$out/serve.log" ] && grep -E "^(== |PASS|FAIL|serve |[0-9]+ passed)|Error|error" "$out/serve.log" | head -60
[ -f "$out/anchor.log" ] && grep -E "^(anchor|SDPA|decode .*out of memory)" "$out/anchor.log"
exit 0
