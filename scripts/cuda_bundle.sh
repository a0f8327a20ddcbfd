#!/usr/bin/env bash
# Packs a CUDA build (the shadowkv binary, the GPU tests) with the non-CUDA shared libraries they
# need (fmt, OpenBLAS, LAPACKE, ...) into one archive, for a GPU machine that has the CUDA
# runtime and cuBLAS but not our build dependencies. scripts/cuda_device_run.sh runs it there.
# Usage: scripts/cuda_bundle.sh [build dir, default build-cuda] [archive, default .devrun/shadowkv_cuda.tar.xz]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-cuda}
archive=${2:-.devrun/shadowkv_cuda.tar.xz}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin" "$stage/lib" "$stage/lib/compat" "$(dirname "$archive")"
binaries=("$build/shadowkv" "$build/tests/shadowkv_gpu_tests")
cp "${binaries[@]}" "$stage/bin/"
# Every resolved dependency except the C library, the loader and CUDA's own libraries (the GPU
# machine brings those, matched to its driver). libstdc++/libgcc go to lib/compat, used only
# when the machine's own are too old.
for lib in $(ldd "${binaries[@]}" | awk '/=> \// {print $3}' | sort -u); do
  name=$(basename "$lib")
  case "$name" in
    libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*) ;;
    libcuda*|libcublas*|libcudart*|libcusolver*|libcusparse*|libnvJitLink*|libnccl*) ;;  # NCCL is opened at run time from the machine's own
    libstdc++*|libgcc_s*) cp -L "$lib" "$stage/lib/compat/$name" ;;
    *) cp -L "$lib" "$stage/lib/$name" ;;
  esac
done
(cd "$build" && git -C .. rev-parse --short HEAD > "$stage/COMMIT" 2>/dev/null || true)
# The GPU tests read tests/data through the source path compiled into them.
pwd > "$stage/SOURCE_DIR"
tar -C "$stage" -cJf "$archive" .
echo "$archive: $(du -h "$archive" | cut -f1) ($(ls "$stage/lib" "$stage/lib/compat" | grep -c so) libraries)"
