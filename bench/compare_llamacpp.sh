#!/usr/bin/env bash
# Prefill and decode speed of shadowkv next to llama.cpp's llama-bench on the same model,
# threads and machine, in one run. llama.cpp is built by the user outside this repository.
# Usage: bench/compare_llamacpp.sh LLAMA_BENCH MODEL [THREADS]
set -euo pipefail
llama_bench=$1
model=$2
threads=${3:-$(nproc)}
here=$(cd "$(dirname "$0")/.." && pwd)
echo "# $(date -u +%FT%TZ) $(uname -m), $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "## llama.cpp: pp512 (prefill of 512 tokens), tg128 (decode of 128 tokens)"
"$llama_bench" -m "$model" -t "$threads" -p 512 -n 128 -r 3
for numerics in int8 exact; do
  echo "## shadowkv --numerics $numerics: prefill of 512 tokens, then 128 decode steps"
  "$here/build/shadowkv" bench -m "$model" -t "$threads" --numerics "$numerics" \
    --context 512 --gen 128 --repeat 3
done
