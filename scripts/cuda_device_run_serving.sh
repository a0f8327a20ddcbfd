#!/usr/bin/env bash
# Serving on a GPU machine, against the bench in the same call (docs/PERF.md, "Serving on the
# GPU"): a real model whose GGUF travels in parts, the CUDA bundle of scripts/cuda_bundle.sh and
# the openai client as wheels (.whl). Logs and JSON go to $OUT (default /tmp/shadowkv_out).
# Usage: scripts/cuda_device_run_serving.sh STEP...
#   assemble: appends the parts in .devrun/qwen/ to $MODEL (default $HOME/m/model.gguf); with
#     MODEL_SHA256 set, checks the whole file's sha256 (the last part's call)
#   setup: keeps the bundle (.devrun/skv/shadowkv_cuda.tar.xz) in $HOME for later calls and
#     installs the wheels in .whl/ to /tmp/site
#   tests: the GPU tests of the serving path (sampling, models, serving, ShadowKV model)
#   tests-all: the whole GPU test binary (tensor-parallel tests in a process of their own)
#   bench: `bench` at SERVE_CONTEXTS (default 20000,30000) x SERVE_BATCH (64), the policies of
#     SERVE_KV (default full,shadowkv), step loop and engine loop
#   serve: bench/serve_bench.py, SERVE_BATCH concurrent streams of SERVE_PROMPT (20000) token ids
#     and SERVE_OUTPUT (2048) tokens each, a server per policy of SERVE_KV
#   (bench and serve: with SERVE_SYNTH=NAME, random weights of that shape instead of the GGUF,
#   e.g. qwen2.5-0.5b; no model to assemble)
#   load: 160 concurrent short streams at --max-batch 64 --max-queue 64 (every stream past the
#     queue gets 429, none is lost)
#   servecheck: tests/gpu/serve_check.py (greedy repeatability, refusals, SIGTERM) on the GPU
#     tests' tiny model, full and ShadowKV
#   synth: synthetic Llama-3-8B at SYNTH_CONTEXT (124928): the bench (SYNTH_KV, default full,
#     ShadowKV and ShadowKV FP8; SYNTH_GEN decode steps, default 128) and serve_bench with one
#     shared prompt copied to SYNTH_BATCH_FULL / SYNTH_BATCH_SKV / SYNTH_BATCH_FP8 streams
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/shadowkv_out}
mkdir -p "$out"
model=${MODEL:-$HOME/m/model.gguf}
bundle=$HOME/shadowkv_cuda.tar.xz
stage=/tmp/shadowkv_serving
contexts=${SERVE_CONTEXTS:-20000,30000}
batch=${SERVE_BATCH:-64}
prompt=${SERVE_PROMPT:-20000}
output=${SERVE_OUTPUT:-2048}
synth_context=${SYNTH_CONTEXT:-124928}
serve_kv=${SERVE_KV:-full,shadowkv}
if [ -n "${SERVE_SYNTH:-}" ]; then
  weights=(--synthetic "$SERVE_SYNTH")
else
  weights=(--model "$model")  # bench's and serve_bench.py's flag alike
fi

bundle_ready() {
  [ -e "$bundle" ] || { echo "no bundle: run the setup step first"; return 1; }
  . scripts/cuda_bundle_env.sh
  unpack_cuda_bundle "$bundle" "$stage" || return 1
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
}

