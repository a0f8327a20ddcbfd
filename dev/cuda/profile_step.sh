#!/usr/bin/env bash
# Where a graph-replayed decode step's GPU time goes, kernel by kernel: Nsight Compute times every
# graph node (`--graph-profiling node`, one metric, each kernel alone) of a window of decode steps
# of `shadowkv bench`, and the table sums them per kernel name (µs per step: total / steps). Run
# on a GPU machine from the repository root after scripts/cuda_device_run_accuracy.sh has
# unpacked the bundle. Arguments after the first two go to `shadowkv bench`.
# Usage: dev/cuda/profile_step.sh SKIP COUNT BENCH_ARGS...
#   e.g. KERNELS='Skv|Decode' dev/cuda/profile_step.sh 1500 2200 -m ~/m/qwen.gguf \
#          --kv shadowkv:accurate=1 --context 32000 --batch 162 --gen 32 --prefill-chunk 2048 \
#          --no-host-values --no-engine-loop
# SKIP kernels are left out first (prefill, compression, the first steps), then COUNT are timed;
# with KERNELS (an ncu regex, e.g. 'SkvSelectFast|DecodeMma') only kernels it matches count.
set -uo pipefail
skip=$1 count=$2
shift 2
out=${OUT:-/tmp/shadowkv_out}
stage=${STAGE:-/tmp/shadowkv_accuracy}
mkdir -p "$out"
. scripts/cuda_bundle_env.sh
[ -d "$stage/lib" ] && export LD_LIBRARY_PATH="$stage/lib:${LD_LIBRARY_PATH:-}"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$ncu" ] || { echo "no ncu on this machine"; exit 1; }
csv="$out/step_kernels${TAG:+_$TAG}.csv"
timeout "${LIMIT:-400}" "$ncu" --graph-profiling node --metrics gpu__time_duration.sum \
  ${KERNELS:+--kernel-name "regex:$KERNELS"} --launch-skip "$skip" --launch-count "$count" --csv \
  "$stage/bin/shadowkv" bench --device cuda "$@" > "$csv" 2> "$out/step_kernels.err"
echo "ncu: exit $?"
python3 - "$csv" <<'EOF'
import collections, csv, re, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]  # the bench's own lines drop out
at = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
head, rows = rows[at], rows[at:]
name, unit, value = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
total, calls = collections.Counter(), collections.Counter()
for r in rows[1:]:
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[r[unit]]
    key = re.sub(r"^.*::", "", r[name].split("(")[0].split("<")[0]) + (
        "<" + r[name].split("(")[0].split("<", 1)[1] if "<" in r[name].split("(")[0] else "")
    total[key] += float(r[value].replace(",", "")) * scale
    calls[key] += 1
print(f"{sum(calls.values())} kernels timed; µs summed per kernel name (calls)")
for key, us in total.most_common():
    print(f"{us:12.1f} us {calls[key]:6d}  {key}")
print(f"{sum(total.values()):12.1f} us in all")
EOF
