#!/usr/bin/env bash
# Accuracy against speed on a GPU machine (docs/RESULTS.md, "Twenty samples per task"): the GPU
# tests of ShadowKV, `eval --device cuda` of several KV settings and `bench` of the same settings,
# from the CUDA bundle of scripts/cuda_bundle.sh (.devrun/skv/shadowkv_cuda.tar.xz, kept in
# $HOME by the first step that finds it). Models travel in parts (steps part and join). Logs and
# JSON go to $OUT.
# Usage: scripts/cuda_device_run_accuracy.sh STEP...
#   part               keeps the model parts carried in .devrun/x_*/ (files NAME_NN, from
#                      `split -d`) in $HOME/m/parts for a later join
#   join:NAME:SHA256   appends $HOME/m/parts/NAME_* in order into $HOME/m/NAME.gguf and checks
#                      its sha256
#   tests              the GPU tests of ShadowKV and the models (CudaShadowKv*, CudaModel*), or
#                      those of the gtest filter $TESTS ('*': the whole binary); tests/data is
#                      linked where the bundle's build had it
#   eval:MODEL:LENGTH  every task at LENGTH, $SAMPLES samples (default 20), policies $KV; with
#                      FIDELITY=1 also each policy's fidelity along full attention's answers;
#                      $EVAL_ARGS are added (e.g. "--multi-turn 4 --fresh-turns")
#   bench:MODEL:CTX    `bench --batch auto` at CTX tokens, policies $KV (full added first);
#                      $BENCH_ARGS are added (e.g. --no-host-values)
#   synth:CTX          the same on synthetic weights of $SYNTH (default llama3-8b) at batch
#                      $BATCH (default auto), $BENCH_ARGS added; stores stay in device memory
#                      unless HOST_VALUES=1
#   lab:NAME           a kernel lab of dev/cuda built here (nvcc ... dev/cuda/NAME.cu -o
#                      .devrun/skv/NAME) and carried beside the bundle; its output to $OUT
# MODEL is a file under $HOME/m (qwen, smol: $HOME/m/qwen.gguf); $TAG names the outputs.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/shadowkv_out}
mkdir -p "$out"
bundle=$HOME/shadowkv_cuda.tar.xz
stage=/tmp/shadowkv_accuracy
haystack=$HOME/jargon.txt.gz
kv=${KV:-full,shadowkv}
tag=${TAG:-run}
host_flag=--no-host-values
[ -n "${HOST_VALUES:-}" ] && host_flag=--host-values
[ -e .devrun/skv/shadowkv_cuda.tar.xz ] && cp .devrun/skv/shadowkv_cuda.tar.xz "$bundle"
[ -e .devrun/skv/jargon.txt.gz ] && cp .devrun/skv/jargon.txt.gz "$haystack"
. scripts/cuda_bundle_env.sh
if [ -e "$bundle" ]; then
  unpack_cuda_bundle "$bundle" "$stage" || exit 1
  echo "bundle commit: $(cat "$stage/COMMIT")"
fi

for step in "$@"; do
  start=$(date +%s)
  IFS=: read -r what model length <<< "$step"
  case "$what" in
    part)
      mkdir -p "$HOME/m/parts"
      for file in .devrun/x_*/*; do [ -e "$file" ] && cp "$file" "$HOME/m/parts/"; done
      ls -la "$HOME/m/parts"
      ;;
    join)
      cat "$HOME/m/parts/${model}"_* > "$HOME/m/$model.gguf" || exit 1
      echo "$length  $HOME/m/$model.gguf" | sha256sum -c - || exit 1
      ;;
    tests)
      source_dir=$(cat "$stage/SOURCE_DIR" 2>/dev/null)
      if [ -n "$source_dir" ] && [ ! -e "$source_dir/tests/data" ]; then
        mkdir -p "$(dirname "$source_dir")" && ln -sfn "$PWD" "$source_dir"
      fi
      timeout "${LIMIT:-400}" "$stage/bin/shadowkv_gpu_tests" \
        --gtest_filter="${TESTS:-CudaShadowKv*:CudaModel*:CudaSkv*:CudaRerank*:CudaSelect*}" \
        > "$out/gpu_tests_${tag}.log" 2>&1
      echo "tests: exit $?"
      grep -E "^\[  (PASSED|FAILED)|FAILED  \]|tests ran|\[ parity" "$out/gpu_tests_${tag}.log" | head -40
      ;;
    eval)
      timeout "${LIMIT:-400}" "$stage/bin/shadowkv" eval -m "$HOME/m/$model.gguf" \
        --haystack "$haystack" --device cuda --kv "$kv" --lengths "$length" \
        --samples "${SAMPLES:-20}" ${SEED:+--seed "$SEED"} ${FIDELITY:+--fidelity} ${EVAL_ARGS:-} \
        --json "$out/${model}_${length}_${tag}.json" > "$out/${model}_${length}_${tag}.log" 2>&1
      echo "eval $model $length: exit $?"
      grep -vE "^\[eval\]" "$out/${model}_${length}_${tag}.log" | tail -22
      ;;
    bench)
      case ",$kv," in *,full,*) bench_kv=$kv ;; *) bench_kv=full,$kv ;; esac
      timeout "${LIMIT:-300}" "$stage/bin/shadowkv" bench --device cuda -m "$HOME/m/$model.gguf" \
        --kv "$bench_kv" --context "$length" --batch auto --gen 128 --prefill-chunk 2048 \
        --no-engine-loop ${BENCH_ARGS:-} --json "$out/bench_${model}_${length}_${tag}.json" \
        > "$out/bench_${model}_${length}_${tag}.log" 2>&1
      echo "bench $model $length: exit $?"
      grep -E "decode|tok/s|rank|batch" "$out/bench_${model}_${length}_${tag}.log" | tail -20
      ;;
    synth)
      timeout "${LIMIT:-400}" "$stage/bin/shadowkv" bench --device cuda \
        --synthetic "${SYNTH:-llama3-8b}" --kv "$kv" --context "$model" --batch "${BATCH:-auto}" \
        --gen 64 --prefill-chunk 4096 $host_flag --no-engine-loop ${BENCH_ARGS:-} \
        --json "$out/bench_synth_${model}_${tag}.json" > "$out/bench_synth_${model}_${tag}.log" 2>&1
      echo "synth $model: exit $?"
      grep -E "decode|tok/s|rank|batch" "$out/bench_synth_${model}_${tag}.log" | tail -20
      ;;
    lab)
      [ -e ".devrun/skv/$model" ] && cp ".devrun/skv/$model" "$HOME/$model"
      timeout "${LIMIT:-300}" "$HOME/$model" > "$out/${model}_${tag}.log" 2>&1
      echo "lab $model: exit $?"
      cat "$out/${model}_${tag}.log"
      ;;
    *) echo "unknown step $step" ;;
  esac
  echo "[$step: $(( $(date +%s) - start )) s]"
done