for step in "$@"; do
  start=$(date +%s)
  case "$step" in
    assemble)
      mkdir -p "$(dirname "$model")"
      for part in .devrun/qwen/part*; do cat "$part" >> "$model"; done
      ls -la "$model"
      if [ -n "${MODEL_SHA256:-}" ]; then
        echo "$MODEL_SHA256  $model" | sha256sum -c - || exit 1
      fi
      ;;
    setup)
      cp .devrun/skv/shadowkv_cuda.tar.xz "$bundle" || exit 1
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
      bundle_ready || exit 1
      echo "bundle commit: $(cat "$stage/COMMIT")"
      nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
      PYTHONPATH=/tmp/site python3 -c "import openai; print('openai', openai.__version__)"
      ;;
    tests)
      bundle_ready || exit 1
      timeout 300 "$stage/bin/shadowkv_gpu_tests" \
        --gtest_filter='CudaSampling*:CudaServing*:CudaModel*:CudaShadowKvParity*:CudaShadowKvFp8*:CudaShadowKvSnapshot*:CudaTensorParallelTest.*Sampl*' \
        > "$out/gpu_tests_serving.log" 2>&1
      echo "tests: exit $?"
      grep -E "^\[  (PASSED|FAILED)|tests ran" "$out/gpu_tests_serving.log" | head -20
      ;;
    tests-all)
      bundle_ready || exit 1
      timeout 300 "$stage/bin/shadowkv_gpu_tests" --gtest_filter='-CudaTensorParallelTest.*' \
        > "$out/gpu_tests.log" 2>&1
      echo "tests (all but TP): exit $?"
      timeout 150 "$stage/bin/shadowkv_gpu_tests" --gtest_filter='CudaTensorParallelTest.*' \
        > "$out/gpu_tests_tp.log" 2>&1
      echo "tests (TP): exit $?"
      grep -hE "^\[  (PASSED|FAILED)|tests ran" "$out/gpu_tests.log" "$out/gpu_tests_tp.log" | head -30
      ;;
    bench)
      bundle_ready || exit 1
      timeout 420 "$stage/bin/shadowkv" bench --device cuda "${weights[@]}" --kv "$serve_kv" \
        --context "$contexts" --batch "$batch" --gen 256 --prefill-chunk 2048 \
        --json "$out/bench_serving.json" > "$out/bench_serving.log" 2>&1
      echo "bench: exit $?"
      grep -E "^(full|shadowkv) |engine loop|context [0-9]+:" "$out/bench_serving.log"
      ;;
    serve)
      bundle_ready || exit 1
      timeout 560 python3 bench/serve_bench.py --binary "$stage/bin/shadowkv" "${weights[@]}" \
        --server-per-kv --kv "$serve_kv" --prompt-ids "$prompt" --output-tokens "$output" \
        --num-requests "$batch" --concurrency "$batch" --client-processes 8 --startup-timeout 300 \
        --request-timeout 1200 --json "$out/serve_${prompt}.json" -- --device cuda \
        --ctx-size 32768 --max-batch "$batch" --max-seqs "$batch" --prefill-chunk 2048 \
        --http-threads $((batch + 16)) --max-body 4096 --timeout 3600 \
        > "$out/serve_${prompt}.log" 2>&1
      echo "serve: exit $?"
      grep -E "== kv|steady|TTFT|ITL|engine loop|compression|errors|GPU pool|bounded" \
        "$out/serve_${prompt}.log"
      ;;
    load)
      bundle_ready || exit 1
      timeout 300 python3 bench/serve_bench.py --binary "$stage/bin/shadowkv" --model "$model" \
        --prompt-ids 1000 --output-tokens 64 --num-requests 160 --concurrency 160 \
        --client-processes 8 \
        --startup-timeout 300 --json "$out/serve_load.json" -- --device cuda --kv full \
        --ctx-size 4096 --max-batch 64 --max-seqs 64 --max-queue 64 --prefill-chunk 2048 \
        --http-threads 200 --timeout 600 > "$out/serve_load.log" 2>&1
      echo "load: exit $?"
      grep -E "== kv|errors|steady" "$out/serve_load.log"
      ;;
    servecheck)
      bundle_ready || exit 1
      tiny=$(ls -t /tmp/tiny_gpu_serving_*.gguf 2>/dev/null | head -1)
      if [ -z "$tiny" ]; then
        "$stage/bin/shadowkv_gpu_tests" --gtest_filter='CudaServingTest.Refuses*' > /dev/null 2>&1
        tiny=$(ls -t /tmp/tiny_gpu_serving_*.gguf 2>/dev/null | head -1)
      fi
      : > "$out/servecheck.log"
      for kv in full shadowkv; do
        timeout 200 python3 tests/gpu/serve_check.py "$stage/bin/shadowkv" "$tiny" --device cuda \
          --kv "$kv" --budget 128 --max-batch 4 --max-seqs 3 --prefill-chunk 64 \
          >> "$out/servecheck.log" 2>&1
        echo "servecheck $kv: exit $?" | tee -a "$out/servecheck.log"
      done
      ;;
    synth)
      bundle_ready || exit 1
      fp8=shadowkv:fp8_values=1:fp8_landmarks=1
      synth_kv=${SYNTH_KV:-full,shadowkv,$fp8}
      timeout 330 "$stage/bin/shadowkv" bench --device cuda --synthetic llama3-8b \
        --kv "$synth_kv" --context "$synth_context" \
        --batch auto --gen "${SYNTH_GEN:-128}" --prefill-chunk 4096 --no-host-values \
        --json "$out/bench_synth.json" > "$out/bench_synth.log" 2>&1
      echo "synth bench: exit $?"
      grep -E "^(full|shadowkv) |engine loop|context [0-9]+:" "$out/bench_synth.log"
      for kv in ${synth_kv//,/ }; do
        n=${SYNTH_BATCH_FULL:-7}
        pool=(--max-seqs "$n")
        # ShadowKV: one prompt slot (the shared prompt's) beside the compressed sequences.
        [ $kv = shadowkv ] && n=${SYNTH_BATCH_SKV:-9} && pool=(--max-seqs "$n" --prefill-slots 1)
        [ $kv = $fp8 ] && n=${SYNTH_BATCH_FP8:-16} && pool=(--max-seqs "$n" --prefill-slots 1)
        timeout 240 python3 bench/serve_bench.py --binary "$stage/bin/shadowkv" \
          --synthetic llama3-8b --prompt-ids "$synth_context" --shared-prompt --output-tokens 256 \
          --num-requests "$n" --concurrency "$n" --client-processes 4 --startup-timeout 200 \
          --request-timeout 600 \
          --json "$out/serve_synth_${kv//[:=]/_}.json" -- --kv "$kv" \
          --ctx-size $((synth_context + 512)) \
          --max-batch "$n" "${pool[@]}" --prefill-chunk 4096 \
          --max-body 4096 --timeout 3600 > "$out/serve_synth_${kv//[:=]/_}.log" 2>&1
        echo "synth serve $kv: exit $?"
        grep -E "== kv|steady|ITL|engine loop|errors|GPU pool" \
          "$out/serve_synth_${kv//[:=]/_}.log"
      done
      ;;
    *)
      echo "unknown step '$step'"
      exit 2
      ;;
  esac
  echo "[$step: $(( $(date +%s) - start )) s]"
done
