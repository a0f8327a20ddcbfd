#!/usr/bin/env bash
# Installs what shadowkv needs to build and test on Debian/Ubuntu (run as root or with sudo).
set -euo pipefail
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
PACKAGES=(
  build-essential cmake ninja-build pkg-config python3
  libopenblas-dev liblapacke-dev    # CPU linear algebra (GEMM, symmetric eigensolver)
  libfmt-dev libcli11-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-dev             # libFuzzer target for the GGUF parser
  jargon-text                       # default essay haystack for the long-context evaluation
  python3-matplotlib                # plots (inspect spectra, eval heatmaps)
  chromium python3-venv             # e2e tests: headless chat page; venv for the openai client
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# The plotting scripts run under whichever python3 is first on PATH.
if ! python3 -c "import matplotlib" 2>/dev/null; then
  python3 -m pip install --quiet matplotlib
fi
# The e2e tests drive the server with the official openai client, from a venv of its own
# (tests/e2e/run.sh looks for it here).
E2E_VENV="${SHADOWKV_CACHE:-$HOME/.cache/shadowkv}/venv-e2e"
if ! "$E2E_VENV/bin/python" -c "import openai" 2>/dev/null; then
  python3 -m venv "$E2E_VENV"
  "$E2E_VENV/bin/python" -m pip install --quiet --disable-pip-version-check openai
fi
