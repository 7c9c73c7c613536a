#!/bin/sh
# run_fp8_check.sh — runs the GPU bit-identity check of ir/numerics.c and keeps a log.
#
#   tests/gpu/run_fp8_check.sh [--build] [LOG]
#
# --build compiles build-gpu/fp8_convert_check first (needs nvcc; the binary links the CUDA
# runtime statically, so the GPU machine needs only the driver). The log (default
# build-gpu/fp8_convert_check.log, or $OUT/fp8_convert_check.log when $OUT is set) starts with
# the date, the commit and nvidia-smi's view of the GPU, then the check's output. Exit status is
# the check's: 0 bit-identical, 1 mismatches, 2 no usable GPU.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
bin="$root/build-gpu/fp8_convert_check"
if [ "${1:-}" = "--build" ]; then
    shift
    nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    mkdir -p "$root/build-gpu" &&
    ${CC:-gcc} -O2 -std=c11 -I"$root/ir" -c "$root/ir/numerics.c" -o "$root/build-gpu/numerics.o" &&
    "$nvcc" -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
        "$root/tests/gpu/fp8_convert_check.cu" "$root/build-gpu/numerics.o" -o "$bin" || exit 2
fi
if [ ! -x "$bin" ]; then
    echo "run_fp8_check.sh: $bin is missing; run with --build where nvcc is installed" >&2
    exit 2
fi
if [ $# -gt 0 ]; then log=$1
elif [ -n "${OUT:-}" ]; then log="$OUT/fp8_convert_check.log"
else log="$root/build-gpu/fp8_convert_check.log"
fi
{
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
        sed 's/^/gpu: /'
} > "$log"
rc_file="$log.rc"
{ "$bin" 2>&1; echo $? > "$rc_file"; } | tee -a "$log"
status=$(cat "$rc_file")
rm -f "$rc_file"
echo "exit status: $status" >> "$log"
echo "log: $log"
exit "$status"
