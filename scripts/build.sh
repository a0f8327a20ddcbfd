#!/usr/bin/env bash
# Installs the build dependencies (scripts/setup.sh) and builds shadowkv into build/ (preset
# "release"). Extra arguments go to the CMake configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake --preset release "$@" > /dev/null
cmake --build --preset release -j "$(nproc)"
