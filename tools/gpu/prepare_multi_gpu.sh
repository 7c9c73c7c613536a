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
#
# usage: tools/gpu/prepare_multi_gpu.sh [BUILD]      (default: build-mgpu)
# Then carry BUILD (ignored by git) to the GPU machine and run there, from the repository root:
#   tools/gpu/multi_gpu_check.sh BUILD
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-mgpu}
mkdir -p "$BUILD" && BUILD=$(cd "$BUILD" && pwd)
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
make -C "$BUILD" -j"${JOBS:-2}" fp8c >/dev/null
BIN=$BUILD/multi-gpu/bin
mkdir -p "$BIN"
rm -f "$BIN"/*
export FP8C_CACHE_DIR=$BUILD/fp8c-cache
"$BUILD/fp8c" build models/gpt2.model -O1 --batch 8 --seq 1024 --gpus 2 -o "$BIN/d12_O1_b8"
"$BUILD/fp8c" build models/gpt2.model -O1 --batch 32 --seq 1024 --gpus 2 -o "$BIN/d12_O1_b32"
"$BUILD/fp8c" build models/gpt2.model -O1 --batch 8 --seq 1024 --gpus 2 --choice comm.overlap=0 -o "$BIN/d12_O1_b8_serial"
"$BUILD/fp8c" build models/gpt2.model -O1 --batch 32 --seq 1024 --gpus 2 --choice comm.overlap=0 -o "$BIN/d12_O1_b32_serial"
"$BUILD/fp8c" build models/gpt2_tiny.model -O0 --batch 16 --seq 256 --gpus 2 -o "$BIN/tiny_O0"
for b in "$BIN"/*; do strip --strip-debug "$b"; done
"$BUILD/fp8c" plan models/gpt2.model -O1 --batch 8 --seq 1024 --gpus 2 > "$BUILD/multi-gpu/plan_d12_O1_b8.txt"
echo "git commit: $(git rev-parse --short HEAD)$(git diff --quiet -- cuda runtime compiler passes || echo ' (with local changes)')" > "$BUILD/multi-gpu/BUILD_INFO"
du -sh "$BUILD/multi-gpu"
echo "ready: carry $BUILD (only multi-gpu/ is needed), then run tools/gpu/multi_gpu_check.sh $BUILD"
