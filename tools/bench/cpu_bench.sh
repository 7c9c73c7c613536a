#!/bin/sh
# cpu_bench.sh — the CPU backend against the reference executor, and its GEMM against OpenBLAS.
#
#   tools/bench/cpu_bench.sh [BUILD_DIR]          build the binaries, then run everything
#   tools/bench/cpu_bench.sh --build BUILD_DIR    only build (into $BENCH_DIR, default
#                                                 /tmp/fp8c-cpu-bench), e.g. to run elsewhere
#                                                 (CPU_TARGET=x86-64-v3: kernels for any AVX2 CPU)
#   tools/bench/cpu_bench.sh --run                only run what --build left in $BENCH_DIR
#
# Training steps: gpt2_tiny (batch 1 x 128, 4 x 64 and 16 x 128, the README's first
# command's) at each level of $LEVELS (default "0 1 2 3") and GPT-2 d12 (-O0, batch 1 x 128)
# on --device cpu (the compiled kernels) and --device ref, with the same thread count
# ($FP8C_THREADS, default: every online CPU). The figure is the median step time over the
# steps after the first two (warm-up), from the binaries' JSON log. GEMM: cpu_gemm_bench at
# d12 shapes (M = 128 rows; K, N from 768, 2304, 3072), against OpenBLAS sgemm when the
# OpenBLAS headers and library are found. Needs a C compiler and python3 (for the medians).
set -eu

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BENCH_DIR=${BENCH_DIR:-/tmp/fp8c-cpu-bench}
THREADS=${FP8C_THREADS:-$(nproc)}
export FP8C_THREADS=$THREADS
LEVELS=${LEVELS:-0 1 2 3}
mode=all
case "${1:-}" in
--build) mode=build; shift ;;
--run) mode=run; shift ;;
esac
BUILD=${1:-$ROOT/build}

# name model level batch seq steps(cpu) steps(ref)
CONFIGS=$(for level in $LEVELS; do
    echo "tiny_b1_t128_O$level models/gpt2_tiny.model $level 1 128 30 12"
    echo "tiny_b4_t64_O$level models/gpt2_tiny.model $level 4 64 30 12"
    echo "tiny_b16_t128_O$level models/gpt2_tiny.model $level 16 128 12 6"
done; echo "d12_b1_t128_O0 models/gpt2.model 0 1 128 8 4")

build() {
    mkdir -p "$BENCH_DIR"
    echo "$CONFIGS" | while read -r name model level batch seq _ _; do
        "$BUILD/fp8c" build "$ROOT/$model" -O"$level" --batch "$batch" --seq "$seq" ${CPU_TARGET:+--cpu=$CPU_TARGET} \
            -o "$BENCH_DIR/$name" \
            >"$BENCH_DIR/build.log" 2>&1 || { cat "$BENCH_DIR/build.log" >&2; exit 1; }
    done
    blas_inc=$(ls -d /usr/include/x86_64-linux-gnu/openblas-pthread /usr/include/openblas 2>/dev/null | head -1 || true)
    if [ -n "$blas_inc" ]; then
        cc -O2 -std=gnu11 -o "$BENCH_DIR/cpu_gemm_bench" "$ROOT/tools/bench/cpu_gemm_bench.c" \
            -I"$ROOT/ir" -I"$ROOT/runtime" -I"$ROOT/codegen" -I"$blas_inc" -L"$BUILD" \
            -lfp8c_rt -lfp8c_kernels -lfp8c_ir -lopenblas -lm -lpthread
    else
        echo "cpu_bench: no OpenBLAS headers (apt-get install libopenblas-dev): GEMM comparison skipped" >&2
    fi
    # a short text corpus for the step timings (the bundled sample)
    cp "$ROOT/data/gcide_sample.txt" "$BENCH_DIR/data.txt"
}

median_ms() {   # median "ms" of a JSON-lines log after the first two steps
    python3 -c '
import json, sys, statistics
ms = [json.loads(l)["ms"] for l in open(sys.argv[1]) if "\"ms\"" in l][2:]
print("%.1f" % statistics.median(ms))' "$1"
}

run() {
    echo "CPU backend benchmark: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $THREADS threads"
    printf '%-17s %12s %12s %8s\n' config "cpu ms/step" "ref ms/step" speedup
    echo "$CONFIGS" | while read -r name _ _ _ _ steps_cpu steps_ref; do
        for dev in cpu ref; do
            steps=$steps_cpu
            [ "$dev" = ref ] && steps=$steps_ref
            rm -f "$BENCH_DIR/$name.$dev.jsonl"
            "$BENCH_DIR/$name" --data "$BENCH_DIR/data.txt" --steps "$steps" --eval-every 0 \
                --device "$dev" --log "$BENCH_DIR/$name.$dev.jsonl" >/dev/null 2>&1 ||
                { echo "cpu_bench: $name --device $dev failed" >&2; exit 1; }
        done
        c=$(median_ms "$BENCH_DIR/$name.cpu.jsonl")
        r=$(median_ms "$BENCH_DIR/$name.ref.jsonl")
        printf '%-17s %12s %12s %7.1fx\n' "$name" "$c" "$r" "$(python3 -c "print($r / $c)")"
    done
    if [ -x "$BENCH_DIR/cpu_gemm_bench" ]; then
        echo
        "$BENCH_DIR/cpu_gemm_bench" 128
    fi
}

case $mode in
build) build ;;
run) run ;;
all) build; run ;;
esac
