#!/usr/bin/env bash
# Runs one e2e test script (tests/e2e/test_*.py) against the shadowkv binary, with the Python
# that has the official openai client: $SHADOWKV_PYTHON, else the venv scripts/setup.sh makes.
set -euo pipefail
script=$1
binary=$2
python="${SHADOWKV_PYTHON:-${SHADOWKV_CACHE:-$HOME/.cache/shadowkv}/venv-e2e/bin/python}"
if ! "$python" -c "import openai" 2> /dev/null; then
  echo "e2e: '$python' cannot import the openai client; run scripts/setup.sh" >&2
  exit 1
fi
exec "$python" "$script" "$binary"
