#!/usr/bin/env bash
# Builds, on a machine without a GPU, the training binaries tools/gpu/multi_gpu_check.sh runs
# on a machine with two GPUs (or more), into BUILD/multi-gpu/bin (about 10 MiB in all):
#   d12_O1_b8    GPT-2 d12 -O1, batch 8 x 1024, built with --gpus 2 (bf16 gradient reduction):
#                the equivalence runs (2 GPUs against 1 GPU with --grad-accum 2), both launch
#                paths, the fault and resume checks
#   d12_O1_b32   GPT-2 d12 -O1, batch 32 x 1024, --gpus 2: tokens/s on 1 and 2 GPUs
#   d12_O1_b8_serial, d12_O1_b32_serial   the same two built with --choice comm.overlap=0
#                (the gradient sums after the backward, not during it): same bits, and the
#                speed the overlap gains
#   tiny_O0      gpt2_tiny -O0, batch 16 x 256, --gpus 2 (f32 gradient reduction)
#   d12_O1_b8_e5m2, d12_O1_b8_e4m3, d12_O1_b32_e5m2   the FP8 gradient reduction
#                (--precision comm:grad=e5m2 or e4m3): its loss against one GPU, its tokens/s
#   d12_O1_b32_zero, d12_O3_b32, d12_O3_b32_zero   sharded optimizer state (--shard-states)
#                against the unsharded step at -O1 and -O3: losses, tokens/s, memory per GPU
#   d12_O3_b32_zero2 the same with --shard-states=2 (sharded gradients, ZeRO stage 2)
#   d12_O3_b32_zero3 the same with --shard-states=3 (sharded weights, ZeRO stage 3)
#   tiny_O3_zero gpt2_tiny -O3 batch 16 x 256 with --shard-states: a sharded checkpoint
#                resumed on 2 GPUs and on 1
# and into BUILD/multi-gpu/test the data-parallel GPU test (test_gpu_comm: the FP8 reduction
# and the sharded step; cmocka linked statically, with the graphs it reads and their modules
# compiled here), about 3 MiB more.
#
# usage: tools/gpu/prepare_multi_gpu.sh [BUILD]      (default: build-mgpu)
# Then carry BUILD (ignored by git) to the GPU machine and run there, from the repository root:
#   tools/gpu/multi_gpu_check.sh BUILD
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-mgpu}
mkdir -p "$BUILD" && BUILD=$(cd "$BUILD" && pwd)
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
make -C "$BUILD" -j"${JOBS:-2}" fp8c test_gpu_comm gpu_test_graphs >/dev/null
BIN=$BUILD/multi-gpu/bin
mkdir -p "$BIN"
rm -f "$BIN"/*
export FP8C_CACHE_DIR=$BUILD/fp8c-cache
"$BUILD/fp8c" build models/gpt2.model -O1 --batch 8 --seq 1024 --gpus 2 -o "$BIN/d12_O1_b8"
"$BUILD/fp8c" build models/gpt2.model -O1 --batch 32 --seq 1024 --gpus 2 -o "$BIN/d12_O1_b32"
"$BUILD/fp8c" build models/gpt2.model -O1 --batch 8 --seq 1024 --gpus 2 --choice comm.overlap=0 -o "$BIN/d12_O1_b8_serial"
"$BUILD/fp8c" build models/gpt2.model -O1 --batch 32 --seq 1024 --gpus 2 --choice comm.overlap=0 -o "$BIN/d12_O1_b32_serial"
"$BUILD/fp8c" build models/gpt2_tiny.model -O0 --batch 16 --seq 256 --gpus 2 -o "$BIN/tiny_O0"
fp8="--gpus 2 --precision comm:grad"
"$BUILD/fp8c" build models/gpt2.model -O1 --batch 8 --seq 1024 $fp8=e5m2 -o "$BIN/d12_O1_b8_e5m2"
"$BUILD/fp8c" build models/gpt2.model -O1 --batch 8 --seq 1024 $fp8=e4m3 -o "$BIN/d12_O1_b8_e4m3"
"$BUILD/fp8c" build models/gpt2.model -O1 --batch 32 --seq 1024 $fp8=e5m2 -o "$BIN/d12_O1_b32_e5m2"
zero="--gpus 2 --shard-states"
"$BUILD/fp8c" build models/gpt2.model -O1 --batch 32 --seq 1024 $zero -o "$BIN/d12_O1_b32_zero"
"$BUILD/fp8c" build models/gpt2.model -O3 --batch 32 --seq 1024 --gpus 2 -o "$BIN/d12_O3_b32"
"$BUILD/fp8c" build models/gpt2.model -O3 --batch 32 --seq 1024 $zero -o "$BIN/d12_O3_b32_zero"
"$BUILD/fp8c" build models/gpt2_tiny.model -O3 --batch 16 --seq 256 $zero -o "$BIN/tiny_O3_zero"
"$BUILD/fp8c" build models/gpt2.model -O3 --batch 32 --seq 1024 $zero=2 -o "$BIN/d12_O3_b32_zero2"
"$BUILD/fp8c" build models/gpt2.model -O3 --batch 32 --seq 1024 $zero=3 -o "$BIN/d12_O3_b32_zero3"
for b in "$BIN"/*; do strip --strip-debug "$b"; done
# test_gpu_comm, its graphs and their modules (the GPU machine finds them through
# FP8C_GPU_IR_DIR and FP8C_CACHE_DIR, which multi_gpu_check.sh sets)
TEST=$BUILD/multi-gpu/test
rm -rf "$TEST" && mkdir -p "$TEST/ir" "$TEST/cache"
if ldd "$BUILD/tests/gpu/test_gpu_comm" | grep -q libcmocka; then
    echo "note: test_gpu_comm links the shared libcmocka, which the GPU machine lacks (run" \
         "tools/gpu/build_cmocka_static.sh first): not carried" >&2
else
    cp "$BUILD"/tests/gpu/ir/gpt2_tiny_dp_*.ir "$BUILD"/tests/gpu/ir/gpt2_tiny_zero_*.ir \
       "$BUILD"/tests/gpu/ir/gpt2_tiny_zero2_*.ir "$BUILD"/tests/gpu/ir/gpt2_tiny_zero3_*.ir "$TEST/ir/"
    cp "$BUILD/tests/gpu/test_gpu_comm" "$TEST/"
    strip --strip-debug "$TEST/test_gpu_comm"
    FP8C_TEST_COMPILE_ONLY=1 FP8C_GPU_IR_DIR="$TEST/ir" FP8C_CACHE_DIR="$TEST/cache" "$TEST/test_gpu_comm" | tail -1
    find "$TEST/cache" -name '*.ptx' -delete   # PTX is for reading; the cubins run
fi
"$BUILD/fp8c" plan models/gpt2.model -O1 --batch 8 --seq 1024 --gpus 2 > "$BUILD/multi-gpu/plan_d12_O1_b8.txt"
for o in 1 3; do   # the per-GPU memory section 7 compares with what the GPUs hold
    "$BUILD/fp8c" plan models/gpt2.model -O$o --batch 32 --seq 1024 $zero > "$BUILD/multi-gpu/plan_d12_O${o}_b32_zero.txt"
    "$BUILD/fp8c" plan models/gpt2.model -O$o --batch 32 --seq 1024 --gpus 2 > "$BUILD/multi-gpu/plan_d12_O${o}_b32.txt"
done
"$BUILD/fp8c" plan models/gpt2.model -O3 --batch 32 --seq 1024 $zero=2 > "$BUILD/multi-gpu/plan_d12_O3_b32_zero2.txt"
"$BUILD/fp8c" plan models/gpt2.model -O3 --batch 32 --seq 1024 $zero=3 > "$BUILD/multi-gpu/plan_d12_O3_b32_zero3.txt"
echo "git commit: $(git rev-parse --short HEAD)$(git diff --quiet -- cuda runtime compiler passes || echo ' (with local changes)')" > "$BUILD/multi-gpu/BUILD_INFO"
du -sh "$BUILD/multi-gpu"
echo "ready: carry $BUILD/multi-gpu, then run tools/gpu/multi_gpu_check.sh $BUILD (SECTIONS=5: the FP8" \
     "reduction alone; SECTIONS=7: the sharded step alone)"
