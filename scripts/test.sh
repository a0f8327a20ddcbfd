#!/usr/bin/env bash
# Sets up, builds, fetches the default model, and runs the whole test suite (ctest).
# Labels: unit, model, cli, fuzz (and gpu, e2e where present). Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
export SHADOWKV_MODEL=$(python3 scripts/fetch_model.py)
ctest --preset release -j "$(nproc)" --no-tests=error "$@"
