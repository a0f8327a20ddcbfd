#!/usr/bin/env bash
# Sets up, builds, fetches the default model, and runs the whole test suite (ctest).
# Labels: unit, model, cli, fuzz, e2e; where the CUDA toolkit is installed the CUDA backend is built
# too (preset "cuda") and its gpu tests run (they skip, saying why, on a machine without a GPU).
# Exits non-zero on any failure, and in CI (CI=true) on any skipped CPU test too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
# Assigned before export: `export X=$(...)` takes export's status, so a failed fetch would not
# stop the run and every model test would skip.
SHADOWKV_MODEL=$(python3 scripts/fetch_model.py)
[ -f "$SHADOWKV_MODEL" ] || { echo "test.sh: no model at '$SHADOWKV_MODEL'" >&2; exit 1; }
export SHADOWKV_MODEL
# llama.cpp's vocabulary-only files and chat templates, for the tokenizer goldens.
SHADOWKV_VOCAB_DIR=$(python3 scripts/fetch_model.py --reference-vocab)
[ -d "$SHADOWKV_VOCAB_DIR" ] || { echo "test.sh: no vocab dir '$SHADOWKV_VOCAB_DIR'" >&2; exit 1; }
export SHADOWKV_VOCAB_DIR
ctest --preset release -j "$(nproc)" --no-tests=error --output-junit ctest-junit.xml "$@"
# In CI setup.sh and the fetches above have provided everything a CPU test looks for, so a
# skipped test there is a broken setup: fail, naming the tests and their reasons.
if [ -n "${CI:-}" ] && ! [[ "$CI" =~ ^(0|false|FALSE|no)$ ]]; then
  python3 scripts/ci_no_skips.py build/ctest-junit.xml
fi
if ! command -v nvcc > /dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
if command -v nvcc > /dev/null; then
  cmake --preset cuda > /dev/null
  cmake --build --preset cuda -j "$(nproc)" --target shadowkv_gpu_tests
  ctest --test-dir build-cuda -L gpu --no-tests=error --output-on-failure
else
  echo "test.sh: no CUDA toolkit (nvcc) found: the CUDA backend and its gpu tests were not built"
fi
