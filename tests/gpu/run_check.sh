#!/bin/sh
# run_check.sh — runs one of the GPU's bit-identity checks and keeps a log.
#
#   tests/gpu/run_check.sh fp8_convert|fastmath [--build] [LOG]
#
#   fp8_convert  ir/numerics.c's conversions against the GPU's, every f32 (fp8_convert_check.cu)
#   fastmath     cuda/kernels/fastmath.cuh against sqrtf and the division (fastmath_check.cu)
#
# --build compiles build-gpu/NAME_check first (needs nvcc; the binary links the CUDA runtime
# statically, so the GPU machine needs only the driver; fastmath is compiled with --fmad=false,
# as NVRTC compiles the kernels). The log (default build-gpu/NAME_check.log, or
# $OUT/NAME_check.log when $OUT is set) starts with the date, the commit and nvidia-smi's view
# of the GPU, then the check's output. Exit status is the check's: 0 bit-identical, 1
# mismatches, 2 no usable GPU (or no such check).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
name=${1:-}
case $name in
fp8_convert|fastmath) shift ;;
*) echo "usage: run_check.sh fp8_convert|fastmath [--build] [LOG]" >&2; exit 2 ;;
esac
bin="$root/build-gpu/${name}_check"
if [ "${1:-}" = "--build" ]; then
    shift
    nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    arch="-O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a"
    mkdir -p "$root/build-gpu" || exit 2
    if [ "$name" = fp8_convert ]; then
        ${CC:-gcc} -O2 -std=c11 -I"$root/ir" -c "$root/ir/numerics.c" -o "$root/build-gpu/numerics.o" &&
        "$nvcc" $arch "$root/tests/gpu/fp8_convert_check.cu" "$root/build-gpu/numerics.o" -o "$bin" || exit 2
    else
        "$nvcc" $arch --fmad=false "$root/tests/gpu/fastmath_check.cu" -o "$bin" || exit 2
    fi
fi
if [ ! -x "$bin" ]; then
    echo "run_check.sh: $bin is missing; run with --build where nvcc is installed" >&2
    exit 2
fi
if [ $# -gt 0 ]; then log=$1
elif [ -n "${OUT:-}" ]; then log="$OUT/${name}_check.log"
else log="$root/build-gpu/${name}_check.log"
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
