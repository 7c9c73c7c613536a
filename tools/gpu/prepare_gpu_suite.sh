#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything tools/gpu/run_gpu_suite.sh needs on the GPU
# machine (which has CUDA, the driver and PyTorch, but no compiler front-end tools, cmocka or
# LLVM, and nothing to install them with):
#   BUILD/                the build tree: GPU tests (cmocka linked statically), the IR they read
#   BUILD/fp8c-cache/     every GPU module those tests compile, already compiled by NVRTC here
#   BUILD/gpu-suite/bin/  training binaries (GPU kernels embedded): gpt2_tiny and GPT-2 d12 at
#                         -O0..-O3 for the trainings (TRAIN_BINS=0: none), GPT-2 d12 batch 32
#                         and d48 batch 8 at BENCH_LEVELS for the benchmark (BENCH_BINS=0: none),
#                         GPT-2 d12 in f32 and bf16 for the PyTorch cross-check (XCHECK_BINS=0)
#   BUILD/gpu-suite/data/ the shared text corpus (gzip), decompressed on the GPU machine
#
# usage: tools/gpu/prepare_gpu_suite.sh [BUILD]      (default: build-gpu)
# Then carry BUILD to the GPU machine (it is ignored by git: name it in the device tool's
# `carry`) and run:  tools/gpu/run_gpu_suite.sh BUILD
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-gpu}
mkdir -p "$BUILD" && BUILD=$(cd "$BUILD" && pwd)
JOBS=${JOBS:-2}
CORPUS=${CORPUS:-/work/shared/data/gcide.txt.gz}

cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
make -C "$BUILD" -j"$JOBS" fp8c fp8c-tokenize test_gpu_ops test_gpu_train test_gpu_cg test_gpu_comm gpu_test_graphs >/dev/null
for t in test_gpu_ops test_gpu_train test_gpu_cg test_gpu_comm; do
    if ldd "$BUILD/tests/gpu/$t" | grep -q libcmocka; then
        echo "$BUILD/tests/gpu/$t links the shared libcmocka, which the GPU machine lacks:" \
             "run tools/gpu/build_cmocka_static.sh, then this again" >&2
        exit 1
    fi
done

export FP8C_CACHE_DIR=$BUILD/fp8c-cache
echo "compiling the GPU tests' modules (NVRTC, cached in $FP8C_CACHE_DIR)"
FP8C_TEST_COMPILE_ONLY=1 "$BUILD/tests/gpu/test_gpu_ops" | tail -1
FP8C_TEST_COMPILE_ONLY=1 "$BUILD/tests/gpu/test_gpu_train" | grep -E "cubin|cannot" || true
FP8C_TEST_COMPILE_ONLY=1 "$BUILD/tests/gpu/test_gpu_cg" | grep -E "kernel IR" || true

mkdir -p "$BUILD/gpu-suite/bin" "$BUILD/gpu-suite/data"
rm -f "$BUILD"/gpu-suite/bin/*
BIN=$BUILD/gpu-suite/bin
D48="-D layers=48 -D dim=1600 -D heads=25"
if [ "${TRAIN_BINS:-1}" = 1 ]; then          # the suite's trainings
    for O in 0 1 2 3; do
        "$BUILD/fp8c" build models/gpt2_tiny.model -O$O --batch 16 --seq 256 -o "$BIN/gpt2_tiny_O$O"
        "$BUILD/fp8c" build models/gpt2.model -O$O --batch ${D12_BATCH:-16} --seq 1024 -o "$BIN/gpt2_d12_O$O"
    done
fi
if [ "${BENCH_BINS:-1}" = 1 ]; then          # tools/bench/gpu_bench.py: d12 batch 32, d48 batch 8
    for O in ${BENCH_LEVELS:-0 1 2 3}; do
        "$BUILD/fp8c" build models/gpt2.model -O$O --batch 32 --seq 1024 -o "$BIN/gpt2_d12_b32_O$O"
        "$BUILD/fp8c" build models/gpt2.model -O$O --batch 8 --seq 1024 $D48 -o "$BIN/gpt2_d48_b8_O$O"
    done
fi
if [ "${XCHECK_BINS:-1}" = 1 ]; then         # tools/torch_crosscheck.py: GPT-2 d12, f32 and bf16
    "$BUILD/fp8c" build models/gpt2.model -O0 --batch 8 --seq 512 --precision '*=f32' \
        --precision 'value:*=f32' -o "$BIN/xcheck_d12_f32"
    "$BUILD/fp8c" build models/gpt2.model -O0 --batch 8 --seq 512 -o "$BIN/xcheck_d12_bf16"
fi
# the PTX beside each cubin and the binaries' debug information are for reading only, and
# the whole binaries fp8c build caches (bin-KEY, compiler/cache.c) are in gpu-suite/bin once
# already; the carried tree stays under the size limit
rm -f "$FP8C_CACHE_DIR"/*.ptx "$FP8C_CACHE_DIR"/bin-*
for b in "$BIN"/*; do [ -f "$b" ] && strip --strip-debug "$b"; done

rm -f "$BUILD/gpu-suite/data/corpus.txt.gz"
if [ -f "$CORPUS" ]; then cp "$CORPUS" "$BUILD/gpu-suite/data/corpus.txt.gz"; fi   # CORPUS=none: the sample only
cp data/gcide_sample.txt "$BUILD/gpu-suite/data/sample.txt"
echo "git commit: $(git rev-parse --short HEAD)$(git diff --quiet -- cuda runtime compiler || echo ' (with local changes)')" > "$BUILD/gpu-suite/BUILD_INFO"
du -sh "$BUILD"
echo "ready: carry $BUILD, then run tools/gpu/run_gpu_suite.sh $BUILD on the GPU machine"
