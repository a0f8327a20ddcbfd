#!/usr/bin/env bash
# Runs `shadowkv eval --device cuda` from a CUDA bundle (scripts/cuda_bundle.sh build-cuda
# .devrun/skv/shadowkv_cuda.tar.xz) on a GPU machine: full attention and ShadowKV answer on the
# GPU, the CPU model synthesises, tokenises and scores. Reports go to $OUT (default
# /tmp/shadowkv_out).
# Usage: scripts/cuda_device_run_eval.sh MODEL.gguf HAYSTACK STEP...
#   tasks:LENGTH    every task at LENGTH (e.g. tasks:16k), $SAMPLES samples (default 5)
#   grid:LENGTHS    the NIAH grid (niah_single_2) at LENGTHS (e.g. grid:4k,8k,16k,32k), 6 depths
# $KV: the policies (default full,shadowkv; snapkv, quest and streaming decode on the CPU from
# the GPU's prefill); $TASKS: a subset of the tasks (default all), named in the label with
# $PART; $LIMIT: seconds per step (default 240).
set -uo pipefail
cd "$(dirname "$0")/.."
model=$1 haystack=$2
shift 2
samples=${SAMPLES:-5}
out=${OUT:-/tmp/shadowkv_out}
mkdir -p "$out"
stage=/tmp/shadowkv_eval
. scripts/cuda_bundle_env.sh
unpack_cuda_bundle .devrun/skv/shadowkv_cuda.tar.xz "$stage" || exit 1
echo "bundle commit: $(cat "$stage/COMMIT" 2>/dev/null); model $(sha256sum "$model")"
name=$(basename "$model" .gguf)
run() {  # label, timeout, eval arguments...
  local label=$1 limit=$2
  shift 2
  local start=$(date +%s)
  timeout "$limit" "$stage/bin/shadowkv" eval -m "$model" --haystack "$haystack" --device cuda \
    --kv "${KV:-full,shadowkv}" "$@" --json "$out/$label.json" > "$out/$label.log" 2>&1
  echo "$label: exit $? in $(( $(date +%s) - start )) s"
  grep -vE "^\[eval\]" "$out/$label.log" | tail -25
}
for step in "$@"; do
  case "$step" in
    tasks:*) run "${name}_${step#tasks:}_tasks${PART:+_$PART}" "${LIMIT:-240}" \
               --lengths "${step#tasks:}" --samples "$samples" ${TASKS:+--tasks "$TASKS"} ;;
    grid:*) run "${name}_grid" "${LIMIT:-200}" --niah-grid --lengths "${step#grid:}" --grid-depths 6 --samples 1 ;;
    *) echo "unknown step $step" ;;
  esac
done
