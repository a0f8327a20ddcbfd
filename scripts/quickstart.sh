#!/usr/bin/env bash
# Quick start: set up, build, fetch the default model, and generate from a chat prompt.
# Usage: scripts/quickstart.sh ["your question"] [extra generate flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
model=$(python3 scripts/fetch_model.py)
question=${1:-"Explain in two sentences why the sky is blue."}
shift || true
exec ./build/shadowkv generate -m "$model" --chat -p "$question" -n 128 "$@"
