# Sourced by the device-run scripts: unpacks a bundle from scripts/cuda_bundle.sh and points the
# loader at its libraries plus the machine's own CUDA runtime, cuBLAS and cuSOLVER (matched to
# its driver).
# Usage: unpack_cuda_bundle ARCHIVE STAGE_DIR   (returns non-zero when the archive is unusable)
unpack_cuda_bundle() {
  local archive=$1 stage=$2
  rm -rf "$stage" && mkdir -p "$stage" && tar -xJf "$archive" -C "$stage" || return 1
  local lib_path="$stage/lib" lib found dir
  for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libcusolver.so.12 libcusparse.so.12 \
             libnvJitLink.so.13; do
    found=$(ldconfig -p | awk -v name="$lib" '$1 == name {print $NF; exit}')
    for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
      [ -z "$found" ] && [ -e "$dir/$lib" ] && found="$dir/$lib"
    done
    [ -z "$found" ] && found=$(find /usr /opt -name "$lib" 2>/dev/null | head -1)
    [ -n "$found" ] && lib_path="$lib_path:$(dirname "$found")"
  done
  export LD_LIBRARY_PATH="$lib_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if ! "$stage/bin/shadowkv" --help > /dev/null 2>&1; then
    export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$stage/lib/compat"  # the machine's libstdc++ is older
  fi
}
